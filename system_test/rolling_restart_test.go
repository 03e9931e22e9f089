package system_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// haproxyConfig is the deployment's own HAProxy configuration, relative to this package.
var haproxyConfig = filepath.Join("..", "deploy", "haproxy.cfg")

// startHAProxy validates deploy/haproxy.cfg with the cluster's addresses, then runs it in the
// foreground; it is killed at cleanup. It returns the address clients connect to.
func startHAProxy(t *testing.T, bin string, c *cluster) string {
	t.Helper()
	listen, _ := startHAProxyLogged(t, bin, c)
	return listen
}

// startHAProxyLogged is startHAProxy that also returns the file HAProxy's log goes to (one
// httplog line per request: the server, the status, the retries).
func startHAProxyLogged(t *testing.T, bin string, c *cluster) (listen, logPath string) {
	t.Helper()
	listen = loopbacktest.Addr(t)
	var members []proc.Replica
	for _, r := range c.replicas {
		members = append(members, r.Replica)
	}
	env, err := proc.DeployEnv(listen, members)
	if err != nil {
		t.Fatal(err)
	}
	h := proc.HAProxy{Binary: bin, Config: haproxyConfig, Env: env}
	if err := h.Check(t.Context()); err != nil {
		t.Fatal(err)
	}
	spec := h.Spec()
	spec.LogPath = filepath.Join(t.TempDir(), "haproxy.log")
	if err := newProcess(t, spec).Start(); err != nil {
		t.Fatal(err)
	}
	return listen, spec.LogPath
}

// waitInRotation waits until every replica of c has answered a request through the
// balancer at base.
func waitInRotation(t *testing.T, hc *http.Client, base string, c *cluster) {
	t.Helper()
	seen := map[string]bool{}
	eventually(t, 30*time.Second, func() error {
		rp, err := chatVia(t.Context(), hc, base, "", "warm-up", 4)
		if err == nil && rp.status == http.StatusOK {
			seen[rp.replica] = true
		}
		if len(seen) < len(c.replicas) {
			return fmt.Errorf("replicas answering through haproxy: %v (last: %+v %v)", seen, rp, err)
		}
		return nil
	})
}

