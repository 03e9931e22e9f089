package openai

import (
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// metrics are the front's instruments. Each Server owns its own set so that tests and
// several servers in one process never share state.
type metrics struct {
	requests *prometheus.CounterVec
	errors   *prometheus.CounterVec
	retries  prometheus.Counter
	// migrations counts streams whose worker failed after the first byte, by outcome.
	migrations *prometheus.CounterVec
	// dispatches counts requests sent to each worker, by why it was that worker.
	dispatches *prometheus.CounterVec
	// dispatchesBy and modelsBy are dispatches' and models' children, resolved once.
	dispatchesBy, modelsBy children
	ttft                   prometheus.Histogram
	selection              prometheus.Histogram
	kvHit                  prometheus.Histogram
	predError              prometheus.Histogram
	// Disaggregation: requests by plan outcome, and the phases of the disaggregated ones.
	disagg           *prometheus.CounterVec
	prefillSelection prometheus.Histogram
	prefillLeg       prometheus.Histogram
	decodeFirstToken prometheus.Histogram
	transfer         prometheus.Histogram
	// reservations counts the decision service's reservations by what happened to them.
	reservations *prometheus.CounterVec
	// tokenizeFallbacks counts prompts routed on text chunks because /tokenize failed.
	tokenizeFallbacks *prometheus.CounterVec
	// clientLimited counts requests refused by a limit per client, by what was limited.
	clientLimited *prometheus.CounterVec
	// models counts requests by model, bounded: a model the fleet does not serve is
	// routing.OtherModel.
	models *prometheus.CounterVec
}

func newMetrics() *metrics {
	m := &metrics{
		models: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_model_requests_total",
			Help: "Requests by the model they name: each model the fleet serves has its own value, every other name counts as \"" + routing.OtherModel + "\" (answered 404 model_not_found once every worker's models are known).",
		}, []string{"model"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_requests_total",
			Help: "Client requests by endpoint and HTTP status (499: the client went away).",
		}, []string{"endpoint", "code"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_errors_total",
			Help: "Failed or degraded requests by cause, including upstream failures that were retried.",
		}, []string{"cause"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrouter_retries_total",
			Help: "Dispatches retried on another worker before the first byte reached the client.",
		}),
		migrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_migrations_total",
			Help: "Streamed chat and completion answers whose worker failed after the first byte, by outcome: moved (continued at another worker), " +
				"disabled (--migration-limit 0), exhausted (moved the limit's times already), unsupported (the request or its answer cannot be continued), " +
				"no_worker (no other worker took the continuation), finished (every token had come; the router sent the end). " +
				"A failure that ends with an error event is also counted in kvrouter_errors_total.",
		}, []string{"outcome"}),
		dispatches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_worker_dispatches_total",
			Help: "Requests this replica sent to the worker (rank), retries included, by why that worker: " +
				"binding (the session is bound to it; affinity outranks load) or choice (the policy, or X-Target-Worker).",
		}, []string{"worker", "by"}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_ttft_seconds",
			Help:    "Time from request arrival to the first body byte from the worker going out, as the router sees it (a new session's also waits for its binding's commit).",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300},
		}),
		selection: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvrouter_selection_seconds",
			Help: "Time spent choosing a worker, affinity wait excluded.",
			// 1us .. ~4s: selection is normally microseconds, queueing for a busy fleet is not.
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12),
		}),
		predError: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvrouter_kv_prediction_error_tokens",
			Help: "Absolute difference between the cached tokens the router predicted (overlap x block size) " +
				"and the cached_tokens the worker reported in its usage.",
			Buckets: append([]float64{0}, prometheus.ExponentialBuckets(16, 4, 8)...),
		}),
		disagg: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_disagg_requests_total",
			Help: "Dispatches by disaggregation outcome: disaggregated, or why aggregated (never, no_prefill, cached, " +
				"prefill_busy, explicit_target, prefill_failed).",
		}, []string{"outcome"}),
		prefillSelection: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_prefill_selection_seconds",
			Help:    "Time spent choosing the prefill worker of a disaggregated request.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12),
		}),
		prefillLeg: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_prefill_leg_seconds",
			Help:    "Time from sending a disaggregated request's prefill leg to its whole answer, retries included.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300},
		}),
		decodeFirstToken: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_decode_first_token_seconds",
			Help:    "Time from sending a disaggregated request's decode leg to its first body byte (the KV transfer included).",
			Buckets: []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10},
		}),
		transfer: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_kv_transfer_seconds",
			Help:    "KV transfer time of a disaggregated request, as its decode worker reports it (X-KV-Transfer-Ms), when it does.",
			Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1},
		}),
		reservations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_reservations_total",
			Help: "Decision-service reservations (POST /v1/reserve) by event: reserved, released, expired (not released within the TTL).",
		}, []string{"event"}),
		tokenizeFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_tokenize_fallbacks_total",
			Help: "Prompts routed on text chunks (approximate keys) because the worker's /tokenize failed, by reason: timeout or error.",
		}, []string{"reason"}),
		kvHit: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvrouter_predicted_kv_hit_ratio",
			Help:    "Predicted share of the prompt's blocks already cached on the chosen worker.",
			Buckets: prometheus.LinearBuckets(0, 0.1, 11),
		}),
		clientLimited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_client_limited_total",
			Help: "Requests refused with 429 by a limit per client, by what: session (new sessions past the client's rate), " +
				"reservation (reservations past its rate), open_reservations (past its open reservations).",
		}, []string{"what"}),
	}
	m.dispatchesBy.vec, m.dispatchesBy.labels = m.dispatches, 2
	m.modelsBy.vec, m.modelsBy.labels = m.models, 1
	return m
}

