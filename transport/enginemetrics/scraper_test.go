package enginemetrics

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// fleet is a Workers whose list a test changes.
type fleet struct {
	mu    sync.Mutex
	specs []routing.WorkerSpec
}

func (f *fleet) List() []routing.WorkerStatus {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]routing.WorkerStatus, len(f.specs))
	for i, s := range f.specs {
		out[i] = routing.WorkerStatus{Spec: s, Healthy: true}
	}
	return out
}

func (f *fleet) set(specs ...routing.WorkerSpec) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.specs = specs
}

func newScraper(t *testing.T, cfg Config, specs ...routing.WorkerSpec) (*Scraper, *routing.EngineLoad, *fleet, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	cfg.Logger = slog.New(slog.DiscardHandler)
	if cfg.Interval == 0 {
		cfg.Interval = 20 * time.Millisecond
	}
	sink := routing.NewEngineLoad(routing.NewTracker(), routing.EngineLoadConfig{})
	f := &fleet{}
	f.set(specs...)
	s, err := New(cfg, f, sink)
	if err != nil {
		t.Fatal(err)
	}
	return s, sink, f, reg
}

// poll waits for cond (a deadline, not a sleep standing in for the condition).
func poll(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ok, detail := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s: %s", what, detail)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// hold sends a streamed completion straight to a worker and keeps it open until ctx ends.
func hold(ctx context.Context, wg *sync.WaitGroup, base string, prompt []uint32) {
	wg.Go(func() {
		body, _ := json.Marshal(map[string]any{"model": sim.DefaultModel, "prompt": prompt, "max_tokens": 50, "stream": true})
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
		if err != nil {
			return
		}
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	})
}

func tokens(start, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = sim.FirstPieceToken + uint32(start+i)%sim.PieceTokens
	}
	return out
}

func TestScraperReadsASimulatedWorkersLoad(t *testing.T) {
	w, err := sim.New(sim.Config{ID: "w0", MaxRunning: 1, CapacityBlocks: 100, DecodePerToken: time.Hour, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(w.Handler())
	defer srv.Close()
	s, sink, _, reg := newScraper(t, Config{}, routing.WorkerSpec{ID: "w0", URL: srv.URL})
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	wg.Go(func() { s.Run(ctx) })
	// Two requests the router never saw, 40 tokens (2 blocks) each: one runs, one waits.
	hold(ctx, &wg, srv.URL, tokens(0, 40))
	hold(ctx, &wg, srv.URL, tokens(500, 40))
	w0 := indexer.Worker{ID: "w0"}
	// The engine runs one request on 2 of 100 blocks: 2 blocks a request; the waiting one's
	// prompt (2 blocks of 16) is prefill.
	want := routing.Load{Requests: 2, PrefillTokens: 32, DecodeBlocks: 4}
	poll(t, "the held requests to count as external load", func() (bool, string) {
		got := sink.External(w0)
		return got == want, fmt.Sprintf("%+v, want %+v", got, want)
	})
	if n, err := count(reg, "kvrouter_engine_external_load", "kvrouter_engine_metrics_last_scrape_age_seconds"); err != nil || n != 4 {
		t.Errorf("gathered %d engine series (%v), want 3 external figures and an age", n, err)
	}
}

func TestScraperCountsErrorsByReason(t *testing.T) {
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedURL := "http://" + closed.Addr().String()
	closed.Close()
	release := make(chan struct{})
	defer close(release)
	tests := []struct {
		name    string
		handler http.HandlerFunc // nil: nothing listens
		reason  string
	}{
		{"nothing listens", nil, reasonConnect},
		{"an error status", func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "no", http.StatusNotFound) }, reasonStatus},
		{"garbage in an engine series", func(w http.ResponseWriter, _ *http.Request) {
			io.WriteString(w, "vllm:num_requests_running{{ 1\n")
		}, reasonParse},
		{"a body past the limit", func(w http.ResponseWriter, _ *http.Request) {
			for range 1000 {
				io.WriteString(w, strings.Repeat("# filler\n", 100))
			}
		}, reasonTooLarge},
		{"a worker that never finishes its body", func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "vllm:num_requests_running 1\n")
			w.(http.Flusher).Flush()
			select {
			case <-release:
			case <-r.Context().Done():
			}
		}, reasonTimeout},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			url := closedURL
			if tc.handler != nil {
				srv := httptest.NewServer(tc.handler)
				defer srv.Close()
				url = srv.URL
			}
			s, sink, _, reg := newScraper(t, Config{Interval: time.Second, Timeout: 100 * time.Millisecond, MaxBodyBytes: 64 << 10},
				routing.WorkerSpec{ID: "bad", URL: url})
			s.Scrape(t.Context())
			if got := errorCount(t, reg, "bad", tc.reason); got != 1 {
				t.Errorf("%s errors: %v", tc.reason, got)
			}
			if got := sink.External(indexer.Worker{ID: "bad"}); got != (routing.Load{}) {
				t.Errorf("a failed scrape fed the sink: %+v", got)
			}
		})
	}
}

