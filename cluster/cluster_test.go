package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

func bindVia(t *testing.T, a *Affinity, session string, w indexer.Worker) routing.Binding {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := a.Acquire(ctx, session, nil)
	if err != nil {
		t.Fatalf("acquire %s: %v", session, err)
	}
	defer l.Release()
	if b, ok := l.Binding(); ok {
		return b
	}
	b, err := l.Commit(ctx, w, "")
	if err != nil && !errors.Is(err, routing.ErrBoundElsewhere) {
		t.Fatalf("commit %s: %v", session, err)
	}
	return b
}

func TestClusterBootstrapsAndElectsOneLeader(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	li, _ := c.leader()
	poll.Until(t, 5*time.Second, func() error {
		ids := map[string]bool{}
		for _, n := range c.nodes {
			ids[n.ClusterID()] = true
		}
		if len(ids) != 1 || ids[""] {
			return fmt.Errorf("cluster ids %v: want one shared id", ids)
		}
		return nil
	})
	// Every member's peer address reaches every replica's FSM.
	poll.Until(t, 5*time.Second, func() error {
		for i, n := range c.nodes {
			if got := len(n.FSM().Members()); got != 3 {
				return fmt.Errorf("node %d knows %d members", i, got)
			}
		}
		return nil
	})
	t.Logf("leader r%d", li)
}

func TestFollowerForwardsBindToLeader(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	li, _ := c.leader()
	fi := (li + 1) % 3
	a := NewAffinity(c.nodes[fi])
	b := bindVia(t, a, "s1", indexer.Worker{ID: "w1"})
	if b.Revision == 0 || b.Worker.ID != "w1" {
		t.Fatalf("binding %+v", b)
	}
	c.net.mu.Lock()
	served := c.net.forwarded[peerAddr(li)]
	c.net.mu.Unlock()
	if served == 0 {
		t.Fatal("the follower's bind was not served by the leader")
	}
	poll.Until(t, 5*time.Second, func() error {
		for i, n := range c.nodes {
			got, ok := n.FSM().Get("s1")
			if !ok || got.Revision != b.Revision || got.Worker != "w1" {
				return fmt.Errorf("node %d has %+v %v", i, got, ok)
			}
		}
		return nil
	})
}

func TestRacingFirstRequestsOnAllReplicasEndOnOneBinding(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	c.leader()
	stores := []*Affinity{NewAffinity(c.nodes[0]), NewAffinity(c.nodes[1]), NewAffinity(c.nodes[2])}
	const sessions = 20
	for s := range sessions {
		session := fmt.Sprintf("race-%d", s)
		got := make([]routing.Binding, 6)
		var wg sync.WaitGroup
		for k := range got {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got[k] = bindVia(t, stores[k%3], session, indexer.Worker{ID: fmt.Sprintf("w%d", k)})
			}()
		}
		wg.Wait()
		for k := range got {
			if got[k] != got[0] {
				t.Fatalf("session %s: request %d saw %+v, request 0 saw %+v", session, k, got[k], got[0])
			}
		}
	}
}

func TestLeaderLossKeepsBindingsAndElectsAnother(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	li, _ := c.leader()
	a := NewAffinity(c.nodes[(li+1)%3])
	want := map[string]routing.Binding{}
	for s := range 50 {
		session := fmt.Sprintf("s%d", s)
		want[session] = bindVia(t, a, session, indexer.Worker{ID: fmt.Sprintf("w%d", s%4)})
	}
	c.kill(li)
	nli, _ := c.leader()
	if nli == li {
		t.Fatal("the killed node still leads")
	}
	// The new leader has everything the old one acknowledged as soon as it has established
	// its term (Barrier); the other survivor once the next heartbeat carries the commit index.
	check := func(i int) error {
		for s, b := range want {
			got, ok := c.nodes[i].FSM().Get(s)
			if !ok || got.Revision != b.Revision || got.Worker != b.Worker.ID {
				return fmt.Errorf("node %d lost %s: %+v %v, want %+v", i, s, got, ok, b)
			}
		}
		return nil
	}
	if err := check(nli); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 5*time.Second, func() error {
		for i, n := range c.nodes {
			if n != nil {
				if err := check(i); err != nil {
					return err
				}
			}
		}
		return nil
	})
	// New sessions bind through the new leader.
	b := bindVia(t, a, "after-failover", indexer.Worker{ID: "w9"})
	if b.Revision == 0 {
		t.Fatalf("no binding after failover: %+v", b)
	}
	// The old leader comes back and catches up.
	c.start(li)
	poll.Until(t, 10*time.Second, func() error {
		if got, ok := c.nodes[li].FSM().Get("after-failover"); !ok || got.Revision != b.Revision {
			return errors.New("restarted node has not caught up")
		}
		return nil
	})
}

