package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// The gauges a router scrapes as engine load (the Gateway API Inference Extension's
// model-server protocol) follow the engine: requests holding a slot, requests queued for
// one, the pinned share of the cache, and the cache's size in cache_config_info.
func TestMetricsReportEngineLoad(t *testing.T) {
	_, srv := newTestWorker(t, Config{MaxRunning: 1, CapacityBlocks: 100, BlockSize: 16, Speedup: 1, DecodePerToken: time.Hour})
	if text := scrape(t, srv.URL); !strings.Contains(text,
		`vllm:cache_config_info{block_size="16",enable_prefix_caching="True",model_name="sim-model",num_gpu_blocks="100"} 1`) {
		t.Fatalf("no cache_config_info with the cache's size:\n%s", text)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	// Two held streams of 40-token prompts (2 full blocks each): one runs, one waits (its
	// headers come only with its slot, so neither is waited for here).
	done := make(chan struct{})
	for _, start := range []int{1, 1000} {
		go func() {
			defer func() { done <- struct{}{} }()
			body, _ := json.Marshal(map[string]any{"prompt": seqTokens(start, 40), "max_tokens": 50, "stream": true})
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/completions", bytes.NewReader(body))
			if resp, err := srv.Client().Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	defer func() { cancel(); <-done; <-done }()
	want := []string{
		`vllm:num_requests_running{model_name="sim-model"} 1`,
		`vllm:num_requests_waiting{model_name="sim-model"} 1`,
		`vllm:kv_cache_usage_perc{model_name="sim-model"} 0.02`,
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		text := scrape(t, srv.URL)
		missing := ""
		for _, w := range want {
			if !strings.Contains(text, w+"\n") {
				missing = w
				break
			}
		}
		if missing == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics never showed %q:\n%s", missing, text)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
