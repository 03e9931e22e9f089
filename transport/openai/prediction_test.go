package openai

import (
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

func TestUsageCountScan(t *testing.T) {
	tests := []struct {
		in, key string
		want    int
		ok      bool
	}{
		{`{"usage":{"prompt_tokens_details":{"cached_tokens":1024}}}`, cachedTokensKey, 1024, true},
		{`data: {"usage":{"prompt_tokens_details":{"cached_tokens" : 0}}}` + "\n\n", cachedTokensKey, 0, true},
		{`{"a":{"cached_tokens":1},"b":{"cached_tokens":32}}`, cachedTokensKey, 32, true},
		{`{"cached_tokens":null}`, cachedTokensKey, 0, false},
		{`{"cached_tokens"`, cachedTokensKey, 0, false},
		{`{"usage":{}}`, cachedTokensKey, 0, false},
		{`{"usage":{"completion_tokens":17,"completion_tokens_details":{"reasoning_tokens":3}}}`, completionTokensKey, 17, true},
		{`{"usage":{"completion_tokens_details":{"reasoning_tokens":3}}}`, completionTokensKey, 0, false},
		{`{"usage":{"completion_tokens":99999999999999999999}}`, completionTokensKey, 999999999999, true},
	}
	for _, tc := range tests {
		got, ok := usageCount([]byte(tc.in), tc.key)
		if got != tc.want || ok != tc.ok {
			t.Errorf("usageCount(%s, %s) = %d, %v; want %d, %v", tc.in, tc.key, got, ok, tc.want, tc.ok)
		}
	}
}

func TestPredictionErrorIsMeasured(t *testing.T) {
	for _, stream := range []bool{false, true} {
		fw := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
			if stream {
				w.Header().Set("Content-Type", "text/event-stream")
				_, _ = io.WriteString(w, "data: {\"choices\":[{\"text\":\"x\"}]}\n\n")
				_, _ = io.WriteString(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\ndata: [DONE]\n\n")
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"choices":[{"text":"x"}],"usage":{"prompt_tokens":64,"prompt_tokens_details":{"cached_tokens":48}}}`)
		})
		rg := newRig(t, []routing.WorkerSpec{spec("w0", fw.URL)}, rigOptions{})
		body := `{"model":"m","prompt":[` + tokenList(64) + `],"stream":` + map[bool]string{true: "true", false: "false"}[stream] + `}`
		resp, _ := rg.post("/v1/completions", body, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
		// Nothing was predicted (the index was empty): the error is the 48 cached tokens.
		poll.Holds(t, 10*time.Second, "the prediction error to be observed", func() bool {
			return rg.metric("kvrouter_kv_prediction_error_tokens", nil) == 1
		})
		if sum := rg.metricSum("kvrouter_kv_prediction_error_tokens"); sum != 48 {
			t.Fatalf("stream=%v: error sum %v, want 48", stream, sum)
		}
	}
}

// metricSum is the sum of a histogram's observations.
func (r *rig) metricSum(name string) float64 {
	r.t.Helper()
	families, err := r.reg.Gather()
	if err != nil {
		r.t.Fatalf("gather: %v", err)
	}
	for _, fam := range families {
		if fam.GetName() == name {
			sum := 0.0
			for _, m := range fam.GetMetric() {
				sum += m.GetHistogram().GetSampleSum()
			}
			return sum
		}
	}
	return 0
}

// tokenList is n comma-separated token ids.
func tokenList(n int) string {
	b := make([]byte, 0, n*5)
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(1000+i), 10)
	}
	return string(b)
}

// TestAFinishedAnswerRecordsItsGeneratedBlocks: when a worker's answer ends whole, the prompt
// is recorded again with stand-ins for the blocks its generated tokens fill (counted from the
// usage, or one per stream event without one); an answer the worker refused adds nothing.
func TestAFinishedAnswerRecordsItsGeneratedBlocks(t *testing.T) {
	events := strings.Repeat("data: {\"choices\":[{\"text\":\"x\"}]}\n\n", 33) + "data: [DONE]\n\n"
	tests := []struct {
		name   string
		stream bool
		answer func(w http.ResponseWriter)
		status int
		want   int // blocks held after the request: 4 of the prompt and those generated
	}{
		{name: "non-streaming, usage", answer: func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"choices":[{"text":"x"}],"usage":{"prompt_tokens":64,"completion_tokens":40}}`)
		}, status: http.StatusOK, want: 6},
		{name: "streaming, usage", stream: true, answer: func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: {\"choices\":[{\"text\":\"x\"}]}\n\n")
			_, _ = io.WriteString(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"completion_tokens\":50}}\n\ndata: [DONE]\n\n")
		}, status: http.StatusOK, want: 7},
		{name: "streaming, no usage", stream: true, answer: func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, events)
		}, status: http.StatusOK, want: 6},
		{name: "refused", answer: func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"no","usage":{"completion_tokens":400}}}`)
		}, status: http.StatusBadRequest, want: 4},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fw := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) { tc.answer(w) })
			rg := newRig(t, []routing.WorkerSpec{spec("w0", fw.URL)}, rigOptions{})
			body := `{"model":"m","prompt":[` + tokenList(64) + `],"stream":` + strconv.FormatBool(tc.stream) + `}`
			resp, _ := rg.post("/v1/completions", body, nil)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d", resp.StatusCode, tc.status)
			}
			// The answer's end reached the client after the record (the proxy records, then
			// the handler returns and the response ends).
			if got := rg.index.held(indexer.Worker{ID: "w0"}); got != tc.want {
				t.Fatalf("blocks recorded on the worker = %d, want %d", got, tc.want)
			}
		})
	}
}
