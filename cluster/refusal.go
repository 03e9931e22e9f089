package cluster

import (
	"errors"
	"time"

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
// is stopping, or it led and stepped down with no successor known (it lost its quorum: a
// partition or a pause cut it off), has heard of no leader since, and has not won an
// election within cutOffGrace of stepping down either. A follower whose leader went quiet,
// a candidate, and a leader still confirming its quorum may expect a leader soon (an
// election takes one or two election timeouts), so they wait.
func (n *Node) hopeless() string {
	switch {
	case n.closed.Load(), n.stopping.Load():
		return "stopping"
	case n.cutOffFor() >= n.cutOffGrace():
		return "cut_off"
	}
	return ""
}

// cutOffFor is how long this node has been cut off (stepped down with no successor known,
// and no leader heard of since), or -1 when it is not.
func (n *Node) cutOffFor() time.Duration {
	at := n.cutOff.Load()
	if at == 0 {
		return -1
	}
	if _, lid := n.raft.LeaderWithID(); lid != "" {
		return -1
	}
	return n.lease.now() - time.Duration(at-1)
}

// cutOffGrace is how long a leader that stepped down with no successor in sight still waits
// before it refuses at once: one election round (election timeouts are drawn between one
// and two ElectionTimeout), in which it may be elected again. A leader that steps down for
// a slow quorum (CPU starvation) often is; one that a partition cut off never is, and its
// requests are then better served on the other side.
func (n *Node) cutOffGrace() time.Duration { return 2 * n.cfg.ElectionTimeout }

// unavailable reports whether err is the kind of failure waiting for a leader may end.
func unavailable(err error) bool {
	return errors.Is(err, ErrStale) || errors.Is(err, ErrNoLeader)
}

// refuse wraps err as a routing.Refusal: nothing was sent to a worker, so the load balancer
// may send the request to another replica.
func refuse(reason string, err error) error {
	return &routing.Refusal{Reason: reason, Err: err}
}
