package system_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// What a client of a killed replica sees, as TestAClientOfAKilledReplicaSeesWhatTheBalancerCanRetry
// counts it.
const (
	outcomeOK        = "ok"
	outcomeRefused   = "connection refused"
	outcomeNoAnswer  = "no answer (EOF or reset before headers)"
	outcomeTruncated = "truncated (200, then cut)"
)

// deathProbe is one request of the test and what its client saw.
type deathProbe struct {
	via     string // "direct" or "haproxy"
	stream  bool
	replica string // X-Kvrouter-Replica of the answer ("" without one)
	outcome string
}

// sendProbe sends one chat request (streamed or not, maxTokens long) to base and classifies how
// it ended. first is called once, when the request is under way on a worker as far as the
// client can tell: a stream's first event, a non-stream's request written (or on any failure).
func sendProbe(ctx context.Context, hc *http.Client, base string, stream bool, maxTokens int, first func()) (outcome, replica string) {
	var once sync.Once
	done := func() { once.Do(first) }
	defer done()
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"death probe"}],"max_tokens":%d,"stream":%t}`,
		sim.DefaultModel, maxTokens, stream)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return "build: " + err.Error(), ""
	}
	req.Header.Set("Content-Type", "application/json")
	if !stream {
		req = req.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
			WroteRequest: func(httptrace.WroteRequestInfo) { done() },
		}))
	}
	resp, err := hc.Do(req)
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return outcomeRefused, ""
	case err != nil && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)):
		return outcomeNoAnswer, ""
	case err != nil:
		return "error: " + err.Error(), ""
	}
	defer resp.Body.Close()
	replica = resp.Header.Get("X-Kvrouter-Replica")
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return fmt.Sprintf("status %d", resp.StatusCode), replica
	}
	if !stream {
		if _, err := io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<20)); err != nil {
			return outcomeTruncated, replica
		}
		return outcomeOK, replica
	}
	sc := bufio.NewScanner(resp.Body)
	for lines := 0; sc.Scan() && lines < 100_000; lines++ {
		if strings.HasPrefix(sc.Text(), "data:") {
			done()
		}
		if sc.Text() == "data: [DONE]" {
			return outcomeOK, replica
		}
	}
	return outcomeTruncated, replica
}

// TestAClientOfAKilledReplicaSeesWhatTheBalancerCanRetry measures what clients of a replica see
// when it is SIGKILLed with requests in flight, streamed and not, sent straight to it and
// through HAProxy running deploy/haproxy.cfg, and then what requests sent right after the kill
// see. The counts are logged (the README's "When a replica dies" section states them); the
// test holds each kind of client to the one outcome the measurement found:
//
//   - in flight, straight to the replica: a stream is cut after its 200 (truncated), a
//     non-stream gets no answer at all (EOF or reset before any header);
//   - in flight through HAProxy on the killed replica: the same cut stream, and a non-stream
//     gets HAProxy's 502, or rarely no answer (the replica had read it: retry-on
//     conn-failure does not replay it);
//   - sent after the kill, straight to it: connection refused; through HAProxy: answered by
//     another replica (the refused connection is retried elsewhere), none lost.
func TestAClientOfAKilledReplicaSeesWhatTheBalancerCanRetry(t *testing.T) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("haproxy is not in PATH: this test runs the real HAProxy (apt-get install haproxy)")
	}
	fl := startFleet(t, 3)
	c := startCluster(t, 3, fl)
	base := "http://" + startHAProxy(t, bin, c)
	tr := &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	hc := &http.Client{Transport: tr, Timeout: 60 * time.Second}
	ctx := t.Context()

	// Every replica in HAProxy's rotation first.
	seen := map[string]bool{}
	eventually(t, 30*time.Second, func() error {
		if out, r := sendProbe(ctx, hc, base, false, 2, func() {}); out == outcomeOK {
			seen[r] = true
		}
		if len(seen) < len(c.replicas) {
			return fmt.Errorf("replicas answering through haproxy: %v", seen)
		}
		return nil
	})
	// A follower dies: the leader's death adds an election, which changes nothing of what a
	// client of the dead replica sees but delays new bindings elsewhere.
	leader := c.leader()
	victim := c.others(leader)[0]
	direct := "http://" + victim.Client

	// Long requests (400 tokens, about 4 s at the simulator's 10 ms a token), all under way
	// on a worker before the kill.
	const perKind, viaLB, tokens = 5, 9, 400
	var (
		mu      sync.Mutex
		probes  []deathProbe
		wg      sync.WaitGroup
		started sync.WaitGroup
	)
	launch := func(via, target string, stream bool) {
		started.Add(1)
		wg.Go(func() {
			out, r := sendProbe(ctx, hc, target, stream, tokens, started.Done)
			mu.Lock()
			probes = append(probes, deathProbe{via: via, stream: stream, replica: r, outcome: out})
			mu.Unlock()
		})
	}
	for range perKind {
		launch("direct", direct, true)
		launch("direct", direct, false)
	}
	for range viaLB {
		launch("haproxy", base, true)
		launch("haproxy", base, false)
	}
	started.Wait()
	total := 2*perKind + 2*viaLB
	eventually(t, 20*time.Second, func() error {
		running := 0
		for _, s := range fl.sims {
			running += s.Stats().Running
		}
		if running < total {
			return fmt.Errorf("%d of %d requests running on the workers", running, total)
		}
		return nil
	})
	c.kill(victim)
	t.Logf("killed %s (a follower) with %d requests in flight", victim.ID, total)

	// Right after the kill, before HAProxy's checks (inter 1s, fall 2) take it out.
	var after []deathProbe
	for range perKind {
		out, r := sendProbe(ctx, hc, direct, false, 2, func() {})
		after = append(after, deathProbe{via: "direct", replica: r, outcome: out})
	}
	for range 2 * perKind {
		out, r := sendProbe(ctx, hc, base, false, 2, func() {})
		after = append(after, deathProbe{via: "haproxy", replica: r, outcome: out})
	}
	wg.Wait()

	count := map[string]int{}
	key := func(phase string, p deathProbe) string {
		kind := "non-stream"
		if p.stream {
			kind = "stream"
		}
		return fmt.Sprintf("%-9s %-7s %-10s %s", phase, p.via, kind, p.outcome)
	}
	for _, p := range probes {
		count[key("in flight", p)]++
		switch {
		case p.via == "direct" && p.stream && p.outcome != outcomeTruncated,
			p.via == "direct" && !p.stream && p.outcome != outcomeNoAnswer:
			t.Errorf("in flight straight to the killed replica: %+v", p)
		case p.via == "haproxy" && p.stream && p.replica == victim.ID && p.outcome != outcomeTruncated,
			p.via == "haproxy" && p.stream && p.replica != victim.ID && p.outcome != outcomeOK,
			p.via == "haproxy" && !p.stream && !slices.Contains([]string{outcomeOK, "status 502", outcomeNoAnswer}, p.outcome):
			t.Errorf("in flight through haproxy: %+v", p)
		}
	}
	for _, p := range after {
		count[key("after", p)]++
		if (p.via == "direct" && p.outcome != outcomeRefused) || (p.via == "haproxy" && (p.outcome != outcomeOK || p.replica == victim.ID)) {
			t.Errorf("sent after the kill: %+v", p)
		}
	}
	keys := make([]string, 0, len(count))
	for k := range count {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "  %3d  %s\n", count[k], k)
	}
	t.Logf("what clients of the killed replica saw (phase, path, kind, outcome):\n%s", b.String())
}
