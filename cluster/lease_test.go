package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

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
	// The lease itself, not Ready: Ready also holds for BindWait after a lease ended.
	poll.Until(t, 10*time.Second, func() error { return f.leaseHolds() })
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
			// No lease held within BindWait either: Ready follows the lease alone (an
			// election's grace is refusal.go's).
			n.lease.last.Store(0)
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

// staleAnswers stands between a leader's Raft and its transport. Once frozen it answers
// each heartbeat with the last answer its follower gave before, and fails every other call:
// what a leader resumed from a pause reads from its sockets, answers to heartbeats it sent
// before the pause, while the others elected a new leader.
type staleAnswers struct {
	raft.Transport
	mu     sync.Mutex
	frozen bool
	last   map[raft.ServerAddress]raft.AppendEntriesResponse
}

// answered is how many followers have answered a heartbeat.
func (s *staleAnswers) answered() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.last)
}

func (s *staleAnswers) freeze() {
	s.mu.Lock()
	s.frozen = true
	s.mu.Unlock()
}

// AppendEntriesPipeline refuses pipelining, so every append goes through AppendEntries.
func (s *staleAnswers) AppendEntriesPipeline(raft.ServerID, raft.ServerAddress) (raft.AppendPipeline, error) {
	return nil, raft.ErrPipelineReplicationNotSupported
}

func (s *staleAnswers) AppendEntries(id raft.ServerID, target raft.ServerAddress, args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	heartbeat := len(args.Entries) == 0 && args.PrevLogEntry == 0 && args.LeaderCommitIndex == 0
	s.mu.Lock()
	frozen := s.frozen
	last, answered := s.last[target]
	s.mu.Unlock()
	if frozen {
		if heartbeat && answered {
			*resp = last
			return nil
		}
		return fmt.Errorf("append to %s: the leader is frozen", target)
	}
	if err := s.Transport.AppendEntries(id, target, args, resp); err != nil {
		return err
	}
	if heartbeat && resp.Success {
		s.mu.Lock()
		s.last[target] = *resp
		s.mu.Unlock()
	}
	return nil
}

func (s *staleAnswers) RequestVote(id raft.ServerID, target raft.ServerAddress, args *raft.RequestVoteRequest, resp *raft.RequestVoteResponse) error {
	s.mu.Lock()
	frozen := s.frozen
	s.mu.Unlock()
	if frozen {
		return fmt.Errorf("vote request to %s: the leader is frozen", target)
	}
	return s.Transport.RequestVote(id, target, args, resp)
}

// TestStaleHeartbeatAnswersGrantNoReadLease cuts a leader off while it goes on reading its
// followers' old answers to heartbeats (as one resumed from SIGSTOP does), lets the others
// elect a leader and rebind a session, and then reads the session on the old leader: from
// the rebind's acknowledgement plus the bound on, it must never serve the old binding. A
// lease round that proves leadership with raft's VerifyLeader fails this (VerifyLeader
// counts any heartbeat answer read after it was asked, even one to a heartbeat sent before);
// a round that commits a barrier passes, since only an answer to the append carrying it can
// commit it.
func TestStaleHeartbeatAnswersGrantNoReadLease(t *testing.T) {
	// The frozen leader stays leader only while its stale answers keep its Raft lease, which
	// a starved machine can let lapse; then the scenario did not happen and is run again on
	// a fresh cluster, a bounded number of times.
	for attempt := 1; attempt <= 3; attempt++ {
		if staleHeartbeatScenario(t) {
			return
		}
		t.Logf("attempt %d: the frozen leader stepped down before the rebind was acknowledged; again", attempt)
	}
	t.Fatal("the frozen leader stepped down in every attempt: its stale answers never kept it leading, the test shows nothing")
}

// staleHeartbeatScenario runs TestStaleHeartbeatAnswersGrantNoReadLease's scenario once and
// reports whether it happened (the frozen leader still led when the rebind was acknowledged).
func staleHeartbeatScenario(t *testing.T) bool {
	t.Helper()
	stale := make([]*staleAnswers, 3)
	c := newWrappedCluster(t, 3, func(cfg *Config) { cfg.BindWait = 50 * time.Millisecond }, func(i int, tr raft.Transport) raft.Transport {
		stale[i] = &staleAnswers{Transport: tr, last: map[raft.ServerAddress]raft.AppendEntriesResponse{}}
		return stale[i]
	})
	li, old := c.leader()
	ctx := context.Background()
	before := bindVia(t, NewAffinity(old), "moving", indexer.Worker{ID: "w1"})
	poll.Until(t, 10*time.Second, func() error { return old.Ready() })
	poll.Until(t, 10*time.Second, func() error {
		if n := stale[li].answered(); n < 2 {
			return fmt.Errorf("%d followers answered a heartbeat", n)
		}
		return nil
	})

	// Freeze the leader: no vote request and no append reaches it or leaves it; only its
	// own heartbeats are answered, from the past.
	c.net.mu.Lock()
	c.net.down[peerAddr(li)] = true
	for addr, tr := range c.net.trans {
		if addr != raftAddr(li) {
			tr.Disconnect(raft.ServerAddress(raftAddr(li)))
		}
	}
	c.net.mu.Unlock()
	stale[li].freeze()

	var ni int
	var nl *Node
	poll.Until(t, 10*time.Second, func() error {
		for i, n := range c.nodes {
			if i != li && n.IsLeader() && n.lead.isEstablished() {
				ni, nl = i, n
				return nil
			}
		}
		return errors.New("no new leader among the others")
	})
	l, err := NewAffinity(nl).Acquire(ctx, "moving", nil)
	if err != nil {
		t.Fatal(err)
	}
	if !l.Reopen() {
		t.Fatal("the new leader does not hold the binding")
	}
	after, err := l.Commit(ctx, indexer.Worker{ID: "w2"}, "")
	if err != nil || after.Revision <= before.Revision {
		t.Fatalf("rebind on the new leader r%d: %+v %v", ni, after, err)
	}
	l.Release()
	acked := old.lease.now()
	if !old.IsLeader() {
		return false
	}

	// From the acknowledgement plus the bound on, no bounded read may miss it.
	poll.Until(t, 10*time.Second, func() error {
		if old.lease.now() < acked+old.cfg.StaleBound {
			return errors.New("within the bound of the rebind")
		}
		return nil
	})
	a := NewAffinity(old)
	for range 10 {
		b, ok, err := a.Peek(ctx, "moving")
		if err == nil && ok && b.Revision < after.Revision {
			t.Fatalf("the old leader served revision %d (%s) %v after revision %d was acknowledged (bound %v)",
				b.Revision, b.Worker.ID, old.lease.now()-acked, after.Revision, old.cfg.StaleBound)
		}
		if err != nil && !errors.Is(err, ErrStale) && !errors.Is(err, ErrNoLeader) {
			t.Fatalf("read on the old leader: %v, want the new binding or ErrStale", err)
		}
	}
	return true
}
