package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// fakeMembers is a MemberSource the test writes.
type fakeMembers struct {
	mu sync.Mutex
	ms map[string]gossip.Member
}

func newFakeMembers(c *testCluster) *fakeMembers {
	f := &fakeMembers{ms: map[string]gossip.Member{}}
	for i := range c.nodes {
		f.set(i, gossip.Alive, time.Time{})
	}
	return f
}

func (f *fakeMembers) set(i int, st gossip.State, since time.Time) {
	f.put(gossip.Member{Name: fmt.Sprintf("r%d", i), State: st, Since: since,
		Meta: gossip.Meta{ID: fmt.Sprintf("r%d", i), RaftAddr: raftAddr(i), PeerAddr: peerAddr(i)}})
}

func (f *fakeMembers) put(m gossip.Member) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ms[m.Name] = m
}

func (f *fakeMembers) drop(i int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.ms, fmt.Sprintf("r%d", i))
}

func (f *fakeMembers) Members() []gossip.Member {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []gossip.Member
	for _, m := range f.ms {
		out = append(out, m)
	}
	return out
}

// manualClock is a settable clock.
type manualClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *manualClock) Now() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *manualClock) set(t time.Time) { c.mu.Lock(); c.now = t; c.mu.Unlock() }

// startLoose opens node i on the cluster's network without any way to join by itself: it
// waits to be added.
func (c *testCluster) startLoose(i int) *Node {
	c.t.Helper()
	_, tr := raft.NewInmemTransport(raft.ServerAddress(raftAddr(i)))
	c.net.mu.Lock()
	for addr, other := range c.net.trans {
		tr.Connect(raft.ServerAddress(addr), other)
		other.Connect(raft.ServerAddress(raftAddr(i)), tr)
	}
	c.net.trans[raftAddr(i)] = tr
	c.net.mu.Unlock()
	cfg := c.cfg(i)
	cfg.Transport, cfg.Remote, cfg.Join, cfg.BootstrapExpect = tr, nil, nil, 2
	n, err := Open(context.Background(), cfg)
	if err != nil {
		c.t.Fatalf("open node %d: %v", i, err)
	}
	c.net.mu.Lock()
	c.net.nodes[peerAddr(i)] = n
	c.net.mu.Unlock()
	for len(c.nodes) <= i {
		c.nodes = append(c.nodes, nil)
	}
	c.nodes[i] = n
	return n
}

// servers is the leader's raft configuration as id -> suffrage.
func servers(t *testing.T, n *Node) map[string]raft.ServerSuffrage {
	t.Helper()
	f := n.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		t.Fatal(err)
	}
	out := map[string]raft.ServerSuffrage{}
	for _, s := range f.Configuration().Servers {
		out[string(s.ID)] = s.Suffrage
	}
	return out
}

// followers returns the indexes of the live nodes other than the leader's.
func (c *testCluster) followers(leader int) []int {
	var out []int
	for i, n := range c.nodes {
		if n != nil && i != leader {
			out = append(out, i)
		}
	}
	return out
}

func TestReconcileAddsAliveMembersAsVotersOnlyOnTheLeader(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	_, ln := c.leader()
	src := newFakeMembers(c)
	fresh := c.startLoose(3)
	src.set(3, gossip.Alive, time.Now())
	src.put(gossip.Member{Name: "r4", State: gossip.Alive, Meta: gossip.Meta{ID: "r4", RaftAddr: "raft-4", ClusterID: "another-cluster"}})
	src.put(gossip.Member{Name: "r5", State: gossip.Alive, Meta: gossip.Meta{ID: "r5"}})
	src.put(gossip.Member{Name: "r6", State: gossip.Alive, Meta: gossip.Meta{ID: "r7", RaftAddr: "raft-6"}})
	src.put(gossip.Member{Name: "r8", State: gossip.Dead, Meta: gossip.Meta{ID: "r8", RaftAddr: "raft-8"}})
	for _, n := range c.nodes[:3] {
		n.ReconcileMembers(src, ReconcileConfig{Interval: 20 * time.Millisecond})
	}
	poll.Until(t, 10*time.Second, func() error {
		if s := servers(t, ln); s["r3"] != raft.Voter {
			return fmt.Errorf("r3 is not a voter: %v", s)
		}
		if s := servers(t, fresh); len(s) != 4 {
			return fmt.Errorf("the new voter has configuration %v", s)
		}
		// The member record is a log entry of its own, committed after the voter.
		if m, ok := ln.FSM().Member("r3"); !ok || m.PeerAddr != peerAddr(3) {
			return fmt.Errorf("r3's peer address not recorded: %+v", m)
		}
		return nil
	})
	s := servers(t, ln)
	for _, id := range []string{"r4", "r5", "r6", "r8"} {
		if _, ok := s[id]; ok {
			t.Errorf("%s was added: %v", id, s)
		}
	}
	if len(s) != 4 {
		t.Errorf("configuration %v, want r0..r3", s)
	}
}

