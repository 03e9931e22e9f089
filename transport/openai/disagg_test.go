package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// prefillAnswer is a prefill worker's answer with the params a decode worker needs.
func prefillAnswer(engine string) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"p","choices":[{"text":"a"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":%q,"remote_host":"127.0.0.1","remote_port":4321,"tp_size":1}}`, engine)
	}
}

func role(s routing.WorkerSpec, r routing.Role) routing.WorkerSpec {
	s.Role = r
	return s
}

// pdFront is a front over prefill and decode fakes, disaggregating every request.
func pdFront(t *testing.T, prefill, decode []*fakeWorker) *rig {
	t.Helper()
	var specs []routing.WorkerSpec
	for i, p := range prefill {
		specs = append(specs, role(spec(fmt.Sprintf("p%d", i), p.URL), routing.RolePrefill))
	}
	for i, d := range decode {
		specs = append(specs, role(spec(fmt.Sprintf("d%d", i), d.URL), routing.RoleDecode))
	}
	return newRig(t, specs, rigOptions{router: func(c *routing.Config) { c.Disagg.Mode = routing.DisaggAlways }})
}

// fields decodes a JSON object body.
func fields(t *testing.T, body string) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatalf("body %q: %v", body, err)
	}
	return m
}

// TestDisaggregatedRequestTakesTwoLegs: the prefill leg is the client's request asking for
// a remote decode, not streamed, one token long; the decode leg is the client's request
// with the prefill worker's params; one request id for both; the client gets the decode
// worker's answer, and every leg's load is released.
func TestDisaggregatedRequestTakesTwoLegs(t *testing.T) {
	p := newFakeWorker(t, prefillAnswer("eng-p0"))
	d := newFakeWorker(t, okJSON)
	rg := pdFront(t, []*fakeWorker{p}, []*fakeWorker{d})
	body := `{"model":"m","prompt":"hello there","stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":50,"min_tokens":5}`
	resp, got := rg.post("/v1/completions", body, nil)
	if resp.StatusCode != http.StatusOK || got != `{"id":"cmpl-1","object":"text_completion","choices":[{"text":"ok"}]}` {
		t.Fatalf("client got %d %s", resp.StatusCode, got)
	}
	if w, pw := resp.Header.Get(HeaderWorker), resp.Header.Get(HeaderPrefillWorker); w != "d0" || pw != "p0" {
		t.Fatalf("worker headers %q, prefill %q", w, pw)
	}
	if p.requests() != 1 || d.requests() != 1 {
		t.Fatalf("prefill got %d requests, decode %d", p.requests(), d.requests())
	}
	pb, ph, ppath := p.last()
	pf := fields(t, pb)
	if ppath != "/v1/completions" || string(pf["stream"]) != "false" || string(pf["max_tokens"]) != "1" || string(pf["max_completion_tokens"]) != "1" {
		t.Fatalf("prefill leg %s: %s", ppath, pb)
	}
	for _, k := range []string{"stream_options", "min_tokens"} {
		if _, ok := pf[k]; ok {
			t.Fatalf("prefill leg keeps %s: %s", k, pb)
		}
	}
	var kv map[string]any
	if err := json.Unmarshal(pf["kv_transfer_params"], &kv); err != nil || kv["do_remote_decode"] != true || kv["do_remote_prefill"] != false {
		t.Fatalf("prefill leg params %s (%v)", pf["kv_transfer_params"], err)
	}
	db, dh, _ := d.last()
	df := fields(t, db)
	if string(df["stream"]) != "true" || string(df["max_tokens"]) != "50" || string(df["min_tokens"]) != "5" {
		t.Fatalf("decode leg is not the client's request: %s", db)
	}
	if err := json.Unmarshal(df["kv_transfer_params"], &kv); err != nil || kv["remote_engine_id"] != "eng-p0" || kv["tp_size"] != 1.0 {
		t.Fatalf("decode leg params %s (%v), want the prefill worker's", df["kv_transfer_params"], err)
	}
	if id := ph.Get(headerRequestID); id == "" || dh.Get(headerRequestID) != id {
		t.Fatalf("request ids: prefill %q, decode %q", id, dh.Get(headerRequestID))
	}
	waitIdle(t, rg)
	if n := rg.metric("kvrouter_disagg_requests_total", map[string]string{"outcome": "disaggregated"}); n != 1 {
		t.Fatalf("disaggregated count %v", n)
	}
	if n := rg.metric("kvrouter_prefill_leg_seconds", nil); n != 1 {
		t.Fatalf("prefill leg observations %v", n)
	}
}

