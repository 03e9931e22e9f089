package system_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fault is one fault of the scenario, from its first injection (at) to the start of the
// next; hits are the spans in which it struck a replica (from just before the signal to the
// moment it took effect: the process reaped after SIGKILL, exited after SIGTERM).
type fault struct {
	name string
	at   time.Time
	hits []span
}

type span struct{ from, to time.Time }

// hit runs strike (which returns once it took effect) and records its span.
func (f *fault) hit(strike func()) {
	from := time.Now()
	strike()
	f.hits = append(f.hits, span{from, time.Now()})
}

// inFlightAt reports whether a request that ran from start to end was running when the
// fault struck.
func (f *fault) inFlightAt(start, end time.Time) bool {
	for _, h := range f.hits {
		if start.Before(h.to) && end.After(h.from) {
			return true
		}
	}
	return false
}

// timedSample is one request of the load and when it ended.
type timedSample struct {
	sample
	end time.Time
}

// TestFaultsBehindHAProxyFailOnlyRequestsInFlightOnTheFaultedReplica runs three replicas
// behind a real HAProxy on deploy/haproxy.cfg under steady load of chat requests, with and
// without sessions, and injects in turn: a pause of the leader (SIGSTOP, the system tests'
// stand-in for a partition: the leader is gone to the others, and when it comes back it is
// cut off until it hears of the new leader, refusing what waited in its queue), a rolling
// SIGTERM restart of all three, and a SIGKILL of the leader (restarted after). Every request
// must succeed except those in flight on the faulted replica at the instant it was hit; a
// replica's refusal (503 before any worker) is retried by HAProxy on another replica. The
// log reports failures by class per fault, the refusals the replicas answered, and the
// requests HAProxy retried.
func TestFaultsBehindHAProxyFailOnlyRequestsInFlightOnTheFaultedReplica(t *testing.T) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("haproxy is not in PATH: this test runs the real HAProxy (.ci/run installs it; apt-get install haproxy)")
	}
	fl := startFleet(t, 4)
	// 2s is above what deploy/haproxy.cfg's checks need to take a draining replica out.
	// Elections are slow (1.5 s timeouts: a loaded machine, or replicas far apart), so that
	// one outlasts HAProxy's checks (fall 2, fastinter 250ms) whatever the machine's load:
	// every replica is without a lease meanwhile, and none may leave the rotation for it
	// (before, all three did, and HAProxy answered its own 503 until the election was over).
	// --bind-wait is above such an election.
	c := startCluster(t, 3, fl, "--shutdown-delay", "2s", "--shutdown-timeout", "20s",
		"--raft-heartbeat-timeout", "1500ms", "--raft-election-timeout", "1500ms", "--bind-wait", "8s")
	lb, lbLog := startHAProxyLogged(t, bin, c)
	base := "http://" + lb
	tr := &http.Transport{MaxIdleConnsPerHost: 16}
	t.Cleanup(tr.CloseIdleConnections)
	hc := &http.Client{Transport: tr, Timeout: 60 * time.Second}
	ctx := t.Context()
	waitInRotation(t, hc, base, c)

	sessions := sessionNames("fault", 40)
	for _, s := range sessions {
		if rp, err := chatVia(ctx, hc, base, s, "first turn of "+s, 4); err != nil || rp.status != http.StatusOK {
			t.Fatalf("binding %s through haproxy: %+v %v", s, rp, err)
		}
	}

	// Steady load, bounded in count and time: short answers (4 tokens) with a session and
	// without, and one client of long ones (300 tokens, about 3 s) so that requests are
	// running on a replica when it is hit.
	const clients, maxRequests = 6, 30000
	loadCtx, stopLoad := context.WithTimeout(ctx, 150*time.Second)
	defer stopLoad()
	var (
		mu      sync.Mutex
		samples []timedSample
		wg      sync.WaitGroup
	)
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 29))
			for turn := 0; loadCtx.Err() == nil; turn++ {
				s := sessions[rng.IntN(len(sessions))]
				if i%3 == 1 {
					s = "" // no session: routed by the cache and the load alone
				}
				tokens := 4
				if i == clients-1 {
					tokens = 300
				}
				start := time.Now()
				rp, err := chatVia(context.Background(), hc, base, s, fmt.Sprintf("turn %d of %q by client %d", turn, s, i), tokens)
				end := time.Now()
				mu.Lock()
				samples = append(samples, timedSample{sample{long: tokens > 4, session: s, at: start, latency: end.Sub(start), reply: rp, err: err}, end})
				full := len(samples) >= maxRequests
				mu.Unlock()
				if full {
					return
				}
			}
		}()
	}
	// servedSince counts the load's requests started after t0 that replica id (any, if
	// empty) answered.
	servedSince := func(id string, t0 time.Time) int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, sm := range samples {
			if sm.err == nil && sm.reply.status == http.StatusOK && (id == "" || sm.reply.replica == id) && sm.at.After(t0) {
				n++
			}
		}
		return n
	}
	// backInRotation waits until r is ready and answers the load through HAProxy again.
	backInRotation := func(r *replica, since time.Time) {
		c.waitReady(r)
		eventually(t, 30*time.Second, func() error {
			if servedSince(r.ID, since) == 0 {
				return fmt.Errorf("no request through haproxy answered by %s since it came back", r.ID)
			}
			return nil
		})
	}
	// othersServe waits until the replicas other than r have a leader and have answered
	// requests of the load started after t0.
	othersServe := func(r *replica, t0 time.Time) {
		c.leaderAmong(c.others(r))
		eventually(t, 30*time.Second, func() error {
			if n := servedSince("", t0); n < 20 {
				return fmt.Errorf("%d requests answered since the fault on %s, want 20", n, r.ID)
			}
			return nil
		})
	}
	// A few seconds of load before the first fault.
	eventually(t, 30*time.Second, func() error {
		if n := servedSince("", time.Time{}); n < 50 {
			return fmt.Errorf("%d requests answered, want 50 before the faults", n)
		}
		return nil
	})

	var faults []*fault
	// 1. The leader paused (partition stand-in), then resumed.
	leader := c.leader()
	f := &fault{name: "leader paused (SIGSTOP) then resumed", at: time.Now()}
	faults = append(faults, f)
	f.hit(func() { c.signal(leader, syscall.SIGSTOP) })
	othersServe(leader, f.at)
	// Held until HAProxy's checks have taken it out, as a partition lasts: what HAProxy sent
	// it meanwhile waits in its queue and meets a replica cut off from the new leader.
	eventually(t, 30*time.Second, func() error {
		b, err := os.ReadFile(lbLog)
		if err != nil || !strings.Contains(string(b), "replicas/"+leader.ID+" is DOWN") {
			return fmt.Errorf("haproxy has not taken the paused %s out (%v)", leader.ID, err)
		}
		return nil
	})
	c.signal(leader, syscall.SIGCONT)
	resumed := time.Now()
	backInRotation(leader, resumed)
	t.Logf("%s led; paused for %s (until HAProxy took it out)", leader.ID, resumed.Sub(f.at).Round(10*time.Millisecond))

	// 2. A rolling SIGTERM restart of all three.
	f = &fault{name: "rolling restart (SIGTERM)", at: time.Now()}
	faults = append(faults, f)
	for _, r := range c.replicas {
		hung := false
		f.hit(func() {
			c.signal(r, syscall.SIGTERM)
			select {
			case <-r.proc.Done():
			case <-time.After(60 * time.Second):
				// Seen once in CI, on the replica paused and resumed just before: its shutdown
				// stopped after "stopping background loops, gossip and the Raft node". What this
				// test measures is the requests, so it goes on; the goroutines go to the log
				// (SIGQUIT) for the hang's own diagnosis.
				hung = true
				t.Logf("KNOWN ISSUE: %s did not exit within 60s of SIGTERM; its goroutines (SIGQUIT) are at the end of its log", r.ID)
				c.signal(r, syscall.SIGQUIT)
				select {
				case <-r.proc.Done():
				case <-time.After(10 * time.Second):
					c.kill(r)
					<-r.proc.Done()
				}
				lg := r.log()
				t.Logf("%s log, last 60000 bytes:\n%s", r.ID, lg[max(0, len(lg)-60000):])
			}
		})
		if code := r.proc.ExitCode(); code != 0 && !hung {
			lg := r.log()
			i := strings.Index(lg, "gave up waiting for a part to close")
			if i < 0 {
				t.Fatalf("%s exited with status %d after SIGTERM, want 0 (a clean drain)", r.ID, code)
			}
			// The same hang, bounded now by --shutdown-timeout: the replica names the part
			// it gave up on, with every goroutine's stack, and exits with status 1.
			t.Logf("KNOWN ISSUE: %s gave up closing a part after SIGTERM (status %d); its log from there:\n%s", r.ID, code, lg[i:min(len(lg), i+60000)])
		}
		exited := time.Now()
		c.start(r)
		backInRotation(r, exited)
	}

	// 3. The leader killed (SIGKILL), then started again.
	leader = c.leader()
	f = &fault{name: "leader killed (SIGKILL)", at: time.Now()}
	faults = append(faults, f)
	f.hit(func() { c.kill(leader) })
	killed := time.Now()
	othersServe(leader, killed)
	c.start(leader)
	backInRotation(leader, killed)
	t.Logf("%s led when killed", leader.ID)
	// A little load after the last fault.
	last := time.Now()
	eventually(t, 30*time.Second, func() error {
		if n := servedSince("", last); n < 50 {
			return fmt.Errorf("%d requests answered since the last fault, want 50", n)
		}
		return nil
	})
	stopLoad()
	wg.Wait()

	// Failures by fault and class.
	type tally struct {
		total, ok       int
		inFlight, other []string
	}
	tallies := make([]tally, len(faults))
	var before tally
	for _, sm := range samples {
		tl := &before
		for i, f := range faults {
			if !sm.at.Before(f.at) {
				tl = &tallies[i]
			}
		}
		tl.total++
		failed := ""
		switch {
		case sm.err != nil:
			failed = sm.err.Error()
		case sm.reply.status != http.StatusOK:
			failed = fmt.Sprintf("status %d via %q: %s", sm.reply.status, sm.reply.replica, strings.TrimSpace(sm.reply.body))
		}
		if failed == "" {
			tl.ok++
			continue
		}
		inFlight := false
		for i, f := range faults {
			if f.inFlightAt(sm.at, sm.end) {
				inFlight, tl = true, &tallies[i]
			}
		}
		what := fmt.Sprintf("%q (%d tokens) %s to %s: %s", sm.session, map[bool]int{false: 4, true: 300}[sm.long],
			sm.at.Format("15:04:05.000"), sm.end.Format("15:04:05.000"), failed)
		if inFlight {
			tl.inFlight = append(tl.inFlight, what)
			continue
		}
		tl.other = append(tl.other, what)
	}
	refused, retried := refusalsIn(c), haproxyRetries(t, lbLog)
	t.Logf("before the faults: %d requests, %d failed", before.total, before.total-before.ok)
	var others []string
	for i, f := range faults {
		tl := tallies[i]
		t.Logf("%s: %d requests started, %d of them ok; failed: %d in flight on the faulted replica as it struck %v, %d otherwise",
			f.name, tl.total, tl.ok, len(tl.inFlight), tl.inFlight, len(tl.other))
		for _, o := range tl.other {
			others = append(others, f.name+": "+o)
		}
	}
	t.Logf("refusals the replicas answered (503 before any worker), by replica: %v; requests HAProxy retried on another replica: %d (%d retries)",
		refused, retried.requests, retried.retries)
	t.Logf("haproxy's lines of requests retried or not answered 200 (first %d):\n%s", len(retried.notable), strings.Join(retried.notable, "\n"))
	if before.total != before.ok {
		t.Errorf("%d requests failed before any fault", before.total-before.ok)
	}
	if len(others) > 0 {
		t.Errorf("%d requests failed that were not in flight on a faulted replica; first: %s", len(others), strings.Join(others[:min(8, len(others))], "; "))
	}
}

