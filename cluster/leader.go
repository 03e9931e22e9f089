package cluster

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
)

// leader holds the duties of the node while it leads: an idle timer per binding (touched
// by every replica's requests, never through the log), Expire proposed once per timer,
// periodic Checkpoints of remaining TTLs, batched read-index rounds, and the duties others
// registered (AddDuty: voter reconciliation, worker-grace invalidation). Every one of them
// starts when a term is established and stops when it ends, from run alone, as Consul's
// establishLeadership and revokeLeadership do.
type leader struct {
	n *Node

	dmu     sync.Mutex
	duties  []duty
	termCtx context.Context // set while a term's duties run
	termWG  sync.WaitGroup

	mu          sync.Mutex
	established bool // Barrier done and timers armed in this term
	active      bool // tracking changes (set before the rebuild so none is missed)
	timers      map[string]*idleTimer
	queue       timerHeap
	wake        chan struct{}
	// lastRound is when the FSM's remaining TTLs were last true: the previous checkpoint
	// round, or the establishment of the term (zero: no round yet).
	lastRound time.Time

	// checkpointBytes and checkpointEntries count what checkpoints wrote to the log.
	checkpointBytes, checkpointEntries atomic.Uint64

	// expiresProposed counts Expire proposals (tests: each timer proposes once).
	expiresProposed atomic.Int64

	rmu     sync.Mutex
	next    *readRound
	running bool
}

// idleTimer is one binding's idle deadline on the leader.
type idleTimer struct {
	revision  uint64
	ttl       time.Duration
	deadline  time.Time
	proposing bool
	// saved is the deadline the FSM's remaining TTL stands for (as aged by the checkpoints
	// since), zero when the binding was never checkpointed.
	saved time.Time
}

type timerEntry struct {
	at       time.Time
	session  string
	revision uint64
}

type timerHeap []timerEntry

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h timerHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *timerHeap) Push(x any)        { *h = append(*h, x.(timerEntry)) }
func (h *timerHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

type readRound struct {
	done chan struct{}
	idx  uint64
	err  error
}

func newLeader(n *Node) *leader {
	return &leader{n: n, timers: make(map[string]*idleTimer), wake: make(chan struct{}, 1)}
}

func (l *leader) ttlOf(b fsm.Binding) time.Duration {
	if b.TTL > 0 {
		return b.TTL
	}
	return l.n.cfg.SessionTTL
}

// observe follows the FSM's changes (inside Apply: no blocking) while leading.
func (l *leader) observe(c fsm.Change) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.active {
		return
	}
	switch c.Kind {
	case fsm.Bound:
		l.armLocked(c.Binding, time.Now().Add(l.ttlOf(c.Binding)))
	case fsm.Unbound:
		if t := l.timers[c.Binding.Session]; t != nil && t.revision == c.Binding.Revision {
			delete(l.timers, c.Binding.Session)
		}
	case fsm.Reset:
		l.rearmAllLocked()
	}
}

// restartTTL is how long a binding lives from a leadership change: what remained at the last
// checkpoint (or the whole TTL) plus an election timeout, so a TTL stays a lower bound.
func (l *leader) restartTTL(b fsm.Binding) time.Duration {
	rem := b.Remaining
	if rem <= 0 {
		rem = l.ttlOf(b)
	}
	return rem + l.n.cfg.ElectionTimeout
}

// rearmAllLocked replaces every timer with one per binding the FSM holds, each due after
// its restart TTL.
func (l *leader) rearmAllLocked() {
	l.timers = make(map[string]*idleTimer)
	l.queue = nil
	now := time.Now()
	l.n.fsm.Range(func(b fsm.Binding) bool {
		l.armLocked(b, now.Add(l.restartTTL(b)))
		if b.Remaining > 0 {
			l.timers[b.Session].saved = now.Add(b.Remaining)
		}
		return true
	})
	l.lastRound = now
}

func (l *leader) armLocked(b fsm.Binding, at time.Time) {
	if t := l.timers[b.Session]; t != nil && t.revision == b.Revision {
		if at.After(t.deadline) {
			t.deadline = at
		}
		return
	}
	l.timers[b.Session] = &idleTimer{revision: b.Revision, ttl: l.ttlOf(b), deadline: at}
	heap.Push(&l.queue, timerEntry{at: at, session: b.Session, revision: b.Revision})
	l.poke()
}

