package system_test

import (
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// releaseBuilds are kvrouter-ha built without the race detector, for benchmarks, by build
// tags ("" for the release itself).
var (
	releaseMu     sync.Mutex
	releaseBuilds = map[string]string{}
)

func releaseBinary(b *testing.B) string { return releaseBuild(b, "") }

// releaseBuild builds kvrouter-ha with tags once per test binary.
func releaseBuild(b testing.TB, tags string) string {
	b.Helper()
	releaseMu.Lock()
	defer releaseMu.Unlock()
	if p, ok := releaseBuilds[tags]; ok {
		return p
	}
	p := filepath.Join(filepath.Dir(binary), "kvrouter-ha-release"+strings.ReplaceAll(tags, ",", "-"))
	out, err := exec.Command("go", "build", "-tags", tags, "-o", p, "github.com/kvrouter-ha/kvrouter-ha/cmd/kvrouter-ha").CombinedOutput()
	if err != nil {
		b.Fatalf("build kvrouter-ha (tags %q): %v\n%s", tags, err, out)
	}
	releaseBuilds[tags] = p
	return p
}

// process runs bin with args until the benchmark ends.
func process(b *testing.B, bin string, args ...string) {
	b.Helper()
	if err := newProcess(b, proc.Spec{Name: args[0], Argv: append([]string{bin}, args...)}).Start(); err != nil {
		b.Fatal(err)
	}
}

// waitHTTP waits until url answers 200.
func waitHTTP(b *testing.B, url string) {
	b.Helper()
	if err := proc.WaitReady(b.Context(), nil, url, 30*time.Second); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkAddedLatencyProcesses is the proxy's added latency as a deployment sees it: the
// simulated worker and the router each run as their own process (their own scheduler and
// threads), and the benchmark is the client. The same request goes straight to the worker
// and through the router, in alternating blocks, one at a time at a fixed rate (a request
// every 2 ms, each from idle), and the percentiles of the two paths are compared. The worker
// is told to answer at once, so the difference is the router's parse, selection and
// proxying, plus one more loopback hop.
func BenchmarkAddedLatencyProcesses(b *testing.B) {
	bin := releaseBinary(b)
	worker := loopbacktest.Addr(b)
	process(b, bin, "sim-worker", "--listen", worker, "--id", "w0", "--speedup", "1000000",
		"--log-level", "error")
	waitHTTP(b, "http://"+worker+"/health")
	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "json", true: "sse"}[stream]
		b.Run(name, func(b *testing.B) {
			router := loopbacktest.Addr(b)
			process(b, bin, "serve", "--listen", router, "--admin-listen", loopbacktest.Addr(b),
				"--raft-listen", loopbacktest.Addr(b), "--peer-listen", loopbacktest.Addr(b),
				"--gossip-listen", loopbacktest.Addr(b), "--data-dir", b.TempDir(),
				"--worker", "w0=http://"+worker, "--log-level", "error")
			waitHTTP(b, "http://"+router+"/readyz")
			body := fmt.Sprintf(`{"model":"sim-model","stream":%v,"max_tokens":4,"prompt":"%s"}`, stream, strings.Repeat("word ", 200))
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
			one := func(base string) time.Duration {
				start := time.Now()
				resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					b.Fatalf("%s: %s", base, resp.Status)
				}
				return time.Since(start)
			}
			// Warm both paths (connections, the router's first routing state).
			for range 200 {
				one("http://" + worker)
				one("http://" + router)
			}
			const block = 4
			var direct, proxied []time.Duration
			next := time.Now()
			i := 0
			for b.Loop() {
				viaRouter := (i/block)%2 == 1
				first := i%block == 0
				i++
				if d := time.Until(next); d > 0 {
					time.Sleep(d)
				}
				next = time.Now().Add(2 * time.Millisecond)
				base := "http://" + worker
				if viaRouter {
					base = "http://" + router
				}
				d := one(base)
				if first {
					continue // what ran just before a block's first request colours it
				}
				if viaRouter {
					proxied = append(proxied, d)
				} else {
					direct = append(direct, d)
				}
			}
			if len(direct) < 10 || len(proxied) < 10 {
				return
			}
			slices.Sort(direct)
			slices.Sort(proxied)
			pct := func(s []time.Duration, p int) time.Duration { return s[len(s)*p/100] }
			b.ReportMetric(float64((pct(proxied, 50) - pct(direct, 50)).Microseconds()), "added-p50-us")
			b.ReportMetric(float64((pct(proxied, 99) - pct(direct, 99)).Microseconds()), "added-p99-us")
			b.ReportMetric(float64(pct(direct, 50).Microseconds()), "direct-p50-us")
		})
	}
}
