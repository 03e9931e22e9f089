package system_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// TestALeaderCutOffFromItsQuorumRefusesANewSessionBeforeAnyWorkerSeesIt: a leader whose
// followers stop answering (SIGSTOP both: its quorum is gone) keeps its read lease until it
// steps down, so a new session's first request still passes its fence. Once the leader's
// contact with its quorum is stale (kvrouter_raft_quorum_contact_age_seconds past 0.2 x the
// heartbeat timeout) and while it still leads, such a request is bound before any worker is
// asked: the bind cannot commit, so the answer is a refusal (503, X-Kvrouter-Refused:
// bind_failed, Retry-After) that a load balancer retries on another replica, and no worker
// saw the request. (Before, the binding was proposed beside the worker's prefill: the worker
// ran the request and the client got a 502 after --bind-wait, which must not be retried.)
//
// The window is made wide rather than raced: heartbeats every 0.2-0.4 s (a 2 s heartbeat
// timeout) make contact stale 0.4 s after the stop, and the leader steps down only after its
// 2 s leader lease (up to twice that); --stale-bound 60s keeps the read lease granted before
// the stop valid until then. The refusal's reason proves the request met the window (a
// request that came after the step-down is refused for the lost lease instead); a scenario
// that missed it is run again, at most three times.
//
// With --bind-before-dispatch every new session binds first, so the request is sent the
// moment the followers stop, while the leader's contact is still fresh: the same refusal.
func TestALeaderCutOffFromItsQuorumRefusesANewSessionBeforeAnyWorkerSeesIt(t *testing.T) {
	for _, tc := range []struct {
		name string
		// waitStale: send once the leader's quorum contact is past the bound (else at once).
		waitStale bool
		args      []string
	}{
		{"contact stale", true, nil},
		{"bind before dispatch", false, []string{"--bind-before-dispatch"}},
	} {
		t.Run(tc.name, func(t *testing.T) { cutOffLeaderRefusesANewSession(t, tc.waitStale, tc.args...) })
	}
}

// cutOffLeaderRefusesANewSession runs the scenario above: a new session's first request to a
// leader whose followers were stopped, sent once its contact is stale (waitStale) or at once.
func cutOffLeaderRefusesANewSession(t *testing.T, waitStale bool, args ...string) {
	const contactBound = 400 * time.Millisecond // 0.2 x --raft-heartbeat-timeout
	fl := startFleet(t, 2)
	c := startCluster(t, 3, fl, append([]string{"--raft-heartbeat-timeout", "2s", "--raft-election-timeout", "2s",
		"--raft-leader-lease-timeout", "2s", "--stale-bound", "60s", "--bind-wait", "3s"}, args...)...)
	seen := func() uint64 {
		var n uint64
		for _, w := range fl.sims {
			st := w.Stats()
			n += st.Served + st.Aborted + st.Failed + st.WrongModel
		}
		return n
	}
	for try := 1; ; try++ {
		leader := c.leader()
		followers := c.others(leader)
		c.waitReady(leader)
		// A request through the leader first: its read lease holds.
		if a, err := chat(t.Context(), leader, fmt.Sprintf("warm-%d", try), "warm up"); err != nil || a.status != http.StatusOK {
			t.Fatalf("warm-up through %s: %+v %v", leader.ID, a, err)
		}
		for _, r := range followers {
			c.signal(r, syscall.SIGSTOP)
		}
		resumed := false
		resume := func() {
			if !resumed {
				resumed = true
				for _, r := range followers {
					_ = r.proc.Resume()
				}
			}
		}
		t.Cleanup(resume)
		var age float64
		eventually(t, 20*time.Second, func() error {
			v, err := metricValue(t.Context(), leader, "kvrouter_raft_quorum_contact_age_seconds")
			if err != nil {
				return err
			}
			if age = v; waitStale && v <= contactBound.Seconds() {
				return fmt.Errorf("the leader's quorum contact is %.3fs old, not past %s yet", v, contactBound)
			}
			return nil
		})
		before := seen()
		session := fmt.Sprintf("cut-off-first-turn-%d", try)
		sent := time.Now()
		status, refused, retryAfter, body, err := chatHeaders(t.Context(), leader, session)
		took := time.Since(sent)
		if err != nil {
			t.Fatalf("new session through the cut-off leader: %v", err)
		}
		after := seen()
		t.Logf("try %d: quorum contact %.3fs old when sent; answered %d (refused %q) after %s", try, age, status, refused, took.Round(time.Millisecond))
		if after != before {
			t.Fatalf("a worker saw the new session's request on the cut-off leader (%d requests before, %d after); answer %d %s", before, after, status, body)
		}
		if status == http.StatusServiceUnavailable && refused != "bind_failed" && refused != "" && try < 3 {
			// Refused for the lease: the leader had stepped down before the request came.
			t.Logf("try %d missed the window (refused %q): again", try, refused)
			resume()
			continue
		}
		if status != http.StatusServiceUnavailable || refused != "bind_failed" || retryAfter == "" {
			t.Fatalf("new session through the cut-off leader: %d, X-Kvrouter-Refused %q, Retry-After %q: %s; want 503, bind_failed and a Retry-After", status, refused, retryAfter, body)
		}
		resume()
		return
	}
}

// chatHeaders sends one new chat request with a session key straight to a replica and
// returns its status, its X-Kvrouter-Refused and Retry-After headers and its body.
func chatHeaders(ctx context.Context, r *replica, session string) (status int, refused, retryAfter, body string, err error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	b := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"first turn of %s"}],"max_tokens":4}`, sim.DefaultModel, session)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.Client+"/v1/chat/completions", strings.NewReader(b))
	if err != nil {
		return 0, "", "", "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, "", "", "", err
	}
	defer resp.Body.Close()
	rb, err := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("X-Kvrouter-Refused"), resp.Header.Get("Retry-After"), string(rb), err
}
