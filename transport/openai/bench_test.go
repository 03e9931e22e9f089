package openai

import (
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

func BenchmarkParse(b *testing.B) {
	ids := make([]string, 2048)
	for i := range ids {
		ids[i] = strconv.Itoa(1000 + i*7)
	}
	cases := []struct {
		name string
		kind Kind
		body string
	}{
		{"chat_4KiB", KindChat, `{"model":"m","stream":true,"messages":[{"role":"system","content":"` +
			strings.Repeat("s", 1024) + `"},{"role":"user","content":"` + strings.Repeat("u", 3072) + `"}]}`},
		{"tokens_2048", KindCompletion, `{"model":"m","prompt":[` + strings.Join(ids, ",") + `]}`},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			body := []byte(c.body)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Parse(c.kind, body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkProxy measures the router's whole path over loopback: parse, route, dispatch to a
// fake worker, relay. The worker answers at once, so this is the router's own overhead.
func BenchmarkProxy(b *testing.B) {
	for _, stream := range []bool{false, true} {
		b.Run("stream="+strconv.FormatBool(stream), func(b *testing.B) {
			worker := newFakeWorker(b, func(w http.ResponseWriter, r *http.Request) {
				if stream {
					w.Header().Set("Content-Type", "text/event-stream")
					for i := range 8 {
						_, _ = io.WriteString(w, "data: {\"i\":"+strconv.Itoa(i)+"}\n\n")
						_ = http.NewResponseController(w).Flush()
					}
					return
				}
				okJSON(w, r)
			})
			rg := newRig(b, []routing.WorkerSpec{spec("w0", worker.URL)},
				rigOptions{front: func(c *Config) { c.Logger = slog.New(slog.DiscardHandler) }})
			body := `{"model":"m","stream":` + strconv.FormatBool(stream) + `,"prompt":"` + strings.Repeat("tok ", 256) + `"}`
			client := rg.front.Client()
			client.Transport.(*http.Transport).MaxIdleConnsPerHost = 64
			b.ReportAllocs()
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					resp, err := client.Post(rg.front.URL+"/v1/completions", "application/json", strings.NewReader(body))
					if err != nil {
						b.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						b.Errorf("status %d", resp.StatusCode)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
		})
	}
}