func TestScraperDropsStaleLoad(t *testing.T) {
	var failing atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if failing.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "vllm:num_requests_running 3\n")
	}))
	defer srv.Close()
	w0 := indexer.Worker{ID: "w0"}
	tests := []struct {
		name       string
		staleAfter time.Duration
		counts     bool // after the failures
	}{
		{"a failure within the staleness bound keeps the last figures", time.Hour, true},
		{"past it they stop counting", time.Millisecond, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			failing.Store(false)
			s, sink, _, _ := newScraper(t, Config{StaleAfter: tc.staleAfter}, routing.WorkerSpec{ID: "w0", URL: srv.URL})
			s.Scrape(t.Context())
			if got := sink.External(w0).Requests; got != 3 {
				t.Fatalf("after a good scrape: %d external requests, want 3", got)
			}
			good := time.Now()
			failing.Store(true)
			// Failed rounds until the good scrape is older than the bound.
			for s.Scrape(t.Context()); time.Since(good) <= tc.staleAfter && tc.staleAfter < time.Minute; s.Scrape(t.Context()) {
			}
			if got := sink.External(w0).Requests; (got == 3) != tc.counts {
				t.Errorf("after failures: %d external requests, counting %v", got, tc.counts)
			}
		})
	}
}

func TestScraperForgetsRemovedWorkers(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/bad/metrics" {
			http.Error(w, "no", http.StatusInternalServerError)
			return
		}
		io.WriteString(w, "vllm:num_requests_running 2\n")
	}))
	defer srv.Close()
	s, sink, f, reg := newScraper(t, Config{}, routing.WorkerSpec{ID: "w0", URL: srv.URL}, routing.WorkerSpec{ID: "w1", URL: srv.URL + "/bad"})
	s.Scrape(t.Context())
	if sink.External(indexer.Worker{ID: "w0"}).Requests != 2 {
		t.Fatalf("w0 not scraped: %+v", sink.External(indexer.Worker{ID: "w0"}))
	}
	f.set()
	s.Scrape(t.Context())
	if got := sink.External(indexer.Worker{ID: "w0"}); got != (routing.Load{}) {
		t.Errorf("a removed worker's load still counts: %+v", got)
	}
	if n, err := count(reg); err != nil || n != 0 {
		t.Errorf("%d series left for removed workers (%v)", n, err)
	}
	if s.Rounds() != 2 {
		t.Errorf("Rounds = %d, want 2", s.Rounds())
	}
}

// count is how many series of the named families (any, with none named) reg gathers.
func count(reg *prometheus.Registry, names ...string) (int, error) {
	mfs, err := reg.Gather()
	n := 0
	for _, mf := range mfs {
		for _, name := range names {
			if mf.GetName() == name {
				n += len(mf.GetMetric())
			}
		}
		if len(names) == 0 {
			n += len(mf.GetMetric())
		}
	}
	return n, err
}

// errorCount is the scrape error counter of worker and reason.
func errorCount(t *testing.T, reg *prometheus.Registry, worker, reason string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "kvrouter_engine_metrics_scrape_errors_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if label(m, "worker") == worker && label(m, "reason") == reason {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func label(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}