func TestNewLeaderRearmsTimersAndExpiresOnce(t *testing.T) {
	const ttl = 300 * time.Millisecond
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.SessionTTL = ttl; cfg.CheckpointInterval = time.Hour })
	li, _ := c.leader()
	a := NewAffinity(c.nodes[(li+1)%3])
	const sessions = 30
	for s := range sessions {
		bindVia(t, a, fmt.Sprintf("s%d", s), indexer.Worker{ID: "w1"})
	}
	c.kill(li)
	_, nl := c.leader()
	changes := nl.Stability().LeaderChanges
	if got := nl.lead.pendingTimers(); got != nl.FSM().Len() {
		t.Fatalf("new leader armed %d timers for %d bindings", got, nl.FSM().Len())
	}
	// Every binding idles out, each through exactly one Expire from the new leader.
	poll.Until(t, 10*time.Second, func() error {
		if n := nl.FSM().Len(); n != 0 {
			return fmt.Errorf("%d bindings left", n)
		}
		return nil
	})
	// With the leadership steady, one proposal per session. On a starved machine the new
	// leader can lose its leadership and win it back (its pending proposals then fail and
	// are proposed again): each such change may cost every session one more proposal, never
	// more.
	got := nl.lead.expiresProposed.Load()
	flaps := nl.Stability().LeaderChanges - changes
	if flaps == 0 && got != sessions || got > sessions*int64(1+flaps) {
		t.Fatalf("new leader proposed %d expiries for %d sessions (%d leadership changes meanwhile)", got, sessions, flaps)
	}
}

func TestActiveSessionIsNotExpired(t *testing.T) {
	const ttl = 200 * time.Millisecond
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.SessionTTL = ttl })
	li, nl := c.leader()
	a := NewAffinity(c.nodes[(li+1)%3])
	ctx := context.Background()
	held, err := a.Acquire(ctx, "long", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := held.Commit(ctx, indexer.Worker{ID: "w1"}, "")
	if err != nil {
		t.Fatal(err)
	}
	bindVia(t, a, "short", indexer.Worker{ID: "w2"})
	// Wait for the idle one to expire: by then the held one has outlived its TTL several
	// times over and must still be bound (its keep-alive touches the leader every ttl/3).
	poll.Until(t, 10*time.Second, func() error {
		if _, ok := nl.FSM().Get("short"); ok {
			return errors.New("idle session not expired yet")
		}
		return nil
	})
	if got, ok := nl.FSM().Get("long"); !ok || got.Revision != b.Revision {
		t.Fatalf("active session lost its binding: %+v %v", got, ok)
	}
	held.Release()
	poll.Until(t, 10*time.Second, func() error {
		if _, ok := nl.FSM().Get("long"); ok {
			return errors.New("released session not expired yet")
		}
		return nil
	})
}

func TestInvalidateIsRevisionGuarded(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	li, _ := c.leader()
	a := NewAffinity(c.nodes[(li+2)%3])
	ctx := context.Background()
	b := bindVia(t, a, "s", indexer.Worker{ID: "w1"})
	if err := a.Invalidate(ctx, "s", b.Revision+1000); err != nil {
		t.Fatal(err)
	}
	if got, ok, err := a.Peek(ctx, "s"); err != nil || !ok || got != b {
		t.Fatalf("a stale invalidate removed the binding: %+v %v %v", got, ok, err)
	}
	if err := a.Invalidate(ctx, "s", b.Revision); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 5*time.Second, func() error {
		if _, ok, _ := a.Peek(ctx, "s"); ok {
			return errors.New("still bound")
		}
		return nil
	})
	b2 := bindVia(t, a, "s", indexer.Worker{ID: "w2"})
	if b2.Revision <= b.Revision || b2.Worker.ID != "w2" {
		t.Fatalf("rebinding %+v after %+v", b2, b)
	}
}

func TestLinearizableReadSeesEveryAcknowledgedBind(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.Level = Linearizable })
	li, _ := c.leader()
	w := NewAffinity(c.nodes[li])
	r := NewAffinity(c.nodes[(li+1)%3])
	ctx := context.Background()
	for s := range 20 {
		session := fmt.Sprintf("lin-%d", s)
		b := bindVia(t, w, session, indexer.Worker{ID: "w1"})
		got, ok, err := r.Peek(ctx, session)
		if err != nil || !ok || got != b {
			t.Fatalf("follower read after an acknowledged bind: %+v %v %v, want %+v", got, ok, err, b)
		}
	}
}

