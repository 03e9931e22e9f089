package cluster

import (
	"errors"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// SetStopping tells the node its replica has begun to stop: from now on a read that finds no
// read lease is refused at once instead of waiting up to BindWait for one (the replica is
// leaving; another one serves the request sooner).
func (n *Node) SetStopping() {
	n.stopping.Store(true)
	n.notifyApplied()
}

// hopeless says why waiting for a read lease cannot help now ("" when it may): the replica
// is stopping, or it led and stepped down with no successor known (it lost its quorum:
// a partition or a pause cut it off) and has heard of no leader since. A follower whose
// leader went quiet, a candidate, and a leader still confirming its quorum may expect a
// leader soon (an election takes one or two election timeouts), so they wait.
func (n *Node) hopeless() string {
	switch {
	case n.closed.Load(), n.stopping.Load():
		return "stopping"
	case n.cutOff.Load():
		if _, lid := n.raft.LeaderWithID(); lid == "" {
			return "cut_off"
		}
	}
	return ""
}

// unavailable reports whether err is the kind of failure waiting for a leader may end.
func unavailable(err error) bool {
	return errors.Is(err, ErrStale) || errors.Is(err, ErrNoLeader)
}

// refuse wraps err as a routing.Refusal: nothing was sent to a worker, so the load balancer
// may send the request to another replica.
func refuse(reason string, err error) error {
	return &routing.Refusal{Reason: reason, Err: err}
}
