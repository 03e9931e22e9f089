//go:build jepsen_broken_lease

package cluster

import (
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// brokenLeaseHolds brings back the freshness rule that the read lease replaced, in builds
// with the jepsen_broken_lease tag only, never in a release, so that the fault harness can
// show its checker catches a replica serving bindings older than the bound. The rule: a
// follower is fresh when it knows a leader and heard from it within the bound, so the
// first heartbeat after a pause made it "fresh" while its FSM lacked everything committed
// meanwhile; a leader is fresh once it has established its term, so a resumed leader
// served until it noticed it had lost its quorum.
func (n *Node) brokenLeaseHolds() (bool, error) {
	return true, n.contactFresh()
}

func (n *Node) contactFresh() error {
	switch n.raft.State() {
	case raft.Leader:
		// A new leader serves only once its Barrier has applied everything committed:
		// before that its FSM may lack bindings acknowledged under the previous leader.
		if !n.lead.isEstablished() {
			return fmt.Errorf("%w: new leader still applying the log", ErrStale)
		}
		return nil
	case raft.Follower:
		if _, lid := n.raft.LeaderWithID(); lid == "" {
			return fmt.Errorf("%w: no leader known", ErrStale)
		}
		if since := time.Since(n.raft.LastContact()); since > n.cfg.StaleBound {
			return fmt.Errorf("%w: last contact %s ago (bound %s)", ErrStale, since.Round(time.Millisecond), n.cfg.StaleBound)
		}
		return nil
	default:
		return fmt.Errorf("%w: raft state %s", ErrStale, n.raft.State())
	}
}
