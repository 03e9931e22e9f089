package cluster

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// quorumContact is when this replica, as leader, last heard from a quorum of voters
// (DESIGN.md, "Binding before dispatch"): itself, and the (quorum-1)-th most recent answer
// among the other voters. An answer counts from the moment its AppendEntries (a heartbeat,
// or replication) was sent, not received: an answer read after a pause, to a request sent
// before it, is as old as the request. Raft sends each follower a heartbeat every
// HeartbeatTimeout/10 to /5 (randomised), so on a leader in contact the age stays under
// HeartbeatTimeout/5 and a round trip.
type quorumContact struct {
	now  func() time.Duration // the read lease's monotonic clock
	self raft.ServerID
	// raft is the node's Raft, for the voters (nil before it runs).
	raft *atomic.Pointer[raft.Raft]

	mu   sync.Mutex
	last map[raft.ServerID]time.Duration // when the latest answered AppendEntries to each was sent

	// at is the quorum's contact (lease clock, +1); 0: none yet.
	at atomic.Int64
}

// heard records an answer of id to an AppendEntries sent at sent, and updates the quorum's
// contact.
func (q *quorumContact) heard(id raft.ServerID, sent time.Duration) {
	r := q.raft.Load()
	if r == nil {
		return
	}
	f := r.GetConfiguration() // a copy raft keeps for readers: no wait on its main loop
	if f.Error() != nil {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if sent > q.last[id] {
		q.last[id] = sent
	}
	if at, ok := quorumTime(f.Configuration().Servers, q.self, q.last); ok && at+1 > time.Duration(q.at.Load()) {
		q.at.Store(int64(at + 1))
	}
}

// quorumTime is when self last heard from a quorum of servers' voters, given when each
// other voter's latest answer was sent (last): the quorum-1 most recent answers and self's
// own make the quorum, so it is the (quorum-1)-th most recent. false: not enough voters
// answered yet, or self is the only voter (its own quorum, always in contact).
func quorumTime(servers []raft.Server, self raft.ServerID, last map[raft.ServerID]time.Duration) (time.Duration, bool) {
	voters := 0
	var others []time.Duration
	for _, s := range servers {
		if s.Suffrage != raft.Voter {
			continue
		}
		voters++
		if s.ID == self {
			continue
		}
		if at, ok := last[s.ID]; ok {
			others = append(others, at)
		}
	}
	need := voters / 2 // the quorum, less self
	if need == 0 || len(others) < need {
		return 0, false
	}
	slices.Sort(others)
	return others[len(others)-need], true
}

// contactTransport is a Raft transport that records, for quorumContact, the answers to the
// AppendEntries this replica sends (heartbeats among them).
type contactTransport struct {
	fullTransport
	q *quorumContact
}

// fullTransport is what raft asks of the transports this node runs on (TCP and in-memory):
// pre-vote and Close included, which a wrapper must pass on.
type fullTransport interface {
	raft.Transport
	raft.WithPreVote
	raft.WithClose
}

// AppendEntries sends the RPC and notes an answer from a server in this term as contact.
func (t *contactTransport) AppendEntries(id raft.ServerID, target raft.ServerAddress, args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	sent := t.q.now()
	err := t.fullTransport.AppendEntries(id, target, args, resp)
	if err == nil && resp.Term == args.Term {
		t.q.heard(id, sent)
	}
	return err
}

// contactAge is how long ago this replica was last in contact with the cluster: on the
// leader, with a quorum of voters (quorumContact; 0 for a lone voter); on a follower, with
// its leader (raft's last contact). ok is false when it never was (or it is a candidate).
func (n *Node) contactAge() (age time.Duration, ok bool) {
	switch n.raft.State() {
	case raft.Leader:
		if at := n.contact.at.Load(); at > 0 {
			return n.lease.now() - time.Duration(at-1), true
		}
		return 0, n.loneVoter()
	case raft.Follower:
		if lc := n.raft.LastContact(); !lc.IsZero() {
			return time.Since(lc), true
		}
	}
	return 0, false
}

// loneVoter reports whether this replica is the only voter (its own quorum).
func (n *Node) loneVoter() bool {
	f := n.raft.GetConfiguration()
	if f.Error() != nil {
		return false
	}
	voters := 0
	for _, s := range f.Configuration().Servers {
		if s.Suffrage == raft.Voter {
			voters++
		}
	}
	return voters == 1
}

// contactBound is the age past which contact is no longer fresh: two heartbeat intervals of
// HeartbeatTimeout/10 (raft draws each between that and twice that), so a replica in contact
// crosses it only when a long interval meets a slow round trip or a late timer, which costs
// a new session its commit's latency, no more (DESIGN.md, "Binding before dispatch").
func (n *Node) contactBound() time.Duration { return n.cfg.HeartbeatTimeout / 5 }

// ContactFresh reports whether this replica's contact with its quorum (the leader's with a
// quorum of voters, a follower's with its leader) is within contactBound: while it is, a
// new session's binding is proposed beside its worker's prefill; once it is not, the binding
// is committed before any worker is asked (routing's bind-first lease), so that a replica
// cut off while its read lease still holds refuses the request instead of failing it after
// a worker ran it.
func (n *Node) ContactFresh() bool {
	age, ok := n.contactAge()
	return ok && age <= n.contactBound()
}
