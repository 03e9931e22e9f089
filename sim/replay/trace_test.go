package replay_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
)

// loadReal is the first n requests of the bundled Mooncake trace, with sessions assigned.
func loadReal(tb testing.TB, n int) []trace.Request {
	tb.Helper()
	reqs, err := trace.Bundled()
	if err != nil {
		tb.Fatalf("Bundled: %v", err)
	}
	reqs = reqs[:min(n, len(reqs))]
	trace.AssignSessions(reqs)
	return reqs
}

// One worker with an unlimited cache, fed serially, must see almost exactly
// the trace's own ceiling: this proves the derived prompts carry the
// trace's prefix structure end to end. It can fall short only where a
// block was first seen as a partial last block (the fake caches whole
// 16-token blocks of what it saw).
func TestRunSingleUnlimitedWorkerReachesTraceCeiling(t *testing.T) {
	// Multi-turn sessions only, up to a token budget that keeps the test
	// quick under -race; the ceiling is recomputed on the same subset.
	all := loadReal(t, 2000)
	turns := make(map[string]int)
	for _, r := range all {
		turns[r.Session]++
	}
	var reqs []trace.Request
	budget := 600_000
	for _, r := range all {
		if turns[r.Session] >= 3 && r.InputLength <= budget {
			budget -= r.InputLength
			reqs = append(reqs, r)
		}
	}
	f := newFake(t, func(f *fakeServer) { f.workerID = "only" })
	cfg := config(reqs)
	cfg.Target = f.URL
	cfg.Concurrency = 1
	cfg.Speedup = 1e6
	sum, err := replay.Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if sum.OK != len(reqs) {
		t.Fatalf("ok %d of %d: %v", sum.OK, len(reqs), sum.Errors)
	}
	_, ceiling := trace.Ceiling(reqs)
	if ceiling < 0.1 {
		t.Fatalf("subset ceiling %.3f: too little reuse to prove anything", ceiling)
	}
	t.Logf("hit rate %.4f, ceiling %.4f", sum.HitRate, ceiling)
	if sum.HitRate > ceiling+1e-9 || sum.HitRate < ceiling-0.01 {
		t.Errorf("hit rate %.4f, trace ceiling %.4f", sum.HitRate, ceiling)
	}
}

// BenchmarkRun measures the client's own cost per request with
// trace-sized prompts against a server that does no work.
func BenchmarkRun(b *testing.B) {
	reqs := loadReal(b, 400)
	for i := range reqs {
		reqs[i].Timestamp = 0
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"choices\":[{\"text\":\"x\"}]}\n\n"+
			"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":5}}}\n\n"+
			"data: [DONE]\n\n")
	}))
	defer srv.Close()
	cfg := config(reqs)
	cfg.Target = srv.URL
	cfg.Concurrency = 4
	tokens := 0
	for _, r := range reqs {
		tokens += r.InputLength
	}
	b.ResetTimer()
	for b.Loop() {
		sum, err := replay.Run(b.Context(), cfg)
		if err != nil || sum.OK != len(reqs) {
			b.Fatalf("Run: %v, %+v", err, sum)
		}
	}
	sec := b.Elapsed().Seconds()
	b.ReportMetric(float64(b.N*len(reqs))/sec, "req/s")
	b.ReportMetric(float64(b.N*tokens)/sec/1e6, "Mtokens/s")
}
