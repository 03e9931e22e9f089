package cluster

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// Affinity is the Raft-backed routing.AffinityStore: bindings are read from the local FSM
// at the node's consistency level and written through the leader. Concurrent first
// requests of a session on this replica wait for one initializer, as in
// routing.MemoryAffinity; across replicas the FSM's absent-only Bind decides, and the
// loser adopts the winner's binding.
type Affinity struct {
	n   *Node
	log interface {
		Debug(string, ...any)
		Warn(string, ...any)
	}

	mu    sync.Mutex
	local map[string]*localSession

	tmu sync.Mutex
	// recent is every session this replica touched within its TTL, with its last touch:
	// the leader's idle timers live in its memory alone, so a new leader (or one whose touch
	// never arrived) learns them again from here, with their age.
	recent map[string]recentTouch
	// unsent lists the sessions of recent the current leader has not acknowledged.
	unsent map[string]struct{}
	wake   chan struct{}
}

// recentTouch is this replica's last touch of a session.
type recentTouch struct {
	revision uint64
	at       time.Time
}

// localSession is this replica's in-flight view of one session.
type localSession struct {
	init   routing.InitGate // held while a request initialises (or replaces) the binding
	active int
	// bound is the binding this replica committed or read, kept until the local FSM has
	// applied it (a follower learns its own bind one round trip later).
	bound routing.Binding
	// dropped is the revision of a binding this replica invalidated, hidden until the local
	// FSM has applied the invalidation (a follower learns it one round trip later): a
	// binding dropped unseen (its worker refused the request) stays unseen here.
	dropped uint64
}

// NewAffinity returns the store over n; it runs until n closes.
func NewAffinity(n *Node) *Affinity {
	a := &Affinity{n: n, log: n.log, local: make(map[string]*localSession), wake: make(chan struct{}, 1),
		recent: make(map[string]recentTouch), unsent: make(map[string]struct{})}
	n.wg.Add(2)
	go a.flushTouches()
	go a.keepAlive()
	return a
}

var _ routing.AffinityStore = (*Affinity)(nil)

func toRouting(b fsm.Binding) routing.Binding {
	return routing.Binding{Session: b.Session, Worker: indexer.Worker{ID: b.Worker, DPRank: b.DPRank}, Revision: b.Revision, Model: b.Model}
}

// fence waits (up to BindWait) for the replica to be fresh enough to read at its level; a
// bounded read made after it must still be confirmed with Node.ReadValid. Where waiting
// cannot help (Node.hopeless: stopping, cut off from the leader) it refuses at once, and a
// wait that ends without a lease is a refusal too: either way no worker was asked, so the
// answer is a routing.Refusal the load balancer may retry on another replica.
func (a *Affinity) fence(ctx context.Context) error {
	err := a.n.ReadFence(ctx)
	if err == nil || !unavailable(err) {
		return err
	}
	if why := a.n.hopeless(); why != "" {
		return refuse(why, err)
	}
	wctx, cancel := context.WithTimeout(ctx, a.n.cfg.BindWait)
	defer cancel()
	for {
		ch := a.n.changeCh()
		select {
		case <-wctx.Done():
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return refuse("no_read_lease", err)
		case <-ch:
		case <-time.After(25 * time.Millisecond):
		}
		if err = a.n.ReadFence(wctx); err == nil {
			return nil
		}
		if !unavailable(err) {
			return err
		}
		if why := a.n.hopeless(); why != "" {
			return refuse(why, err)
		}
	}
}

// Sync implements routing.Syncer: it returns once the local FSM has applied every change
// acknowledged before the call (a read-index round through the leader, whatever the
// consistency level), waiting up to BindWait for a leader to answer one.
func (a *Affinity) Sync(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, a.n.cfg.BindWait)
	defer cancel()
	for {
		ch := a.n.changeCh()
		idx, err := a.n.readIndex(ctx, a.n.IsLeader())
		if err == nil {
			return a.n.waitApplied(ctx, idx)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("sync bindings: %w", err)
		case <-ch:
		case <-time.After(25 * time.Millisecond):
		}
	}
}

var _ routing.Syncer = (*Affinity)(nil)

