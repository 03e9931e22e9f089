package cluster

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// timerDeadline is the idle deadline n's leader holds for session (false: no timer).
func timerDeadline(n *Node, session string) (time.Time, bool) {
	n.lead.mu.Lock()
	defer n.lead.mu.Unlock()
	t := n.lead.timers[session]
	if t == nil {
		return time.Time{}, false
	}
	return t.deadline, true
}

// TestTouchedSessionOutlivesQuickLeaderChanges: a binding touched through a follower that
// stays up is not expired as idle within its TTL of that touch when the touch reached a
// leader that lost its leadership before its next checkpoint, or could not be delivered
// before the leader changed. (Before, the new leader re-armed the binding from the last
// checkpoint's remaining TTL, and the touch was lost: an active session of the jepsen
// harness was rebound as if idle after a few quick leader changes.)
func TestTouchedSessionOutlivesQuickLeaderChanges(t *testing.T) {
	const ttl = 4 * time.Second
	cases := []struct {
		name string
		// lose makes the leader li lose its leadership after calling touch (a touch of
		// the session through node fi), with no checkpoint in between.
		lose func(t *testing.T, c *testCluster, li, fi, gi int, touch func())
	}{
		{"touch reached a leader that then handed over", func(t *testing.T, c *testCluster, li, fi, gi int, touch func()) {
			touch()
			waitTouched(t, c.nodes[li], ttl)
			transfer(t, c, li, gi)
		}},
		{"touch reached a leader that was then killed", func(t *testing.T, c *testCluster, li, fi, gi int, touch func()) {
			touch()
			waitTouched(t, c.nodes[li], ttl)
			c.kill(li)
		}},
		{"touch failed to reach the leader before it handed over", func(t *testing.T, c *testCluster, li, fi, gi int, touch func()) {
			c.net.mu.Lock()
			c.net.noTouches[peerAddr(fi)] = true
			c.net.mu.Unlock()
			touch()
			poll.Until(t, 10*time.Second, func() error {
				c.net.mu.Lock()
				defer c.net.mu.Unlock()
				if c.net.refusedTouches == 0 {
					return errors.New("the touch has not been tried yet")
				}
				return nil
			})
			transfer(t, c, li, gi)
			c.newLeader(li)
			c.net.mu.Lock()
			c.net.noTouches[peerAddr(fi)] = false
			c.net.mu.Unlock()
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCluster(t, 3, func(cfg *Config) { cfg.SessionTTL = ttl; cfg.CheckpointInterval = time.Hour })
			li, _ := c.leader()
			fi := (li + 1) % 3
			a := NewAffinity(c.nodes[fi])
			b := bindVia(t, a, "s", indexer.Worker{ID: "w1"})
			li = idleAndCheckpoint(t, c, fi)
			gi := 3 - li - fi
			var touchedAt time.Time
			tc.lose(t, c, li, fi, gi, func() {
				touchedAt = time.Now()
				a.touch("s", b.Revision)
			})
			nl := c.newLeader(li)
			// The new leader must hold the binding at least until the touch's TTL ends
			// (less some slack for the touch's travel), and not expire it before.
			gone := false
			poll.Until(t, 10*time.Second, func() error {
				if _, ok := nl.FSM().Get("s"); !ok {
					gone = true
					return nil
				}
				d, ok := timerDeadline(nl, "s")
				if want := touchedAt.Add(ttl - 500*time.Millisecond); !ok || d.Before(want) {
					return fmt.Errorf("new leader's deadline is %v after the touch, want at least %v", d.Sub(touchedAt), want.Sub(touchedAt))
				}
				return nil
			})
			if gone {
				t.Fatalf("binding touched %v ago, with a TTL of %v, was expired by the new leader", time.Since(touchedAt).Round(time.Millisecond), ttl)
			}
		})
	}
}

