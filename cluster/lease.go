package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// readLease is what the bounded level serves on (DESIGN.md, "Reading a binding"). While it
// holds, this replica's FSM reflects every binding change acknowledged to any client before
// the lease's round started, and the lease lasts StaleBound from that start: so a read under
// it misses nothing acknowledged more than StaleBound ago. It is anchored on the log, never
// on contact: a round is a read-index through the leader (a committed barrier on the leader
// itself) followed by waiting until the local FSM has applied that index. A heartbeat, which
// carries neither entries nor a commit index, renews nothing, and neither does its answer.
//
// The hot path only compares clocks and two of raft's atomics (leaseHolds); rounds run
// in the background about every StaleBound/3, and at once when a reader finds the lease gone.
type readLease struct {
	// base is the monotonic origin of grant offsets; a SIGSTOP does not stop that clock.
	base  time.Time
	grant atomic.Pointer[leaseGrant]
	poke  chan struct{}
	// last is the end (an offset from base) of the latest lease ever granted, which a term
	// change does not reset: how long ago this replica last held one (0: never).
	last atomic.Int64

	// Round outcomes, for metrics: renewed, failed (no answer, no leader, not applied in
	// time), discarded (the term or role changed while it ran).
	renewed, failed, discarded atomic.Uint64
}

// leaseGrant is one renewal: valid until the offset until, in the term and role it was
// granted in. Any change of either ends it at once.
type leaseGrant struct {
	until time.Duration
	term  uint64
	state raft.RaftState
}

func newReadLease() *readLease {
	return &readLease{base: time.Now(), poke: make(chan struct{}, 1)}
}

// now is the lease clock: monotonic time since base.
func (l *readLease) now() time.Duration { return time.Since(l.base) }

// reset ends the lease (a term change, a step-down, a lost leader).
func (l *readLease) reset() { l.grant.Store(nil) }

// wake asks for a round now, without waiting for it.
func (l *readLease) wake() {
	select {
	case l.poke <- struct{}{}:
	default:
	}
}

// errTermChanged discards a round that straddled a term or role change.
var errTermChanged = errors.New("term or role changed during the round")

// leaseHolds reports whether this replica may serve a bounded read now, and why not.
func (n *Node) leaseHolds() error {
	if broken, err := n.brokenLeaseHolds(); broken {
		return err
	}
	g := n.lease.grant.Load()
	if g == nil {
		return fmt.Errorf("%w: no read lease (waiting for a read-index round through the leader)", ErrStale)
	}
	if term, st := n.raft.CurrentTerm(), n.raft.State(); term != g.term || st != g.state {
		return fmt.Errorf("%w: read lease of term %d as %s, now term %d as %s", ErrStale, g.term, g.state, term, st)
	}
	if now := n.lease.now(); now >= g.until {
		return fmt.Errorf("%w: read lease expired %s ago (bound %s)", ErrStale, (now - g.until).Round(time.Millisecond), n.cfg.StaleBound)
	}
	return nil
}

// leaseRemaining is how long the read lease still holds (0 when it does not).
func (n *Node) leaseRemaining() time.Duration {
	if n.leaseHolds() != nil {
		return 0
	}
	if g := n.lease.grant.Load(); g != nil {
		return max(g.until-n.lease.now(), 0)
	}
	return 0
}

// renewLease runs one round: note the start and the term, get a read index (the leader
// confirms its leadership with a quorum; a follower asks the leader), wait until the FSM has
// applied it, and grant start + StaleBound if the term and role did not change meanwhile.
func (n *Node) renewLease(ctx context.Context) error {
	start := n.lease.now()
	term, st := n.raft.CurrentTerm(), n.raft.State()
	switch st {
	case raft.Leader:
	case raft.Follower:
		if _, lid := n.raft.LeaderWithID(); lid == "" {
			return fmt.Errorf("%w: no leader known", ErrNoLeader)
		}
	default:
		return fmt.Errorf("%w: raft state %s", ErrNoLeader, st)
	}
	idx, err := n.readIndex(ctx, st == raft.Leader)
	if err != nil {
		return err
	}
	if err := n.waitApplied(ctx, idx); err != nil {
		return fmt.Errorf("apply up to read index %d: %w", idx, err)
	}
	if n.raft.CurrentTerm() != term || n.raft.State() != st {
		return errTermChanged
	}
	until := start + n.cfg.StaleBound
	for {
		old := n.lease.grant.Load()
		if old != nil && old.term == term && old.state == st && old.until >= until {
			return nil
		}
		if n.lease.grant.CompareAndSwap(old, &leaseGrant{until: until, term: term, state: st}) {
			break
		}
	}
	for {
		last := n.lease.last.Load()
		if last >= int64(until) || n.lease.last.CompareAndSwap(last, int64(until)) {
			break
		}
	}
	n.notifyApplied() // readers waiting for freshness look again
	return nil
}

// keepLease renews the read lease every StaleBound/3, and at once when a reader found it
// gone, one round at a time, each bounded by StaleBound (a longer one grants nothing).
func (n *Node) keepLease() {
	defer n.wg.Done()
	every := max(n.cfg.StaleBound/3, time.Millisecond)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-n.ctx.Done():
			return
		case <-tick.C:
		case <-n.lease.poke:
		}
		ctx, cancel := context.WithTimeout(n.ctx, n.cfg.StaleBound)
		err := n.renewLease(ctx)
		cancel()
		switch {
		case err == nil:
			n.lease.renewed.Add(1)
		case errors.Is(err, errTermChanged):
			n.lease.discarded.Add(1)
		default:
			n.lease.failed.Add(1)
			n.log.Debug("read lease round failed", "err", err)
			// Waiting readers ask again every few milliseconds; do not spin on their pokes
			// while no leader answers.
			select {
			case <-n.ctx.Done():
				return
			case <-time.After(min(every, 20*time.Millisecond)):
			}
		}
	}
}