// current is the session's binding as this replica knows it: the FSM's, or a newer one
// this replica committed that the FSM has not applied yet.
func (a *Affinity) currentLocked(session string) (routing.Binding, bool) {
	b, ok := a.n.fsm.Get(session)
	ls := a.local[session]
	if ok && ls != nil && ls.dropped != 0 && b.Revision == ls.dropped {
		ok = false
	}
	if ls != nil && ls.bound.Revision != 0 {
		if !ok && a.n.fsm.AppliedIndex() < ls.bound.Revision {
			return ls.bound, true
		}
		if ok && b.Revision < ls.bound.Revision {
			return ls.bound, true
		}
	}
	if ok {
		return toRouting(b), true
	}
	return routing.Binding{}, false
}

// Acquire implements routing.AffinityStore. Under the bounded level what it reads is served
// only under a valid read lease, checked again after the read: a pause between the fence
// and the read must not let an old binding through. A new session waits for the lease too,
// though its absent-only Bind goes through the leader anyway: a replica that cannot vouch
// for its state should not send a new session's request to a worker it may not bind.
func (a *Affinity) Acquire(ctx context.Context, session string, explicit *indexer.Worker) (routing.Lease, error) {
	if err := fsm.ValidSession(session); err != nil {
		return nil, err
	}
	if err := a.fence(ctx); err != nil {
		return nil, err
	}
	for {
		a.mu.Lock()
		ls := a.local[session]
		if ls != nil && ls.init.Busy() {
			if err := ls.init.Wait(ctx, a.mu.Unlock); err != nil {
				return nil, err
			}
			continue
		}
		if ls == nil {
			ls = &localSession{}
			// The key outlives the request: its own copy, not a slice of the request's head.
			a.local[strings.Clone(session)] = ls
		}
		b, ok := a.currentLocked(session)
		if err := a.n.ReadValid(); err != nil {
			// The lease ended between the fence and the read (a pause, say): what was read
			// may be older than the bound. Fence again and read again.
			a.dropIfIdleLocked(session, ls)
			a.mu.Unlock()
			if err := a.fence(ctx); err != nil {
				return nil, err
			}
			continue
		}
		if ok {
			if explicit != nil && *explicit != b.Worker {
				a.dropIfIdleLocked(session, ls)
				a.mu.Unlock()
				return nil, fmt.Errorf("session bound to %s at revision %d, target %s: %w", b.Worker, b.Revision, explicit, routing.ErrTargetConflict)
			}
			ls.active++
			a.mu.Unlock()
			a.touch(session, b.Revision)
			return &lease{a: a, session: session, ls: ls, bound: true, binding: b}, nil
		}
		if max := a.n.cfg.MaxBindings; max > 0 && a.n.fsm.Len() >= max {
			a.dropIfIdleLocked(session, ls)
			a.mu.Unlock()
			return nil, fmt.Errorf("%d sessions bound: %w", max, routing.ErrTooManySessions)
		}
		ls.init.Take()
		ls.active++
		a.mu.Unlock()
		return &lease{a: a, session: session, ls: ls, binding: routing.Binding{Session: session}, gate: true}, nil
	}
}

func (a *Affinity) dropIfIdleLocked(session string, ls *localSession) {
	if ls.active == 0 && !ls.init.Busy() && a.local[session] == ls && !a.dropPendingLocked(session, ls) {
		delete(a.local, session)
	}
}

// dropPendingLocked reports whether the local FSM still holds a binding this replica
// invalidated (ls.dropped), which ls must hide a while longer.
func (a *Affinity) dropPendingLocked(session string, ls *localSession) bool {
	if ls.dropped == 0 {
		return false
	}
	b, ok := a.n.fsm.Get(session)
	return ok && b.Revision == ls.dropped
}

// Len is the number of sessions held: bound in the FSM or being initialised here.
func (a *Affinity) Len() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := a.n.fsm.Len()
	for s, ls := range a.local {
		if _, ok := a.n.fsm.Get(s); !ok && (ls.init.Busy() || ls.bound.Revision != 0) {
			n++
		}
	}
	return n
}

// Peek implements routing.AffinityStore.
func (a *Affinity) Peek(ctx context.Context, session string) (routing.Binding, bool, error) {
	if err := fsm.ValidSession(session); err != nil {
		return routing.Binding{}, false, err
	}
	if err := a.fence(ctx); err != nil {
		return routing.Binding{}, false, err
	}
	for {
		a.mu.Lock()
		b, ok := a.currentLocked(session)
		a.mu.Unlock()
		if a.n.ReadValid() == nil {
			return b, ok, nil
		}
		if err := a.fence(ctx); err != nil {
			return routing.Binding{}, false, err
		}
	}
}