// idleAndCheckpoint lets session "s" idle until at most 2s of its TTL is left, has the
// leader (never node fi) checkpoint that, and returns the leader's index. A leader that
// changes meanwhile (a loaded machine) is followed.
func idleAndCheckpoint(t *testing.T, c *testCluster, fi int) int {
	t.Helper()
	li := -1
	poll.Until(t, 20*time.Second, func() error {
		li = -1
		for i, n := range c.nodes {
			if n != nil && n.IsLeader() && n.lead.isEstablished() {
				li = i
			}
		}
		if li < 0 {
			return errors.New("no established leader")
		}
		if li == fi {
			// A loaded machine moved the leadership to the touching replica: move it on.
			err := c.nodes[fi].raft.LeadershipTransfer().Error()
			return fmt.Errorf("the touching replica leads; handing over: %v", err)
		}
		ln := c.nodes[li]
		if _, ok := ln.FSM().Get("s"); !ok {
			t.Fatal("the binding expired before it was checkpointed (the test was starved for over a second)")
		}
		if d, ok := timerDeadline(ln, "s"); !ok || time.Until(d) > 2*time.Second {
			return fmt.Errorf("binding not idle enough yet (timer %v, %v left)", ok, time.Until(d))
		}
		ln.lead.checkpoint(context.Background())
		if got, ok := ln.FSM().Get("s"); !ok || got.Remaining <= 0 || got.Remaining > 2*time.Second || !ln.IsLeader() {
			return fmt.Errorf("checkpointed binding %+v (found %v): want at most 2s remaining, and the leader still leading", got, ok)
		}
		return nil
	})
	return li
}

// waitTouched waits until n's leader has moved the timer of session "s" to about a TTL ahead.
func waitTouched(t *testing.T, n *Node, ttl time.Duration) {
	t.Helper()
	poll.Until(t, 10*time.Second, func() error {
		if d, ok := timerDeadline(n, "s"); !ok || time.Until(d) < ttl-time.Second {
			return errors.New("the touch has not reached the leader")
		}
		return nil
	})
}

// transfer hands the leadership of node from to node to.
func transfer(t *testing.T, c *testCluster, from, to int) {
	t.Helper()
	f := c.nodes[from].raft.LeadershipTransferToServer(raft.ServerID(fmt.Sprintf("r%d", to)), raft.ServerAddress(raftAddr(to)))
	if err := f.Error(); err != nil {
		t.Fatalf("leadership transfer from r%d to r%d: %v", from, to, err)
	}
}

// newLeader waits for an established leader other than node old.
func (c *testCluster) newLeader(old int) *Node {
	c.t.Helper()
	var ln *Node
	poll.Until(c.t, 10*time.Second, func() error {
		for i, n := range c.nodes {
			if i != old && n != nil && n.IsLeader() && n.lead.isEstablished() {
				ln = n
				return nil
			}
		}
		return errors.New("no new established leader")
	})
	return ln
}

// TestTouchCountsTheTTLFromWhenTheTouchWasMade: a touch's age moves the deadline back by
// that much, so a touch sent again to a new leader gives the binding what the touch promised
// and never more: never later than now + TTL, and a touch older than the TTL extends nothing
// (idle bindings still expire).
func TestTouchCountsTheTTLFromWhenTheTouchWasMade(t *testing.T) {
	const ttl = 10 * time.Second
	cases := []struct {
		name        string
		established bool
		revision    uint64
		age         time.Duration
		// want is the deadline's distance from now after the touch (the timer starts at now).
		want    time.Duration
		wantErr error
	}{
		{"a fresh touch", true, 1, 0, ttl, nil},
		{"a touch 4s old", true, 1, 4 * time.Second, ttl - 4*time.Second, nil},
		{"a negative age counts as now", true, 1, -5 * time.Second, ttl, nil},
		{"a touch older than the TTL extends nothing", true, 1, 2 * ttl, 0, nil},
		{"a touch of another revision touches nothing", true, 2, 0, 0, nil},
		{"a leader not established yet refuses it", false, 1, 0, 0, errNotEstablished},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l := newLeader(nil)
			start := time.Now()
			l.established = tc.established
			l.timers["s"] = &idleTimer{revision: 1, ttl: ttl, deadline: start}
			err := l.touch("s", tc.revision, tc.age)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("touch: %v, want %v", err, tc.wantErr)
			}
			got := l.timers["s"].deadline.Sub(start)
			// The touch reads the clock after start: allow that much later, never earlier.
			if got < tc.want || got > tc.want+time.Second {
				t.Fatalf("deadline moved to now+%v, want now+%v", got, tc.want)
			}
		})
	}
}