func (m *metrics) register(reg prometheus.Registerer, c prometheus.Collector) error {
	// Every outcome is exported from the start, at 0: a dashboard's query of a migration
	// that has not happened yet finds the series, and rate() sees the first one.
	for _, o := range migrationOutcomes() {
		m.migrations.WithLabelValues(o)
	}
	for _, col := range []prometheus.Collector{m.requests, m.errors, m.retries, m.migrations, m.dispatches, m.ttft, m.selection, m.kvHit, m.predError,
		m.disagg, m.prefillSelection, m.prefillLeg, m.decodeFirstToken, m.transfer, m.reservations, m.tokenizeFallbacks, m.clientLimited, m.models, c} {
		if err := reg.Register(col); err != nil {
			return fmt.Errorf("register metrics: %w", err)
		}
	}
	return nil
}

// fleetCollector reads per-worker load and health at scrape time, so the figures are never
// stale and removed workers disappear.
type fleetCollector struct {
	tracker  *routing.Tracker
	workers  *routing.Registry
	requests *prometheus.Desc
	prefill  *prometheus.Desc
	decode   *prometheus.Desc
	healthy  *prometheus.Desc
	drained  *prometheus.Desc
}

func newFleetCollector(tracker *routing.Tracker, workers *routing.Registry) *fleetCollector {
	return &fleetCollector{
		tracker: tracker,
		workers: workers,
		requests: prometheus.NewDesc("kvrouter_worker_inflight_requests",
			"Requests this replica has in flight on the worker (rank).", []string{"worker"}, nil),
		prefill: prometheus.NewDesc("kvrouter_worker_prefill_tokens",
			"Prompt tokens this replica has waiting for prefill on the worker (rank).", []string{"worker"}, nil),
		decode: prometheus.NewDesc("kvrouter_worker_decode_blocks",
			"KV blocks of this replica's requests decoding on the worker (rank).", []string{"worker"}, nil),
		healthy: prometheus.NewDesc("kvrouter_worker_healthy",
			"1 when the worker is healthy in the registry, else 0.", []string{"worker"}, nil),
		drained: prometheus.NewDesc("kvrouter_worker_drained",
			"1 when the worker is drained, else 0.", []string{"worker"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.requests
	ch <- c.prefill
	ch <- c.decode
	ch <- c.healthy
	ch <- c.drained
}

// Collect implements prometheus.Collector.
func (c *fleetCollector) Collect(ch chan<- prometheus.Metric) {
	if c.tracker != nil {
		for w, l := range c.tracker.Snapshot() {
			name := w.String()
			ch <- prometheus.MustNewConstMetric(c.requests, prometheus.GaugeValue, float64(l.Requests), name)
			ch <- prometheus.MustNewConstMetric(c.prefill, prometheus.GaugeValue, float64(l.PrefillTokens), name)
			ch <- prometheus.MustNewConstMetric(c.decode, prometheus.GaugeValue, float64(l.DecodeBlocks), name)
		}
	}
	if c.workers != nil {
		for _, st := range c.workers.List() {
			ch <- prometheus.MustNewConstMetric(c.healthy, prometheus.GaugeValue, boolFloat(st.Healthy), st.Spec.ID)
			ch <- prometheus.MustNewConstMetric(c.drained, prometheus.GaugeValue, boolFloat(st.Drained), st.Spec.ID)
		}
	}
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// AdminHandler serves the admin listener's endpoints: /metrics from g.
func AdminHandler(g prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	return mux
}

// children resolves a CounterVec's child for a set of label values (one or two) once, for the
// counters every request adds to: WithLabelValues hashes the values and takes the vector's
// lock on every call. The values are bounded by what the counter's labels are (workers,
// models), and the vector keeps every child it made anyway; the map is replaced, never
// changed, when a new one comes.
type children struct {
	vec    *prometheus.CounterVec
	labels int        // the vector's: 1 or 2
	mu     sync.Mutex // serialises additions
	byKV   atomic.Pointer[map[[2]string]prometheus.Counter]
}

// with returns the child for label values a and b (b is "" for a vector of one label).
func (c *children) with(a, b string) prometheus.Counter {
	k := [2]string{a, b}
	if m := c.byKV.Load(); m != nil {
		if ctr, ok := (*m)[k]; ok {
			return ctr
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var old map[[2]string]prometheus.Counter
	if m := c.byKV.Load(); m != nil {
		if ctr, ok := (*m)[k]; ok {
			return ctr
		}
		old = *m
	}
	ctr := c.vec.WithLabelValues(k[:c.labels]...)
	next := make(map[[2]string]prometheus.Counter, len(old)+1)
	for key, v := range old {
		next[key] = v
	}
	next[k] = ctr
	c.byKV.Store(&next)
	return ctr
}
