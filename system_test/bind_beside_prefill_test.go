package system_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// TestNoByteOfANewSessionLeavesBeforeItsBindingCommits: a new session's binding is proposed
// as its request is dispatched, beside the worker's prefill, and the worker's answer waits
// for the commit (or, once the replica's contact with its leader is stale, the binding is
// committed before the request is sent). Through a follower whose two peers are stopped
// (SIGSTOP: no quorum, so no commit), the client gets no byte while the peers are stopped,
// and once they resume gets the answer with the binding's revision, the one the leader
// holds. Streamed and whole answers alike.
//
// The window the client is watched in (while the peers stay stopped) is where a byte must
// not come, whatever the machine's speed: it bounds how long a broken router would have to
// let one out, not how fast a correct one is.
func TestNoByteOfANewSessionLeavesBeforeItsBindingCommits(t *testing.T) {
	const watch = 2 * time.Second
	fl := startFleet(t, 2)
	// A stale bound long enough that the follower still vouches for its state when the
	// request arrives just after its peers stop; a bind wait longer than the stop.
	c := startCluster(t, 3, fl, "--stale-bound", "5s", "--bind-wait", "60s")
	leader := c.leader()
	lone := c.others(leader)[0]
	peers := c.others(lone)
	defer func() {
		for _, r := range peers {
			_ = r.proc.Resume()
		}
	}()
	served := func() uint64 {
		var n uint64
		for _, w := range fl.sims {
			n += w.Stats().Served
		}
		return n
	}
	type reply struct {
		a   answer
		err error
	}
	for _, stream := range []bool{false, true} {
		session := fmt.Sprintf("born-cut-off-stream-%v", stream)
		t.Run(session, func(t *testing.T) {
			c.waitReady(lone)
			// A request through lone first, so that its read lease has just been renewed.
			if a, err := chat(t.Context(), lone, "warm-"+session, "warm up"); err != nil || a.status != http.StatusOK {
				t.Fatalf("warm-up through %s: %+v %v", lone.ID, a, err)
			}
			before := served()
			for _, r := range peers {
				c.signal(r, syscall.SIGSTOP)
			}
			resumed := false
			t.Cleanup(func() {
				if !resumed { // the subtest failed with its peers stopped: the next one needs them
					for _, r := range peers {
						_ = r.proc.Resume()
					}
				}
			})
			got, head := make(chan reply, 1), make(chan struct{})
			go func() {
				a, err := firstByte(context.Background(), lone, session, stream, head)
				got <- reply{a, err}
			}()
			// A request that came while lone's contact with its leader was fresh went to its
			// worker beside the bind; one that came later waits for its binding before any
			// worker is asked (contact stale). Either way no byte reaches the client.
			select {
			case <-head:
				r := <-got
				t.Fatalf("the client got %+v (%v) from %s while no quorum could commit its binding", r.a, r.err, lone.ID)
			case <-time.After(watch):
			}
			t.Logf("a worker answered before the quorum returned: %v", served() != before)
			for _, r := range peers {
				c.signal(r, syscall.SIGCONT)
			}
			resumed = true
			var r reply
			select {
			case r = <-got:
			case <-time.After(90 * time.Second):
				t.Fatal("no answer 90 s after the quorum returned")
			}
			if r.err != nil || r.a.status != http.StatusOK || r.a.revision == 0 || r.a.worker == "" {
				t.Fatalf("the new session's answer once the quorum returned: %+v %v", r.a, r.err)
			}
			var sv admin.SessionView
			eventually(t, 30*time.Second, func() error {
				return proc.Get(t.Context(), httpClient, "http://"+c.leader().Admin+"/admin/sessions/"+session, &sv)
			})
			if sv.Worker != r.a.worker || sv.Revision != r.a.revision {
				t.Fatalf("the client was answered by %s at revision %d; the leader holds %s at %d", r.a.worker, r.a.revision, sv.Worker, sv.Revision)
			}
			t.Logf("%s: answered by %s at revision %d after the quorum returned", session, r.a.worker, r.a.revision)
		})
	}
}

// firstByte sends a new session's chat request to r, closes head when the answer's head
// (its first byte) has come, and returns the answer with its X-Kvrouter-* headers.
func firstByte(ctx context.Context, r *replica, session string, stream bool, head chan<- struct{}) (answer, error) {
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello from %s"}],"max_tokens":4,"stream":%v}`,
		sim.DefaultModel, session, stream)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.Client+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	hc := &http.Client{Timeout: 3 * time.Minute}
	resp, err := hc.Do(req)
	close(head)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	a := answer{status: resp.StatusCode, worker: resp.Header.Get("X-Kvrouter-Worker"), replica: resp.Header.Get("X-Kvrouter-Replica")}
	if v := resp.Header.Get("X-Kvrouter-Binding-Revision"); v != "" {
		a.revision, _ = strconv.ParseUint(v, 10, 64)
	}
	b, err := io.ReadAll(resp.Body)
	a.body = string(b)
	return a, err
}
