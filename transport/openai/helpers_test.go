package openai

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// mapIndex is a prefix index and decision recorder over a plain map.
type mapIndex struct {
	mu     sync.Mutex
	blocks map[uint64]map[indexer.Worker]bool
}

func (m *mapIndex) Record(w indexer.Worker, seq []uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, h := range seq {
		if m.blocks[h] == nil {
			m.blocks[h] = map[indexer.Worker]bool{}
		}
		m.blocks[h][w] = true
	}
}

// held is how many blocks m holds for w.
func (m *mapIndex) held(w indexer.Worker) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for _, ws := range m.blocks {
		if ws[w] {
			n++
		}
	}
	return n
}

func (m *mapIndex) FindMatches(seq []uint64, dst []indexer.Match) []indexer.Match {
	m.mu.Lock()
	defer m.mu.Unlock()
	counts := map[indexer.Worker]int{}
	for i, h := range seq {
		if len(m.blocks[h]) == 0 {
			break
		}
		for w := range m.blocks[h] {
			if counts[w] == i {
				counts[w] = i + 1
			}
		}
	}
	dst = dst[:0]
	for w, n := range counts {
		dst = append(dst, indexer.Match{Worker: w, Blocks: n})
	}
	return dst
}

// rig is one replica's front over fake workers, served on loopback.
type rig struct {
	t        testing.TB
	srv      *Server
	front    *frontServer
	workers  *routing.Registry
	tracker  *routing.Tracker
	affinity *routing.MemoryAffinity
	reg      *prometheus.Registry
	index    *mapIndex // nil with realIndex
}

type rigOptions struct {
	router func(*routing.Config)
	front  func(*Config)
	// realIndex routes over the production prefix index (approximate mode) instead of the
	// map index, as a replica does; benchmarks use it.
	realIndex bool
	// affinity, when set, wraps the rig's in-memory affinity store.
	affinity func(*routing.MemoryAffinity) routing.AffinityStore
	// server is the HTTP server the front is served with: "net" (the default) or "fast"
	// (transport/h1), as --http-server chooses.
	server string
}

// forEachServer runs test on each of the client port's HTTP servers (--http-server): the
// handlers' semantics must not depend on which serves them.
func forEachServer(t *testing.T, test func(t *testing.T, server string)) {
	for _, server := range []string{"net", "fast"} {
		t.Run(server, func(t *testing.T) { test(t, server) })
	}
}

// frontServer is the rig's front on loopback: its URL and a client for it.
type frontServer struct {
	URL    string
	client *http.Client
	stop   func()
}

// Client is a client for the front (keep-alive, no proxy).
func (f *frontServer) Client() *http.Client { return f.client }

// Close stops the front and closes the client's idle connections.
func (f *frontServer) Close() {
	f.stop()
	f.client.CloseIdleConnections()
}

