package replica

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/enginemetrics"
)

// directClient sends requests straight to a worker, past every router: a client the
// cluster knows nothing of.
func directClient(t *testing.T, w *testWorker) *routerClient {
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	return &routerClient{t: t, base: w.spec.URL, hc: &http.Client{Transport: tr, Timeout: 4 * pollTimeout}}
}

// engineScrapes is fast engine metrics for the tests (0: off), with a timeout and a
// staleness bound that a slow scrape on a loaded machine does not reach.
func engineScrapes(interval time.Duration) func(int, *Config) {
	return func(_ int, cfg *Config) {
		cfg.EngineMetrics = enginemetrics.Config{Interval: interval, Timeout: 5 * time.Second, StaleAfter: 10 * time.Second}
	}
}

func TestEngineMetricsSteerRequestsAwayFromAWorkerLoadedFromOutside(t *testing.T) {
	const (
		external = 8  // streams held open on w0 by a client the cluster does not see
		requests = 60 // sent through the three replicas in turn
	)
	tests := []struct {
		name     string
		interval time.Duration
		// w0Max and w0Min bound w0's requests; its fair share is requests/4.
		w0Min, w0Max int
	}{
		// The kv cost sees w0's eight requests and their blocks: it is never the cheapest.
		{"scraping on: w0 gets nothing while others are idle", 20 * time.Millisecond, 0, 1},
		// Blind to them, the router spreads evenly (15 expected; 4 or fewer has a chance
		// below 1 in 1000).
		{"scraping off: w0 gets about its share", 0, 5, requests},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// A slow decode holds the outside client's streams open for the whole test; the
			// cluster's requests ask for one token and end at their first.
			fleet := startWorkers(t, 4, simConfig(30*time.Second))
			gc := startGossipCluster(t, fleet, 3, engineScrapes(tc.interval))
			w0 := fleet.byID(t, "w0")
			outside := directClient(t, w0)
			for i := range external {
				s := outside.openStream(promptTokens(uint64(9000+i), 16*blockTokens), 4000, nil)
				s.firstChunk(t)
			}
			eventually(t, "w0's engine to run the outside client's requests", func() (bool, string) {
				st := w0.Stats()
				return st.Running == external, fmt.Sprintf("w0 runs %d", st.Running)
			})
			if tc.interval > 0 {
				for i := range 3 {
					rep := gc.rep(i)
					eventually(t, fmt.Sprintf("g%d to see w0's external load", i), func() (bool, string) {
						x := rep.engineLoad.External(indexer.Worker{ID: "w0"})
						return x.Requests == external, fmt.Sprintf("external %+v", x)
					})
				}
			}
			got := map[string]int{}
			for i := range requests {
				c := gc.client(i % 3)
				a := c.complete(promptTokens(uint64(i), 4*blockTokens), 1, nil).mustOK(t)
				got[a.worker()]++
				waitRouterIdle(t, gc.rep(i%3))
			}
			t.Logf("requests per worker: %v", got)
			if got["w0"] < tc.w0Min || got["w0"] > tc.w0Max {
				t.Errorf("w0, loaded from outside, got %d of %d requests, want %d to %d (per worker: %v)",
					got["w0"], requests, tc.w0Min, tc.w0Max, got)
			}
		})
	}
}

func TestEngineMetricsDoNotCountTheClustersOwnRequests(t *testing.T) {
	// The cluster's own streams run on the engines; every replica subtracts the whole
	// cluster's (its own and, merged over gossip, the others'), so none of them is external.
	const streams = 6
	fleet := startWorkers(t, 3, simConfig(30*time.Second))
	gc := startGossipCluster(t, fleet, 3, engineScrapes(20*time.Millisecond))
	for i := range streams {
		s := gc.client(i%3).openStream(promptTokens(uint64(700+i), 8*blockTokens), 4000, nil)
		s.firstChunk(t)
	}
	eventually(t, "the engines to run the cluster's streams", func() (bool, string) {
		n := 0
		for _, w := range fleet {
			n += w.Stats().Running
		}
		return n == streams, fmt.Sprintf("%d running", n)
	})
	for i := range 3 {
		rep := gc.rep(i)
		eventually(t, fmt.Sprintf("g%d's merged view to hold every stream", i), func() (bool, string) {
			var n int64
			for _, w := range fleet {
				n += rep.share.remote.Load(indexer.Worker{ID: w.spec.ID}).Requests
			}
			return n == streams, fmt.Sprintf("%d in the merged view", n)
		})
	}
	// Three scrape rounds on each replica after that: each saw the engines and the merged
	// view together.
	for i := range 3 {
		rep := gc.rep(i)
		from := rep.scraper.Rounds()
		eventually(t, fmt.Sprintf("g%d to scrape three more rounds", i), func() (bool, string) {
			return rep.scraper.Rounds() >= from+3, fmt.Sprintf("%d rounds", rep.scraper.Rounds()-from)
		})
		for _, w := range fleet {
			if x := rep.engineLoad.External(indexer.Worker{ID: w.spec.ID}); x != (routing.Load{}) {
				t.Errorf("g%d counts the cluster's own requests on %s as external: %+v", i, w.spec.ID, x)
			}
		}
	}
	// The replica's own metrics report the scrapes.
	m := gc.client(0).scrapeMetrics()
	for _, w := range fleet {
		key := fmt.Sprintf(`kvrouter_engine_metrics_last_scrape_age_seconds{worker="%s"}`, w.spec.ID)
		if age, ok := m[key]; !ok || age > 1 {
			t.Errorf("%s = %v (present %v), want a recent scrape", key, age, ok)
		}
	}
}
