package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

func adminDo(t *testing.T, rep *replica, method, path, token string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, "http://"+rep.AdminAddr()+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func TestAdminAPIWithoutTheTokenIs401(t *testing.T) {
	fleet := startWorkers(t, 1, simConfig(time.Millisecond))
	rep := startTestReplica(t, fleet, func(cfg *serveConfig) { cfg.AdminToken = "s3cret" })
	for _, tc := range []struct{ method, path, token string }{
		{http.MethodGet, "/admin/workers", ""},
		{http.MethodGet, "/admin/cluster", "wrong"},
		{http.MethodDelete, "/admin/sessions/x", ""},
		{http.MethodPost, "/admin/cluster/snapshot", "Bearer s3cret"},
	} {
		status, body := adminDo(t, rep, tc.method, tc.path, tc.token)
		if status != http.StatusUnauthorized {
			t.Errorf("%s %s with token %q: %d %s, want 401", tc.method, tc.path, tc.token, status, body)
		}
	}
	if status, body := adminDo(t, rep, http.MethodGet, "/admin/workers", "s3cret"); status != http.StatusOK {
		t.Fatalf("with the token: %d %s", status, body)
	}
	// The client port does not serve admin routes at all.
	resp, err := http.Get("http://" + rep.Addr() + "/admin/workers")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("client port /admin/workers: %d, want 404", resp.StatusCode)
	}
}

// runCtl runs `kvrouter-ha ctl` against rep's admin port and returns its output.
func runCtl(t *testing.T, rep *replica, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	all := append([]string{"ctl", "--addr", rep.AdminAddr(), "--token", "tok"}, args...)
	err := run(context.Background(), all, &out, &errOut)
	return out.String() + errOut.String(), err
}

func TestCtlOperatesSessionsWorkersAndCluster(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(time.Millisecond))
	rep := startTestReplica(t, fleet, func(cfg *serveConfig) { cfg.AdminToken = "tok" })
	c := newRouterClient(t, rep)
	a := c.complete(promptTokens(1, 2*blockTokens), 2, hdr("X-Session-ID", "ctl-session")).mustOK(t)
	bound, rev := a.worker(), a.revision(t)

	out, err := runCtl(t, rep, "sessions", "get", "ctl-session")
	if err != nil || !strings.Contains(out, bound) || !strings.Contains(out, fmt.Sprint(rev)) {
		t.Fatalf("ctl sessions get: %v\n%s", err, out)
	}
	out, err = runCtl(t, rep, "--json", "cluster", "status")
	if err != nil {
		t.Fatalf("ctl cluster status: %v\n%s", err, out)
	}
	var view clusterView
	if err := json.Unmarshal([]byte(out), &view); err != nil || view.Self.State != "Leader" || view.Bindings != 1 || len(view.Servers) != 1 {
		t.Fatalf("cluster status JSON: %v %+v", err, view)
	}
	out, err = runCtl(t, rep, "workers", "list")
	if err != nil || !strings.Contains(out, "BINDINGS") || !strings.Contains(out, bound) {
		t.Fatalf("ctl workers list: %v\n%s", err, out)
	}

	// Draining the bound worker moves the session: its next request gets another worker
	// and a higher revision.
	if out, err = runCtl(t, rep, "workers", "drain", bound); err != nil {
		t.Fatalf("ctl workers drain: %v\n%s", err, out)
	}
	eventually(t, "the drained worker leaves the routable set", func() (bool, string) {
		for _, tg := range rep.registry.Routable() {
			if tg.Worker.ID == bound {
				return false, "still routable"
			}
		}
		return true, ""
	})
	moved := c.complete(promptTokens(2, 2*blockTokens), 2, hdr("X-Session-ID", "ctl-session")).mustOK(t)
	if moved.worker() == bound || moved.revision(t) <= rev {
		t.Fatalf("after draining %s: worker %s revision %d (was %d)", bound, moved.worker(), moved.revision(t), rev)
	}
	if out, err = runCtl(t, rep, "sessions", "invalidate", "ctl-session"); err != nil {
		t.Fatalf("ctl sessions invalidate: %v\n%s", err, out)
	}
	if out, err = runCtl(t, rep, "sessions", "get", "ctl-session"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("ctl sessions get after invalidate: %v\n%s", err, out)
	}
	if out, err = runCtl(t, rep, "cluster", "snapshot"); err != nil || !strings.Contains(out, "index") {
		t.Fatalf("ctl cluster snapshot: %v\n%s", err, out)
	}
}

func TestUnhealthyWorkerLosesItsBindingsAfterTheGrace(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(time.Millisecond))
	rep := startTestReplica(t, fleet, func(cfg *serveConfig) { cfg.Cluster.WorkerGrace = 200 * time.Millisecond })
	c := newRouterClient(t, rep)
	a := c.complete(promptTokens(1, 2*blockTokens), 2, hdr("X-Session-ID", "grace")).mustOK(t)
	bound := a.worker()
	rep.registry.SetHealthy(bound, false, "test: down")
	eventually(t, "the unhealthy worker's binding is invalidated", func() (bool, string) {
		if b, ok := rep.cluster.node.FSM().Get("grace"); ok {
			return false, fmt.Sprintf("still bound to %s", b.Worker)
		}
		return true, ""
	})
}