// Invalidate implements routing.AffinityStore.
func (a *Affinity) Invalidate(ctx context.Context, session string, revision uint64) error {
	_, err := a.n.Apply(ctx, &fsm.Invalidate{Session: session, Revision: revision})
	a.mu.Lock()
	if ls := a.local[session]; ls != nil {
		if ls.bound.Revision == revision {
			ls.bound = routing.Binding{}
		}
		if err == nil {
			ls.dropped = revision
		}
	}
	a.mu.Unlock()
	return err
}

// bind proposes a Bind through the leader, waiting up to BindWait for one: absent-only with
// expect 0, else a compare-and-set on that revision.
func (a *Affinity) bind(ctx context.Context, session string, w indexer.Worker, model string, expect uint64) (*fsm.Result, error) {
	ctx, cancel := context.WithTimeout(ctx, a.n.cfg.BindWait)
	defer cancel()
	res, err := a.n.Apply(ctx, &fsm.Bind{
		Session: session, Worker: w.ID, DPRank: w.DPRank, ExpectRevision: expect,
		TTL: a.n.cfg.SessionTTL, MaxBindings: uint64(max(a.n.cfg.MaxBindings, 0)), Model: model,
	})
	if err != nil {
		return nil, fmt.Errorf("bind session %q: %w", session, err)
	}
	return res, nil
}

// touch tells the leader a session is in use (its idle timer restarts). The touch is
// remembered for the TTL: a touch the leader has not acknowledged is sent again until it
// is, and every remembered touch goes again, with its age, to each new leader (a leader
// keeps its timers in memory, so what it was told dies with its term).
func (a *Affinity) touch(session string, revision uint64) {
	if revision == 0 {
		return
	}
	a.tmu.Lock()
	a.recent[session] = recentTouch{revision: revision, at: time.Now()}
	a.tmu.Unlock()
	if a.n.IsLeader() && a.n.lead.touch(session, revision, 0) == nil {
		return
	}
	a.tmu.Lock()
	a.unsent[session] = struct{}{}
	a.tmu.Unlock()
	select {
	case a.wake <- struct{}{}:
	default:
	}
}

// flushTouches sends coalesced touches to the leader, each with its age. A failed send is
// kept and tried again (at the latest every quarter of an election timeout), and a new term
// makes every touch made within its TTL unsent again, so a touch survives changes of leader
// and the times without one: a binding touched within its TTL by a replica that stays up is
// never expired as idle.
func (a *Affinity) flushTouches() {
	defer a.n.wg.Done()
	tick := time.NewTicker(max(a.n.cfg.ElectionTimeout/4, a.n.cfg.TouchFlush, 10*time.Millisecond))
	defer tick.Stop()
	var term uint64
	pruned := time.Now()
	for {
		select {
		case <-a.n.ctx.Done():
			return
		case <-a.wake:
		case <-tick.C:
		}
		if now := time.Now(); now.Sub(pruned) >= a.n.cfg.SessionTTL/2 {
			a.pruneTouches(now)
			pruned = now
		}
		if cur := a.n.raft.CurrentTerm(); cur != term {
			term = cur
			a.tmu.Lock()
			for s := range a.recent {
				a.unsent[s] = struct{}{}
			}
			a.tmu.Unlock()
		}
		if !a.pendingTouches() {
			continue
		}
		select {
		case <-a.n.ctx.Done():
			return
		case <-time.After(a.n.cfg.TouchFlush):
		}
		batch := a.takeUnsent(time.Now())
		if len(batch) == 0 {
			continue
		}
		if err := a.deliver(batch); err != nil {
			a.log.Debug("touch flush failed; kept for the next try", "touches", len(batch), "err", err)
			a.tmu.Lock()
			for _, t := range batch {
				if r, ok := a.recent[t.Session]; ok && r.revision == t.Revision {
					a.unsent[t.Session] = struct{}{}
				}
			}
			a.tmu.Unlock()
		}
	}
}

func (a *Affinity) pendingTouches() bool {
	a.tmu.Lock()
	defer a.tmu.Unlock()
	return len(a.unsent) > 0
}

// pruneTouches forgets every touch older than the session TTL: the leader's timer has run
// out since, or it holds a newer touch. (Run every TTL/2, so a touch is kept at most 1.5 TTL.)
func (a *Affinity) pruneTouches(now time.Time) {
	a.tmu.Lock()
	defer a.tmu.Unlock()
	for s, r := range a.recent {
		if now.Sub(r.at) >= a.n.cfg.SessionTTL {
			delete(a.recent, s)
			delete(a.unsent, s)
		}
	}
}

