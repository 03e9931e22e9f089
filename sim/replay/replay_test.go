package replay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
)

// mkTrace builds a trace from (timestamp ms, input length, output length,
// ids) tuples, with sessions assigned.
func mkTrace(specs ...spec) []trace.Request {
	reqs := make([]trace.Request, len(specs))
	for i, s := range specs {
		reqs[i] = trace.Request{
			Index: i, Timestamp: time.Duration(s.ms) * time.Millisecond,
			InputLength: s.in, OutputLength: s.out, HashIDs: s.ids,
		}
	}
	trace.AssignSessions(reqs)
	return reqs
}

type spec struct {
	ms, in, out int
	ids         []uint64
}

// uniform is n requests at the same instant with distinct one-block prompts.
func uniform(n int) []trace.Request {
	specs := make([]spec, n)
	for i := range specs {
		specs[i] = spec{0, 64, 4, []uint64{uint64(1000 + i)}}
	}
	return mkTrace(specs...)
}

func config(reqs []trace.Request) replay.Config {
	cfg := replay.DefaultConfig()
	cfg.Requests = reqs
	cfg.Speedup = 1000
	cfg.Timeout = 20 * time.Second
	return cfg
}

func TestRunSendsPromptsSessionsAndHeaders(t *testing.T) {
	f := newFake(t, func(f *fakeServer) { f.workerID = "w-a" })
	reqs := mkTrace(
		spec{0, 1024, 6, []uint64{1, 2}},
		spec{10, 1300, 100, []uint64{1, 2, 3}}, // continues s0; 1024 tokens cached
		spec{20, 700, 0, []uint64{7, 8}},       // new session
		spec{30, 1100, 30, []uint64{1, 2, 3}},  // s0 again; 1024 + 16*((1100-1024)/16)... see below
	)
	cfg := config(reqs)
	cfg.Target = f.URL + "/" // a trailing slash must not double up
	cfg.Concurrency = 1      // serial, so the cache sees requests in order
	cfg.Model = "test-model"
	cfg.MaxOutputTokens = 50
	cfg.Label = "router"

	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	got := f.requests()
	if len(got) != len(reqs) {
		t.Fatalf("server saw %d requests, want %d", len(got), len(reqs))
	}
	wantSessions := []string{"s0", "s0", "s2", "s0"}
	wantMax := []int{6, 50, 1, 30}
	for i, g := range got {
		if g.Method != http.MethodPost || g.Path != "/v1/completions" || g.ContentType != "application/json" {
			t.Errorf("request %d: %s %s (%s)", i, g.Method, g.Path, g.ContentType)
		}
		if g.Session != wantSessions[i] {
			t.Errorf("request %d: X-Session-ID %q, want %q", i, g.Session, wantSessions[i])
		}
		if want := trace.Tokens(reqs[i], 512, nil); !slices.Equal(g.Prompt, want) {
			t.Errorf("request %d: prompt of %d tokens differs from trace.Tokens (%d)", i, len(g.Prompt), len(want))
		}
		if g.Model != "test-model" || !g.Stream || !g.IncludeUsage || g.MaxTokens != wantMax[i] {
			t.Errorf("request %d: model %q stream %v include_usage %v max_tokens %d (want %d)",
				i, g.Model, g.Stream, g.IncludeUsage, g.MaxTokens, wantMax[i])
		}
	}

	// Cached tokens at 16-token granularity: request 1 reuses blocks 1, 2
	// (1024); request 3 reuses all of request 1's first 1100 tokens that
	// form whole 16-token blocks (1088).
	wantPrompt := int64(1024 + 1300 + 700 + 1100)
	wantCached := int64(0 + 1024 + 0 + 1088)
	if sum.OK != 4 || sum.Failed != 0 || sum.Requests != 4 || sum.Planned != 4 || sum.Interrupted {
		t.Errorf("ok %d failed %d requests %d planned %d interrupted %v", sum.OK, sum.Failed, sum.Requests, sum.Planned, sum.Interrupted)
	}
	if sum.PromptTokens != wantPrompt || sum.CachedTokens != wantCached {
		t.Errorf("prompt %d cached %d, want %d %d", sum.PromptTokens, sum.CachedTokens, wantPrompt, wantCached)
	}
	if want := float64(wantCached) / float64(wantPrompt); sum.HitRate != want {
		t.Errorf("hit rate %v, want %v", sum.HitRate, want)
	}
	w, ok := sum.Workers["w-a"]
	if !ok || len(sum.Workers) != 1 || w.Requests != 4 || w.PromptTokens != wantPrompt {
		t.Errorf("workers %+v, want all 4 on w-a", sum.Workers)
	}
	if sum.TTFTSamples != 4 || sum.TTFTP50Ms <= 0 || sum.TTFTP99Ms < sum.TTFTP50Ms || sum.LatencyP99Ms < sum.TTFTP50Ms {
		t.Errorf("TTFT samples %d p50 %v p99 %v latency p99 %v", sum.TTFTSamples, sum.TTFTP50Ms, sum.TTFTP99Ms, sum.LatencyP99Ms)
	}
	if sum.RequestImbalance != 1 || sum.OverlapSamples != 0 || sum.Label != "router" {
		t.Errorf("imbalance %v overlap samples %d label %q", sum.RequestImbalance, sum.OverlapSamples, sum.Label)
	}
}

