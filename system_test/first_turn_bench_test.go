package system_test

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
)

// BenchmarkFirstTurnTTFTOneAgainstThreeReplicas is a new session's time to first byte
// through one replica and through three (round-robin over them, so two thirds of the
// binds are forwarded to the leader), side by side: the same simulated worker (its own
// process, 50 us of prefill per prompt token), release builds of the router, new sessions
// one at a time with prompts no cache holds (about 50 ms of prefill each), in alternating
// blocks of four. It reports each path's p50, p90 and p99 and the three replicas' p90
// over the one's: a first turn's Bind is a Raft quorum write, which runs beside the
// worker's prefill, so that ratio should stay near 1. Timings are reported, not asserted.
func BenchmarkFirstTurnTTFTOneAgainstThreeReplicas(b *testing.B) {
	bin := releaseBinary(b)
	worker := loopbacktest.Addr(b)
	process(b, bin, "sim-worker", "--listen", worker, "--id", "w0", "--prefill-per-token", "50us",
		"--decode-per-token", "1ms", "--log-level", "error")
	waitHTTP(b, "http://"+worker+"/health")
	workers := []string{"w0=http://" + worker}
	one := startClusterOf(b, bin, 1, workers, "--log-level", "error")
	three := startClusterOf(b, bin, 3, workers, "--log-level", "error")
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}, Timeout: time.Minute}
	words := strings.Repeat("word ", 1000)
	n := 0
	ttft := func(r *replica) time.Duration {
		n++
		session := fmt.Sprintf("first-turn-%d", n)
		// The session's name opens the prompt, so no prompt shares a cached prefix.
		body := fmt.Sprintf(`{"model":"sim-model","stream":true,"max_tokens":2,"messages":[{"role":"user","content":"%s %s"}]}`, session, words)
		req, err := http.NewRequestWithContext(b.Context(), http.MethodPost, "http://"+r.Client+"/v1/chat/completions", strings.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Session-ID", session)
		start := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("%s via %s: %s", session, r.ID, resp.Status)
		}
		buf := make([]byte, 512)
		for {
			k, err := resp.Body.Read(buf)
			if k > 0 {
				break
			}
			if err != nil {
				b.Fatalf("%s via %s: no body: %v", session, r.ID, err)
			}
		}
		took := time.Since(start)
		_, _ = io.Copy(io.Discard, resp.Body)
		return took
	}
	// Warm both paths (connections, the leader's first binds).
	for i := range 12 {
		ttft(one.replicas[0])
		ttft(three.replicas[i%3])
	}
	const block = 4
	var x1, x3 []time.Duration
	i := 0
	for b.Loop() {
		viaThree := (i/block)%2 == 1
		if viaThree {
			x3 = append(x3, ttft(three.replicas[i%3]))
		} else {
			x1 = append(x1, ttft(one.replicas[0]))
		}
		i++
	}
	if len(x1) < 10 || len(x3) < 10 {
		return
	}
	slices.Sort(x1)
	slices.Sort(x3)
	pct := func(s []time.Duration, p int) float64 { return float64(s[(len(s)-1)*p/100].Microseconds()) / 1000 }
	for _, p := range []int{50, 90, 99} {
		b.ReportMetric(pct(x1, p), fmt.Sprintf("x1-p%d-ms", p))
		b.ReportMetric(pct(x3, p), fmt.Sprintf("x3-p%d-ms", p))
	}
	b.ReportMetric(pct(x3, 90)/pct(x1, 90), "x3/x1-p90")
	b.Logf("%d first turns through one replica, %d through three", len(x1), len(x3))
}
