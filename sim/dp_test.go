package sim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// newTestDP returns a front over n ranks made from cfg (each its own Worker), served by a
// loopback test server.
func newTestDP(t *testing.T, n int, cfg Config) (*DataParallel, *httptest.Server) {
	t.Helper()
	ranks := make([]*Worker, n)
	for i := range ranks {
		w, err := New(testConfig(cfg))
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		ranks[i] = w
	}
	d, err := NewDataParallel(ranks...)
	if err != nil {
		t.Fatalf("NewDataParallel: %v", err)
	}
	srv := httptest.NewServer(d.Handler())
	t.Cleanup(srv.Close)
	return d, srv
}

// dpAnswer is one whole answer from a front.
type dpAnswer struct {
	status int
	header http.Header
	body   []byte
}

// rank is the rank the answer says served it, -1 when it names none.
func (a dpAnswer) rank(t *testing.T) int {
	t.Helper()
	v := a.header.Get(DPRankHeader)
	if v == "" {
		return -1
	}
	var r int
	if err := json.Unmarshal([]byte(v), &r); err != nil {
		t.Fatalf("%s %q: %v", DPRankHeader, v, err)
	}
	return r
}

// cached is usage.prompt_tokens_details.cached_tokens of a whole completion.
func (a dpAnswer) cached(t *testing.T) int {
	t.Helper()
	var r testResponse
	if err := json.Unmarshal(a.body, &r); err != nil || r.Usage == nil {
		t.Fatalf("not a completion with usage (%v): %s", err, a.body)
	}
	return r.Usage.PromptTokensDetails.CachedTokens
}