// streamVia sends one streamed chat request to base and reads it to the end: nil only when
// it ended with [DONE].
func streamVia(ctx context.Context, hc *http.Client, base, session string, maxTokens int) error {
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"stream for %s"}],"max_tokens":%d,"stream":true}`,
		sim.DefaultModel, session, maxTokens)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if sc.Text() == "data: [DONE]" {
			return nil
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("stream cut: %w", err)
	}
	return errors.New("stream ended without [DONE]")
}

// sample is one non-streaming request of the load.
type sample struct {
	long    bool
	session string
	at      time.Time
	latency time.Duration
	reply   answer
	err     error
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, int(p*float64(len(sorted))))]
}

// TestRollingRestartBehindHAProxyLosesNothing restarts three replicas one by one (SIGTERM,
// wait for the exit, start again on the same data directory and addresses) behind a real
// HAProxy running deploy/haproxy.cfg, under steady load of sessions through HAProxy. The
// drain (/readyz fails first, the port keeps serving for --shutdown-delay, then in-flight
// requests finish) must cost no request and move no session.
func TestRollingRestartBehindHAProxyLosesNothing(t *testing.T) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("haproxy is not in PATH: this test runs the real HAProxy (.ci/run installs it; apt-get install haproxy)")
	}
	fl := startFleet(t, 4)
	// 2s is above what deploy/haproxy.cfg's checks need to take a replica out (inter 1s,
	// fastinter 250ms, fall 2).
	c := startCluster(t, 3, fl, "--shutdown-delay", "2s", "--shutdown-timeout", "20s")
	base := "http://" + startHAProxy(t, bin, c)
	tr := &http.Transport{MaxIdleConnsPerHost: 16}
	t.Cleanup(tr.CloseIdleConnections)
	hc := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	ctx := t.Context()

	// Every replica is in HAProxy's rotation before the load starts.
	waitInRotation(t, hc, base, c)

	// Bind the sessions through HAProxy; from here on each must keep its worker and revision.
	sessions := sessionNames("roll", 50)
	bound := map[string]answer{}
	for _, s := range sessions {
		rp, err := chatVia(ctx, hc, base, s, "first turn of "+s, 4)
		if err != nil || rp.status != http.StatusOK || rp.worker == "" || rp.revision == 0 {
			t.Fatalf("binding %s through haproxy: %+v %v", s, rp, err)
		}
		bound[s] = rp
	}

	// Steady load until the restarts are over, bounded in count and time: a few clients of
	// short answers (4 tokens, about 40 ms) and one of long ones (300 tokens, about 3 s: longer
	// than the shutdown delay, so some are still running on a replica when its port closes).
	const clients, maxRequests = 5, 20000
	loadCtx, stopLoad := context.WithTimeout(ctx, 75*time.Second)
	defer stopLoad()
	var (
		mu      sync.Mutex
		samples []sample
		wg      sync.WaitGroup
	)
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 7))
			for turn := 0; loadCtx.Err() == nil; turn++ {
				s := sessions[rng.IntN(len(sessions))]
				long := i == clients-1
				tokens := 4
				if long {
					tokens = 300
				}
				start := time.Now()
				rp, err := chatVia(context.Background(), hc, base, s, fmt.Sprintf("turn %d of %s by client %d", turn, s, i), tokens)
				mu.Lock()
				samples = append(samples, sample{long: long, session: s, at: start, latency: time.Since(start), reply: rp, err: err})
				full := len(samples) >= maxRequests
				mu.Unlock()
				if full {
					return
				}
			}
		}()
	}
	// A few streams alongside (400 tokens, about 4 s), reported rather than asserted.
	var (
		streamsOK  int
		streamErrs []string
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 0; loadCtx.Err() == nil && n < 40; n++ {
			err := streamVia(context.Background(), hc, base, sessions[n%len(sessions)], 400)
			mu.Lock()
			if err != nil {
				streamErrs = append(streamErrs, err.Error())
			} else {
				streamsOK++
			}
			mu.Unlock()
		}
	}()

	// servedBy reports whether a request of the load that started after t0 was answered by
	// replica id.
	servedBy := func(id string, t0 time.Time) bool {
		mu.Lock()
		defer mu.Unlock()
		for _, sm := range slices.Backward(samples) {
			if sm.err == nil && sm.reply.status == http.StatusOK && sm.reply.replica == id && sm.at.After(t0) {
				return true
			}
		}
		return false
	}

	leader := c.leader()
	t.Logf("restarting r0, r1, r2 in turn; %s leads", leader.ID)
	restartsBegin := time.Now()
	var outFor []string
	for _, r := range c.replicas {
		oldPid := r.proc.PID()
		// Straight to the replica, not through HAProxy: a long request and a stream that are
		// surely running on it when its port closes, which the drain must let finish.
		s := sessions[len(outFor)]
		pinned := make(chan sample, 1)
		go func() {
			start := time.Now()
			rp, err := chatVia(context.Background(), hc, "http://"+r.Client, s, "pinned to "+r.ID, 300)
			pinned <- sample{long: true, session: s, at: start, latency: time.Since(start), reply: rp, err: err}
		}()
		pinnedStream := make(chan error, 1)
		go func() { pinnedStream <- streamVia(context.Background(), hc, "http://"+r.Client, s, 400) }()
		stopped := time.Now()
		c.signal(r, syscall.SIGTERM)
		select {
		case <-r.proc.Done():
		case <-time.After(60 * time.Second):
			t.Fatalf("%s did not exit within 60s of SIGTERM", r.ID)
		}
		exited := time.Now()
		for range 2 {
			select {
			case sm := <-pinned:
				mu.Lock()
				samples = append(samples, sm)
				mu.Unlock()
			case err := <-pinnedStream:
				mu.Lock()
				if err != nil {
					streamErrs = append(streamErrs, fmt.Sprintf("pinned to %s: %v", r.ID, err))
				} else {
					streamsOK++
				}
				mu.Unlock()
			case <-time.After(30 * time.Second):
				t.Fatalf("a request pinned to %s did not end within 30s of its exit", r.ID)
			}
		}
		if code := r.proc.ExitCode(); code != 0 {
			t.Fatalf("%s exited with status %d after SIGTERM, want 0 (a clean drain)", r.ID, code)
		}
		c.start(r)
		if r.proc.PID() == oldPid {
			t.Fatalf("%s: the new process has the old pid %d", r.ID, oldPid)
		}
		c.waitReady(r)
		// Back in HAProxy's rotation: the load reaches the new process.
		eventually(t, 30*time.Second, func() error {
			if !servedBy(r.ID, exited) {
				return fmt.Errorf("no request through haproxy answered by the restarted %s yet", r.ID)
			}
			return nil
		})
		back := time.Now()
		outFor = append(outFor, fmt.Sprintf("%s %s (drain to exit %s)", r.ID,
			back.Sub(stopped).Round(10*time.Millisecond), exited.Sub(stopped).Round(10*time.Millisecond)))
	}
	restartsEnd := time.Now()
	stopLoad()
	wg.Wait()

	var (
		failures, moved []string
		during          []time.Duration
		long            int
		perReplica      = map[string]int{}
	)
	for _, sm := range samples {
		switch {
		case sm.err != nil:
			failures = append(failures, fmt.Sprintf("%s at +%s: %v", sm.session, sm.at.Sub(restartsBegin).Round(time.Millisecond), sm.err))
			continue
		case sm.reply.status != http.StatusOK:
			failures = append(failures, fmt.Sprintf("%s at +%s via %s: status %d %s", sm.session,
				sm.at.Sub(restartsBegin).Round(time.Millisecond), sm.reply.replica, sm.reply.status, strings.TrimSpace(sm.reply.body)))
			continue
		}
		perReplica[sm.reply.replica]++
		if b := bound[sm.session]; sm.reply.worker != b.worker || sm.reply.revision != b.revision {
			moved = append(moved, fmt.Sprintf("%s via %s: %s rev %d, bound to %s rev %d", sm.session, sm.reply.replica,
				sm.reply.worker, sm.reply.revision, b.worker, b.revision))
		}
		if sm.long {
			long++
		} else if !sm.at.Before(restartsBegin) && sm.at.Before(restartsEnd) {
			during = append(during, sm.latency)
		}
	}
	slices.Sort(during)
	t.Logf("requests: %d non-streaming (%d of them long; %d short ones during the restarts), %d failed, %d answered by a worker other than the session's; per replica %v",
		len(samples), long, len(during), len(failures), len(moved), perReplica)
	t.Logf("short requests' latency during the restarts: p50 %s, p99 %s, max %s", percentile(during, 0.50).Round(time.Millisecond),
		percentile(during, 0.99).Round(time.Millisecond), percentile(during, 1).Round(time.Millisecond))
	t.Logf("each replica out (SIGTERM to serving through haproxy again): %s", strings.Join(outFor, ", "))
	t.Logf("streams (reported, not asserted): %d completed, %d failed %v", streamsOK, len(streamErrs), streamErrs)
	if len(during) == 0 {
		t.Fatal("no request was sent during the restarts: the test proved nothing")
	}
	if len(failures) > 0 {
		t.Errorf("%d of %d requests failed across the rolling restart; first: %s", len(failures), len(samples), strings.Join(failures[:min(5, len(failures))], "; "))
	}
	if len(moved) > 0 {
		t.Errorf("%d answers came from a worker or revision other than the session's binding; first: %s", len(moved), strings.Join(moved[:min(5, len(moved))], "; "))
	}
}