func TestRunWithoutStreamReadsJSONBody(t *testing.T) {
	f := newFake(t, nil)
	reqs := mkTrace(spec{0, 512, 3, []uint64{1}}, spec{1, 600, 3, []uint64{1, 2}})
	cfg := config(reqs)
	cfg.Target = f.URL
	cfg.Stream = false
	cfg.Concurrency = 1
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	for i, g := range f.requests() {
		if g.Stream || g.IncludeUsage || g.Model != "" {
			t.Errorf("request %d: stream %v include_usage %v model %q", i, g.Stream, g.IncludeUsage, g.Model)
		}
	}
	if sum.OK != 2 || sum.PromptTokens != 1112 || sum.CachedTokens != 512 || sum.TTFTSamples != 2 {
		t.Errorf("ok %d prompt %d cached %d ttft samples %d", sum.OK, sum.PromptTokens, sum.CachedTokens, sum.TTFTSamples)
	}
	// Without a worker header a router run cannot say where requests went.
	if _, ok := sum.Workers["unknown"]; !ok {
		t.Errorf("workers %v, want \"unknown\"", sum.Workers)
	}
}

func TestRunRoundRobinsOverWorkersAsBaseline(t *testing.T) {
	a := newFake(t, func(f *fakeServer) { f.workerID = "worker-a" })
	b := newFake(t, nil) // names no worker: the summary falls back to its URL
	cfg := config(uniform(6))
	cfg.Workers = []string{a.URL, b.URL}
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(a.requests()) != 3 || len(b.requests()) != 3 {
		t.Errorf("a got %d, b got %d; want 3 each", len(a.requests()), len(b.requests()))
	}
	if sum.Workers["worker-a"].Requests != 3 || sum.Workers[b.URL].Requests != 3 {
		t.Errorf("workers %+v", sum.Workers)
	}
	if sum.RequestImbalance != 1 || sum.PromptTokenImbalance != 1 {
		t.Errorf("imbalance %v / %v, want 1 / 1", sum.RequestImbalance, sum.PromptTokenImbalance)
	}
}

func TestRunRoundRobinsOverRouterReplicas(t *testing.T) {
	routers := []*fakeServer{
		newFake(t, func(f *fakeServer) { f.workerID = "w1" }),
		newFake(t, func(f *fakeServer) { f.workerID = "w1" }),
		newFake(t, func(f *fakeServer) { f.workerID = "w2" }),
	}
	cfg := config(uniform(9))
	for _, r := range routers {
		cfg.Targets = append(cfg.Targets, r.URL)
	}
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	for i, r := range routers {
		if n := len(r.requests()); n != 3 {
			t.Errorf("router %d got %d requests, want 3", i, n)
		}
	}
	// Workers are counted by the worker the routers named, not by router.
	if sum.Workers["w1"].Requests != 6 || sum.Workers["w2"].Requests != 3 {
		t.Errorf("workers %+v", sum.Workers)
	}
}

