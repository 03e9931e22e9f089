package replica

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/internal/envoytest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// TestWorkerAddedThroughTheAdminAPIServesItsDeclaredModels: a worker added through the admin
// API (its spec through the Raft log) with "models" takes only its model's requests, on the
// client port and through the endpoint picker; a model no worker serves is 404
// model_not_found on both.
func TestWorkerAddedThroughTheAdminAPIServesItsDeclaredModels(t *testing.T) {
	smallCfg, largeCfg := simConfig(0), simConfig(0)
	smallCfg.Model, largeCfg.Model = "small", "large"
	small := startRoleWorkers(t, []workerRole{{id: "s0"}, {id: "s1"}}, smallCfg)
	large := startRoleWorkers(t, []workerRole{{id: "l0"}}, largeCfg)
	rep, gw := startPicker(t, small, func(c *Config) {
		for i := range c.Workers {
			c.Workers[i].Models = []string{"small"}
		}
	})
	spec := fmt.Sprintf(`{"id":"l0","url":%q,"models":["large"]}`, large[0].spec.URL)
	if status, body := adminSend(t, rep, http.MethodPost, "/admin/workers", "", spec); status >= 300 {
		t.Fatalf("add l0: %d %s", status, body)
	}
	poll.Holds(t, pollTimeout, "l0 routable", func() bool {
		for _, tg := range rep.registry.Routable() {
			if tg.Worker.ID == "l0" && tg.Spec.Models[0] == "large" {
				return true
			}
		}
		return false
	})
	c := newRouterClient(t, rep)
	for i := range 12 {
		model, want := "small", []string{"s0", "s1"}
		if i%2 == 1 {
			model, want = "large", []string{"l0"}
		}
		body := fmt.Sprintf(`{"model":%q,"prompt":"turn %d","max_tokens":1}`, model, i)
		resp, err := c.hc.Post("http://"+rep.Addr()+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := resp.Header.Get("X-Kvrouter-Worker"); resp.StatusCode != http.StatusOK || !strings.Contains(strings.Join(want, ","), got) || got == "" {
			t.Fatalf("request %d for %s: %d on %q, want one of %v", i, model, resp.StatusCode, got, want)
		}
		r, err := gw.Do(t.Context(), envoytest.Request{Path: "/v1/completions", Body: []byte(body)})
		if err != nil || r.Status != http.StatusOK || (model == "large") != (r.Endpoint == endpointOf(large[0])) {
			t.Fatalf("picker, request %d for %s: %v, status %d, endpoint %s", i, model, err, r.Status, r.Endpoint)
		}
	}
	resp, err := c.hc.Post("http://"+rep.Addr()+"/v1/completions", "application/json", strings.NewReader(`{"model":"huge","prompt":"x"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("unknown model on the client port: %d, want 404", resp.StatusCode)
	}
	r, err := gw.Do(t.Context(), envoytest.Request{Path: "/v1/completions", Body: []byte(`{"model":"huge","prompt":"x"}`)})
	if err != nil || r.Immediate == nil || r.Status != http.StatusNotFound || !strings.Contains(string(r.Body), "model_not_found") {
		t.Fatalf("unknown model through the picker: %v, status %d, body %s; want an immediate 404 model_not_found", err, r.Status, r.Body)
	}
	for _, w := range append(small, large...) {
		if n := w.Stats().WrongModel; n != 0 {
			t.Fatalf("worker %s refused %d requests for another model", w.spec.ID, n)
		}
	}

}
