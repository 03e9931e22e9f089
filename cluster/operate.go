package cluster

import (
	"errors"
	"fmt"

	"github.com/hashicorp/raft"
)

// Server is one member of the Raft configuration, as an operator sees it.
type Server struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"`
	PeerAddr string `json:"peer_addr"`
	// Suffrage is Voter, Nonvoter or Staging.
	Suffrage string `json:"suffrage"`
	Leader   bool   `json:"leader"`
}

// Servers is the latest Raft configuration this replica knows, with each member's peer
// address from the state machine.
func (n *Node) Servers() ([]Server, error) {
	f := n.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, fmt.Errorf("cluster: raft configuration: %w", err)
	}
	lid, _, _ := n.Leader()
	var out []Server
	for _, s := range f.Configuration().Servers {
		sv := Server{ID: string(s.ID), RaftAddr: string(s.Address), Suffrage: s.Suffrage.String(), Leader: string(s.ID) == lid}
		if m, ok := n.fsm.Member(string(s.ID)); ok {
			sv.PeerAddr = m.PeerAddr
		}
		out = append(out, sv)
	}
	return out, nil
}

// RaftStats is raft's own diagnostic table (state, term, indexes, timings) for operators.
func (n *Node) RaftStats() map[string]string { return n.raft.Stats() }

// ErrNotLeader: the call must be made on the leader.
var ErrNotLeader = errors.New("this replica does not lead")

// TransferLeadership hands leadership to the replica named to ("": the most up-to-date
// follower) and returns the new leader's id. Only the leader can; others get ErrNotLeader.
func (n *Node) TransferLeadership(to string) (string, error) {
	if !n.IsLeader() {
		return "", ErrNotLeader
	}
	var f raft.Future
	if to != "" {
		m, ok := n.fsm.Member(to)
		if !ok {
			return "", fmt.Errorf("cluster: no replica %q: %w", to, ErrUnknownReplica)
		}
		f = n.raft.LeadershipTransferToServer(raft.ServerID(to), raft.ServerAddress(m.RaftAddr))
	} else {
		f = n.raft.LeadershipTransfer()
	}
	if err := f.Error(); err != nil {
		return "", fmt.Errorf("cluster: leadership transfer: %w", err)
	}
	lid, _, _ := n.Leader()
	return lid, nil
}

// ErrUnknownReplica: no replica of that name is in the cluster's member list.
var ErrUnknownReplica = errors.New("unknown replica")

// SnapshotInfo describes a Raft snapshot taken on request.
type SnapshotInfo struct {
	ID    string `json:"id"`
	Index uint64 `json:"index"`
	Term  uint64 `json:"term"`
	Bytes int64  `json:"bytes"`
}

// Snapshot takes a Raft snapshot of this replica now (log compaction follows raft's own
// rules) and describes it.
func (n *Node) Snapshot() (SnapshotInfo, error) {
	f := n.raft.Snapshot()
	if err := f.Error(); err != nil {
		return SnapshotInfo{}, fmt.Errorf("cluster: snapshot: %w", err)
	}
	meta, rc, err := f.Open()
	if err != nil {
		return SnapshotInfo{}, fmt.Errorf("cluster: snapshot taken, but: %w", err)
	}
	rc.Close()
	return SnapshotInfo{ID: meta.ID, Index: meta.Index, Term: meta.Term, Bytes: meta.Size}, nil
}