func (l *leader) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// errNotEstablished answers a touch that reached a leader whose term is not established
// yet: its timers are not armed, so the touch must be sent again.
var errNotEstablished = errors.New("leadership not established yet")

// touch pushes a binding's idle deadline to the touch's time + its TTL: now - age, where age
// is how long ago the touch was made (a request started or ended, or a long stream is still
// running). A touch sent again to a new leader carries its age, so the TTL counts from the
// touch; the deadline is never later than now + the TTL, so a touch cannot extend a binding
// beyond what it promised. A touch of a binding that is gone or replaced does nothing; one
// that reaches the leader before its term is established is refused (errNotEstablished).
func (l *leader) touch(session string, revision uint64, age time.Duration) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.established {
		return errNotEstablished
	}
	t := l.timers[session]
	if t == nil || t.revision != revision {
		return nil
	}
	age = min(max(age, 0), t.ttl)
	if at := time.Now().Add(t.ttl - age); at.After(t.deadline) {
		t.deadline = at
	}
	return nil
}

// duty is work that runs only while this node leads (Node.AddDuty).
type duty struct {
	name string
	run  func(ctx context.Context)
}

// AddDuty registers work that runs only while this node leads: run starts once each term is
// established (its Barrier applied, its timers armed) and its context ends with the term;
// the term's end waits for it to return. A duty added while the node leads starts at once.
func (n *Node) AddDuty(name string, run func(ctx context.Context)) {
	n.lead.addDuty(duty{name: name, run: run})
}

func (l *leader) addDuty(d duty) {
	l.dmu.Lock()
	defer l.dmu.Unlock()
	l.duties = append(l.duties, d)
	if l.termCtx != nil {
		l.goDuty(l.termCtx, d)
	}
}

func (l *leader) goDuty(ctx context.Context, d duty) {
	l.termWG.Add(1)
	go func() {
		defer l.termWG.Done()
		l.n.log.Debug("leader duty started", "duty", d.name)
		d.run(ctx)
		l.n.log.Debug("leader duty stopped", "duty", d.name)
	}()
}

// startDuties starts every registered duty for the term whose context is ctx.
func (l *leader) startDuties(ctx context.Context) {
	l.dmu.Lock()
	defer l.dmu.Unlock()
	l.termCtx = ctx
	for _, d := range l.duties {
		l.goDuty(ctx, d)
	}
}

// stopDuties waits for the term's duties, whose context has ended, to return.
func (l *leader) stopDuties() {
	l.dmu.Lock()
	l.termCtx = nil
	l.dmu.Unlock()
	l.termWG.Wait()
}

// run is the leader's loop for one term: establish, start every duty, then serve timers
// and checkpoints until leadership ends (ctx), and stop them all.
func (l *leader) run(ctx context.Context) {
	log := l.n.log
	if err := l.establish(ctx); err != nil {
		log.Warn("establishing leadership failed", "err", err)
		l.revoke()
		return
	}
	log.Info("leadership established", "bindings", l.n.fsm.Len())
	defer l.revoke()
	l.startDuties(ctx)
	defer l.stopDuties()
	checkpoint := time.NewTicker(l.n.cfg.CheckpointInterval)
	defer checkpoint.Stop()
	for {
		wait := l.fire(ctx)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-l.wake:
		case <-t.C:
		case <-checkpoint.C:
			l.checkpoint(ctx)
		}
		t.Stop()
	}
}

// establish is the start of a term: Barrier (everything committed is applied), our member
// record, then every binding's timer armed from its checkpointed remaining TTL.
func (l *leader) establish(ctx context.Context) error {
	if err := awaitFuture(ctx, l.n.raft.Barrier(0)); err != nil {
		return fmt.Errorf("barrier: %w", err)
	}
	l.mu.Lock()
	l.active = true
	l.rearmAllLocked()
	l.established = true
	l.mu.Unlock()
	l.n.notifyApplied() // read-index callers waiting for the term to be established
	l.n.lease.wake()    // the term's first read lease need not wait for the next tick
	if err := l.n.recordMembers(ctx); err != nil {
		l.n.log.Warn("recording member addresses", "err", err)
	}
	return nil
}

func (l *leader) revoke() {
	l.mu.Lock()
	l.active, l.established = false, false
	l.timers = make(map[string]*idleTimer)
	l.queue = nil
	l.lastRound = time.Time{}
	l.mu.Unlock()
}