func TestRunReadsRouterOverlapHeader(t *testing.T) {
	f := newFake(t, func(f *fakeServer) {
		f.header = func(h http.Header, prompt []uint32) {
			h.Set("X-Kvrouter-Worker", "routed-w")
			h.Set("X-Worker-ID", "ignored")
			// The router claims 2 blocks for every request.
			h.Set("X-Kvrouter-Overlap-Blocks", "2")
		}
	})
	reqs := mkTrace(spec{0, 512, 1, []uint64{1}}, spec{1, 512, 1, []uint64{1}})
	cfg := config(reqs)
	cfg.Target = f.URL
	cfg.Concurrency = 1
	cfg.RouterBlockSize = 32
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	// Predicted 64 tokens both times; actual 0 then 512: errors 64 and 448.
	if sum.OverlapSamples != 2 || sum.OverlapMAETokens != 256 || sum.RouterBlockSize != 32 {
		t.Errorf("overlap samples %d MAE %v block %d, want 2, 256, 32", sum.OverlapSamples, sum.OverlapMAETokens, sum.RouterBlockSize)
	}
	if sum.Workers["routed-w"].Requests != 2 {
		t.Errorf("workers %+v, want X-Kvrouter-Worker to win", sum.Workers)
	}
}

func TestRunRespectsConcurrencyBound(t *testing.T) {
	const n, limit = 12, 3
	var f *fakeServer
	f = newFake(t, func(fs *fakeServer) {
		// Hold each request while a client over the bound could still add
		// one more, so one that does is caught in the act. A client within
		// the bound never satisfies the condition; the probe then gives up.
		fs.gate = func(r *http.Request) {
			_ = poll.Wait(100*time.Millisecond, func() error {
				if inflight, done := f.state(); inflight < min(limit+1, n-done) && r.Context().Err() == nil {
					return errors.New("no client over the bound yet")
				}
				return nil
			})
		}
	})
	cfg := config(uniform(n))
	cfg.Target = f.URL
	cfg.Concurrency = limit
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if sum.OK != n {
		t.Fatalf("ok %d of %d: %v", sum.OK, n, sum.Errors)
	}
	if got := f.peakInflight(); got != limit {
		t.Errorf("peak in flight %d, want exactly %d", got, limit)
	}
}

func TestRunDispatchesInOrderNoEarlierThanScaledArrival(t *testing.T) {
	f := newFake(t, nil)
	reqs := mkTrace(
		spec{0, 64, 1, []uint64{1}},
		spec{100, 64, 1, []uint64{2}},
		spec{150, 64, 1, []uint64{3}},
		spec{300, 64, 1, []uint64{4}},
	)
	cfg := config(reqs)
	cfg.Target = f.URL
	cfg.Speedup = 10 // the last arrival is due 30 ms in
	cfg.Concurrency = 1
	begin := time.Now()
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	got := f.requests()
	if len(got) != 4 {
		t.Fatalf("server saw %d requests", len(got))
	}
	for i, g := range got {
		if want := trace.Tokens(reqs[i], 0, nil); !slices.Equal(g.Prompt, want) {
			t.Errorf("request %d arrived out of order", i)
		}
		due := reqs[i].Timestamp / 10
		if early := begin.Add(due).Sub(g.At); early > 0 {
			t.Errorf("request %d arrived %v before its scaled arrival %v", i, early, due)
		}
	}
	if sum.DurationSeconds < 0.030 {
		t.Errorf("run took %.3f s, less than the scaled trace (0.030 s)", sum.DurationSeconds)
	}
}

func TestRunLimitsRequests(t *testing.T) {
	f := newFake(t, nil)
	cfg := config(uniform(5))
	cfg.Target = f.URL
	cfg.Limit = 2
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(f.requests()) != 2 || sum.Requests != 2 || sum.Planned != 2 {
		t.Errorf("server saw %d, summary %d of %d; want 2", len(f.requests()), sum.Requests, sum.Planned)
	}
}

