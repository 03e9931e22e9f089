package replica

import (
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/envoytest"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// BenchmarkPickerAddedLatency compares what a decision adds to one request's latency when
// the replica proxies it and when a gateway carries it after asking the picker over ext_proc
// (envoytest's gateway: the picker's gRPC round trips in Envoy's order, then the request
// straight to the worker): the same small completion, to a worker that answers at once, on
// the three paths in turns of four (the first of each turn not counted), one at a time. It
// reports each path's p50 and p90 above the direct path's, in microseconds. The gateway here
// is Go, not Envoy: what it shows is the picker's share, not a given gateway's.
func BenchmarkPickerAddedLatency(b *testing.B) {
	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "json", true: "sse"}[stream]
		b.Run(name, func(b *testing.B) {
			worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				if stream {
					w.Header().Set("Content-Type", "text/event-stream")
					for range 4 {
						_, _ = io.WriteString(w, "data: {\"choices\":[{\"text\":\"x\"}]}\n\n")
						_ = http.NewResponseController(w).Flush()
					}
					_, _ = io.WriteString(w, "data: [DONE]\n\n")
					return
				}
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, `{"choices":[{"text":"ok"}],"usage":{"completion_tokens":1}}`)
			}))
			b.Cleanup(worker.Close)
			fleet := testFleet{{spec: routing.WorkerSpec{ID: "w0", URL: worker.URL}}}
			rep := startTestReplica(b, fleet, func(c *Config) { c.ExtProcListen = "127.0.0.1:0" })
			gw, err := envoytest.Dial(rep.ExtProcAddr())
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { gw.Close() })
			body := `{"model":"m","stream":` + map[bool]string{true: "true", false: "false"}[stream] +
				`,"max_tokens":4,"prompt":"` + strings.Repeat("word ", 200) + `"}`
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, DisableCompression: true}}
			b.Cleanup(client.CloseIdleConnections)
			gw.HTTP = client
			post := func(base string) time.Duration {
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
			picked := func() time.Duration {
				start := time.Now()
				res, err := gw.Do(b.Context(), envoytest.Request{Path: "/v1/completions", Body: []byte(body),
					Header: http.Header{"Content-Type": {"application/json"}}})
				if err != nil || res.Status != http.StatusOK {
					b.Fatalf("through the picker: %v %+v", err, res)
				}
				return time.Since(start)
			}
			paths := []func() time.Duration{
				func() time.Duration { return post(worker.URL) },
				func() time.Duration { return post("http://" + rep.Addr()) },
				picked,
			}
			for _, p := range paths {
				p()
			}
			lat := make([][]time.Duration, len(paths))
			for i := 0; b.Loop(); i++ {
				p := i / 4 % len(paths)
				d := paths[p]()
				if i%4 != 0 {
					lat[p] = append(lat[p], d)
				}
			}
			q := func(ds []time.Duration, f float64) float64 {
				if len(ds) == 0 {
					return 0
				}
				s := slices.Clone(ds)
				slices.Sort(s)
				return float64(s[int(f*float64(len(s)-1))].Microseconds())
			}
			for _, f := range []struct {
				name string
				q    float64
			}{{"p50", 0.5}, {"p90", 0.9}} {
				b.ReportMetric(q(lat[0], f.q), "direct-"+f.name+"-us")
				b.ReportMetric(q(lat[1], f.q)-q(lat[0], f.q), "proxy-added-"+f.name+"-us")
				b.ReportMetric(q(lat[2], f.q)-q(lat[0], f.q), "extproc-added-"+f.name+"-us")
			}
			waitRouterIdle(b, rep)
		})
	}
}