// takeUnsent returns the unsent touches made within the session TTL, with their ages at now.
func (a *Affinity) takeUnsent(now time.Time) []peer.Touch {
	a.tmu.Lock()
	defer a.tmu.Unlock()
	batch := make([]peer.Touch, 0, len(a.unsent))
	for s := range a.unsent {
		if r, ok := a.recent[s]; ok && now.Sub(r.at) < a.n.cfg.SessionTTL {
			batch = append(batch, peer.Touch{Session: s, Revision: r.revision, Age: max(now.Sub(r.at), 0)})
		}
	}
	clear(a.unsent)
	return batch
}

// deliver hands touches to the leader: this node's own timers when it leads, else the
// leader's over the peer port.
func (a *Affinity) deliver(batch []peer.Touch) error {
	if a.n.IsLeader() {
		for _, t := range batch {
			if err := a.n.lead.touch(t.Session, t.Revision, t.Age); err != nil {
				return err
			}
		}
		return nil
	}
	if a.n.cfg.Remote == nil {
		return ErrNoLeader
	}
	// A new term sends every touch of the last TTL: in calls of touchChunk, each well
	// under the peer port's message limit.
	for i := 0; i < len(batch); i += touchChunk {
		ctx, cancel := context.WithTimeout(a.n.ctx, time.Second)
		err := a.n.cfg.Remote.Touch(ctx, batch[i:min(i+touchChunk, len(batch))])
		cancel()
		if err != nil {
			return err
		}
	}
	return nil
}

// touchChunk bounds the touches of one Touch call.
const touchChunk = 4096

// keepAlive touches every session with a request in flight here every ttl/3, so a long
// stream does not idle its binding out.
func (a *Affinity) keepAlive() {
	defer a.n.wg.Done()
	every := max(a.n.cfg.SessionTTL/3, 10*time.Millisecond)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-a.n.ctx.Done():
			return
		case <-t.C:
		}
		type st struct {
			s string
			r uint64
		}
		var live []st
		a.mu.Lock()
		applied := a.n.fsm.AppliedIndex()
		for s, ls := range a.local {
			if ls.active == 0 && !ls.init.Busy() && applied >= ls.bound.Revision && !a.dropPendingLocked(s, ls) {
				delete(a.local, s) // its bind has reached the FSM: the map is no longer needed
				continue
			}
			if ls.active > 0 {
				if b, ok := a.currentLocked(s); ok {
					live = append(live, st{s, b.Revision})
				}
			}
		}
		a.mu.Unlock()
		for _, x := range live {
			a.touch(x.s, x.r)
		}
	}
}

// lease is one request's hold on a session.
type lease struct {
	a       *Affinity
	session string
	ls      *localSession
	bound   bool
	binding routing.Binding
	done    bool
	// replaces is the revision a reopened lease's Commit replaces (0: a first binding).
	replaces uint64
	// gate: this lease holds the session's initializer gate (until Commit or the end), so
	// it opens the gate only while it is its own.
	gate bool
	// holdGate (HoldGate): a Commit that binds keeps the gate until OpenGate or the end.
	holdGate bool
}

// HoldGate makes a later Commit that binds keep the session's gate closed, so that this
// replica's other requests for the session see the binding only once OpenGate (or the
// lease's end) opens it: routing proposes a binding as the request is dispatched and
// opens the gate once the worker has accepted the request (a worker that refuses it has
// its binding dropped first, unseen here).
func (l *lease) HoldGate() {
	l.a.mu.Lock()
	defer l.a.mu.Unlock()
	l.holdGate = true
}

// OpenGate opens a gate a Commit kept (HoldGate); otherwise it does nothing.
func (l *lease) OpenGate() {
	l.a.mu.Lock()
	defer l.a.mu.Unlock()
	l.holdGate = false
	if l.gate && l.bound {
		l.ls.init.Open()
		l.gate = false
	}
}

// BindFirst tells routing to commit a new binding before its request is sent to a worker
// while this replica's contact with its quorum is not fresh (Node.ContactFresh): a replica
// cut off while its read lease still holds then refuses the request, which another replica
// may serve, instead of failing it after a worker ran it. With Config.BindBeforeDispatch it
// always does, which closes the window before contact goes stale too.
func (l *lease) BindFirst() bool { return l.a.n.cfg.BindBeforeDispatch || !l.a.n.ContactFresh() }

