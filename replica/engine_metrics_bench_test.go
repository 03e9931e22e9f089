package replica

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
	"github.com/kvrouter-ha/kvrouter-ha/transport/enginemetrics"
)

// The replay behind the README's before/after figures for engine metrics.
const (
	extStart    = 2500 // where sessions are in full swing, as the demo starts
	extRequests = 400
	extSpeedup  = 5
	extWorkers  = 4
	// Each engine runs extSlots requests at once; a client the router does not see keeps
	// some of w0's busy all the time, one long request after another.
	extSlots = 12
	// extPromptTokens is the size of the outside requests' prompts: the slice's median, so
	// that in KV blocks (what the kv cost weighs) each weighs what a trace request does.
	extPromptTokens = 16384
)

// BenchmarkExternalLoadReplay replays a slice of the trace through one replica over four
// simulated workers while another client keeps 8 or all 12 of w0's engine slots busy, with
// engine metrics off and on, and reports how the requests spread (max/mean per worker, w0's
// share, the requests in each engine with the outside ones) and what that did to time to
// first token:
//
//	go test ./replica -run '^$' -bench ExternalLoadReplay -benchtime 1x
func BenchmarkExternalLoadReplay(b *testing.B) {
	reqs, err := trace.ForReplay("", extStart) // the bundled trace

	if err != nil {
		b.Fatal(err)
	}
	reqs = reqs[:extRequests]
	// The scrape interval is the default second in trace time, like the demo's gossip
	// intervals.
	on := enginemetrics.DefaultInterval / extSpeedup
	for _, tc := range []struct {
		name     string
		outside  int
		interval time.Duration
	}{
		{"outside=8of12/scrape=off", 8, 0}, {"outside=8of12/scrape=on", 8, on},
		{"outside=12of12/scrape=off", 12, 0}, {"outside=12of12/scrape=on", 12, on},
	} {
		b.Run(tc.name, func(b *testing.B) {
			for b.Loop() {
				sum, p90, inFlight := externalLoadReplay(b, reqs, tc.outside, tc.interval)
				mean := 0.0
				for _, v := range inFlight {
					mean += v / float64(len(inFlight))
				}
				w0 := float64(sum.Workers["w0"].Requests) / float64(max(sum.OK, 1))
				b.ReportMetric(sum.RequestImbalance, "max/mean")
				b.ReportMetric(100*w0, "w0_%")
				b.ReportMetric(sum.TTFTP50Ms, "ttft_p50_ms")
				b.ReportMetric(sum.TTFTP90Ms, "ttft_p90_ms")
				b.ReportMetric(100*sum.HitRate, "hit_%")
				b.ReportMetric(p90["w0"], "w0_ttft_p90_ms")
				b.ReportMetric(slices.Max(inFlight)/mean, "engine_max/mean")
				b.ReportMetric(float64(sum.Failed), "failed")
				var per []string
				for _, id := range []string{"w0", "w1", "w2", "w3"} {
					per = append(per, fmt.Sprintf("%s %d", id, sum.Workers[id].Requests))
				}
				b.Logf("%s: %d ok of %d; requests per worker: %v (max/mean %.2f, w0 %.1f%%); TTFT p50 %.0f ms, p90 %.0f ms (w0's p90 %.0f ms); hit rate %.1f%%; mean requests in each engine, outside ones included: %.1f (max/mean %.2f)",
					tc.name, sum.OK, sum.Requests, per, sum.RequestImbalance, 100*w0, sum.TTFTP50Ms, sum.TTFTP90Ms, p90["w0"], 100*sum.HitRate, inFlight, slices.Max(inFlight)/mean)
			}
		})
	}
}

