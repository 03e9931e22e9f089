package openai

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// BenchmarkAddedLatency measures what the router adds to a request's latency: at a fixed rate
// (one request per interval, alternating), the same request goes straight to a worker and
// through the router to that worker, and the percentiles of the two are compared. The worker
// answers at once, so the difference is the router's parse, selection and proxying.
func BenchmarkAddedLatency(b *testing.B) {
	for _, tc := range []struct {
		name   string
		stream bool
	}{{"json", false}, {"sse", true}} {
		b.Run(tc.name, func(b *testing.B) {
			upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				if tc.stream {
					w.Header().Set("Content-Type", "text/event-stream")
					for range 4 {
						_, _ = io.WriteString(w, "data: {\"choices\":[{\"text\":\"x\"}]}\n\n")
						_ = http.NewResponseController(w).Flush()
					}
					_, _ = io.WriteString(w, "data: [DONE]\n\n")
					return
				}
				okJSON(w, r)
			}))
			b.Cleanup(upstream.Close)
			rg := newRig(b, []routing.WorkerSpec{spec("w0", upstream.URL)},
				rigOptions{front: func(c *Config) { c.Logger = slog.New(slog.DiscardHandler) }})
			body := `{"model":"m","stream":` + map[bool]string{true: "true", false: "false"}[tc.stream] +
				`,"max_tokens":4,"prompt":"` + strings.Repeat("word ", 200) + `"}`
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, DisableCompression: true}}
			b.Cleanup(client.CloseIdleConnections)
			do := func(base string) time.Duration {
				start := time.Now()
				resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					b.Fatalf("status %d from %s", resp.StatusCode, base)
				}
				return time.Since(start)
			}
			// Warm both paths' connections.
			do(upstream.URL)
			do(rg.front.URL)
			const interval = 500 * time.Microsecond // 1,000 req/s on each path
			var direct, proxied []time.Duration
			next := time.Now()
			for i := 0; b.Loop(); i++ {
				if d := time.Until(next); d > 0 {
					time.Sleep(d)
				}
				next = next.Add(interval)
				if i%2 == 0 {
					direct = append(direct, do(upstream.URL))
				} else {
					proxied = append(proxied, do(rg.front.URL))
				}
			}
			if len(direct) < 2 || len(proxied) < 2 {
				return
			}
			slices.Sort(direct)
			slices.Sort(proxied)
			pct := func(v []time.Duration, p int) float64 { return float64(v[(len(v)-1)*p/100].Microseconds()) }
			b.ReportMetric(pct(direct, 50), "direct-p50-us")
			b.ReportMetric(pct(proxied, 50), "proxied-p50-us")
			b.ReportMetric(pct(proxied, 50)-pct(direct, 50), "added-p50-us")
			b.ReportMetric(pct(proxied, 99)-pct(direct, 99), "added-p99-us")
		})
	}
}
