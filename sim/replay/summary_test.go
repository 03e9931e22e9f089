package replay

import (
	"testing"
	"time"
)

func TestSummarizeOnKnownResults(t *testing.T) {
	ms := time.Millisecond
	results := []result{
		{ok: true, worker: "a", ttft: 10 * ms, hasTTFT: true, latency: 100 * ms, promptTokens: 1000, cachedTokens: 500, overlap: 10, hasOverlap: true},
		{ok: true, worker: "a", ttft: 20 * ms, hasTTFT: true, latency: 200 * ms, promptTokens: 1000, cachedTokens: 1000, overlap: 60, hasOverlap: true},
		{ok: true, worker: "a", ttft: 30 * ms, hasTTFT: true, latency: 300 * ms, promptTokens: 2000, cachedTokens: 0},
		{ok: true, worker: "b", ttft: 40 * ms, hasTTFT: true, latency: 400 * ms, promptTokens: 4000, cachedTokens: 1500},
		{ok: true, worker: "b", latency: 500 * ms, promptTokens: 0}, // no first token seen
		{cause: "timeout"},
		{cause: "http_503"},
		{cause: "http_503"},
	}
	s := summarize(results, 16)
	if s.Requests != 8 || s.OK != 5 || s.Failed != 3 || s.Errors["timeout"] != 1 || s.Errors["http_503"] != 2 || len(s.Errors) != 2 {
		t.Errorf("requests %d ok %d failed %d errors %v", s.Requests, s.OK, s.Failed, s.Errors)
	}
	if s.PromptTokens != 8000 || s.CachedTokens != 3000 || s.HitRate != 0.375 {
		t.Errorf("prompt %d cached %d hit %v, want 8000 3000 0.375", s.PromptTokens, s.CachedTokens, s.HitRate)
	}
	// Nearest rank over 4 TTFTs: p50 -> 2nd, p90 and p99 -> 4th.
	if s.TTFTSamples != 4 || s.TTFTP50Ms != 20 || s.TTFTP90Ms != 40 || s.TTFTP99Ms != 40 {
		t.Errorf("TTFT n %d p50 %v p90 %v p99 %v", s.TTFTSamples, s.TTFTP50Ms, s.TTFTP90Ms, s.TTFTP99Ms)
	}
	if s.LatencyP50Ms != 300 || s.LatencyP99Ms != 500 {
		t.Errorf("latency p50 %v p99 %v, want 300 500", s.LatencyP50Ms, s.LatencyP99Ms)
	}
	a, b := s.Workers["a"], s.Workers["b"]
	if a.Requests != 3 || a.PromptTokens != 4000 || a.CachedTokens != 1500 || a.HitRate != 0.375 ||
		b.Requests != 2 || b.PromptTokens != 4000 || b.HitRate != 0.375 {
		t.Errorf("workers %+v", s.Workers)
	}
	// Requests 3 and 2: max 3 over mean 2.5. Tokens 4000 and 4000: even.
	if s.RequestImbalance != 1.2 || s.PromptTokenImbalance != 1 {
		t.Errorf("imbalance %v / %v, want 1.2 / 1", s.RequestImbalance, s.PromptTokenImbalance)
	}
	// Predicted 160 vs 500 and 960 vs 1000: errors 340 and 40, both under: bias -190.
	if s.OverlapSamples != 2 || s.OverlapMAETokens != 190 || s.OverlapBiasTokens != -190 {
		t.Errorf("overlap n %d MAE %v bias %v, want 2 190 -190", s.OverlapSamples, s.OverlapMAETokens, s.OverlapBiasTokens)
	}
}

func TestSummarizeEmpty(t *testing.T) {
	s := summarize(nil, 16)
	if s.Requests != 0 || s.HitRate != 0 || s.TTFTP50Ms != 0 || s.RequestImbalance != 0 || s.OverlapMAETokens != 0 {
		t.Errorf("empty summary %+v", s)
	}
}

