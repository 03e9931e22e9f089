package cluster

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// lostAnswers stands between a node's Raft and its transport: while cut, the node's appends
// either reach the follower with their answers lost (deliver) or do not reach it at all, and
// its vote requests fail, so a leader cannot commit, steps down and cannot lead again.
type lostAnswers struct {
	raft.Transport
	cut     atomic.Bool
	deliver bool
}

// AppendEntriesPipeline refuses pipelining, so every append goes through AppendEntries.
func (s *lostAnswers) AppendEntriesPipeline(raft.ServerID, raft.ServerAddress) (raft.AppendPipeline, error) {
	return nil, raft.ErrPipelineReplicationNotSupported
}

func (s *lostAnswers) AppendEntries(id raft.ServerID, target raft.ServerAddress, args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	if !s.cut.Load() {
		return s.Transport.AppendEntries(id, target, args, resp)
	}
	if s.deliver {
		var lost raft.AppendEntriesResponse
		_ = s.Transport.AppendEntries(id, target, args, &lost)
	}
	return errors.New("answer lost")
}

func (s *lostAnswers) RequestVote(id raft.ServerID, target raft.ServerAddress, args *raft.RequestVoteRequest, resp *raft.RequestVoteResponse) error {
	if s.cut.Load() {
		return errors.New("vote request lost")
	}
	return s.Transport.RequestVote(id, target, args, resp)
}

// TestInvalidationAcrossAChangeOfLeaderAnswersWhatItDid: an invalidation applied on a leader
// that steps down before the entry commits answers what it did: "removed" when the next term
// commits that very entry (before, the node sent it again, and the second copy answered "not
// found": `ctl sessions invalidate` and the admin DELETE reported 409 for an invalidation
// that had succeeded), and "removed" when the entry was lost, by sending it again.
func TestInvalidationAcrossAChangeOfLeaderAnswersWhatItDid(t *testing.T) {
	cases := []struct {
		name    string
		deliver bool // the followers store the entry: the next term commits it
	}{
		{"the followers stored the entry: the next term commits it", true},
		{"no follower stored the entry: the next term overwrites it", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			wraps := make([]*lostAnswers, 3)
			c := newWrappedCluster(t, 3, func(cfg *Config) { cfg.CheckpointInterval = time.Hour }, func(i int, tr raft.Transport) raft.Transport {
				wraps[i] = &lostAnswers{Transport: tr, deliver: tc.deliver}
				return wraps[i]
			})
			li, old := c.leader()
			b := bindVia(t, NewAffinity(old), "s", indexer.Worker{ID: "w1"})
			before := old.raft.LastIndex()
			wraps[li].cut.Store(true)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			res, err := old.Apply(ctx, &fsm.Invalidate{Session: "s", Revision: b.Revision})
			if err != nil {
				t.Fatalf("invalidate through r%d as it stepped down: %v", li, err)
			}
			if res.Status != fsm.Removed || res.Binding.Revision != b.Revision {
				t.Fatalf("invalidate answered %s (revision %d), want removed (revision %d)", res.Status, res.Binding.Revision, b.Revision)
			}
			if old.IsLeader() {
				t.Fatalf("r%d still leads: the scenario did not happen", li)
			}
			_, nl := c.leader()
			if got := commandsOf(t, nl, before, nl.raft.AppliedIndex(), &fsm.Invalidate{Session: "s", Revision: b.Revision}); got != 1 {
				t.Fatalf("the invalidation is in the log %d times, want once", got)
			}
			if _, ok := nl.FSM().Get("s"); ok {
				t.Fatal("the binding is still there")
			}
		})
	}
}

// commandsOf counts the entries of n's log after index from, up to index to, that are cmd.
func commandsOf(t *testing.T, n *Node, from, to uint64, cmd fsm.Command) int {
	t.Helper()
	want, err := fsm.Encode(cmd)
	if err != nil {
		t.Fatal(err)
	}
	count := 0
	for i := from + 1; i <= to; i++ {
		var e raft.Log
		if err := n.logs.GetLog(i, &e); err != nil {
			t.Fatalf("log entry %d: %v", i, err)
		}
		if e.Type == raft.LogCommand && string(e.Data) == string(want) {
			count++
		}
	}
	return count
}