// fire proposes Expire for every due timer and returns how long until the next one.
func (l *leader) fire(ctx context.Context) time.Duration {
	due, wait := l.dueAt(time.Now())
	for _, d := range due {
		l.proposeExpire(ctx, d.t, d.e)
	}
	return max(wait, time.Millisecond)
}

// dueAt marks the timers due at now as proposing and returns them, and how long until the
// next one is due (a second at most).
func (l *leader) dueAt(now time.Time) ([]dueTimer, time.Duration) {
	var due []dueTimer
	l.mu.Lock()
	defer l.mu.Unlock()
	wait := time.Second
	for l.queue.Len() > 0 {
		e := l.queue[0]
		if e.at.After(now) {
			wait = min(wait, e.at.Sub(now))
			break
		}
		heap.Pop(&l.queue)
		t := l.timers[e.session]
		if t == nil || t.revision != e.revision || t.proposing {
			continue
		}
		if t.deadline.After(now) {
			heap.Push(&l.queue, timerEntry{at: t.deadline, session: e.session, revision: e.revision})
			continue
		}
		t.proposing = true
		due = append(due, dueTimer{t, e})
	}
	return due, wait
}

// dueTimer is a timer fire found due, and its heap entry.
type dueTimer struct {
	t *idleTimer
	e timerEntry
}

// proposeExpire sends one Expire for timer t without waiting for it: the FSM's revision
// guard makes a stale one harmless; a failed proposal re-arms the timer (expireFailed).
func (l *leader) proposeExpire(ctx context.Context, t *idleTimer, e timerEntry) {
	b, err := fsm.Encode(&fsm.Expire{Session: e.session, Revision: e.revision})
	if err != nil {
		l.n.log.Error("encode expire", "session", e.session, "err", err)
		return
	}
	l.expiresProposed.Add(1)
	f := l.n.raft.Apply(b, 5*time.Second)
	go func() {
		if err := f.Error(); err != nil {
			l.expireFailed(t, e, time.Now())
			if !errors.Is(err, raft.ErrNotLeader) && !errors.Is(err, raft.ErrLeadershipLost) && ctx.Err() == nil {
				l.n.log.Warn("expire proposal failed", "session", e.session, "err", err)
			}
		}
	}()
}

// expireFailed re-arms timer t, whose Expire proposal failed at now, to be proposed again
// a second later, or at its deadline when a touch moved that later meanwhile. A timer that
// is no longer the session's (the term ended, and a later one armed its own) is left alone:
// the later term's deadline (a whole restart TTL) is not this proposal's to shorten.
func (l *leader) expireFailed(t *idleTimer, e timerEntry, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.timers[e.session] != t {
		return
	}
	t.proposing = false
	t.deadline = later(t.deadline, now.Add(time.Second))
	heap.Push(&l.queue, timerEntry{at: t.deadline, session: e.session, revision: e.revision})
	l.poke()
}

// later is the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// checkpointChunk bounds one Checkpoint command.
const checkpointChunk = 4096

// checkpointRound is one round of checkpoints: the commands, in order, made at one instant.
type checkpointRound struct {
	at   time.Time
	cmds []*fsm.Checkpoint
}

// planCheckpoint lists what the FSM must learn at now so that a later leader re-arms no
// binding later than the election timeout past its deadline here: every binding never
// checkpointed, and every one whose deadline moved by more than the election timeout since
// its last entry (a touch). The first command ages every other checkpointed binding by the
// time since the last round, so a binding idle since its entry costs nothing. A leader that
// wrote every binding each round wrote 17 MB a round at 63,000 bindings.
func (l *leader) planCheckpoint(now time.Time) checkpointRound {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := checkpointRound{at: now}
	if len(l.timers) == 0 {
		return r
	}
	var aged time.Duration
	if !l.lastRound.IsZero() {
		aged = max(now.Sub(l.lastRound), 0)
	}
	slack := l.n.cfg.ElectionTimeout
	var entries []fsm.Remaining
	for s, t := range l.timers {
		if !t.saved.IsZero() && t.deadline.Sub(t.saved) <= slack {
			continue
		}
		entries = append(entries, fsm.Remaining{Session: s, Revision: t.revision, Remaining: max(t.deadline.Sub(now), time.Millisecond)})
	}
	r.cmds = append(r.cmds, &fsm.Checkpoint{Aged: aged})
	for i := 0; i < len(entries); i += checkpointChunk {
		chunk := entries[i:min(i+checkpointChunk, len(entries))]
		if i == 0 {
			r.cmds[0].Entries = chunk
			continue
		}
		r.cmds = append(r.cmds, &fsm.Checkpoint{Entries: chunk})
	}
	return r
}

