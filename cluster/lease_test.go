package cluster

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// TestHeartbeatsAloneRenewNoReadLease cuts a follower's read-index calls while its Raft
// traffic flows on: it keeps hearing the leader's heartbeats (last contact stays recent), yet
// it must turn unready and refuse bounded reads within the bound, because contact says
// nothing about what its FSM has applied. The contact rule that the lease replaced kept it
// ready for as long as heartbeats arrived.
func TestHeartbeatsAloneRenewNoReadLease(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.BindWait = 100 * time.Millisecond })
	li, _ := c.leader()
	fi := (li + 1) % 3
	f := c.nodes[fi]
	poll.Until(t, 10*time.Second, func() error { return f.Ready() })
	a := NewAffinity(f)
	ctx := context.Background()
	bindVia(t, NewAffinity(c.nodes[li]), "kept", indexer.Worker{ID: "w1"})

	c.net.mu.Lock()
	c.net.noReads[peerAddr(fi)] = true
	c.net.mu.Unlock()
	cut := time.Now()
	poll.Until(t, 10*time.Second, func() error {
		if err := f.Ready(); err == nil {
			return errors.New("still ready without a read-index round")
		}
		return nil
	})
	t.Logf("unready %v after its read-index rounds stopped (bound %v)", time.Since(cut).Round(time.Millisecond), f.cfg.StaleBound)
	if since := time.Since(f.raft.LastContact()); since > f.cfg.StaleBound {
		t.Fatalf("the follower lost contact too (%v ago): the test shows nothing", since)
	}
	if _, _, err := a.Peek(ctx, "kept"); !errors.Is(err, ErrStale) {
		t.Fatalf("bounded read without a lease: %v, want ErrStale", err)
	}

	c.net.mu.Lock()
	c.net.noReads[peerAddr(fi)] = false
	c.net.mu.Unlock()
	poll.Until(t, 10*time.Second, func() error { return f.Ready() })
	if b, ok, err := a.Peek(ctx, "kept"); err != nil || !ok || b.Worker.ID != "w1" {
		t.Fatalf("after the lease returned: %+v %v %v", b, ok, err)
	}
}

// TestReadLeaseEndsWithItsTermRoleOrTime checks the hot-path rule on one node's grant: a
// lease holds only in the term and role it was granted in, and only until its end.
func TestReadLeaseEndsWithItsTermRoleOrTime(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	_, n := c.leader()
	poll.Until(t, 10*time.Second, func() error { return n.Ready() })
	term, st := n.raft.CurrentTerm(), n.raft.State()
	far := n.lease.now() + time.Hour
	cases := []struct {
		name  string
		grant *leaseGrant
		ok    bool
	}{
		{"valid", &leaseGrant{until: far, term: term, state: st}, true},
		{"none", nil, false},
		{"expired", &leaseGrant{until: n.lease.now() - time.Millisecond, term: term, state: st}, false},
		{"older term", &leaseGrant{until: far, term: term - 1, state: st}, false},
		{"granted as follower", &leaseGrant{until: far, term: term, state: st + 1}, false},
	}
	// Stop the renewals so the grants under test stay as set.
	n.cancel()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n.lease.grant.Store(tc.grant)
			err := n.leaseHolds()
			if (err == nil) != tc.ok {
				t.Fatalf("leaseHolds: %v, want ok=%v", err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrStale) {
				t.Fatalf("leaseHolds: %v, want ErrStale", err)
			}
			if rerr := n.Ready(); (rerr == nil) != tc.ok {
				t.Fatalf("Ready: %v, want ok=%v", rerr, tc.ok)
			}
		})
	}
}

// TestLeaseRoundsStayOffTheRequestPath counts read-index rounds while many bounded reads
// run: the rounds follow the clock (about three per bound), not the reads.
func TestLeaseRoundsStayOffTheRequestPath(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	li, _ := c.leader()
	f := c.nodes[(li+1)%3]
	poll.Until(t, 10*time.Second, func() error { return f.Ready() })
	a := NewAffinity(f)
	bindVia(t, NewAffinity(c.nodes[li]), "hot", indexer.Worker{ID: "w2"})
	poll.Until(t, 10*time.Second, func() error {
		if _, ok, err := a.Peek(context.Background(), "hot"); err != nil || !ok {
			return fmt.Errorf("not yet applied: %v %v", ok, err)
		}
		return nil
	})
	before := f.lease.renewed.Load() + f.lease.failed.Load() + f.lease.discarded.Load()
	const reads = 20000
	for range reads {
		if _, _, err := a.Peek(context.Background(), "hot"); err != nil {
			t.Fatal(err)
		}
	}
	rounds := f.lease.renewed.Load() + f.lease.failed.Load() + f.lease.discarded.Load() - before
	if rounds > reads/100 {
		t.Fatalf("%d lease rounds for %d reads: rounds follow the reads", rounds, reads)
	}
	t.Logf("%d reads, %d lease rounds", reads, rounds)
}
