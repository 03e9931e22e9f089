package openai

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// flakyHealth serves /health with a status the test switches.
func flakyHealth(t *testing.T) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	status := &atomic.Int32{}
	status.Store(http.StatusOK)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(int(status.Load()))
	}))
	t.Cleanup(srv.Close)
	return srv, status
}

func isHealthy(t *testing.T, workers *routing.Registry, id string) bool {
	t.Helper()
	for _, st := range workers.List() {
		if st.Spec.ID == id {
			return st.Healthy
		}
	}
	t.Fatalf("no worker %s", id)
	return false
}

func TestHealthCheckerThresholds(t *testing.T) {
	srv, status := flakyHealth(t)
	workers, err := routing.NewRegistry([]routing.WorkerSpec{spec("w0", srv.URL), spec("gone", refusedURL(t))})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	h, err := NewHealthChecker(workers, HealthConfig{FailThreshold: 2, RiseThreshold: 2, Registerer: reg, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	steps := []struct {
		status      int
		wantHealthy bool
	}{
		{http.StatusOK, true},
		{http.StatusServiceUnavailable, true}, // one failure is not enough
		{http.StatusServiceUnavailable, false},
		{http.StatusServiceUnavailable, false},
		{http.StatusOK, false}, // one success is not enough
		{http.StatusOK, true},
		{http.StatusServiceUnavailable, true}, // the failure run starts over
		{http.StatusOK, true},
		{http.StatusServiceUnavailable, true},
	}
	for i, st := range steps {
		status.Store(int32(st.status))
		h.Check(ctx)
		if got := isHealthy(t, workers, "w0"); got != st.wantHealthy {
			t.Fatalf("step %d (probe %d): healthy %v, want %v", i, st.status, got, st.wantHealthy)
		}
	}
	if isHealthy(t, workers, "gone") {
		t.Fatal("a worker refusing connections is still healthy")
	}
	if got := gathered(t, reg, "kvrouter_worker_probe_up", map[string]string{"worker": "w0"}); got != 0 {
		t.Fatalf("probe gauge %v after a failed probe", got)
	}
	status.Store(http.StatusOK)
	h.Check(ctx)
	if got := gathered(t, reg, "kvrouter_worker_probe_up", map[string]string{"worker": "w0"}); got != 1 {
		t.Fatalf("probe gauge %v after a good probe", got)
	}

	// A removed worker's gauge goes away.
	if err := workers.Remove("gone"); err != nil {
		t.Fatal(err)
	}
	h.Check(ctx)
	families, _ := reg.Gather()
	for _, f := range families {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetValue() == "gone" {
					t.Fatal("removed worker still has a probe gauge")
				}
			}
		}
	}
}

func TestHealthCheckerBringsBackAWorkerTheProxyMarked(t *testing.T) {
	srv, _ := flakyHealth(t)
	workers, err := routing.NewRegistry([]routing.WorkerSpec{spec("w0", srv.URL)})
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewHealthChecker(workers, HealthConfig{RiseThreshold: 2})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	h.Check(ctx)
	h.Check(ctx)
	workers.SetHealthy("w0", false, "bad response: garbage")
	// Successes seen before the mark do not count: it takes RiseThreshold fresh ones.
	h.Check(ctx)
	if isHealthy(t, workers, "w0") {
		t.Fatal("worker back after one probe")
	}
	h.Check(ctx)
	if !isHealthy(t, workers, "w0") {
		t.Fatal("worker not back after two good probes")
	}
}

func TestHealthCheckerRunTakesOutAndPutsBack(t *testing.T) {
	srv, status := flakyHealth(t)
	workers, err := routing.NewRegistry([]routing.WorkerSpec{spec("w0", srv.URL)})
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewHealthChecker(workers, HealthConfig{Interval: 5 * time.Millisecond, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.Run(ctx)
	}()
	status.Store(http.StatusInternalServerError)
	poll.Holds(t, 10*time.Second, "the failing worker to be taken out", func() bool { return len(workers.Routable()) == 0 })
	status.Store(http.StatusOK)
	poll.Holds(t, 10*time.Second, "the worker to be put back", func() bool { return len(workers.Routable()) == 1 })
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
}

func TestNewHealthCheckerRejectsBadConfig(t *testing.T) {
	workers, _ := routing.NewRegistry(nil)
	if _, err := NewHealthChecker(workers, HealthConfig{Interval: -1}); err == nil {
		t.Fatal("negative interval accepted")
	}
	if _, err := NewHealthChecker(nil, HealthConfig{}); err == nil {
		t.Fatal("nil registry accepted")
	}
}