func TestRunCountsErrorsByCause(t *testing.T) {
	behaviours := map[string]func(w http.ResponseWriter, r *http.Request){
		"ok": nil,
		"http_500": func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, `{"error":{"message":"boom"}}`, http.StatusInternalServerError)
		},
		"http_429": func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusTooManyRequests)
		},
		"bad_body": func(w http.ResponseWriter, r *http.Request) {
			writeEvent(w, `{"choices": [`)
		},
		"bad_body_plain": func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Write([]byte(`{"choices":[],"usage":{"prompt_tokens":3}}`))
		},
		"stream_error": func(w http.ResponseWriter, r *http.Request) {
			writeEvent(w, `{"choices":[{"text":"x"}]}`)
			writeEvent(w, `{"error":{"message":"engine died"}}`)
		},
		"no_usage": func(w http.ResponseWriter, r *http.Request) {
			writeEvent(w, `{"choices":[{"text":"x"}]}`)
			writeEvent(w, `[DONE]`)
		},
		"truncated": func(w http.ResponseWriter, r *http.Request) {
			writeEvent(w, `{"choices":[{"text":"x"}]}`)
		},
		"bad_usage": func(w http.ResponseWriter, r *http.Request) {
			writeEvent(w, `{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":9}}}`)
			writeEvent(w, `[DONE]`)
		},
		"transport": func(w http.ResponseWriter, r *http.Request) {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				conn.Close()
			}
		},
		"timeout": func(w http.ResponseWriter, r *http.Request) {
			<-r.Context().Done()
		},
	}
	wantCause := map[string]string{
		"bad_body_plain": "bad_body", "bad_usage": "bad_body",
	}
	var names []string
	for name := range behaviours {
		names = append(names, name)
	}
	slices.Sort(names)
	specs := make([]spec, len(names))
	for i := range names {
		specs[i] = spec{0, 32, 1, []uint64{uint64(100 + i)}}
	}
	reqs := mkTrace(specs...)
	for i := range reqs {
		reqs[i].Session = names[i]
	}
	f := newFake(t, func(f *fakeServer) {
		f.behave = func(w http.ResponseWriter, r *http.Request, got received) bool {
			b := behaviours[got.Session]
			if b == nil {
				return false
			}
			b(w, r)
			return true
		}
	})
	cfg := config(reqs)
	cfg.Target = f.URL
	cfg.Timeout = 300 * time.Millisecond // only the "timeout" request waits it out
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	want := make(map[string]int)
	for _, name := range names {
		if name == "ok" {
			continue
		}
		cause := name
		if c, ok := wantCause[name]; ok {
			cause = c
		}
		want[cause]++
	}
	if !mapsEqual(sum.Errors, want) {
		t.Errorf("errors %v, want %v", sum.Errors, want)
	}
	if sum.OK != 1 || sum.Failed != len(names)-1 || sum.Requests != len(names) {
		t.Errorf("ok %d failed %d requests %d", sum.OK, sum.Failed, sum.Requests)
	}
}

