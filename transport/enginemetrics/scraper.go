// Package enginemetrics scrapes each worker's Prometheus endpoint for the load its engine
// reports (the Gateway API Inference Extension's model-server protocol: requests running and
// queued, KV cache usage and size, as vLLM and SGLang name them) and hands it, as plain
// numbers, to a sink: routing.EngineLoad, which folds what the router cannot see itself
// (other clients' requests, the engine's real queue) into the load the policies read.
//
// A scrape is bounded in time (Timeout) and size (MaxBodyBytes), and only the few series it
// needs are parsed, so a worker that answers garbage or a huge body costs the replica one
// bounded read and a counted error. A worker whose scrapes fail stops counting once its last
// good scrape is older than StaleAfter.
package enginemetrics

import (
	"context"
	"crypto/tls"
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

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Defaults for the zero fields of a Config.
const (
	// DefaultInterval is the time between scrape rounds.
	DefaultInterval = time.Second
	// DefaultTimeout bounds one scrape.
	DefaultTimeout = 500 * time.Millisecond
	// DefaultPath is where vLLM and SGLang serve their metrics.
	DefaultPath = "/metrics"
	// DefaultStaleIntervals is how many intervals a scrape counts for when StaleAfter is 0.
	DefaultStaleIntervals = 3
)

// maxScrapesInFlight bounds how many workers are scraped at once.
const maxScrapesInFlight = 32

// Config tunes a Scraper. Zero values take the defaults above.
type Config struct {
	// Interval between scrape rounds. The Scraper needs a positive one; the replica reads
	// 0 as "off" and makes none.
	Interval time.Duration
	// Timeout bounds one scrape, connection included. A round waits for its slowest scrape,
	// so a timeout past Interval delays the next round.
	Timeout time.Duration
	// Path is scraped on each worker's URL.
	Path string
	// MaxBodyBytes bounds a metrics body; a larger one is an error.
	MaxBodyBytes int64
	// StaleAfter is how long a worker's last good scrape counts (DefaultStaleIntervals
	// intervals); after it the worker's engine load is dropped until a scrape succeeds.
	StaleAfter time.Duration
	// TLS configures connections to https workers (nil: the system's roots).
	TLS *tls.Config
	// Logger receives a worker's first failure and its recovery (nil: discarded).
	Logger *slog.Logger
	// Registerer receives the scraper's metrics (nil: not registered).
	Registerer prometheus.Registerer
}

// Workers is the set of workers to scrape (routing.Registry).
type Workers interface {
	List() []routing.WorkerStatus
}

// Sink takes what the scrapes read (routing.EngineLoad).
type Sink interface {
	// Observe records a worker's report, scraped at `at`.
	Observe(spec routing.WorkerSpec, rep routing.EngineReport, at time.Time)
	// Expire drops the reports scraped before cutoff.
	Expire(cutoff time.Time) int
	// Forget drops a worker that left the registry.
	Forget(id string)
	// Snapshot is every target's external load now (for the metrics).
	Snapshot() map[indexer.Worker]routing.Load
}

// Scraper scrapes every configured worker on an interval.
type Scraper struct {
	cfg     Config
	workers Workers
	sink    Sink
	log     *slog.Logger
	client  *http.Client
	metrics *metrics

	mu     sync.Mutex
	states map[string]*scrapeState
	rounds uint64
}

// scrapeState is one worker's scrape history.
type scrapeState struct {
	// since is when the worker was first seen, lastOK its last good scrape (zero: none).
	since, lastOK time.Time
	failing       bool
}

// New returns a scraper of workers feeding sink; Run starts it.
func New(cfg Config, workers Workers, sink Sink) (*Scraper, error) {
	if workers == nil || sink == nil {
		return nil, errors.New("engine metrics: workers and a sink are required")
	}
	if cfg.Interval < 0 || cfg.Timeout < 0 || cfg.MaxBodyBytes < 0 || cfg.StaleAfter < 0 {
		return nil, errors.New("engine metrics: negative interval, timeout, body limit or staleness")
	}
	if cfg.Interval == 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Path == "" {
		cfg.Path = DefaultPath
	}
	if !strings.HasPrefix(cfg.Path, "/") {
		cfg.Path = "/" + cfg.Path
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.StaleAfter == 0 {
		cfg.StaleAfter = DefaultStaleIntervals * cfg.Interval
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Scraper{
		cfg: cfg, workers: workers, sink: sink, log: cfg.Logger, states: map[string]*scrapeState{},
		client: &http.Client{
			Transport: &http.Transport{
				Proxy:               nil, // workers are reached directly, as the proxy reaches them
				DialContext:         (&net.Dialer{Timeout: cfg.Timeout}).DialContext,
				TLSClientConfig:     cfg.TLS,
				MaxIdleConnsPerHost: 2,
				IdleConnTimeout:     3 * cfg.Interval,
				// Not asking for gzip keeps MaxBodyBytes a bound on what is read and parsed.
				DisableCompression:    true,
				ResponseHeaderTimeout: cfg.Timeout,
			},
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		},
	}
	s.metrics = newMetrics(s)
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(s.metrics); err != nil {
			return nil, fmt.Errorf("engine metrics: register metrics: %w", err)
		}
	}
	return s, nil
}

// Run scrapes every Interval until ctx is done, starting at once.
func (s *Scraper) Run(ctx context.Context) {
	defer s.client.CloseIdleConnections()
	tick := time.NewTicker(s.cfg.Interval)
	defer tick.Stop()
	for {
		s.Scrape(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// Rounds is how many scrape rounds have completed.
func (s *Scraper) Rounds() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rounds
}

// Scrape runs one round over every configured worker, hands the sink what it read, and
// drops what has gone stale.
func (s *Scraper) Scrape(ctx context.Context) {
	list := s.workers.List()
	s.track(list)
	sem := make(chan struct{}, maxScrapesInFlight)
	var wg sync.WaitGroup
	for _, st := range list {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			wg.Wait()
			return
		}
		wg.Go(func() {
			defer func() { <-sem }()
			s.scrapeOne(ctx, st.Spec)
		})
	}
	wg.Wait()
	if ctx.Err() != nil {
		return
	}
	s.sink.Expire(time.Now().Add(-s.cfg.StaleAfter))
	s.mu.Lock()
	s.rounds++
	s.mu.Unlock()
}

// track starts the history of new workers and forgets the ones that left.
func (s *Scraper) track(list []routing.WorkerStatus) {
	now := time.Now()
	present := make(map[string]bool, len(list))
	var gone []string
	s.mu.Lock()
	for _, st := range list {
		present[st.Spec.ID] = true
		if s.states[st.Spec.ID] == nil {
			s.states[st.Spec.ID] = &scrapeState{since: now}
		}
	}
	for id := range s.states {
		if !present[id] {
			delete(s.states, id)
			gone = append(gone, id)
		}
	}
	s.mu.Unlock()
	for _, id := range gone {
		s.sink.Forget(id)
		s.metrics.forget(id)
	}
}

// scrapeOne scrapes one worker and records the outcome.
func (s *Scraper) scrapeOne(ctx context.Context, spec routing.WorkerSpec) {
	rep, reason, err := s.fetch(ctx, spec.URL)
	if ctx.Err() != nil {
		return // shutting down: not the worker's failure
	}
	now := time.Now()
	if err == nil {
		s.sink.Observe(spec, rep, now)
	} else {
		s.metrics.failed(spec.ID, reason)
	}
	s.mu.Lock()
	st := s.states[spec.ID]
	var was bool
	if st != nil {
		was = st.failing
		st.failing = err != nil
		if err == nil {
			st.lastOK = now
		}
	}
	s.mu.Unlock()
	switch {
	case err != nil && !was:
		s.log.Warn("engine metrics scrape failed; the worker's engine load counts until it is stale", "worker", spec.ID, "reason", reason, "err", err)
	case err == nil && was:
		s.log.Info("engine metrics scrape recovered", "worker", spec.ID)
	case err != nil:
		s.log.Debug("engine metrics scrape failed", "worker", spec.ID, "reason", reason, "err", err)
	}
}

// Reasons a scrape failed (the reason label of the error counter).
const (
	reasonConnect  = "connect"
	reasonTimeout  = "timeout"
	reasonStatus   = "status"
	reasonTooLarge = "too_large"
	reasonParse    = "parse"
)

// fetch GETs base's metrics and parses them.
func (s *Scraper) fetch(ctx context.Context, base string) (routing.EngineReport, string, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(base, "/")+s.cfg.Path, nil)
	if err != nil {
		return routing.EngineReport{}, reasonConnect, fmt.Errorf("build scrape: %w", err)
	}
	// The text format, which vLLM and SGLang (prometheus_client) serve by default.
	req.Header.Set("Accept", "text/plain;version=0.0.4;q=1,*/*;q=0.1")
	resp, err := s.client.Do(req)
	if err != nil {
		return routing.EngineReport{}, timeoutOr(ctx, reasonConnect), fmt.Errorf("scrape: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.CopyN(io.Discard, resp.Body, 4<<10)
		return routing.EngineReport{}, reasonStatus, fmt.Errorf("scrape answered %s", resp.Status)
	}
	rep, err := Parse(resp.Body, s.cfg.MaxBodyBytes)
	switch {
	case err == nil:
		return rep, "", nil
	case errors.Is(err, ErrTooLarge):
		return rep, reasonTooLarge, err
	case errors.Is(err, ErrParse):
		return rep, reasonParse, err
	}
	return rep, timeoutOr(ctx, reasonConnect), err
}

// timeoutOr is reasonTimeout when ctx's deadline passed, else reason.
func timeoutOr(ctx context.Context, reason string) string {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return reasonTimeout
	}
	return reason
}

// ages returns, for every watched worker, how long ago its last good scrape was (since it
// was first seen, when none was good yet).
func (s *Scraper) ages(now time.Time) map[string]time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]time.Duration, len(s.states))
	for id, st := range s.states {
		at := st.lastOK
		if at.IsZero() {
			at = st.since
		}
		out[id] = now.Sub(at)
	}
	return out
}
