package system_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/internal/envoytest"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// TestAnAliasThroughThePickerReachesTheWorkerAsItsTarget: three pickers over two workers
// serving llama-v2 and two serving llama-v3, with the alias llama -> llama-v2 90, llama-v3
// 10 set through the admin API. Each request for llama through a gateway reaches an
// endpoint serving its target, with the body's model replaced by the target (the simulated
// worker refuses a model it does not serve, 404, as vLLM does) and a content-length that
// matches the new body; both turns of a session, through two replicas, go to one target
// and one endpoint. With --tokenizer worker each prompt is tokenized as its target by a
// worker serving it (the simulated worker's /tokenize refuses another model, as vLLM's).
func TestAnAliasThroughThePickerReachesTheWorkerAsItsTarget(t *testing.T) {
	const v2, v3 = "llama-v2", "llama-v3"
	fl := startFleetOf(t, sim.Config{Model: v2}, sim.Config{Model: v2}, sim.Config{Model: v3}, sim.Config{Model: v3})
	serves := map[string]string{}
	for i, m := range []string{v2, v2, v3, v3} {
		serves[strings.TrimPrefix(fl.urls[i], "http://")] = m
	}
	c, gws := startPickers(t, fl, "--tokenizer", "worker")
	ctx := t.Context()
	servingModels(ctx, t, c, v2, v3)
	for r, gw := range gws {
		eventually(t, 30*time.Second, func() error {
			if s, err := gw.Health(ctx, "readiness"); err != nil || s != healthpb.HealthCheckResponse_SERVING {
				return fmt.Errorf("%s: %v %v", r.ID, s, err)
			}
			return nil
		})
	}
	adm := &admin.Client{Addr: c.replicas[0].Admin, HTTP: httpClient}
	if _, err := adm.Do(ctx, http.MethodPut, "/admin/models/aliases/llama", admin.AliasView{Targets: []admin.AliasTargetView{
		{Model: v2, Weight: 90}, {Model: v3, Weight: 10}}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, func() error {
		for _, r := range c.replicas {
			var v admin.AliasView
			if err := getAdmin(ctx, r, "/admin/models/aliases/llama", &v); err != nil {
				return err
			}
			if len(v.Targets) != 2 {
				return fmt.Errorf("%s has %+v", r.ID, v)
			}
		}
		return nil
	})
	// send sends one turn for llama through replica i's gateway and checks what reached the
	// worker; it returns the target and the endpoint.
	send := func(session string, i, turn int) (string, string) {
		t.Helper()
		r := c.replicas[i%len(c.replicas)]
		h := http.Header{"Content-Type": {"application/json"}}
		if session != "" {
			h.Set("X-Session-Id", session)
		}
		body := fmt.Appendf(nil, `{"model":"llama","messages":[{"role":"user","content":"turn %d of %s"}],"max_tokens":2}`, turn, session)
		res, err := gws[r].Do(ctx, envoytest.Request{Path: "/v1/chat/completions", Header: h, Body: body})
		if err != nil {
			t.Fatalf("%s turn %d via %s: %v", session, turn, r.ID, err)
		}
		var sent, answer struct {
			Model string `json:"model"`
		}
		_ = json.Unmarshal(res.Sent, &sent)
		if res.Status != http.StatusOK {
			t.Fatalf("%s turn %d via %s: sent on as model %q to %s (serving %q): %d %s", session, turn, r.ID, sent.Model, res.Endpoint, serves[res.Endpoint], res.Status, res.Body)
		}
		_ = json.Unmarshal(res.Body, &answer)
		if serves[res.Endpoint] != sent.Model || answer.Model != sent.Model {
			t.Fatalf("%s turn %d via %s: sent on as %q to %s serving %q, answered as %q", session, turn, r.ID, sent.Model, res.Endpoint, serves[res.Endpoint], answer.Model)
		}
		return sent.Model, res.Endpoint
	}
	targets := map[string]int{}
	for s := range 40 {
		session := fmt.Sprintf("alias-gw-%d", s)
		model, ep := send(session, s, 0)
		targets[model]++
		if m2, ep2 := send(session, s+1, 1); m2 != model || ep2 != ep {
			t.Fatalf("%s: turn 0 went to %s on %s, turn 1 to %s on %s", session, model, ep, m2, ep2)
		}
	}
	for i := range 5 {
		send("", i, 0)
	}
	t.Logf("sessions by target: %v", targets)
	// The workers' own record: each prompt was tokenized by a worker serving its target, as
	// the target, and none was asked for a model it does not serve.
	tokenized := map[string]uint64{}
	for i, w := range fl.sims {
		st := w.Stats()
		if st.WrongModel != 0 {
			t.Fatalf("%s (%s) was asked for another model %d times", fl.ids[i], w.Config().Model, st.WrongModel)
		}
		tokenized[w.Config().Model] += st.Tokenized
	}
	for model, n := range targets {
		if tokenized[model] == 0 {
			t.Fatalf("no prompt tokenized as %s, the target of %d sessions (tokenized: %v)", model, n, tokenized)
		}
	}
	t.Logf("prompts tokenized by target: %v", tokenized)
}
