package openai

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// fixedRate is the spacing of requests in the rate-limited runs: one request per
// millisecond at most, each after an idle gap, as a lightly loaded replica sees them. A
// sleeping Go process on Linux wakes for timers in whole milliseconds (epoll's timeout), so
// a shorter spacing could not be held: the run would fall behind and catch up with requests
// back to back, measuring a mix of idle and busy rounds instead.
const fixedRate = time.Millisecond

// latencyWorker answers at once: a small JSON completion, or a short SSE stream.
func latencyWorker(stream bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
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
		okJSON(w, r)
	}
}

func latencyBody(stream bool) string {
	return `{"model":"m","stream":` + map[bool]string{true: "true", false: "false"}[stream] +
		`,"max_tokens":4,"prompt":"` + strings.Repeat("word ", 200) + `"}`
}

// BenchmarkAddedLatency measures what the router adds to a request's latency: the same
// request goes straight to a worker and through the router to that worker, in turns, one at
// a time, and the percentiles of the two are compared. The worker answers at once, so the
// difference is the router's parse, selection and proxying. The plain runs send at a fixed
// rate (cores idle between requests, so thread wake-ups count); the -busy runs send back to
// back.
func BenchmarkAddedLatency(b *testing.B) {
	for _, tc := range []struct {
		name     string
		stream   bool
		interval time.Duration
	}{
		{"json", false, fixedRate},
		{"sse", true, fixedRate},
		{"json-busy", false, 0},
		{"sse-busy", true, 0},
	} {
		b.Run(tc.name, func(b *testing.B) {
			upstream := httptest.NewServer(latencyWorker(tc.stream))
			b.Cleanup(upstream.Close)
			rg := newRig(b, []routing.WorkerSpec{spec("w0", upstream.URL)}, rigOptions{realIndex: true,
				front: func(c *Config) { c.Logger = slog.New(slog.DiscardHandler) }})
			measureAdded(b, upstream.URL, rg.front.URL, latencyBody(tc.stream), tc.interval)
		})
	}
}

// BenchmarkAddedLatencyFloor is the same measurement through proxies that do no routing: a
// bare httputil.ReverseProxy over net/http's Transport (what any Go proxy pays), and a bare
// handler over the router's own upstream client. Their added latency is the floor under the
// router's on this machine.
func BenchmarkAddedLatencyFloor(b *testing.B) {
	for _, tc := range []struct {
		name     string
		stream   bool
		interval time.Duration
		client   string
	}{
		{"json-reverseproxy", false, fixedRate, "transport"},
		{"sse-reverseproxy", true, fixedRate, "transport"},
		{"json-upstream", false, fixedRate, "upstream"},
		{"sse-upstream", true, fixedRate, "upstream"},
	} {
		b.Run(tc.name, func(b *testing.B) {
			upstream := httptest.NewServer(latencyWorker(tc.stream))
			b.Cleanup(upstream.Close)
			var h http.Handler
			switch tc.client {
			case "transport":
				u, err := url.Parse(upstream.URL)
				if err != nil {
					b.Fatal(err)
				}
				rp := httputil.NewSingleHostReverseProxy(u)
				tr := newTransport(Config{ConnectTimeout: time.Second, FirstByteTimeout: time.Minute})
				b.Cleanup(tr.CloseIdleConnections)
				rp.Transport = tr
				h = rp
			default:
				h = bareProxy(b, upstream.URL)
			}
			front := httptest.NewServer(h)
			b.Cleanup(front.Close)
			measureAdded(b, upstream.URL, front.URL, latencyBody(tc.stream), tc.interval)
		})
	}
}

// pathBlock is how many requests in a row measureAdded sends on one path.
const pathBlock = 4