// serveRig serves h with the HTTP server named kind on a loopback port.
func serveRig(tb testing.TB, kind string, h http.Handler) *frontServer {
	if kind == "" || kind == "net" {
		hs := httptest.NewServer(h)
		return &frontServer{URL: hs.URL, client: hs.Client(), stop: hs.Close}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	return &frontServer{URL: "http://" + ln.Addr().String(),
		client: &http.Client{Transport: &http.Transport{}}, stop: serveFront(tb, kind, h, ln)}
}

// newRig serves a front over the given worker specs.
func newRig(t testing.TB, specs []routing.WorkerSpec, opts rigOptions) *rig {
	t.Helper()
	workers, err := routing.NewRegistry(specs)
	if err != nil {
		t.Fatalf("registry: %v", err)
	}
	tracker := routing.NewTracker()
	affinity := routing.NewMemoryAffinity(time.Hour, 0)
	deps := routing.Deps{Workers: workers, Tracker: tracker, Affinity: affinity}
	if opts.affinity != nil {
		deps.Affinity = opts.affinity(affinity)
	}
	var mi *mapIndex
	if opts.realIndex {
		idx := indexer.New(indexer.Options{TTL: 2 * time.Minute})
		deps.Index, deps.Recorder = idx, idx
	} else {
		mi = &mapIndex{blocks: map[uint64]map[indexer.Worker]bool{}}
		deps.Index, deps.Recorder = mi, mi
	}
	rcfg := routing.Config{Seed: 1}
	if opts.router != nil {
		opts.router(&rcfg)
	}
	router, err := routing.New(rcfg, deps)
	if err != nil {
		t.Fatalf("router: %v", err)
	}
	reg := prometheus.NewRegistry()
	cfg := Config{ReplicaID: "replica-1", Registerer: reg, Logger: testLogger(t)}
	if opts.front != nil {
		opts.front(&cfg)
	}
	srv, err := NewServer(cfg, router, workers, tracker)
	if err != nil {
		t.Fatalf("NewServer: %v", err)
	}
	front := serveRig(t, opts.server, srv.Handler())
	t.Cleanup(func() {
		front.Close()
		srv.Close()
	})
	return &rig{t: t, srv: srv, front: front, workers: workers, tracker: tracker, affinity: affinity, reg: reg, index: mi}
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// tWriter sends logs to the test's log, shown only on failure.
type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// post sends body to the front and returns the response with its body read.
func (r *rig) post(path, body string, hdr map[string]string) (*http.Response, string) {
	r.t.Helper()
	return r.do(context.Background(), http.MethodPost, path, body, hdr)
}

func (r *rig) do(ctx context.Context, method, path, body string, hdr map[string]string) (*http.Response, string) {
	r.t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, r.front.URL+path, strings.NewReader(body))
	if err != nil {
		r.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := r.front.Client().Do(req)
	if err != nil {
		r.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		r.t.Fatalf("read %s: %v", path, err)
	}
	return resp, string(b)
}

// idle reports whether every worker's load is back to zero.
func (r *rig) idle() bool {
	for _, l := range r.tracker.Snapshot() {
		if l != (routing.Load{}) {
			return false
		}
	}
	return true
}

// healthy reports the registry's health verdict for id.
func (r *rig) healthy(id string) bool {
	for _, st := range r.workers.List() {
		if st.Spec.ID == id {
			return st.Healthy
		}
	}
	r.t.Fatalf("no worker %s", id)
	return false
}

// counter reads a counter or gauge from the rig's registry by name and labels.
func (r *rig) metric(name string, labels map[string]string) float64 {
	r.t.Helper()
	return gathered(r.t, r.reg, name, labels)
}

func gathered(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, fam := range families {
		if fam.GetName() != name {
			continue
		}
		total := 0.0
		for _, m := range fam.GetMetric() {
			if !labelsMatch(m, labels) {
				continue
			}
			switch {
			case m.Counter != nil:
				total += m.Counter.GetValue()
			case m.Gauge != nil:
				total += m.Gauge.GetValue()
			case m.Histogram != nil:
				total += float64(m.Histogram.GetSampleCount())
			}
		}
		return total
	}
	return 0
}

func labelsMatch(m *dto.Metric, want map[string]string) bool {
	for k, v := range want {
		found := false
		for _, lp := range m.GetLabel() {
			if lp.GetName() == k && lp.GetValue() == v {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// errorOf decodes an OpenAI error body.
func errorOf(t *testing.T, body string) Error {
	t.Helper()
	var e struct {
		Error *Error `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error == nil {
		t.Fatalf("body %q is not an OpenAI error: %v", body, err)
	}
	return *e.Error
}

// fakeWorker is an inference worker stand-in that records what it received.
type fakeWorker struct {
	*httptest.Server
	mu      sync.Mutex
	bodies  []string
	headers []http.Header
	paths   []string
}

// newFakeWorker serves handle for the OpenAI paths and 200 at /health.
func newFakeWorker(t testing.TB, handle http.HandlerFunc) *fakeWorker {
	t.Helper()
	fw := &fakeWorker{}
	fw.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			w.WriteHeader(http.StatusOK)
			return
		}
		body, _ := io.ReadAll(r.Body)
		fw.mu.Lock()
		fw.bodies = append(fw.bodies, string(body))
		fw.headers = append(fw.headers, r.Header.Clone())
		fw.paths = append(fw.paths, r.URL.Path)
		fw.mu.Unlock()
		handle(w, r)
	}))
	t.Cleanup(fw.Close)
	return fw
}

func (fw *fakeWorker) requests() int {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	return len(fw.bodies)
}

func (fw *fakeWorker) last() (string, http.Header, string) {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	n := len(fw.bodies) - 1
	return fw.bodies[n], fw.headers[n], fw.paths[n]
}

// okJSON answers a small completion.
func okJSON(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"id":"cmpl-1","object":"text_completion","choices":[{"text":"ok"}]}`)
}

// refusedURL returns a loopback URL nothing listens on.
func refusedURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return "http://" + addr
}

func spec(id, url string) routing.WorkerSpec {
	return routing.WorkerSpec{ID: id, URL: url, CapacityBlocks: 1000}
}

const completionBody = `{"model":"m","prompt":"hello there, general kenobi"}`

// forwardContentType is what a worker request carries of a client request holding only
// Content-Type ct (nil: none), for a worker without data parallelism.
func forwardContentType(ct []string) forwarding {
	h := http.Header{}
	if ct != nil {
		h["Content-Type"] = ct
	}
	return forwarding{from: &http.Request{Header: h}, to: routing.Target{Spec: &routing.WorkerSpec{}}}
}
