package system_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
)

// leaseBuilds are the two freshness rules compared side by side: the contact rule that the
// read lease replaced (kept in the jepsen_broken_lease build) and the read lease.
func leaseBuilds(b *testing.B) []struct{ name, bin string } {
	return []struct{ name, bin string }{
		{"contact", releaseBuild(b, "jepsen_broken_lease")},
		{"lease", releaseBinary(b)},
	}
}

// fastWorker starts one simulated worker process that answers at once.
func fastWorker(b *testing.B, bin string) []string {
	addr := loopbacktest.Addr(b)
	process(b, bin, "sim-worker", "--listen", addr, "--id", "w0", "--speedup", "1000000", "--log-level", "error")
	waitHTTP(b, "http://"+addr+"/health")
	return []string{"w0=http://" + addr}
}

// BenchmarkBoundReadsThroughThreeReplicas is the cost of the read lease on the request path:
// two three-replica clusters, one of each build, run at once over one fast simulated worker.
// Bound sessions (already bound, so every request is a bounded read of its binding and a
// proxied completion) are sent by 8 concurrent clients to the replicas in turn, in
// alternating 1.5 s blocks on the two clusters (so the machine's noise falls on both), and the
// reads per second and the latency percentiles of each build are reported. Run it once:
//
//	go test -run '^$' -bench BoundReadsThroughThreeReplicas -benchtime 1x ./system_test
func BenchmarkBoundReadsThroughThreeReplicas(b *testing.B) {
	builds := leaseBuilds(b)
	workers := fastWorker(b, builds[1].bin)
	const sessions, clients, blocks = 48, 8, 12
	const block = 1500 * time.Millisecond
	clusters := make([]*cluster, len(builds))
	for i, bd := range builds {
		clusters[i] = startClusterOf(b, bd.bin, 3, workers, "--log-level", "warn")
		for s := range sessions {
			r := clusters[i].replicas[s%3]
			if a, err := chat(context.Background(), r, fmt.Sprintf("bench-%d", s), "bind me"); err != nil || a.status != http.StatusOK {
				b.Fatalf("%s: bind: %+v %v", bd.name, a, err)
			}
		}
	}
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 2 * clients}}
	lat := make([][]time.Duration, len(builds))
	reads := make([][]float64, len(builds))
	for b.Loop() {
		for blk := range blocks {
			i := blk % len(builds)
			c := clusters[i]
			var mu sync.Mutex
			var got []time.Duration
			var failed int
			end := time.Now().Add(block)
			var wg sync.WaitGroup
			for cl := range clients {
				wg.Go(func() {
					for n := 0; n < 1_000_000 && time.Now().Before(end); n++ {
						r := c.replicas[(cl+n)%3]
						start := time.Now()
						a, err := chatVia(context.Background(), hc, "http://"+r.Client, fmt.Sprintf("bench-%d", (cl*7+n)%sessions), "again", 2)
						d := time.Since(start)
						mu.Lock()
						if err != nil || a.status != http.StatusOK {
							failed++
						} else {
							got = append(got, d)
						}
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			if failed > 0 {
				b.Fatalf("%s: %d requests failed in block %d", builds[i].name, failed, blk)
			}
			if blk >= len(builds) { // the first block of each warms it up
				lat[i] = append(lat[i], got...)
				reads[i] = append(reads[i], float64(len(got))/block.Seconds())
			}
		}
	}
	for i, bd := range builds {
		slices.Sort(reads[i])
		slices.Sort(lat[i])
		b.ReportMetric(reads[i][len(reads[i])/2], bd.name+"-reads/s")
		b.ReportMetric(float64(percentile(lat[i], 0.50).Microseconds()), bd.name+"-p50-us")
		b.ReportMetric(float64(percentile(lat[i], 0.99).Microseconds()), bd.name+"-p99-us")
	}
}

// BenchmarkFailoverToFirstNewBinding is the time from the leader's SIGKILL to the first new
// session bound through a surviving replica, for each build, in alternating rounds (the
// killed replica is started again and every replica is ready before the next round). Run it
// once:
//
//	go test -run '^$' -bench FailoverToFirstNewBinding -benchtime 1x ./system_test
func BenchmarkFailoverToFirstNewBinding(b *testing.B) {
	builds := leaseBuilds(b)
	workers := fastWorker(b, builds[1].bin)
	const rounds = 16
	clusters := make([]*cluster, len(builds))
	for i, bd := range builds {
		clusters[i] = startClusterOf(b, bd.bin, 3, workers, "--log-level", "warn")
	}
	times := make([][]time.Duration, len(builds))
	for b.Loop() {
		for round := range rounds * len(builds) {
			i := round % len(builds)
			c := clusters[i]
			leader := c.leader()
			survivor := c.others(leader)[round%2]
			_ = leader.proc.Signal(syscall.SIGKILL)
			killed := time.Now()
			session := fmt.Sprintf("failover-%d", round)
			for {
				a, err := chat(context.Background(), survivor, session, "hello")
				if err == nil && a.status == http.StatusOK {
					break
				}
				if time.Since(killed) > 30*time.Second {
					b.Fatalf("%s: no new binding 30 s after the leader's kill: %+v %v", builds[i].name, a, err)
				}
			}
			times[i] = append(times[i], time.Since(killed))
			<-leader.proc.Done()
			c.start(leader)
			for _, r := range c.replicas {
				c.waitReady(r)
			}
		}
	}
	for i, bd := range builds {
		b.Logf("%s: %v", bd.name, times[i])
		slices.Sort(times[i])
		b.ReportMetric(float64(percentile(times[i], 0.5).Milliseconds()), bd.name+"-median-ms")
		b.ReportMetric(float64(percentile(times[i], 1).Milliseconds()), bd.name+"-max-ms")
	}
}
