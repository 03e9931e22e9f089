package openai

import (
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

func TestCachedTokensScan(t *testing.T) {
	tests := []struct {
		in   string
		want int
		ok   bool
	}{
		{`{"usage":{"prompt_tokens_details":{"cached_tokens":1024}}}`, 1024, true},
		{`data: {"usage":{"prompt_tokens_details":{"cached_tokens" : 0}}}` + "\n\n", 0, true},
		{`{"a":{"cached_tokens":1},"b":{"cached_tokens":32}}`, 32, true},
		{`{"cached_tokens":null}`, 0, false},
		{`{"cached_tokens"`, 0, false},
		{`{"usage":{}}`, 0, false},
	}
	for _, tc := range tests {
		got, ok := cachedTokens([]byte(tc.in))
		if got != tc.want || ok != tc.ok {
			t.Errorf("cachedTokens(%s) = %d, %v; want %d, %v", tc.in, got, ok, tc.want, tc.ok)
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