// TestDisaggregationFailures: each failure of a leg ends as documented.
func TestDisaggregationFailures(t *testing.T) {
	fail := func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "boom", http.StatusInternalServerError) }
	badParams := func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"p","choices":[{"text":"a"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":"nope","remote_host":"h","remote_port":1}}`)
	}
	cases := []struct {
		name             string
		prefill, decode  []http.HandlerFunc
		status           int
		prefillCalls     []int // per prefill worker
		decodeCalls      []int
		decodeHasParams  bool // the last decode request carried kv_transfer_params
		outcome          string
		prefillUnhealthy bool
	}{
		{name: "prefill fails, retried on the other prefill worker",
			prefill: []http.HandlerFunc{fail, prefillAnswer("e1")}, decode: []http.HandlerFunc{okJSON},
			status: 200, prefillCalls: []int{1, 1}, decodeCalls: []int{1}, decodeHasParams: true, outcome: "disaggregated"},
		{name: "every prefill worker fails: aggregated on the decode worker",
			prefill: []http.HandlerFunc{fail, fail}, decode: []http.HandlerFunc{okJSON},
			status: 200, prefillCalls: []int{1, 1}, decodeCalls: []int{1}, decodeHasParams: false, outcome: "prefill_failed"},
		{name: "bad kv_transfer_params: 502, the prefill worker marked",
			prefill: []http.HandlerFunc{badParams}, decode: []http.HandlerFunc{okJSON},
			status: 502, prefillCalls: []int{1}, decodeCalls: []int{0}, prefillUnhealthy: true},
		{name: "decode fails before its first byte: decode elsewhere, with a fresh prefill",
			prefill: []http.HandlerFunc{prefillAnswer("e0")}, decode: []http.HandlerFunc{fail, fail},
			status: 502, prefillCalls: []int{2}, decodeCalls: []int{1, 1}, decodeHasParams: true, outcome: "disaggregated"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var ps, ds []*fakeWorker
			for _, h := range tc.prefill {
				ps = append(ps, newFakeWorker(t, h))
			}
			for _, h := range tc.decode {
				ds = append(ds, newFakeWorker(t, h))
			}
			rg := pdFront(t, ps, ds)
			resp, body := rg.post("/v1/completions", completionBody, nil)
			if resp.StatusCode != tc.status && !(tc.status == 502 && resp.StatusCode >= 500) {
				t.Fatalf("status %d (%s), want %d", resp.StatusCode, body, tc.status)
			}
			if tc.status == 502 && tc.prefillUnhealthy {
				if e := errorOf(t, body); resp.StatusCode != 502 || e.Code != "bad_kv_transfer_params" {
					t.Fatalf("answer %d %+v, want 502 bad_kv_transfer_params", resp.StatusCode, e)
				}
				if rg.healthy("p0") {
					t.Fatal("a prefill worker that sent bad params is still healthy")
				}
			}
			sum := func(ws []*fakeWorker) (n []int) {
				for _, w := range ws {
					n = append(n, w.requests())
				}
				return n
			}
			// Which of two equal workers goes first is the policy's draw: compare sorted.
			if got := sum(ps); fmt.Sprint(sortedInts(got)) != fmt.Sprint(sortedInts(tc.prefillCalls)) {
				t.Fatalf("prefill calls %v, want %v", got, tc.prefillCalls)
			}
			if got := sum(ds); fmt.Sprint(sortedInts(got)) != fmt.Sprint(sortedInts(tc.decodeCalls)) {
				t.Fatalf("decode calls %v, want %v", got, tc.decodeCalls)
			}
			if tc.decodeCalls[0]+tc.decodeCalls[len(tc.decodeCalls)-1] > 0 {
				var last string
				for _, d := range ds {
					if d.requests() > 0 {
						last, _, _ = d.last()
					}
				}
				if _, has := fields(t, last)["kv_transfer_params"]; has != tc.decodeHasParams {
					t.Fatalf("decode leg %s: kv_transfer_params present %v, want %v", last, has, tc.decodeHasParams)
				}
			}
			if tc.outcome != "" && rg.metric("kvrouter_disagg_requests_total", map[string]string{"outcome": tc.outcome}) == 0 {
				t.Fatalf("no %s outcome counted", tc.outcome)
			}
			waitIdle(t, rg)
		})
	}
}

// waitIdle waits until every leg's load is released (the handler finishes its attempts
// after the client has its answer).
func waitIdle(t *testing.T, rg *rig) {
	t.Helper()
	poll.Until(t, 10*time.Second, func() error {
		if !rg.idle() {
			return fmt.Errorf("load left: %v", rg.tracker.Snapshot())
		}
		return nil
	})
}