func TestStaleReplicaTurnsUnready(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.BindWait = 100 * time.Millisecond })
	li, _ := c.leader()
	fi := (li + 1) % 3
	// A follower turns ready with its first read lease, one read-index round after it
	// learned of the leader.
	poll.Until(t, 10*time.Second, func() error {
		if err := c.nodes[fi].Ready(); err != nil {
			return fmt.Errorf("healthy follower unready: %w", err)
		}
		return nil
	})
	// Cut the follower off from both others.
	c.net.mu.Lock()
	tr := c.net.trans[raftAddr(fi)]
	c.net.mu.Unlock()
	tr.DisconnectAll()
	for i := range 3 {
		if i != fi {
			c.net.trans[raftAddr(i)].Disconnect(raft.ServerAddress(raftAddr(fi)))
		}
	}
	poll.Until(t, 10*time.Second, func() error {
		if err := c.nodes[fi].Ready(); err == nil {
			return errors.New("cut-off follower still ready")
		}
		return nil
	})
	a := NewAffinity(c.nodes[fi])
	_, err := a.Acquire(context.Background(), "x", nil)
	if !errors.Is(err, ErrStale) {
		t.Fatalf("acquire on a stale replica: %v, want ErrStale", err)
	}
}

func TestOneNodeBindingsSurviveRestart(t *testing.T) {
	dir := t.TempDir()
	open := func() *Node {
		n, err := Open(context.Background(), Config{
			ID: "solo", DataDir: dir, RaftBind: "127.0.0.1:0", PeerAddr: "127.0.0.1:1",
			HeartbeatTimeout: 100 * time.Millisecond, ElectionTimeout: 100 * time.Millisecond, LeaderLeaseTimeout: 50 * time.Millisecond,
		})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	n := open()
	a := NewAffinity(n)
	b := bindVia(t, a, "durable", indexer.Worker{ID: "w3", DPRank: 1})
	// Half the bindings come back from a snapshot, half from the log after it.
	if err := n.raft.Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	b2 := bindVia(t, a, "after-snapshot", indexer.Worker{ID: "w1"})
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	n = open()
	defer n.Close()
	poll.Until(t, 10*time.Second, func() error {
		got, ok := n.FSM().Get("durable")
		if !ok || got.Revision != b.Revision || got.Worker != "w3" || got.DPRank != 1 {
			return fmt.Errorf("after restart: %+v %v", got, ok)
		}
		if got, ok := n.FSM().Get("after-snapshot"); !ok || got.Revision != b2.Revision {
			return fmt.Errorf("after restart, the bind after the snapshot: %+v %v", got, ok)
		}
		return nil
	})
}

func TestApplyRejectsGarbageCommandFromPeer(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	_, ln := c.leader()
	_, _, err := ln.PeerHandler().Apply(context.Background(), []byte{0x7f, 1, 2, 3})
	if err == nil {
		t.Fatal("garbage command accepted")
	}
	// Had it reached the log, applying it would panic every replica's FSM (an unknown type
	// without the 0x80 flag): everything the leader appended so far applies cleanly. (The
	// applied index cannot be compared: the leader appends entries of its own meanwhile.)
	if err := ln.raft.Barrier(5 * time.Second).Error(); err != nil {
		t.Fatalf("barrier after the garbage: %v", err)
	}
}

// TestLoneNodeAnswersACommandSentBeforeItLeads: a lone node's command issued before it has
// elected itself waits for that and answers with the result (it used to answer nothing,
// which a caller reading the result then dereferenced).
func TestLoneNodeAnswersACommandSentBeforeItLeads(t *testing.T) {
	_, tr := raft.NewInmemTransport("solo")
	n, err := Open(context.Background(), Config{ID: "solo", RaftBind: "solo", PeerAddr: "solo-peer", InMemory: true, Transport: tr,
		HeartbeatTimeout: 100 * time.Millisecond, ElectionTimeout: 100 * time.Millisecond, LeaderLeaseTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if n.IsLeader() {
		t.Skip("the node led before the command could be sent")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := n.Apply(ctx, &fsm.Bind{Session: "early", Worker: "w1", TTL: time.Minute})
	if err != nil || res == nil || res.Status != fsm.Created || res.Binding.Worker != "w1" {
		t.Fatalf("Apply before leading: %+v %v, want a created binding", res, err)
	}
}

// TestRebindIsOneCompareAndSet: a lease reopened because its worker failed replaces the
// binding with one compare-and-set Bind on its revision (one log entry, no Invalidate
// first), and of two replicas replacing it at once, the first wins and the second is told
// where the session went.
func TestRebindIsOneCompareAndSet(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.CheckpointInterval = time.Hour })
	li, ln := c.leader()
	a := NewAffinity(ln)
	other := NewAffinity(c.nodes[(li+1)%3])
	old := bindVia(t, a, "moving", indexer.Worker{ID: "w1"})
	poll.Until(t, 10*time.Second, func() error {
		if b, ok, err := other.Peek(context.Background(), "moving"); err != nil || !ok || b != old {
			return fmt.Errorf("the follower reads %+v %v %v", b, ok, err)
		}
		return nil
	})
	ctx := context.Background()
	first, err := a.Acquire(ctx, "moving", nil)
	if err != nil {
		t.Fatal(err)
	}
	second, err := other.Acquire(ctx, "moving", nil)
	if err != nil {
		t.Fatal(err)
	}
	if !first.Reopen() || !second.Reopen() {
		t.Fatal("a bound lease did not reopen")
	}
	if _, bound := first.Binding(); bound {
		t.Fatal("a reopened lease still reports its old binding")
	}
	before := ln.fsm.AppliedIndex()
	nb, err := first.Commit(ctx, indexer.Worker{ID: "w2"}, "")
	if err != nil || nb.Worker.ID != "w2" || nb.Revision <= old.Revision {
		t.Fatalf("first replacement: %+v %v", nb, err)
	}
	if got := commandsBetween(t, ln, before, ln.fsm.AppliedIndex()); got != 1 {
		t.Fatalf("the replacement took %d commands, want 1", got)
	}
	lost, err := second.Commit(ctx, indexer.Worker{ID: "w3"}, "")
	if !errors.Is(err, routing.ErrBoundElsewhere) || lost != nb {
		t.Fatalf("second replacement: %+v %v, want the first's %+v and ErrBoundElsewhere", lost, err, nb)
	}
	first.Release()
	second.Release()
	if b, _ := ln.fsm.Get("moving"); b.Worker != "w2" || b.Revision != nb.Revision {
		t.Fatalf("binding after both: %+v, want %+v", b, nb)
	}

	// A reopened lease that gives up drops the binding it was to replace.
	l, err := a.Acquire(ctx, "moving", nil)
	if err != nil || !l.Reopen() {
		t.Fatalf("acquire and reopen: %v", err)
	}
	l.Invalidate(ctx)
	if _, ok := ln.fsm.Get("moving"); ok {
		t.Fatal("the binding outlived a reopened lease that gave up")
	}
}

// TestCommitToAWorkerDrainedMeanwhileLeavesTheLeaseOpenForTheNextChoice: a worker drained
// between a request's choice and its commit refuses the binding with ErrWorkerDraining, binds
// nothing, and the same lease then commits the request's next choice (another request of the
// session would otherwise wait on a gate nobody opens, or the client get a 503 for a worker
// that answered).
func TestCommitToAWorkerDrainedMeanwhileLeavesTheLeaseOpenForTheNextChoice(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	li, leader := c.leader()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, id := range []string{"w1", "w2"} {
		if _, err := leader.Apply(ctx, &fsm.AddWorker{ID: id, Spec: []byte(`{"id":"` + id + `"}`)}); err != nil {
			t.Fatal(err)
		}
	}
	a := NewAffinity(c.nodes[(li+1)%3])
	l, err := a.Acquire(ctx, "s", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if _, err := leader.Apply(ctx, &fsm.DrainWorker{ID: "w1"}); err != nil {
		t.Fatal(err)
	}
	if b, err := l.Commit(ctx, indexer.Worker{ID: "w1"}, ""); !errors.Is(err, routing.ErrWorkerDraining) {
		t.Fatalf("commit to the draining worker: %+v %v, want ErrWorkerDraining", b, err)
	}
	if _, ok := leader.FSM().Get("s"); ok {
		t.Fatal("a binding was made to the draining worker")
	}
	b, err := l.Commit(ctx, indexer.Worker{ID: "w2"}, "")
	if err != nil || b.Worker.ID != "w2" || b.Revision == 0 {
		t.Fatalf("commit of the next choice: %+v %v", b, err)
	}
}