// dpDo sends one request with the given rank header values (none: no header).
func dpDo(t *testing.T, srv *httptest.Server, method, path, body string, ranks ...string) dpAnswer {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for _, r := range ranks {
		req.Header.Add(DPRankHeader, r)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return dpAnswer{status: resp.StatusCode, header: resp.Header, body: b}
}

func completionJSON(t *testing.T, tokens []uint32, maxTokens int) string {
	t.Helper()
	b, err := json.Marshal(map[string]any{"prompt": tokens, "max_tokens": maxTokens})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestDataParallelRankHeaderPicksThatRanksCache(t *testing.T) {
	d, srv := newTestDP(t, 2, Config{ID: "dp"})
	prompt := completionJSON(t, seqTokens(5000, 4*16+3), 4)
	for i, want := range []int{0, 4 * 16} {
		a := dpDo(t, srv, http.MethodPost, "/v1/completions", prompt, "1")
		if a.status != http.StatusOK {
			t.Fatalf("request %d to rank 1: %d %s", i, a.status, a.body)
		}
		if got := a.rank(t); got != 1 {
			t.Fatalf("request %d: served by rank %d, want 1", i, got)
		}
		if a.header.Get("X-Worker-ID") != "dp" {
			t.Fatalf("request %d: X-Worker-ID %q, want dp", i, a.header.Get("X-Worker-ID"))
		}
		if got := a.cached(t); got != want {
			t.Fatalf("request %d to rank 1: %d cached tokens, want %d", i, got, want)
		}
	}
	// Rank 0 has a cache of its own, in which the prompt is not.
	a := dpDo(t, srv, http.MethodPost, "/v1/completions", prompt, "0")
	if a.status != http.StatusOK || a.rank(t) != 0 {
		t.Fatalf("request to rank 0: %d, rank %d: %s", a.status, a.rank(t), a.body)
	}
	if got := a.cached(t); got != 0 {
		t.Fatalf("rank 0 reports %d cached tokens for a prompt only rank 1 has seen", got)
	}
	if s0, s1 := d.Rank(0).Stats(), d.Rank(1).Stats(); s0.Served != 1 || s1.Served != 2 || s1.CachedTokens != 4*16 {
		t.Fatalf("rank stats %+v and %+v, want 1 and 2 served, rank 1 with 64 cached tokens", s0, s1)
	}
}

func TestDataParallelWithoutRankBalancesOnRequestsInFlight(t *testing.T) {
	// A decode step of an hour holds a stream open until its client leaves.
	d, srv := newTestDP(t, 2, Config{Speedup: 1, DecodePerToken: time.Hour})
	quick := completionJSON(t, seqTokens(1, 8), 1)
	send := func(what string) int {
		t.Helper()
		a := dpDo(t, srv, http.MethodPost, "/v1/completions", quick)
		if a.status != http.StatusOK {
			t.Fatalf("%s: %d %s", what, a.status, a.body)
		}
		return a.rank(t)
	}
	waitIdle := func() {
		t.Helper()
		poll.Holds(t, 10*time.Second, "no request in flight", func() bool {
			d.mu.Lock()
			defer d.mu.Unlock()
			return d.inFlight[0] == 0 && d.inFlight[1] == 0
		})
	}

	if r := send("idle front"); r != 0 {
		t.Fatalf("with both ranks idle the request went to rank %d, want the lowest, 0", r)
	}
	waitIdle()

	// A stream that stays open on rank 0 makes rank 1 the less busy one.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	body := `{"prompt": [1, 2, 3], "max_tokens": 100, "stream": true}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatalf("first chunk of the held stream: %v", err)
	}
	if got := resp.Header.Get(DPRankHeader); got != "0" {
		t.Fatalf("held stream on rank %q, want 0", got)
	}
	for i := range 2 {
		if r := send("beside the held stream"); r != 1 {
			t.Fatalf("request %d beside a stream held on rank 0 went to rank %d, want 1", i, r)
		}
	}
	cancel()
	waitIdle()
	if r := send("after the stream"); r != 0 {
		t.Fatalf("after the stream ended the request went to rank %d, want 0 again", r)
	}

	// A refusing rank is an engine that is down: the balancer passes it over.
	if err := d.Rank(0).SetFaults(Faults{Refuse: true}); err != nil {
		t.Fatal(err)
	}
	waitIdle()
	if r := send("rank 0 refusing"); r != 1 {
		t.Fatalf("with rank 0 refusing the request went to rank %d, want 1", r)
	}
}

func TestDataParallelBadRankHeaderIsRejectedAndChangesNothing(t *testing.T) {
	d, srv := newTestDP(t, 2, Config{})
	// Warm both caches, so that a reset that got through would show.
	for _, r := range []string{"0", "1"} {
		if a := dpDo(t, srv, http.MethodPost, "/v1/completions", completionJSON(t, seqTokens(7000, 40), 2), r); a.status != http.StatusOK {
			t.Fatalf("warm rank %s: %d %s", r, a.status, a.body)
		}
	}
	type snapshot struct {
		stats  Stats
		cache  CacheStats
		faults Faults
	}
	take := func() []snapshot {
		out := make([]snapshot, d.Size())
		for i := range out {
			w := d.Rank(i)
			out[i] = snapshot{w.Stats(), w.Cache(), w.Faults()}
		}
		return out
	}
	before := take()
	requests := []struct{ method, path, body string }{
		{http.MethodPost, "/v1/completions", completionJSON(t, seqTokens(8000, 40), 2)},
		{http.MethodPost, "/v1/chat/completions", `{"messages": [{"role": "user", "content": "hi"}]}`},
		{http.MethodPost, "/sim/faults", `{"error_rate": 1}`},
		{http.MethodPost, "/reset_prefix_cache", ""},
		{http.MethodGet, "/sim/stats", ""},
		{http.MethodGet, "/health", ""},
	}
	for _, tc := range []struct {
		name  string
		ranks []string
	}{
		{"not a number", []string{"one"}},
		{"negative", []string{"-1"}},
		{"signed", []string{"+1"}},
		{"fraction", []string{"1.0"}},
		{"empty", []string{""}},
		{"equal to the size", []string{"2"}},
		{"far past the size", []string{"65536"}},
		{"past uint64", []string{"99999999999999999999999"}},
		{"given twice", []string{"0", "1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, rq := range requests {
				a := dpDo(t, srv, rq.method, rq.path, rq.body, tc.ranks...)
				if a.status != http.StatusBadRequest {
					t.Fatalf("%s %s with %s %q: status %d, want 400: %s", rq.method, rq.path, DPRankHeader, tc.ranks, a.status, a.body)
				}
				assertErrorShape(t, a.body, "invalid_request_error")
				if !bytes.Contains(a.body, []byte(DPRankHeader)) {
					t.Errorf("error %s does not name %s", a.body, DPRankHeader)
				}
				if r := a.rank(t); r != -1 {
					t.Errorf("a rejected request says rank %d served it", r)
				}
			}
		})
	}
	after := take()
	for i := range before {
		if before[i] != after[i] {
			t.Errorf("rank %d changed under rejected requests:\nbefore %+v\nafter  %+v", i, before[i], after[i])
		}
	}
}

