package enginemetrics

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// vllmV1 is the shape of a vLLM V1 engine's /metrics (abridged): every series labelled with
// the engine index, histograms in between.
const vllmV1 = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27000"} 1.0
`

func TestParse(t *testing.T) {
	sample := func(running, waiting, usage, blocks float64, bs int) routing.EngineSample {
		return routing.EngineSample{Running: running, Waiting: waiting, KVUsage: usage, KVBlocks: blocks, KVBlockSize: bs}
	}
	whole := func(s routing.EngineSample) routing.EngineReport { return routing.EngineReport{Whole: &s} }
	ranks := func(m map[int]routing.EngineSample) routing.EngineReport { return routing.EngineReport{Ranks: m} }
	tests := []struct {
		name string
		body string
		want routing.EngineReport
	}{
		{"vLLM V1, one engine", vllmV1, ranks(map[int]routing.EngineSample{0: sample(3, 2, 0.25, 27000, 16)})},
		{"vLLM V0: gpu_cache_usage_perc, no engine label", `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
`, whole(sample(1, 0, 0.5, 0, 0))},
		{"data-parallel engines, the cache info worker-wide", `vllm:num_requests_running{engine="0"} 1
vllm:num_requests_running{engine="1"} 4
vllm:num_requests_waiting{engine="1"} 2
vllm:kv_cache_usage_perc{engine="0"} 0.1
vllm:kv_cache_usage_perc{engine="1"} 0.4
vllm:cache_config_info{block_size="32",num_gpu_blocks="1000"} 1
`, ranks(map[int]routing.EngineSample{0: sample(1, 0, 0.1, 1000, 32), 1: sample(4, 2, 0.4, 1000, 32)})},
		{"SGLang: copies per tensor-parallel rank count once", `# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 5
sglang:num_running_reqs{model_name="m",tp_rank="1"} 5
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 7
sglang:token_usage{model_name="m",tp_rank="0"} 0.28
sglang:max_total_num_tokens{model_name="m",tp_rank="0"} 161721
`, whole(sample(5, 7, 0.28, 161721, 1))},
		{"SGLang data-parallel ranks", `sglang:num_running_reqs{dp_rank="0"} 1
sglang:num_running_reqs{dp_rank="1"} 2
`, ranks(map[int]routing.EngineSample{0: sample(1, 0, -1, 0, 0), 1: sample(2, 0, -1, 0, 0)})},
		{"no engine series: an empty report", "# HELP go_goroutines x\ngo_goroutines 12\n", routing.EngineReport{}},
		{"empty body", "", routing.EngineReport{}},
		{"garbage in other series is never parsed", "go_goroutines{{{ !!\n\x00\xff\nvllm:num_requests_running 2\n",
			whole(sample(2, 0, -1, 0, 0))},
		{"values that are not finite and non-negative are ignored", `vllm:num_requests_running NaN
vllm:num_requests_running{engine="1"} -3
vllm:num_requests_waiting 2
vllm:kv_cache_usage_perc +Inf
vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1
`, whole(sample(0, 2, -1, 0, 0))},
		{"a usage over 1 is 1; no final newline", "vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 1.5",
			whole(sample(1, 0, 1, 0, 0))},
		{"an engine label that is no rank is the whole worker's", `vllm:num_requests_running{engine="x"} 2`,
			whole(sample(2, 0, -1, 0, 0))},
		{"an over-long line is skipped", "vllm:num_requests_running{a=\"" + strings.Repeat("x", 2*maxLineBytes) + "\"} 9\nvllm:num_requests_waiting 1\n",
			whole(sample(0, 1, -1, 0, 0))},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Parse(strings.NewReader(tc.body), 0)
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got %s, want %s", show(got), show(tc.want))
			}
		})
	}
}

func show(r routing.EngineReport) string {
	s := fmt.Sprintf("ranks %+v", r.Ranks)
	if r.Whole != nil {
		s += fmt.Sprintf(", whole %+v", *r.Whole)
	}
	return s
}

func TestParseRefuses(t *testing.T) {
	tests := []struct {
		name string
		body string
		max  int64
		want error
	}{
		{"a body over the limit", strings.Repeat("# padding\n", 200), 1000, ErrTooLarge},
		{"an over-long line still counts towards the limit", strings.Repeat("x", 5000), 1000, ErrTooLarge},
		{"too many engine series", strings.Repeat("vllm:num_requests_running{engine=\"1\"} 1\n", maxKeptLines+1), 1 << 30, ErrTooLarge},
		{"garbage in an engine series", "vllm:num_requests_running{engine=0} 1\n", 0, ErrParse},
		{"a second TYPE line", "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n# TYPE vllm:num_requests_running gauge\n", 0, ErrParse},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Parse(strings.NewReader(tc.body), tc.max); !errors.Is(err, tc.want) {
				t.Errorf("Parse: %v, want %v", err, tc.want)
			}
		})
	}
}

// FuzzParse feeds Parse arbitrary bodies: it must return (a report or an error) without
// panicking, within its limits, and a report's figures must be usable as they are.
func FuzzParse(f *testing.F) {
	f.Add([]byte(vllmV1))
	f.Add([]byte("sglang:num_running_reqs{dp_rank=\"1\"} 2\nsglang:token_usage 0.5\n"))
	f.Add([]byte("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1e400\"} 1\nvllm:num_requests_running 1\n"))
	f.Add([]byte("# TYPE vllm:num_requests_waiting histogram\nvllm:num_requests_waiting_bucket{le=\"1\"} 1\n"))
	f.Fuzz(func(t *testing.T, body []byte) {
		rep, err := Parse(bytes.NewReader(body), 1<<16)
		if err != nil {
			return
		}
		check := func(s routing.EngineSample) {
			if !(s.Running >= 0 && s.Waiting >= 0 && s.KVUsage <= 1 && s.KVBlocks >= 0 && s.KVBlockSize >= 0) {
				t.Fatalf("report out of range: %+v", s)
			}
		}
		if rep.Whole != nil {
			check(*rep.Whole)
		}
		for r, s := range rep.Ranks {
			if r < 0 || r >= routing.MaxDPSize {
				t.Fatalf("rank %d out of range", r)
			}
			check(s)
		}
	})
}