// externalLoadReplay runs one replay while outside requests keep w0 busy, with engine
// metrics scraped every interval (0: off).
func externalLoadReplay(b *testing.B, reqs []trace.Request, outside int, interval time.Duration) (*replay.Summary, map[string]float64, []float64) {
	quiet := slog.New(slog.DiscardHandler)
	fleet := startBenchWorkers(b, extWorkers, sim.Config{
		Speedup: extSpeedup, CapacityBlocks: 32768, MaxModelLen: 262144, MaxRunning: extSlots, Logger: quiet,
		ShutdownTimeout: 500 * time.Millisecond,
	})
	rep := startTestReplica(b, fleet, func(c *Config) {
		c.ApproxMaxBlocks = 32768
		c.SessionTTL = time.Minute
		c.EngineMetrics = enginemetrics.Config{Interval: interval}
	})
	ctx, cancel := context.WithCancel(b.Context())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	w0 := fleet[0]
	var seq atomic.Uint64
	for range outside {
		wg.Go(func() { keepBusy(ctx, w0.spec.URL, &seq) })
	}
	deadline := time.Now().Add(pollTimeout)
	for ready := false; !ready; {
		st := w0.Stats()
		ready = st.Running+st.Waiting >= outside &&
			(interval == 0 || rep.engineLoad.External(indexer.Worker{ID: "w0"}).Requests >= int64(outside))
		if time.Now().After(deadline) {
			b.Fatalf("the outside load never showed: w0 runs %d, waits %d", st.Running, st.Waiting)
		}
		time.Sleep(5 * time.Millisecond)
	}
	rc := replay.DefaultConfig()
	rc.Target = "http://" + rep.Addr()
	rc.Requests = reqs
	rc.Speedup = extSpeedup
	rc.Model = sim.DefaultModel
	var log bytes.Buffer
	rc.RequestLog = &log
	sampled := make(chan []float64, 1)
	sctx, stopSampling := context.WithCancel(ctx)
	go func() { sampled <- sampleEngines(sctx, fleet) }()
	sum, err := replay.Run(ctx, rc)
	stopSampling()
	inFlight := <-sampled
	if err != nil {
		b.Fatal(err)
	}
	return sum, ttftByWorker(b, &log), inFlight
}

// sampleEngines is each worker's mean number of requests in its engine (running and
// waiting, every client's) over samples every 10 ms until ctx ends.
func sampleEngines(ctx context.Context, fleet testFleet) []float64 {
	sums := make([]float64, len(fleet))
	n := 0
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			for i := range sums {
				sums[i] /= float64(max(n, 1))
			}
			return sums
		case <-tick.C:
		}
		for i, w := range fleet {
			st := w.Stats()
			sums[i] += float64(st.Running + st.Waiting)
		}
		n++
	}
}

// ttftByWorker is the p90 time to first token of each worker's requests, from a replay's
// request log, in milliseconds.
func ttftByWorker(tb testing.TB, log io.Reader) map[string]float64 {
	by := map[string][]float64{}
	dec := json.NewDecoder(log)
	for {
		var rec replay.RequestRecord
		if err := dec.Decode(&rec); err == io.EOF {
			break
		} else if err != nil {
			tb.Fatalf("request log: %v", err)
		}
		if rec.OK {
			by[rec.Worker] = append(by[rec.Worker], rec.TTFTMs)
		}
	}
	out := map[string]float64{}
	for w, v := range by {
		slices.Sort(v)
		out[w] = v[min(len(v)-1, int(math.Ceil(0.9*float64(len(v))))-1)]
	}
	return out
}

// keepBusy keeps one long request on the worker at base, one after another, until ctx ends:
// a client of the worker that no router sees.
func keepBusy(ctx context.Context, base string, seq *atomic.Uint64) {
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	defer client.CloseIdleConnections()
	for ctx.Err() == nil {
		body := completionBody(promptTokens(1<<40+seq.Add(1), extPromptTokens), 2000, true)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
		if err != nil {
			return
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// startBenchWorkers starts n simulated workers w0.. on 127.0.0.1:0, stopped at cleanup
// (startWorkers for a benchmark).
func startBenchWorkers(tb testing.TB, n int, base sim.Config) testFleet {
	tb.Helper()
	var fleet testFleet
	for i := range n {
		c := base
		c.ID = fmt.Sprintf("w%d", i)
		sw, err := sim.New(c)
		if err != nil {
			tb.Fatalf("sim.New: %v", err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			tb.Fatalf("listen: %v", err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		w := &testWorker{Worker: sw, cancel: cancel, done: make(chan struct{}),
			spec: routing.WorkerSpec{ID: c.ID, URL: "http://" + ln.Addr().String(), CapacityBlocks: sw.Config().CapacityBlocks}}
		go func() {
			defer close(w.done)
			_ = sw.Serve(ctx, ln)
		}()
		fleet = append(fleet, w)
	}
	tb.Cleanup(func() {
		for _, w := range slices.Backward(fleet) {
			w.stop()
		}
	})
	return fleet
}
