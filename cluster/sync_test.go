package cluster

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// heldAppends stands between a node's Raft and its transport: while a target is held, the
// appends that carry entries or a commit index to it wait (heartbeats pass, so it stays a
// follower), as for a follower a moment behind its leader.
type heldAppends struct {
	raft.Transport
	hold *appendHold
}

// appendHold is the held target of every node's heldAppends, and its release.
type appendHold struct {
	mu      sync.Mutex
	target  raft.ServerAddress
	release chan struct{}
}

func (h *appendHold) set(target raft.ServerAddress) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.target, h.release = target, make(chan struct{})
}

func (h *appendHold) lift() {
	h.mu.Lock()
	defer h.mu.Unlock()
	close(h.release)
	h.target = ""
}

// AppendEntriesPipeline refuses pipelining, so every append goes through AppendEntries.
func (s *heldAppends) AppendEntriesPipeline(raft.ServerID, raft.ServerAddress) (raft.AppendPipeline, error) {
	return nil, raft.ErrPipelineReplicationNotSupported
}

func (s *heldAppends) AppendEntries(id raft.ServerID, target raft.ServerAddress, args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	heartbeat := len(args.Entries) == 0 && args.PrevLogEntry == 0 && args.LeaderCommitIndex == 0
	s.hold.mu.Lock()
	held, release := s.hold.target == target, s.hold.release
	s.hold.mu.Unlock()
	if held && !heartbeat {
		<-release
	}
	return s.Transport.AppendEntries(id, target, args, resp)
}

// TestSyncCatchesUpWithABindingMadeThroughTheLeader: a binding acknowledged through the
// leader while a follower has not heard of it yet is in that follower's state once its Sync
// returns (the follow-up of a Responses answer, arriving on a replica a moment behind).
func TestSyncCatchesUpWithABindingMadeThroughTheLeader(t *testing.T) {
	hold := &appendHold{}
	c := newWrappedCluster(t, 3, nil, func(_ int, tr raft.Transport) raft.Transport {
		return &heldAppends{Transport: tr, hold: hold}
	})
	li, leader := c.leader()
	fi := (li + 1) % 3
	follower := c.nodes[fi]
	hold.set(raft.ServerAddress(raftAddr(fi)))
	const session = "response resp_1"
	bound := bindVia(t, NewAffinity(leader), session, indexer.Worker{ID: "w1"})
	if _, ok := follower.fsm.Get(session); ok {
		hold.lift()
		t.Fatal("the held follower has the binding already: the test shows nothing")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- NewAffinity(follower).Sync(ctx) }()
	hold.lift()
	if err := <-done; err != nil {
		t.Fatalf("Sync: %v", err)
	}
	if b, ok := follower.fsm.Get(session); !ok || b.Revision != bound.Revision {
		t.Fatalf("after Sync the follower has %+v (%v), want revision %d", b, ok, bound.Revision)
	}
}
