package replica

import (
	"fmt"
	"io"
	"net/http"
	"slices"
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

// TestAdminAPIWordsABadBodyInJSONTerms: a worker spec or alias body that does not decode is a
// 400 naming the member and what it must be, never a Go type, and changes nothing.
func TestAdminAPIWordsABadBodyInJSONTerms(t *testing.T) {
	fleet := startWorkers(t, 1, simConfig(0))
	rep := startTestReplica(t, fleet, nil)
	ids := func() (out []string) {
		for _, st := range rep.registry.List() {
			out = append(out, st.Spec.ID)
		}
		return out
	}
	before := ids()
	for _, tc := range []struct {
		method, path, body, want string
	}{
		{http.MethodPost, "/admin/workers", `{"id":"x","url":3}`, "worker spec: url must be a string, not a number"},
		{http.MethodPost, "/admin/workers", `{"id":"x","url":"http://127.0.0.1:1","capacity_blocks":"many"}`, "worker spec: capacity_blocks must be an integer in range, not a string"},
		{http.MethodPost, "/admin/workers", `{"id":"x","color":"red"}`, `worker spec: request body has an unknown field \"color\"`},
		{http.MethodPost, "/admin/workers", ``, "worker spec: request body is empty"},
		{http.MethodPut, "/admin/models/aliases/llama", `{"targets":"m"}`, "alias: targets must be an array, not a string"},
	} {
		t.Run(tc.body, func(t *testing.T) {
			status, body := adminSend(t, rep, tc.method, tc.path, "", tc.body)
			if status != http.StatusBadRequest || !strings.Contains(string(body), tc.want) || strings.Contains(string(body), "Go ") {
				t.Fatalf("%d %s, want 400 saying %q", status, body, tc.want)
			}
		})
	}
	if after := ids(); !slices.Equal(after, before) {
		t.Fatalf("bad bodies changed the workers: %v, then %v", before, after)
	}
}