func TestPercentileNearestRank(t *testing.T) {
	var hundred []time.Duration
	for i := 1; i <= 100; i++ {
		hundred = append(hundred, time.Duration(i)*time.Millisecond)
	}
	tests := []struct {
		name   string
		sorted []time.Duration
		p      float64
		want   float64
	}{
		{"empty", nil, 0.5, 0},
		{"single", []time.Duration{7 * time.Millisecond}, 0.99, 7},
		{"p50 of 100", hundred, 0.50, 50},
		{"p90 of 100", hundred, 0.90, 90},
		{"p99 of 100", hundred, 0.99, 99},
		{"p100 of 100", hundred, 1, 100},
		{"p0 is the minimum", hundred, 0, 1},
		{"sub-millisecond", []time.Duration{1500 * time.Microsecond}, 0.5, 1.5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := percentileMs(tt.sorted, tt.p); got != tt.want {
				t.Errorf("percentileMs = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestImbalance(t *testing.T) {
	tests := []struct {
		name string
		xs   []float64
		want float64
	}{
		{"none", nil, 0},
		{"even", []float64{5, 5, 5, 5}, 1},
		{"one takes all", []float64{8, 0, 0, 0}, 4},
		{"all zero", []float64{0, 0}, 0},
		{"skewed", []float64{1, 2, 3}, 1.5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := imbalance(tt.xs); got != tt.want {
				t.Errorf("imbalance(%v) = %v, want %v", tt.xs, got, tt.want)
			}
		})
	}
}

func TestMaxTokens(t *testing.T) {
	tests := []struct{ out, limit, want int }{
		{100, 0, 100}, {100, 50, 50}, {10, 50, 10}, {0, 0, 1}, {0, 50, 1},
	}
	for _, tt := range tests {
		if got := maxTokens(tt.out, tt.limit); got != tt.want {
			t.Errorf("maxTokens(%d, %d) = %d, want %d", tt.out, tt.limit, got, tt.want)
		}
	}
}

func TestSummarizeCountsSessionsThatMoved(t *testing.T) {
	results := []result{
		{ok: true, worker: "a", session: "s1"},
		{ok: true, worker: "a", session: "s1"},
		{ok: true, worker: "b", session: "s2"},
		{ok: true, worker: "c", session: "s2"}, // moved
		{ok: true, worker: "b", session: "s2"}, // moved back: still one moved session
		{cause: "timeout", worker: "z", session: "s3"},
		{ok: true, worker: "a", session: "s3"},
		{ok: true, worker: "a"}, // no session
	}
	s := summarize(results, 16)
	if s.Sessions != 3 || s.SessionsMoved != 1 {
		t.Errorf("sessions %d moved %d, want 3 and 1", s.Sessions, s.SessionsMoved)
	}
}

// TestSummarizeInterTokenLatencyAndThroughput: a streamed request's inter-token latency is
// the time after its first token over the tokens after it; a non-streamed one, or one of a
// single token, has none; every OK request's output counts toward throughput.
func TestSummarizeInterTokenLatencyAndThroughput(t *testing.T) {
	ms := time.Millisecond
	results := []result{
		{ok: true, streamed: true, hasTTFT: true, ttft: 10 * ms, latency: 110 * ms, outputTokens: 11}, // 10 ms
		{ok: true, streamed: true, hasTTFT: true, ttft: 10 * ms, latency: 210 * ms, outputTokens: 11}, // 20 ms
		{ok: true, streamed: true, hasTTFT: true, ttft: 10 * ms, latency: 10 * ms, outputTokens: 1},   // none
		{ok: true, hasTTFT: true, ttft: 500 * ms, latency: 500 * ms, outputTokens: 50},                // not streamed
		{ok: false, streamed: true, outputTokens: 100},
	}
	s := summarize(results, 16)
	if s.ITLSamples != 2 || s.ITLP50Ms != 10 || s.ITLP90Ms != 20 {
		t.Fatalf("inter-token: %d samples, p50 %v, p90 %v; want 2, 10, 20", s.ITLSamples, s.ITLP50Ms, s.ITLP90Ms)
	}
	if s.OutputTokens != 73 {
		t.Fatalf("output tokens %d, want 73", s.OutputTokens)
	}
}

// TestFirstTurnTTFTCountsEachSessionsFirstRequest: the first-turn figures are those of each
// session's first request in the run (a new session for the router), not its later turns
// nor requests without a session.
func TestFirstTurnTTFTCountsEachSessionsFirstRequest(t *testing.T) {
	ms := time.Millisecond
	results := []result{
		{ok: true, session: "s1", worker: "a", ttft: 50 * ms, hasTTFT: true},
		{ok: true, session: "s1", worker: "a", ttft: 1 * ms, hasTTFT: true},
		{ok: true, session: "s2", worker: "b", ttft: 70 * ms, hasTTFT: true},
		{ok: true, session: "s2", worker: "b", ttft: 2 * ms, hasTTFT: true},
		{ok: true, worker: "b", ttft: 900 * ms, hasTTFT: true},
	}
	s := summarize(results, 16)
	if s.FirstTTFTSamples != 2 || s.FirstTTFTP50Ms != 50 || s.FirstTTFTP90Ms != 70 || s.FirstTTFTP99Ms != 70 {
		t.Errorf("first-turn TTFT n %d p50 %v p90 %v p99 %v, want 2 50 70 70",
			s.FirstTTFTSamples, s.FirstTTFTP50Ms, s.FirstTTFTP90Ms, s.FirstTTFTP99Ms)
	}
}

// TestPredictionErrorCountsWhatTheEngineReports: vLLM computes a prompt's last token even when
// the whole prompt is cached, so a wholly cached 128-token prompt reports 112 cached tokens at
// 16-token blocks: a router's 8 blocks (128 tokens) are a prediction of 112, no error.
func TestPredictionErrorCountsWhatTheEngineReports(t *testing.T) {
	cases := []struct {
		name              string
		prompt, cached    int64
		overlap           int64
		wantMAE, wantBias float64
	}{
		{"a wholly cached prompt in full blocks", 128, 112, 8, 0, 0},
		{"one token past the full blocks", 129, 128, 8, 0, 0},
		{"an overlap past the prompt's blocks", 100, 96, 9, 0, 0},
		{"a miss where the router predicted a hit", 128, 0, 8, 112, 112},
		{"a short prediction", 128, 112, 3, 64, -64},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := summarize([]result{{ok: true, worker: "a", promptTokens: c.prompt, cachedTokens: c.cached, overlap: c.overlap, hasOverlap: true}}, 16)
			if s.OverlapMAETokens != c.wantMAE || s.OverlapBiasTokens != c.wantBias {
				t.Fatalf("MAE %v bias %v, want %v %v", s.OverlapMAETokens, s.OverlapBiasTokens, c.wantMAE, c.wantBias)
			}
		})
	}
}
