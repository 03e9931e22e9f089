package enginemetrics

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the scraper's own series: errors by worker and reason, the age of each
// worker's last good scrape, and the external load the scrapes add to each target.
type metrics struct {
	s        *Scraper
	errors   *prometheus.CounterVec
	age      *prometheus.Desc
	external *prometheus.Desc
}

func newMetrics(s *Scraper) *metrics {
	return &metrics{
		s: s,
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_engine_metrics_scrape_errors_total",
			Help: "Failed scrapes of a worker's engine metrics, by reason (connect, timeout, status, too_large, parse).",
		}, []string{"worker", "reason"}),
		age: prometheus.NewDesc("kvrouter_engine_metrics_last_scrape_age_seconds",
			"Seconds since the worker's last good engine metrics scrape (since the worker was first seen, before one); past --engine-metrics-stale-after its engine load no longer counts.",
			[]string{"worker"}, nil),
		external: prometheus.NewDesc("kvrouter_engine_external_load",
			"Load a worker's engine reports beyond this cluster's own in-flight requests (other clients, the engine's queue), as the policies add it: requests, prefill_tokens, decode_blocks.",
			[]string{"worker", "dp_rank", "kind"}, nil),
	}
}

func (m *metrics) failed(worker, reason string) { m.errors.WithLabelValues(worker, reason).Inc() }

// forget drops a removed worker's error series.
func (m *metrics) forget(worker string) {
	m.errors.DeletePartialMatch(prometheus.Labels{"worker": worker})
}

// Describe implements prometheus.Collector.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	m.errors.Describe(ch)
	ch <- m.age
	ch <- m.external
}

// Collect implements prometheus.Collector.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	m.errors.Collect(ch)
	for id, age := range m.s.ages(time.Now()) {
		ch <- prometheus.MustNewConstMetric(m.age, prometheus.GaugeValue, age.Seconds(), id)
	}
	for w, l := range m.s.sink.Snapshot() {
		rank := strconv.FormatUint(uint64(w.DPRank), 10)
		ch <- prometheus.MustNewConstMetric(m.external, prometheus.GaugeValue, float64(l.Requests), w.ID, rank, "requests")
		ch <- prometheus.MustNewConstMetric(m.external, prometheus.GaugeValue, float64(l.PrefillTokens), w.ID, rank, "prefill_tokens")
		ch <- prometheus.MustNewConstMetric(m.external, prometheus.GaugeValue, float64(l.DecodeBlocks), w.ID, rank, "decode_blocks")
	}
}
