package openai

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// maxProbesInFlight bounds how many workers are probed at once.
const maxProbesInFlight = 32

// HealthConfig tunes the health checker. Zero values take the documented defaults.
type HealthConfig struct {
	// Interval between probe rounds (1s).
	Interval time.Duration
	// Timeout of one probe (500ms).
	Timeout time.Duration
	// FailThreshold consecutive failed probes make a healthy worker unhealthy (2).
	FailThreshold int
	// RiseThreshold consecutive good probes make an unhealthy worker healthy (2).
	RiseThreshold int
	// Path is probed on each worker's URL (/health, as vLLM and SGLang serve it).
	Path string
	// Logger receives health transitions (nil: discarded).
	Logger *slog.Logger
	// Registerer receives the probe gauge (nil: not registered).
	Registerer prometheus.Registerer
	// Observe, when set, receives every probe result and the checker leaves the registry
	// alone: something else (the cluster's merged health view) decides routability from
	// this replica's probes and the other replicas'. The thresholds are then that view's.
	Observe func(worker string, healthy bool)
}

// HealthChecker probes every configured worker and records the verdicts in the registry.
type HealthChecker struct {
	workers *routing.Registry
	cfg     HealthConfig
	log     *slog.Logger
	client  *http.Client
	up      *prometheus.GaugeVec

	mu     sync.Mutex
	states map[string]*probeState
}

// probeState is one worker's run of probe results.
type probeState struct {
	fails, oks int
	// healthy is the registry's verdict as this checker last saw it; when someone else
	// (the proxy, on a bad response) changes it, the runs start over.
	healthy bool
}

// NewHealthChecker builds a checker over workers; call Run to start probing.
func NewHealthChecker(workers *routing.Registry, cfg HealthConfig) (*HealthChecker, error) {
	if workers == nil {
		return nil, errors.New("health: workers are required")
	}
	if cfg.Interval < 0 || cfg.Timeout < 0 || cfg.FailThreshold < 0 || cfg.RiseThreshold < 0 {
		return nil, errors.New("health: negative interval, timeout or threshold")
	}
	if cfg.Interval == 0 {
		cfg.Interval = time.Second
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 500 * time.Millisecond
	}
	if cfg.FailThreshold == 0 {
		cfg.FailThreshold = 2
	}
	if cfg.RiseThreshold == 0 {
		cfg.RiseThreshold = 2
	}
	if cfg.Path == "" {
		cfg.Path = "/health"
	}
	if !strings.HasPrefix(cfg.Path, "/") {
		cfg.Path = "/" + cfg.Path
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	h := &HealthChecker{
		workers: workers,
		cfg:     cfg,
		log:     cfg.Logger,
		client: &http.Client{
			Transport: &http.Transport{
				DialContext:         (&net.Dialer{Timeout: cfg.Timeout}).DialContext,
				MaxIdleConnsPerHost: 2,
				IdleConnTimeout:     3 * cfg.Interval,
				DisableCompression:  true,
			},
			// A redirecting health endpoint is a misconfigured one.
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		},
		up: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvrouter_worker_probe_up",
			Help: "1 when the worker's last health probe succeeded, else 0.",
		}, []string{"worker"}),
		states: make(map[string]*probeState),
	}
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(h.up); err != nil {
			return nil, fmt.Errorf("health: register metrics: %w", err)
		}
	}
	return h, nil
}

// Run probes every Interval until ctx is done, starting at once.
func (h *HealthChecker) Run(ctx context.Context) {
	defer h.client.CloseIdleConnections()
	tick := time.NewTicker(h.cfg.Interval)
	defer tick.Stop()
	for {
		h.Check(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// Check runs one round of probes over every configured worker and applies the verdicts.
func (h *HealthChecker) Check(ctx context.Context) {
	list := h.workers.List()
	results := make([]error, len(list))
	sem := make(chan struct{}, maxProbesInFlight)
	var wg sync.WaitGroup
	for i, st := range list {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return
		}
		wg.Go(func() {
			defer func() { <-sem }()
			results[i] = h.probe(ctx, st.Spec.URL)
		})
	}
	wg.Wait()
	if ctx.Err() != nil {
		return
	}

	h.mu.Lock()
	defer h.mu.Unlock()
	present := make(map[string]bool, len(list))
	for i, st := range list {
		id := st.Spec.ID
		present[id] = true
		h.apply(id, st.Healthy, results[i])
	}
	for id := range h.states {
		if !present[id] {
			delete(h.states, id)
			h.up.DeleteLabelValues(id)
		}
	}
}

// apply folds one probe result into a worker's runs and flips the registry at a threshold.
func (h *HealthChecker) apply(id string, healthy bool, result error) {
	if h.cfg.Observe != nil {
		h.up.WithLabelValues(id).Set(boolGauge(result == nil))
		h.cfg.Observe(id, result == nil)
		return
	}
	st := h.states[id]
	if st == nil || st.healthy != healthy {
		st = &probeState{healthy: healthy}
		h.states[id] = st
	}
	if result == nil {
		h.up.WithLabelValues(id).Set(1)
		st.oks++
		st.fails = 0
		if !healthy && st.oks >= h.cfg.RiseThreshold {
			if h.workers.SetHealthy(id, true, "") {
				h.log.Info("worker healthy", "worker", id, "probes", st.oks)
			}
			st.healthy = true
		}
		return
	}
	h.up.WithLabelValues(id).Set(0)
	st.fails++
	st.oks = 0
	if healthy && st.fails >= h.cfg.FailThreshold {
		reason := fmt.Sprintf("health check failed %d times: %v", st.fails, result)
		if h.workers.SetHealthy(id, false, reason) {
			h.log.Warn("worker unhealthy", "worker", id, "reason", reason)
		}
		st.healthy = false
	}
}

// probe asks one worker's health endpoint; any 2xx is healthy.
func (h *HealthChecker) probe(ctx context.Context, base string) error {
	ctx, cancel := context.WithTimeout(ctx, h.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(base, "/")+h.cfg.Path, nil)
	if err != nil {
		return fmt.Errorf("build probe: %w", err)
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	defer resp.Body.Close()
	// Reading a little lets the connection be reused for the next round.
	_, _ = io.CopyN(io.Discard, resp.Body, 4<<10)
	if resp.StatusCode < 200 || resp.StatusCode >= 300 {
		return fmt.Errorf("probe answered %s", resp.Status)
	}
	return nil
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