// Reopen implements routing.Lease: this replica's other requests for the session wait for
// this one, whose Commit is a compare-and-set on the old revision.
func (l *lease) Reopen() bool {
	if l.done || !l.bound || l.binding.Revision == 0 {
		return false
	}
	a := l.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if !l.gate {
		if l.ls.init.Busy() {
			return false // another request is replacing it already
		}
		l.ls.init.Take()
		l.gate = true
	}
	// (With the gate still its own, kept past its Commit, the lease replaces its own binding
	// before any other request of this replica saw it.)
	l.holdGate = false
	l.replaces = l.binding.Revision
	l.bound, l.binding = false, routing.Binding{Session: l.session}
	return true
}

func (l *lease) Binding() (routing.Binding, bool) { return l.binding, l.bound }

// Commit binds the session (initializer). If another replica bound it first, the lease
// adopts that binding and returns it with routing.ErrBoundElsewhere, so the caller can move
// the request to the bound worker while no byte has reached the client.
func (l *lease) Commit(ctx context.Context, w indexer.Worker, model string) (routing.Binding, error) {
	if l.done || l.bound || !l.gate {
		return routing.Binding{}, fmt.Errorf("commit of session %q: lease is not an open initializer", l.session)
	}
	res, err := l.a.bind(ctx, l.session, w, model, l.replaces)
	if err == nil && res.Status == fsm.Conflict && !res.Found {
		// The binding this one replaces is gone (expired, invalidated): bind afresh.
		res, err = l.a.bind(ctx, l.session, w, model, 0)
	}
	a := l.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if err == nil && res.Status == fsm.Rejected {
		// The worker began draining after it was chosen: nothing is bound, and the lease
		// keeps the gate, so the request's next choice commits through it.
		return routing.Binding{}, fmt.Errorf("bind session %q to %s: %w", l.session, w, routing.ErrWorkerDraining)
	}
	keep := false // the gate stays closed: HoldGate, and the session bound as asked
	defer func() {
		if !keep {
			l.ls.init.Open()
			l.gate = false
		}
	}()
	if err != nil {
		return routing.Binding{}, err
	}
	switch res.Status {
	case fsm.Created, fsm.Exists, fsm.Conflict:
		// Exists or Conflict: another request (on any replica) bound or replaced it first;
		// its binding wins.
		b := toRouting(res.Binding)
		l.ls.bound = b
		// No touch here: the leader arms the new binding's timer when it applies the Bind,
		// and Release touches it when the request ends.
		l.bound, l.binding, l.replaces = true, b, 0
		if res.Status != fsm.Created && (b.Worker != w || b.Model != model) {
			return b, fmt.Errorf("session %q: %w", l.session, routing.ErrBoundElsewhere)
		}
		keep = l.holdGate
		return b, nil
	case fsm.Full:
		return routing.Binding{}, fmt.Errorf("bind session %q: %w", l.session, routing.ErrTooManySessions)
	default:
		return routing.Binding{}, fmt.Errorf("bind session %q to %s: %s", l.session, w, res.Status)
	}
}

// Invalidate drops the lease's binding (revision-guarded) or gives up an initialization; a
// reopened lease that gives up drops the binding it was to replace.
func (l *lease) Invalidate(ctx context.Context) {
	if l.done {
		return
	}
	rev := l.replaces
	if l.bound {
		rev = l.binding.Revision
	}
	if rev != 0 {
		if err := l.a.Invalidate(ctx, l.session, rev); err != nil {
			l.a.log.Warn("invalidate binding", "session", l.session, "revision", rev, "err", err)
		}
	}
	l.end()
}

// Release ends the request; the binding's idle TTL counts from now.
func (l *lease) Release() {
	if l.done {
		return
	}
	if l.bound {
		l.a.touch(l.session, l.binding.Revision)
	}
	l.end()
}

func (l *lease) end() {
	l.done = true
	a := l.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if l.gate {
		l.ls.init.Open()
		l.gate = false
	}
	l.ls.active--
	if l.ls.active <= 0 && a.local[l.session] == l.ls && a.n.fsm.AppliedIndex() >= l.ls.bound.Revision && !a.dropPendingLocked(l.session, l.ls) {
		delete(a.local, l.session)
	}
}
