package sim

import (
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the worker's Prometheus series, named as vLLM names them where vLLM has one.
type metrics struct {
	requests *prometheus.CounterVec
	finished *prometheus.CounterVec
	ttft     prometheus.Histogram
	e2e      prometheus.Histogram
	// kvTransfers counts decode legs' transfers by outcome (ok, failed); kvReleased the
	// prefill legs' held transfers by how they ended (pulled, expired, cleared).
	kvTransfers *prometheus.CounterVec
	kvReleased  *prometheus.CounterVec
}

func newMetrics(w *Worker) (*metrics, error) {
	// The buckets span latencies from sped-up tests to slow real-time runs.
	latencyBuckets := []float64{
		0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
	}
	labels := prometheus.Labels{"model_name": w.cfg.Model}
	gauge := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels}, f)
	}
	counter := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels}, f)
	}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sim_requests_total", Help: "Generation requests by outcome (ok, aborted, rejected, kv_transfer_failed, fault_error, fault_stall).",
			ConstLabels: labels,
		}, []string{"outcome"}),
		finished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:request_success_total", Help: "Finished requests by finish reason.", ConstLabels: labels,
		}, []string{"finished_reason"}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vllm:time_to_first_token_seconds", Help: "Time to first token (wall clock).",
			ConstLabels: labels, Buckets: latencyBuckets,
		}),
		e2e: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vllm:e2e_request_latency_seconds", Help: "End-to-end request latency (wall clock).",
			ConstLabels: labels, Buckets: latencyBuckets,
		}),
		kvTransfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sim_kv_transfers_total", Help: "Decode legs' KV transfers (pulls from a prefill worker) by outcome (ok, failed).",
			ConstLabels: labels,
		}, []string{"outcome"}),
		kvReleased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "sim_kv_transfers_released_total", Help: "Prefill legs' held KV transfers released, by reason (pulled, expired, cleared).",
			ConstLabels: labels,
		}, []string{"reason"}),
	}
	collectors := []prometheus.Collector{
		m.requests, m.finished, m.ttft, m.e2e, m.kvTransfers, m.kvReleased,
		counter("sim_kv_transfer_blocks_total", "KV blocks decode legs transferred (those not cached here already).",
			func() float64 { return float64(w.kvTransferBlocks.Load()) }),
		counter("sim_kv_transfer_seconds_total", "Simulated KV transfer time of decode legs (not divided by speedup).",
			func() float64 { return time.Duration(w.kvTransferNanos.Load()).Seconds() }),
		gauge("sim_kv_transfers_held", "Prefill legs whose prompt blocks wait, pinned, for a decode worker's pull.",
			func() float64 { return float64(w.heldTransfers()) }),
		counter("sim_inter_tokens_total", "Output tokens after each request's first.",
			func() float64 { return float64(w.interTokens.Load()) }),
		counter("sim_inter_token_seconds_total", "Simulated inter-token latency of those tokens, summed (not divided by speedup).",
			func() float64 { return time.Duration(w.interTokenNanos.Load()).Seconds() }),
		gauge("vllm:num_requests_running", "Requests holding an engine slot.",
			func() float64 { running, _ := w.running.counts(); return float64(running) }),
		gauge("vllm:num_requests_waiting", "Requests waiting for an engine slot.",
			func() float64 { _, waiting := w.running.counts(); return float64(waiting) }),
		gauge("vllm:kv_cache_usage_perc", "Share of KV cache blocks pinned by running requests (1 = full).",
			w.cache.usage),
		// vLLM's info gauge: the cache's configuration in labels, the value 1. A router reads
		// the capacity behind kv_cache_usage_perc from it.
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "vllm:cache_config_info", Help: "Information of the engine's CacheConfig.",
			ConstLabels: prometheus.Labels{
				"model_name": w.cfg.Model, "block_size": strconv.Itoa(w.cfg.BlockSize),
				"num_gpu_blocks": strconv.Itoa(w.cfg.CapacityBlocks), "enable_prefix_caching": "True",
			},
		}, func() float64 { return 1 }),
		counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
			func() float64 { return float64(w.cache.snapshot().Queries) }),
		counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
			func() float64 { return float64(w.cache.snapshot().Hits) }),
		counter("vllm:prompt_tokens_total", "Prompt tokens prefilled or found cached.",
			func() float64 { return float64(w.promptTokens.Load()) }),
		counter("vllm:generation_tokens_total", "Output tokens sent.",
			func() float64 { return float64(w.genTokens.Load()) }),
	}
	for _, c := range collectors {
		if err := w.reg.Register(c); err != nil {
			return nil, fmt.Errorf("sim: register metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) outcome(o string) { m.requests.WithLabelValues(o).Inc() }