func mapsEqual(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestRunCountsRefusedConnectionsAsTransport(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	cfg := config(uniform(3))
	cfg.Target = "http://" + addr
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if sum.Errors["transport"] != 3 || sum.OK != 0 {
		t.Errorf("errors %v ok %d, want 3 transport", sum.Errors, sum.OK)
	}
}

func TestRunCancelReturnsPartialSummary(t *testing.T) {
	f := newFake(t, func(f *fakeServer) {
		f.behave = func(w http.ResponseWriter, r *http.Request, got received) bool {
			if got.Session != "s2" {
				return false
			}
			<-r.Context().Done() // hangs until the client goes away
			return true
		}
	})
	specs := []spec{{0, 32, 1, []uint64{1}}, {0, 32, 1, []uint64{2}}, {0, 32, 1, []uint64{3}}}
	for i := range 10 {
		// Due in an hour: must never be sent.
		specs = append(specs, spec{3_600_000_000, 32, 1, []uint64{uint64(10 + i)}})
	}
	cfg := config(mkTrace(specs...))
	cfg.Target = f.URL
	cfg.Concurrency = 1
	var progress bytes.Buffer
	cfg.Progress = &progress
	cfg.Label = "cancel"

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	type out struct {
		sum *replay.Summary
		err error
	}
	done := make(chan out, 1)
	go func() {
		sum, err := replay.Run(ctx, cfg)
		done <- out{sum, err}
	}()
	poll.Holds(t, 10*time.Second, "the third request to reach the server", func() bool { return len(f.requests()) == 3 })
	cancel()
	var o out
	select {
	case o = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	if !errors.Is(o.err, context.Canceled) {
		t.Errorf("error %v, want context.Canceled", o.err)
	}
	s := o.sum
	if s == nil {
		t.Fatal("no partial summary")
	}
	if !s.Interrupted || s.Requests != 3 || s.Planned != 13 || s.OK != 2 || s.Errors["canceled"] != 1 {
		t.Errorf("interrupted %v requests %d planned %d ok %d errors %v", s.Interrupted, s.Requests, s.Planned, s.OK, s.Errors)
	}
	if !strings.Contains(progress.String(), "cancel") {
		t.Errorf("progress output %q lacks the label", progress.String())
	}
	var text strings.Builder
	s.WriteText(&text)
	if !strings.Contains(text.String(), "(interrupted)") {
		t.Errorf("text summary does not say interrupted:\n%s", text.String())
	}
}

func TestRunRejectsBadConfig(t *testing.T) {
	reqs := uniform(1)
	tests := []struct {
		name    string
		mutate  func(*replay.Config)
		wantErr string
	}{
		{"no endpoint", func(c *replay.Config) {}, "no target or workers"},
		{"both", func(c *replay.Config) { c.Target = "http://a"; c.Workers = []string{"http://b"} }, "not both"},
		{"bad scheme", func(c *replay.Config) { c.Target = "ftp://a" }, "want http(s)"},
		{"no host", func(c *replay.Config) { c.Workers = []string{"http://"} }, "want http(s)"},
		{"unparsable", func(c *replay.Config) { c.Target = "http://a b:%zz" }, "base URL"},
		{"no requests", func(c *replay.Config) { c.Target = "http://a"; c.Requests = nil }, "no requests"},
		{"negative speedup", func(c *replay.Config) { c.Target = "http://a"; c.Speedup = -1 }, "speedup"},
		{"huge speedup", func(c *replay.Config) { c.Target = "http://a"; c.Speedup = 1e12 }, "speedup"},
		{"negative concurrency", func(c *replay.Config) { c.Target = "http://a"; c.Concurrency = -1 }, "concurrency"},
		{"negative limit", func(c *replay.Config) { c.Target = "http://a"; c.Limit = -1 }, "limit"},
		{"negative timeout", func(c *replay.Config) { c.Target = "http://a"; c.Timeout = -1 }, "timeout"},
		{"negative block tokens", func(c *replay.Config) { c.Target = "http://a"; c.BlockTokens = -1 }, "block tokens"},
		{"negative router block", func(c *replay.Config) { c.Target = "http://a"; c.RouterBlockSize = -1 }, "router block"},
		{"negative output cap", func(c *replay.Config) { c.Target = "http://a"; c.MaxOutputTokens = -1 }, "max output"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := config(reqs)
			tt.mutate(&cfg)
			sum, err := replay.Run(t.Context(), cfg)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) || sum != nil {
				t.Errorf("Run = %v, %v; want error containing %q", sum, err, tt.wantErr)
			}
		})
	}
}