func TestDataParallelWithoutRankStatsSumAndFaultsApplyToEveryRank(t *testing.T) {
	d, srv := newTestDP(t, 3, Config{ID: "dp", CapacityBlocks: 100})
	for _, r := range []string{"0", "2", "2"} {
		if a := dpDo(t, srv, http.MethodPost, "/v1/completions", completionJSON(t, seqTokens(3000, 40), 2), r); a.status != http.StatusOK {
			t.Fatalf("rank %s: %d %s", r, a.status, a.body)
		}
	}
	var stats struct {
		ID     string     `json:"id"`
		DPSize int        `json:"dp_size"`
		Stats  Stats      `json:"stats"`
		Cache  CacheStats `json:"cache"`
		Ranks  []struct {
			Rank  int   `json:"dp_rank"`
			Stats Stats `json:"stats"`
		} `json:"ranks"`
	}
	a := dpDo(t, srv, http.MethodGet, "/sim/stats", "")
	if err := json.Unmarshal(a.body, &stats); a.status != http.StatusOK || err != nil {
		t.Fatalf("stats: %d %v: %s", a.status, err, a.body)
	}
	if stats.ID != "dp" || stats.DPSize != 3 || stats.Stats.Served != 3 || stats.Stats.PromptTokens != 120 ||
		stats.Stats.CachedTokens != 32 || stats.Cache.Capacity != 300 || stats.Cache.BlockSize != DefaultBlockSize {
		t.Fatalf("summed stats %+v", stats)
	}
	if len(stats.Ranks) != 3 || stats.Ranks[2].Rank != 2 || stats.Ranks[2].Stats.Served != 2 || stats.Ranks[1].Stats.Served != 0 {
		t.Fatalf("per-rank stats %+v", stats.Ranks)
	}
	// Named, the rank answers alone, in the single worker's shape.
	var one struct {
		Stats Stats `json:"stats"`
	}
	a = dpDo(t, srv, http.MethodGet, "/sim/stats", "", "2")
	if err := json.Unmarshal(a.body, &one); err != nil || a.rank(t) != 2 || one.Stats.Served != 2 {
		t.Fatalf("rank 2's stats: %v, rank %d: %s", err, a.rank(t), a.body)
	}

	// Faults: a named rank only, then every rank; a POST changes only the fields it gives.
	if a := dpDo(t, srv, http.MethodPost, "/sim/faults", `{"stall_rate": 0.5}`, "1"); a.status != http.StatusOK {
		t.Fatalf("faults on rank 1: %d %s", a.status, a.body)
	}
	if f0, f1 := d.Rank(0).Faults(), d.Rank(1).Faults(); f0 != (Faults{}) || f1.StallRate != 0.5 {
		t.Fatalf("faults for rank 1 gave rank 0 %+v and rank 1 %+v", f0, f1)
	}
	a = dpDo(t, srv, http.MethodPost, "/sim/faults", `{"error_rate": 0.25}`)
	var fw struct {
		ErrorRate float64 `json:"error_rate"`
		Ranks     []struct {
			ErrorRate float64 `json:"error_rate"`
			StallRate float64 `json:"stall_rate"`
		} `json:"ranks"`
	}
	if err := json.Unmarshal(a.body, &fw); a.status != http.StatusOK || err != nil || fw.ErrorRate != 0.25 || len(fw.Ranks) != 3 {
		t.Fatalf("faults on every rank: %d %v: %s", a.status, err, a.body)
	}
	for i := range d.Size() {
		f := d.Rank(i).Faults()
		wantStall := map[bool]float64{true: 0.5}[i == 1]
		if f.ErrorRate != 0.25 || f.StallRate != wantStall || fw.Ranks[i].StallRate != wantStall {
			t.Fatalf("rank %d faults %+v (answer %+v), want error rate 0.25 and stall rate %v", i, f, fw.Ranks[i], wantStall)
		}
	}
	// A bad body changes no rank.
	if a := dpDo(t, srv, http.MethodPost, "/sim/faults", `{"error_rate": 0.1, "stall": "soon"}`); a.status != http.StatusBadRequest {
		t.Fatalf("bad faults: %d %s", a.status, a.body)
	}
	for i := range d.Size() {
		if f := d.Rank(i).Faults(); f.ErrorRate != 0.25 {
			t.Fatalf("a rejected faults body changed rank %d: %+v", i, f)
		}
	}

	// A cache reset without a rank clears every rank.
	if a := dpDo(t, srv, http.MethodPost, "/reset_prefix_cache", ""); a.status != http.StatusOK {
		t.Fatalf("reset: %d %s", a.status, a.body)
	}
	for i := range d.Size() {
		if n := d.Rank(i).Cache().Blocks; n != 0 {
			t.Fatalf("rank %d keeps %d blocks after a reset of every rank", i, n)
		}
	}
}