func sortedInts(n []int) []int {
	out := slices.Clone(n)
	slices.Sort(out)
	return out
}

// TestClientCancelDuringPrefillFreesItsLoad: a client that leaves while its prefill leg
// runs cancels that leg, never reaches a decode worker, and leaves no load behind.
func TestClientCancelDuringPrefillFreesItsLoad(t *testing.T) {
	started := make(chan struct{}, 1)
	p := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-r.Context().Done()
	})
	d := newFakeWorker(t, okJSON)
	rg := pdFront(t, []*fakeWorker{p}, []*fakeWorker{d})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, rg.front.URL+"/v1/completions", strings.NewReader(completionBody))
		resp, err := rg.front.Client().Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the prefill leg never arrived")
	}
	if rg.idle() {
		t.Fatal("no load counted while the prefill leg runs: the test shows nothing")
	}
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("client: %v, want canceled", err)
	}
	waitIdle(t, rg)
	if d.requests() != 0 {
		t.Fatalf("a cancelled request reached the decode worker %d times", d.requests())
	}
}

// TestSessionBindsItsDecodeWorker: a session's follow-up turns go to the decode worker its
// first turn used, while each turn's prefill is chosen afresh.
func TestSessionBindsItsDecodeWorker(t *testing.T) {
	ps := []*fakeWorker{newFakeWorker(t, prefillAnswer("e0")), newFakeWorker(t, prefillAnswer("e1"))}
	ds := []*fakeWorker{newFakeWorker(t, okJSON), newFakeWorker(t, okJSON), newFakeWorker(t, okJSON)}
	rg := pdFront(t, ps, ds)
	hdr := map[string]string{"X-Session-ID": "chat-1"}
	resp, _ := rg.post("/v1/completions", completionBody, hdr)
	first := resp.Header.Get(HeaderWorker)
	if resp.StatusCode != 200 || first == "" || first[0] != 'd' {
		t.Fatalf("first turn: %d on %q", resp.StatusCode, first)
	}
	for i := range 5 {
		resp, _ := rg.post("/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"hello there, general kenobi, turn %d"}`, i), hdr)
		if w := resp.Header.Get(HeaderWorker); resp.StatusCode != 200 || w != first || resp.Header.Get(HeaderPrefillWorker) == "" {
			t.Fatalf("turn %d: %d on %q (prefill %q), want decode worker %s", i, resp.StatusCode, w, resp.Header.Get(HeaderPrefillWorker), first)
		}
	}
}

// TestRouteAnswersBothTargets: POST /v1/route names the decode and the prefill worker of a
// disaggregated request, and sends nothing to either.
func TestRouteAnswersBothTargets(t *testing.T) {
	p := newFakeWorker(t, prefillAnswer("e0"))
	d := newFakeWorker(t, okJSON)
	rg := pdFront(t, []*fakeWorker{p}, []*fakeWorker{d})
	resp, body := rg.post("/v1/route", completionBody, nil)
	var ans routeAnswer
	if err := json.Unmarshal([]byte(body), &ans); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d %s: %v", resp.StatusCode, body, err)
	}
	if ans.Worker != "d0" || ans.Disaggregation != routing.OutcomeDisaggregated || ans.Prefill == nil || ans.Prefill.Worker != "p0" || ans.Prefill.URL != p.URL {
		t.Fatalf("route answer %s", body)
	}
	if p.requests()+d.requests() != 0 || !rg.idle() {
		t.Fatalf("a query dispatched (%d, %d) or left load", p.requests(), d.requests())
	}
}

// FuzzTransferParams: whatever a prefill worker answers, reading its params never panics,
// and params accepted are a JSON object asking the decode side to pull, which a decode leg
// body can carry.
func FuzzTransferParams(f *testing.F) {
	f.Add([]byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[1],"remote_host":"h","remote_port":1}}`))
	f.Add([]byte(`{"kv_transfer_params":null}`))
	f.Add([]byte(`{"kv_transfer_params":{"do_remote_prefill":"yes"}}`))
	f.Add([]byte(`[1,2]`))
	f.Add([]byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[-1e309],"remote_host":"h","remote_port":70000}}`))
	f.Fuzz(func(t *testing.T, answer []byte) {
		p, err := transferParams(answer)
		if err != nil {
			return
		}
		var m map[string]json.RawMessage
		if json.Unmarshal(p, &m) != nil || string(m["do_remote_prefill"]) != "true" {
			t.Fatalf("accepted params %s", p)
		}
		b, err := decodeBody([]byte(completionBody), p)
		if err != nil || !json.Valid(b) {
			t.Fatalf("decode body from %s: %s %v", p, b, err)
		}
	})
}