// measureAdded sends the request on the direct and the proxied path in turns of pathBlock
// requests (same client, same body), one request at a time, each at least interval after
// the previous one started (none if interval is 0), and reports the percentiles.
func measureAdded(b *testing.B, direct, proxied, body string, interval time.Duration) {
	b.Helper()
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
	do(direct)
	do(proxied)
	var directs, proxieds []time.Duration
	next := time.Now()
	for i := 0; b.Loop(); i++ {
		if d := time.Until(next); d > 0 {
			time.Sleep(d)
		}
		// An overslept timer does not make the next requests catch up back to back: every
		// request of a paced run starts after an idle gap.
		if now := time.Now(); interval > 0 && next.Before(now) {
			next = now
		}
		next = next.Add(interval)
		// The paths take turns in blocks, and the first request of a block is not counted:
		// what ran just before a request (whose code is warm, which thread is awake) shifts
		// its latency by tens of microseconds here, so every counted request follows one on
		// its own path, as in a steady stream, while both paths share the machine's moods.
		onDirect, counted := i/pathBlock%2 == 0, i%pathBlock != 0
		switch {
		case onDirect && counted:
			directs = append(directs, do(direct))
		case onDirect:
			do(direct)
		case counted:
			proxieds = append(proxieds, do(proxied))
		default:
			do(proxied)
		}
	}
	if len(directs) < 2 || len(proxieds) < 2 {
		return
	}
	slices.Sort(directs)
	slices.Sort(proxieds)
	pct := func(v []time.Duration, p int) float64 { return float64(v[(len(v)-1)*p/100].Microseconds()) }
	b.ReportMetric(pct(directs, 50), "direct-p50-us")
	b.ReportMetric(pct(proxieds, 50), "proxied-p50-us")
	b.ReportMetric(pct(proxieds, 50)-pct(directs, 50), "added-p50-us")
	b.ReportMetric(pct(proxieds, 99)-pct(directs, 99), "added-p99-us")
}

// bareProxy relays every request to workerURL over the router's upstream client, with no
// parsing, routing or accounting: the floor of the router's own proxying.
func bareProxy(b *testing.B, workerURL string) http.Handler {
	up := newUpstream(time.Second, nil)
	b.Cleanup(up.close)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		resp, _, err := up.roundTrip(r.Context(), workerURL, outbound{method: r.Method, target: r.URL.RequestURI(),
			body: body, forwarding: forwardContentType(r.Header["Content-Type"])},
			time.Now().Add(time.Minute))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		copyHeaders(w.Header(), resp.Header)
		w.WriteHeader(resp.StatusCode)
		buf := make([]byte, copyBuffer)
		rc := http.NewResponseController(w)
		// Each pass reads at least one byte or ends.
		for {
			n, err := resp.Body.Read(buf)
			if n > 0 {
				_, _ = w.Write(buf[:n])
				_ = rc.Flush()
			}
			if err != nil {
				return
			}
		}
	})
}

// BenchmarkDisaggregatedAddedLatency measures what the two-leg dispatch adds to one
// aggregated dispatch: the same request through a router over one aggregated worker and
// through a router that disaggregates it over a prefill and a decode worker, in turns, one
// at a time. Every worker answers at once, so the difference is the router's prefill leg
// (its selection, the body rewrite, a round trip, reading the params) and the decode body's
// rewrite. In the metrics, "direct" is the aggregated router and "proxied" the
// disaggregating one.
func BenchmarkDisaggregatedAddedLatency(b *testing.B) {
	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "json", true: "sse"}[stream]
		b.Run(name, func(b *testing.B) {
			quiet := func(c *Config) { c.Logger = slog.New(slog.DiscardHandler) }
			agg := httptest.NewServer(latencyWorker(stream))
			b.Cleanup(agg.Close)
			aggregated := newRig(b, []routing.WorkerSpec{spec("w0", agg.URL)}, rigOptions{realIndex: true, front: quiet})
			pre := httptest.NewServer(prefillAnswer("eng-p0"))
			b.Cleanup(pre.Close)
			dec := httptest.NewServer(latencyWorker(stream))
			b.Cleanup(dec.Close)
			disagg := newRig(b, []routing.WorkerSpec{role(spec("p0", pre.URL), routing.RolePrefill), role(spec("d0", dec.URL), routing.RoleDecode)},
				rigOptions{realIndex: true, front: quiet, router: func(c *routing.Config) { c.Disagg.Mode = routing.DisaggAlways }})
			measureAdded(b, aggregated.front.URL, disagg.front.URL, latencyBody(stream), fixedRate)
		})
	}
}