// reconcilerOn builds a reconciler on the leader of c with a manual clock.
func reconcilerOn(t *testing.T, ln *Node, src MemberSource, cfg ReconcileConfig) (*reconciler, *manualClock) {
	clock := &manualClock{now: time.Unix(10_000, 0)}
	return reconcilerWith(t, ln, src, cfg, clock), clock
}

// reconcilerWith builds a reconciler on n that reads the time from clock.
func reconcilerWith(t *testing.T, n *Node, src MemberSource, cfg ReconcileConfig, clock *manualClock) *reconciler {
	cfg.Now = clock.Now
	r := newReconciler(n, src, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	r.watch(ctx)
	return r
}

// leadingPass runs one reconciliation pass on whichever live node of c leads, and says why
// it was not a pass that decided anything about id: no established leader, the leader's
// first pass of its term (which forgets older heartbeat failures), no fresh heartbeat
// failure to id yet (unless id is out of the leader's configuration already: a leader does
// not heartbeat a server it removed), or leadership moved during the pass. It returns the
// leader.
func leadingPass(c *testCluster, rs []*reconciler, id string) (*Node, error) {
	for i, n := range c.nodes {
		if n == nil || !n.IsLeader() || !n.lead.isEstablished() {
			continue
		}
		r := rs[i]
		term := n.raft.CurrentTerm()
		_, member := servers(c.t, n)[id]
		r.mu.Lock()
		known, unreachable := r.term == term, !member || r.raftUnreachable(id, r.cfg.Now())
		r.mu.Unlock()
		if err := r.once(context.Background()); err != nil {
			return nil, fmt.Errorf("pass on r%d: %w", i, err)
		}
		switch {
		case !known:
			return nil, fmt.Errorf("r%d's first pass in term %d", i, term)
		case !unreachable:
			return nil, fmt.Errorf("no recent heartbeat failure from r%d to %s", i, id)
		case !n.IsLeader() || n.raft.CurrentTerm() != term:
			return nil, fmt.Errorf("r%d lost term %d during the pass", i, term)
		}
		return n, nil
	}
	return nil, errors.New("no established leader")
}

// untilUnreachable waits until the leader's heartbeats to id have failed at the current
// (manual) time.
func untilUnreachable(t *testing.T, r *reconciler, id string) {
	t.Helper()
	poll.Until(t, 10*time.Second, func() error {
		r.mu.Lock()
		defer r.mu.Unlock()
		if !r.raftUnreachable(id, r.cfg.Now()) {
			return fmt.Errorf("no recent heartbeat failure to %s", id)
		}
		return nil
	})
}

// TestReconcileRemovesDeadMembersAfterCleanupNeverBelowMinQuorum holds under load too: with
// one of four nodes dead the cluster keeps quorum only while every other answers in time, so
// leadership may move. Every live node runs a reconciler on one clock, and each step waits
// for a pass by whichever node leads that can decide (see leadingPass).
func TestReconcileRemovesDeadMembersAfterCleanupNeverBelowMinQuorum(t *testing.T) {
	c := newTestCluster(t, 4, nil)
	li, _ := c.leader()
	fs := c.followers(li)
	src := newFakeMembers(c)
	clock := &manualClock{now: time.Unix(10_000, 0)}
	cfg := ReconcileConfig{MinQuorum: 3, CleanupInterval: time.Minute}
	rs := make([]*reconciler, len(c.nodes))
	for i, n := range c.nodes {
		rs[i] = reconcilerWith(t, n, src, cfg, clock)
	}
	// decided waits for a pass that decided about id, and returns the configuration after it.
	decided := func(id string, done func(map[string]raft.ServerSuffrage) error) map[string]raft.ServerSuffrage {
		t.Helper()
		var s map[string]raft.ServerSuffrage
		poll.Until(t, 60*time.Second, func() error {
			ln, err := leadingPass(c, rs, id)
			if err != nil {
				return err
			}
			s = servers(t, ln)
			return done(s)
		})
		return s
	}
	t0 := clock.Now()
	victim := fmt.Sprintf("r%d", fs[0])
	c.kill(fs[0])
	src.set(fs[0], gossip.Dead, t0)

	clock.set(t0.Add(30 * time.Second))
	if s := decided(victim, func(map[string]raft.ServerSuffrage) error { return nil }); s[victim] != raft.Voter {
		t.Fatalf("removed before the cleanup interval: %v", s)
	}

	clock.set(t0.Add(61 * time.Second))
	decided(victim, func(s map[string]raft.ServerSuffrage) error {
		if _, ok := s[victim]; ok {
			return fmt.Errorf("dead past the cleanup interval and unreachable, yet still a server: %v", s)
		}
		return nil
	})

	// Three voters left: a second death must not shrink the cluster below the floor. The
	// leader's configuration can be ahead of its followers': every live node holds the three
	// voters before a follower of the leader dies (were the leader to die with the removal
	// unreplicated, two of four voters could elect nobody).
	poll.Until(t, 60*time.Second, func() error {
		_, _ = leadingPass(c, rs, victim) // a new leader without the removal makes it again
		for i, n := range c.nodes {
			if n == nil {
				continue
			}
			if _, ok := servers(t, n)[victim]; ok {
				return fmt.Errorf("r%d still has %s in its configuration", i, victim)
			}
		}
		return nil
	})
	li, _ = c.leaderWithin(60 * time.Second)
	dies := c.followers(li)[0]
	second := fmt.Sprintf("r%d", dies)
	c.kill(dies)
	src.set(dies, gossip.Dead, t0)
	clock.set(t0.Add(time.Hour))
	if s := decided(second, func(map[string]raft.ServerSuffrage) error { return nil }); len(s) != 3 || s[second] != raft.Voter {
		t.Fatalf("configuration %v: the floor of 3 voters was not kept", s)
	}
}

func TestReconcileRemovesALeaverAtOnceWithinTheFloor(t *testing.T) {
	c := newTestCluster(t, 4, nil)
	li, ln := c.leader()
	fs := c.followers(li)
	src := newFakeMembers(c)
	r, clock := reconcilerOn(t, ln, src, ReconcileConfig{MinQuorum: 3, CleanupInterval: time.Hour})
	ctx := context.Background()
	src.set(fs[0], gossip.Left, clock.Now())
	src.set(fs[1], gossip.Left, clock.Now())
	if err := r.once(ctx); err != nil {
		t.Fatal(err)
	}
	s := servers(t, ln)
	left := 0
	for _, i := range fs[:2] {
		if _, ok := s[fmt.Sprintf("r%d", i)]; !ok {
			left++
		}
	}
	if left != 1 || len(s) != 3 {
		t.Fatalf("configuration %v: want exactly one leaver removed (floor of 3 voters)", s)
	}
}

func TestReconcileKeepsServersRaftCanStillReach(t *testing.T) {
	c := newTestCluster(t, 4, nil)
	li, ln := c.leader()
	fs := c.followers(li)
	src := newFakeMembers(c)
	r, clock := reconcilerOn(t, ln, src, ReconcileConfig{MinQuorum: 1, CleanupInterval: time.Minute})
	ctx := context.Background()
	// Gossip says one is long dead and knows nothing of another, but both answer Raft.
	src.set(fs[0], gossip.Dead, clock.Now().Add(-time.Hour))
	src.drop(fs[1])
	for range 3 {
		if err := r.once(ctx); err != nil {
			t.Fatal(err)
		}
		clock.set(clock.Now().Add(time.Hour))
	}
	if s := servers(t, ln); len(s) != 4 {
		t.Fatalf("a reachable voter was removed on gossip's word alone: %v", s)
	}
}

func TestReconcileRemovesServersGossipNeverKnew(t *testing.T) {
	c := newTestCluster(t, 4, nil)
	li, ln := c.leader()
	fs := c.followers(li)
	src := newFakeMembers(c)
	r, clock := reconcilerOn(t, ln, src, ReconcileConfig{MinQuorum: 3, CleanupInterval: time.Minute})
	ctx := context.Background()
	victim := fmt.Sprintf("r%d", fs[0])
	c.kill(fs[0])
	src.drop(fs[0]) // as after a restart of the leader: gossip never saw it die
	untilUnreachable(t, r, victim)
	if err := r.once(ctx); err != nil {
		t.Fatal(err)
	}
	if _, ok := servers(t, ln)[victim]; !ok {
		t.Fatal("removed the moment it was missed")
	}
	clock.set(clock.Now().Add(2 * time.Minute))
	untilUnreachable(t, r, victim)
	if err := r.once(ctx); err != nil {
		t.Fatal(err)
	}
	if _, ok := servers(t, ln)[victim]; ok {
		t.Fatal("unknown to gossip and unreachable past the cleanup interval, yet kept")
	}
}

func TestReconcileDoesNothingOnAFollower(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	li, ln := c.leader()
	fi := c.followers(li)[0]
	// A follower learns the configuration from the leader's first entries.
	poll.Until(t, 10*time.Second, func() error {
		if s := servers(t, c.nodes[fi]); len(s) != 3 {
			return fmt.Errorf("the follower sees %v", s)
		}
		return nil
	})
	src := newFakeMembers(c)
	src.set(li, gossip.Left, time.Now())
	r, _ := reconcilerOn(t, c.nodes[fi], src, ReconcileConfig{MinQuorum: 1})
	if err := r.once(context.Background()); err != nil {
		t.Fatal(err)
	}
	if s := servers(t, ln); len(s) != 3 {
		t.Fatalf("a follower changed the configuration: %v", s)
	}
	if s := servers(t, c.nodes[fi]); len(s) != 3 {
		t.Fatalf("the follower sees %v", s)
	}
}