// checkpointed records that the first n commands of r were applied.
func (l *leader) checkpointed(r checkpointRound, n int) {
	if n == 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lastRound = r.at
	for _, c := range r.cmds[:n] {
		for _, e := range c.Entries {
			if t := l.timers[e.Session]; t != nil && t.revision == e.Revision {
				t.saved = r.at.Add(e.Remaining)
			}
		}
	}
}

// checkpoint records remaining TTLs (planCheckpoint), so a later leader cannot extend a
// binding's life by more than an election timeout per change of leader.
func (l *leader) checkpoint(ctx context.Context) {
	r := l.planCheckpoint(time.Now())
	for i, c := range r.cmds {
		if ctx.Err() != nil {
			l.checkpointed(r, i)
			return
		}
		b, err := fsm.Encode(c)
		if err != nil {
			l.n.log.Error("encode checkpoint", "err", err)
			l.checkpointed(r, i)
			return
		}
		if err := awaitFuture(ctx, l.n.raft.Apply(b, 10*time.Second)); err != nil {
			l.n.log.Warn("checkpoint failed", "err", err)
			l.checkpointed(r, i)
			return
		}
		l.checkpointBytes.Add(uint64(len(b)))
		l.checkpointEntries.Add(uint64(len(c.Entries)))
	}
	l.checkpointed(r, len(r.cmds))
}

// readIndex confirms leadership and returns the commit index to read at. Concurrent callers
// share a round; a caller arriving while a round runs waits for the next one.
func (l *leader) readIndex(ctx context.Context) (uint64, error) {
	if err := l.waitEstablished(ctx); err != nil {
		return 0, err
	}
	l.rmu.Lock()
	r := l.next
	if r == nil {
		r = &readRound{done: make(chan struct{})}
		l.next = r
		if !l.running {
			l.running = true
			go l.rounds()
		}
	}
	l.rmu.Unlock()
	select {
	case <-r.done:
		return r.idx, r.err
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// waitEstablished waits, while this node leads, until its term is established (Barrier
// applied): a read index taken earlier could miss what the previous leader acknowledged. A
// new leader's first readers (followers renewing their read leases) wait a few milliseconds
// here rather than fail and ask again.
func (l *leader) waitEstablished(ctx context.Context) error {
	for {
		ch := l.n.changeCh()
		if l.isEstablished() {
			return nil
		}
		if !l.n.IsLeader() {
			return fmt.Errorf("%w: leadership lost before it was established", ErrNoLeader)
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("%w: leadership not established yet: %w", ErrNoLeader, ctx.Err())
		case <-l.n.ctx.Done():
			return ErrClosed
		case <-time.After(50 * time.Millisecond): // a missed notification costs at most this
		}
	}
}

func (l *leader) rounds() {
	for {
		l.rmu.Lock()
		r := l.next
		l.next = nil
		if r == nil {
			l.running = false
			l.rmu.Unlock()
			return
		}
		l.rmu.Unlock()
		// The leader acknowledges a command only after its own FSM applied it, so the
		// index of its last applied command bounds every write acknowledged before this
		// read began (Raft's commit index would also count no-op and barrier entries, which
		// never reach an FSM, and a follower would wait for them in vain).
		//
		// Leadership is proved by committing a barrier, not with VerifyLeader: VerifyLeader
		// counts the first heartbeat answer each follower gives after it was asked, even an
		// answer to a heartbeat sent before, and a leader resumed from a pause reads such
		// answers from its sockets after the others have elected a new leader. Only answers
		// to the append that carries the barrier can commit it, and a follower that has
		// moved to a later term refuses that append. (The cost: one log entry per round.)
		r.idx = l.n.fsm.AppliedIndex()
		if err := l.n.raft.Barrier(l.n.cfg.StaleBound).Error(); err != nil {
			r.err = fmt.Errorf("%w: %w", ErrNoLeader, err)
		}
		close(r.done)
	}
}

// pendingTimers is the number of armed idle timers (tests, metrics).
func (l *leader) pendingTimers() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.timers)
}

func (l *leader) isEstablished() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.established
}