func TestSummaryJSONAndTable(t *testing.T) {
	f := newFake(t, func(f *fakeServer) { f.workerID = "w" })
	cfg := config(uniform(4))
	cfg.Target = f.URL
	cfg.Label = "kv"
	kv, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	rr := *kv
	rr.Label = "round-robin"
	rr.HitRate = 0.125
	rr.Failed = 7

	b, err := json.Marshal(kv)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"label", "requests", "ok", "errors", "duration_s", "prompt_tokens",
		"cached_tokens", "hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "latency_p50_ms",
		"latency_p99_ms", "workers", "request_imbalance", "prompt_token_imbalance", "overlap_mae_tokens"} {
		if _, ok := m[key]; !ok {
			t.Errorf("JSON lacks %q: %s", key, b)
		}
	}

	var tbl strings.Builder
	replay.Table(&tbl, []*replay.Summary{kv, &rr})
	lines := strings.Split(strings.TrimRight(tbl.String(), "\n"), "\n")
	if len(lines) < 8 || !strings.Contains(lines[0], "kv") || !strings.Contains(lines[0], "round-robin") {
		t.Fatalf("table:\n%s", tbl.String())
	}
	for _, want := range []string{"hit rate", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "errors", "imbalance", "12.5%", " 7"} {
		if !strings.Contains(tbl.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, tbl.String())
		}
	}
	if strings.Contains(tbl.String(), "raft leader changes") {
		t.Errorf("a table of one-replica runs shows cluster rows:\n%s", tbl.String())
	}
	x3 := rr
	x3.Label, x3.Replicas, x3.LeaderChanges, x3.ReadLeaseFailures = "kv x3", 3, 4, 2
	tbl.Reset()
	replay.Table(&tbl, []*replay.Summary{kv, &x3})
	for _, want := range []string{"raft leader changes", "read lease failures"} {
		i := strings.Index(tbl.String(), want)
		if i < 0 {
			t.Fatalf("table lacks %q:\n%s", want, tbl.String())
		}
		if line := strings.SplitN(tbl.String()[i:], "\n", 2)[0]; !strings.HasSuffix(strings.TrimSpace(line), map[bool]string{true: "4", false: "2"}[want == "raft leader changes"]) {
			t.Errorf("row %q: %q", want, line)
		}
	}
	var text strings.Builder
	kv.WriteText(&text)
	for _, want := range []string{"kv: 4 of 4 requests", "hit rate", "TTFT ms", "  w  ", strconv.Itoa(4*64) + " prompt tokens"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("text lacks %q:\n%s", want, text.String())
		}
	}
}

func TestRunStartsASliceAtItsFirstRequest(t *testing.T) {
	f := newFake(t, nil)
	// A slice from deep inside a trace: at speedup 1, waiting for its absolute timestamps
	// would take an hour; the deadline below would interrupt the run.
	reqs := mkTrace(spec{3_600_000, 64, 4, []uint64{1}}, spec{3_600_001, 64, 4, []uint64{2}})
	cfg := config(reqs)
	cfg.Speedup = 1
	cfg.Target = f.URL
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sum, err := replay.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Interrupted || sum.OK != 2 {
		t.Fatalf("ok %d interrupted %v: the slice waited for the trace's origin", sum.OK, sum.Interrupted)
	}
}

// TestProgressIsPlainLinesOffATerminal: written to a file or a pipe (a CI log, make demo >
// log), progress is whole lines, no carriage-return frames, at most one per interval, and a
// last line saying the run is done.
func TestProgressIsPlainLinesOffATerminal(t *testing.T) {
	f := newFake(t, nil)
	var specs []spec
	for i := range 6 {
		specs = append(specs, spec{i, 32, 1, []uint64{uint64(i + 1)}})
	}
	for _, tc := range []struct {
		every     time.Duration
		wantLines int
	}{
		{time.Nanosecond, 7}, // a line per request, and the last
		{time.Hour, 1},       // only the last
	} {
		cfg := config(mkTrace(specs...))
		cfg.Target = f.URL
		cfg.Concurrency = 1
		cfg.Label = "plain"
		cfg.ProgressEvery = tc.every
		var out bytes.Buffer
		cfg.Progress = &out
		if _, err := replay.Run(t.Context(), cfg); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(out.String(), "\r") {
			t.Fatalf("progress has carriage returns: %q", out.String())
		}
		lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
		if len(lines) != tc.wantLines ||
			!strings.HasPrefix(lines[len(lines)-1], "plain: 6/6 requests (100%)") || !strings.HasSuffix(lines[len(lines)-1], ", done") {
			t.Fatalf("every %v: %d lines, want %d ending in the done line: %q", tc.every, len(lines), tc.wantLines, out.String())
		}
	}
}
