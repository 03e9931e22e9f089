package replica

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

func adminDo(t *testing.T, rep *Replica, method, path, token string) (int, []byte) {
	t.Helper()
	return adminSend(t, rep, method, path, token, "")
}

// adminSend is adminDo with a JSON body ("" for none).
func adminSend(t *testing.T, rep *Replica, method, path, token, body string) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, "http://"+rep.AdminAddr()+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
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
	rep := startTestReplica(t, fleet, func(cfg *Config) { cfg.AdminToken = "s3cret" })
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

func TestUnhealthyWorkerLosesItsBindingsAfterTheGrace(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(time.Millisecond))
	rep := startTestReplica(t, fleet, func(cfg *Config) { cfg.Cluster.WorkerGrace = 200 * time.Millisecond })
	c := newRouterClient(t, rep)
	a := c.complete(promptTokens(1, 2*blockTokens), 2, hdr("X-Session-ID", "grace")).mustOK(t)
	bound := a.worker()
	// The leader's own evidence (as when its proxy sees the worker answer garbage): the grace
	// acts on that, never on what the merged view took from other replicas.
	rep.share.health.MarkDown(bound, "test: down")
	eventually(t, "the unhealthy worker's binding is invalidated", func() (bool, string) {
		if b, ok := rep.node.FSM().Get("grace"); ok {
			return false, fmt.Sprintf("still bound to %s", b.Worker)
		}
		return true, ""
	})
}