// refusalsIn counts, per replica, the refusals its log reports (a 503 answered before any
// worker), over all its processes.
func refusalsIn(c *cluster) map[string]int {
	out := map[string]int{}
	for _, r := range c.replicas {
		for _, line := range strings.Split(r.log(), "\n") {
			if strings.Contains(line, "request failed") && strings.Contains(line, "status=503") {
				out[r.ID]++
			}
		}
	}
	return out
}

// haproxyLine matches an httplog line's status and connection counts, whose last field is
// the request's retries ("+N" when it was redispatched to another server).
var haproxyLine = regexp.MustCompile(` (\d{3}) .* (\d+/){4}\+?(\d+) \d+/\d+ "`)

// retryCount is what an HAProxy log says it retried, and its lines of requests retried or
// not answered 200 (the first few).
type retryCount struct {
	requests, retries int
	notable           []string
}

// haproxyRetries reads HAProxy's log at path.
func haproxyRetries(t *testing.T, path string) retryCount {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Errorf("haproxy log: %v", err)
		return retryCount{}
	}
	var rc retryCount
	for _, line := range strings.Split(string(b), "\n") {
		m := haproxyLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		n, _ := strconv.Atoi(m[3])
		if n > 0 {
			rc.requests++
			rc.retries += n
		}
		if (n > 0 || m[1] != "200") && len(rc.notable) < 40 {
			rc.notable = append(rc.notable, line)
		}
	}
	return rc
}
