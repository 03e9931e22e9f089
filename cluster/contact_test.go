package cluster

import (
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// TestQuorumContactIsTheLatestAnswerThatMakesAQuorum: the leader's contact with its quorum
// is the (quorum-1)-th most recent answer among the other voters (itself making up the rest);
// non-voters and strangers do not count, and too few answers (or a lone voter) give none.
func TestQuorumContactIsTheLatestAnswerThatMakesAQuorum(t *testing.T) {
	voter := func(id string) raft.Server { return raft.Server{ID: raft.ServerID(id), Suffrage: raft.Voter} }
	nonvoter := raft.Server{ID: "n", Suffrage: raft.Nonvoter}
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	cases := []struct {
		name    string
		servers []raft.Server
		last    map[raft.ServerID]time.Duration
		want    time.Duration
		wantOK  bool
	}{
		{name: "three voters: the more recent follower", servers: []raft.Server{voter("a"), voter("b"), voter("c")},
			last: map[raft.ServerID]time.Duration{"b": ms(100), "c": ms(40)}, want: ms(100), wantOK: true},
		{name: "three voters, one answered", servers: []raft.Server{voter("a"), voter("b"), voter("c")},
			last: map[raft.ServerID]time.Duration{"c": ms(40)}, want: ms(40), wantOK: true},
		{name: "five voters: the second most recent", servers: []raft.Server{voter("a"), voter("b"), voter("c"), voter("d"), voter("e")},
			last: map[raft.ServerID]time.Duration{"b": ms(10), "c": ms(90), "d": ms(50), "e": ms(70)}, want: ms(70), wantOK: true},
		{name: "five voters, one answered: no quorum yet", servers: []raft.Server{voter("a"), voter("b"), voter("c"), voter("d"), voter("e")},
			last: map[raft.ServerID]time.Duration{"b": ms(10)}},
		{name: "a non-voter's and a stranger's answers do not count", servers: []raft.Server{voter("a"), voter("b"), voter("c"), nonvoter},
			last: map[raft.ServerID]time.Duration{"n": ms(500), "x": ms(600), "b": ms(30)}, want: ms(30), wantOK: true},
		{name: "two voters: the other one", servers: []raft.Server{voter("a"), voter("b")},
			last: map[raft.ServerID]time.Duration{"b": ms(20)}, want: ms(20), wantOK: true},
		{name: "a lone voter", servers: []raft.Server{voter("a"), nonvoter},
			last: map[raft.ServerID]time.Duration{"n": ms(20)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := quorumTime(tc.servers, "a", tc.last)
			if got != tc.want || ok != tc.wantOK {
				t.Fatalf("quorumTime = %s, %v; want %s, %v", got, ok, tc.want, tc.wantOK)
			}
		})
	}
}

// TestALeaderCutOffFromItsQuorumSeesItsContactGoStaleBeforeItStepsDown: in a healthy
// three-node cluster the leader's and the followers' contact is fresh, so a new session's
// binding goes beside its worker's prefill (BindFirst false); once the leader's links to
// both followers are cut, its contact goes stale while it still leads (the window in which
// its read lease may still hold), so a new binding is committed before dispatch. The
// heartbeat and leader-lease timeouts are wide (1 s: contact stale after 0.2 s, step-down
// after 1-2 s), so that the test sees the window on a loaded machine.
func TestALeaderCutOffFromItsQuorumSeesItsContactGoStaleBeforeItStepsDown(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) {
		cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = time.Second, time.Second, time.Second
	})
	li, ln := c.leader()
	poll.Until(t, 10*time.Second, func() error {
		for i, n := range c.nodes {
			if !n.ContactFresh() {
				age, ok := n.contactAge()
				return fmt.Errorf("node %d: contact not fresh (%s, %v)", i, age, ok)
			}
		}
		return nil
	})
	a := NewAffinity(ln)
	l, err := a.Acquire(t.Context(), "s", nil)
	if err != nil {
		t.Fatal(err)
	}
	if l.(*lease).BindFirst() {
		t.Fatal("a leader in contact with its quorum binds new sessions before dispatch")
	}
	l.Release()
	c.net.mu.Lock()
	for addr, tr := range c.net.trans {
		if addr != raftAddr(li) {
			tr.Disconnect(raft.ServerAddress(raftAddr(li)))
			c.net.trans[raftAddr(li)].Disconnect(raft.ServerAddress(addr))
		}
	}
	c.net.mu.Unlock()
	poll.Until(t, 10*time.Second, func() error {
		if !ln.IsLeader() {
			t.Fatal("the cut-off leader stepped down before its contact went stale")
		}
		if ln.ContactFresh() {
			age, _ := ln.contactAge()
			return fmt.Errorf("the cut-off leader's quorum contact is %s old, still fresh", age)
		}
		return nil
	})
	age, _ := ln.contactAge()
	t.Logf("stale at %s (bound %s) while still leading", age, ln.contactBound())
}
