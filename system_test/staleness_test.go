package system_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// invalidate drops a session's binding through r's admin API (the write goes through the leader).
func (r *replica) invalidate(session string) error {
	req, err := http.NewRequest(http.MethodDelete, "http://"+r.Admin+"/admin/sessions/"+session, nil)
	if err != nil {
		return err
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		return nil
	case http.StatusNotFound:
		return fmt.Errorf("DELETE /admin/sessions/%s on %s: %w", session, r.ID, errNoBinding)
	}
	return fmt.Errorf("DELETE /admin/sessions/%s on %s: status %d", session, r.ID, resp.StatusCode)
}

// errNoBinding is invalidate's answer for a session with no binding (404).
var errNoBinding = errors.New("no binding (404)")

// chatTo sends one non-streaming chat request for session to r, optionally naming a worker
// (X-Target-Worker), with its own client so a request can wait out a stopped replica.
func chatTo(ctx context.Context, hc *http.Client, r *replica, session, target, prompt string) (answer, error) {
	body := fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":%q}],"max_tokens":4}`, prompt)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.Client+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	if target != "" {
		req.Header.Set("X-Target-Worker", target)
	}
	return doChat(hc, req)
}

// rebind moves session to another worker than from, through r (which must have applied the
// invalidation it asks for: the leader does before it answers), and returns the new binding.
func rebind(ctx context.Context, r *replica, session string, from answer, workers []string) (answer, error) {
	// A session with no binding is what the invalidation is for: a retried rebind finds it
	// so when its first try invalidated the binding and its turn then failed (an election).
	// The turn below must still bind it anew, at a higher revision.
	if err := r.invalidate(session); err != nil && !errors.Is(err, errNoBinding) {
		return answer{}, err
	}
	to := workers[0]
	for _, w := range workers {
		if w != from.worker {
			to = w
			break
		}
	}
	a, err := chatTo(ctx, httpClient, r, session, to, "rebound turn of "+session)
	switch {
	case err != nil:
		return a, err
	case a.status != http.StatusOK || a.worker != to || a.revision <= from.revision:
		return a, fmt.Errorf("rebind %s to %s via %s: %+v (was %s rev %d)", session, to, r.ID, a, from.worker, from.revision)
	}
	return a, nil
}

// TestResumedReplicaNeverServesARevisionOlderThanTheBound stops one replica (the leader, or a
// follower) with SIGSTOP, rebinds every session to another worker through the others while it
// is stopped, waits past the stale bound, and resumes it. Requests that were queued on the
// stopped replica, and requests sent to it the moment it resumes, may wait or get 503; none
// may be answered with the binding it held before the pause: every rebind was acknowledged
// more than the bound before those requests ran (contract 2, DESIGN.md section 5).
func TestResumedReplicaNeverServesARevisionOlderThanTheBound(t *testing.T) {
	for _, stopLeader := range []bool{true, false} {
		name := "follower"
		if stopLeader {
			name = "leader"
		}
		t.Run(name, func(t *testing.T) {
			const bound = time.Second
			fl := startFleet(t, 3)
			c := startCluster(t, 3, fl, "--stale-bound", bound.String())
			sessions := sessionNames("moved-"+name, 30)
			before := bindSessions(t, c, sessions)
			leader := c.leader()
			// Every replica has applied every binding before the pause, so what the stopped one
			// holds is exactly the old state.
			eventually(t, 30*time.Second, func() error {
				for _, r := range c.replicas {
					if st, err := r.status(); err != nil || st.Bindings != len(sessions) {
						return fmt.Errorf("%s holds %d bindings (%v), want %d", r.ID, st.Bindings, err, len(sessions))
					}
				}
				return nil
			})
			stopped := leader
			if !stopLeader {
				stopped = c.others(leader)[0]
			}
			c.signal(stopped, syscall.SIGSTOP)
			// Until every thread has stopped, the replica may still read and serve a request
			// sent now, before the rebinds: that one may rightly get the old binding.
			if err := stopped.proc.WaitStopped(t.Context()); err != nil {
				t.Fatal(err)
			}
			resumed := false
			defer func() {
				if !resumed {
					_ = stopped.proc.Resume()
				}
			}()

			// Requests queued on the stopped replica: the kernel accepts them, the process runs
			// them after SIGCONT. They use a client of their own, patient enough for the pause.
			patient := &http.Client{Timeout: 60 * time.Second}
			type result struct {
				session, when string
				a             answer
				err           error
			}
			results := make(chan result, 2*len(sessions))
			var queued sync.WaitGroup
			for _, s := range sessions {
				queued.Go(func() {
					a, err := chatTo(context.Background(), patient, stopped, s, "", "queued turn of "+s)
					results <- result{s, "queued before SIGCONT", a, err}
				})
			}

			// Rebind every session through a live leader (the next one, when the leader is stopped).
			live := c.leaderAmong(c.others(stopped))
			after := map[string]answer{}
			for _, s := range sessions {
				var a answer
				eventually(t, 30*time.Second, func() (err error) {
					a, err = rebind(context.Background(), live, s, before[s], fl.ids)
					return err
				})
				after[s] = a
			}
			// Every rebind was acknowledged; let more than the bound pass before the resume.
			// (Waiting is the scenario here, not a stand-in for a condition.)
			time.Sleep(2 * bound)

			c.signal(stopped, syscall.SIGCONT)
			resumed = true
			var fresh sync.WaitGroup
			for _, s := range sessions {
				fresh.Go(func() {
					a, err := chatTo(context.Background(), patient, stopped, s, "", "turn after the resume of "+s)
					results <- result{s, "sent after SIGCONT", a, err}
				})
			}
			queued.Wait()
			fresh.Wait()
			close(results)

			counts := map[string]int{}
			for r := range results {
				old, cur := before[r.session], after[r.session]
				switch {
				case r.err != nil:
					t.Errorf("%s (%s): %v", r.session, r.when, r.err)
				case r.a.status == http.StatusServiceUnavailable:
					counts[r.when+": 503"]++
				case r.a.status != http.StatusOK:
					t.Errorf("%s (%s): status %d %s", r.session, r.when, r.a.status, r.a.body)
				case r.a.revision < cur.revision:
					counts[r.when+": OLD binding"]++
					t.Errorf("%s (%s) on resumed %s: %s rev %d, but %s rev %d was acknowledged %v before it ran (bound %v); the binding before the pause was %s rev %d",
						r.session, r.when, stopped.ID, r.a.worker, r.a.revision, cur.worker, cur.revision, 2*bound, bound, old.worker, old.revision)
				case r.a.revision == cur.revision && r.a.worker != cur.worker:
					t.Errorf("%s (%s): rev %d names %s, was acknowledged on %s", r.session, r.when, r.a.revision, r.a.worker, cur.worker)
				default:
					counts[r.when+": new binding"]++
				}
			}
			t.Logf("stopped %s (%s): %v", stopped.ID, name, counts)
		})
	}
}