func TestDataParallelRankIndependentEndpointsAnswerWithoutRank(t *testing.T) {
	_, srv := newTestDP(t, 2, Config{})
	for _, tc := range []struct{ method, path, body string }{
		{http.MethodGet, "/v1/models", ""},
		{http.MethodGet, "/health", ""},
		{http.MethodPost, "/tokenize", `{"prompt": "hello world"}`},
		{http.MethodGet, "/metrics", ""},
	} {
		a := dpDo(t, srv, tc.method, tc.path, tc.body)
		if a.status != http.StatusOK || a.rank(t) != 0 {
			t.Errorf("%s %s: %d from rank %d, want 200 from rank 0: %s", tc.method, tc.path, a.status, a.rank(t), a.body)
		}
	}
}

func TestNewDataParallelRejectsRanksThatAreNotOneWorker(t *testing.T) {
	mk := func(cfg Config) *Worker {
		w, err := New(testConfig(cfg))
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	a := mk(Config{ID: "a"})
	for _, tc := range []struct {
		name  string
		ranks []*Worker
	}{
		{"no ranks", nil},
		{"a nil rank", []*Worker{a, nil}},
		{"one worker twice", []*Worker{a, a}},
		{"another id", []*Worker{a, mk(Config{ID: "b"})}},
		{"another model", []*Worker{a, mk(Config{ID: "a", Model: "other"})}},
		{"another role", []*Worker{a, mk(Config{ID: "a", Role: RolePrefill})}},
	} {
		if _, err := NewDataParallel(tc.ranks...); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

func TestDataParallelServeRefusesOnlyWhenEveryRankRefuses(t *testing.T) {
	d, _ := newTestDP(t, 2, Config{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- d.Serve(ctx, ln) }()
	fresh := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	try := func() error { return tinyCompletion(fresh, "http://"+ln.Addr().String()) }
	if err := d.Rank(0).SetFaults(Faults{Refuse: true}); err != nil {
		t.Fatal(err)
	}
	if err := try(); err != nil {
		t.Fatalf("with one rank of two refusing: %v", err)
	}
	if err := d.Rank(1).SetFaults(Faults{Refuse: true}); err != nil {
		t.Fatal(err)
	}
	if err := try(); err == nil {
		t.Fatal("with every rank refusing a new connection was served")
	}
	cancel()
	if err := <-served; err != nil {
		t.Fatalf("Serve returned %v after its context ended", err)
	}
}
