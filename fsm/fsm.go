// Package fsm is the deterministic state machine that Raft replicates: session-affinity
// bindings, the worker registry and the cluster's member list. It implements raft.FSM and
// raft.BatchingFSM, encodes its commands (one type byte plus a protobuf body), and takes
// copy-on-write snapshots.
//
// Apply reads no clock, no random source, no network and no disk: every replica that
// applies the same log ends in the same state. Time enters only through the commands
// (TTLs, Checkpoint's remaining TTLs, the leader's Expire); see DESIGN.md.
package fsm

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// Options configure an FSM.
type Options struct {
	// OnChange is called synchronously inside Apply (and once with Kind Reset after
	// Restore) for every change, after the entry's state is visible to readers and
	// AppliedIndex covers it. It must not block and must not call Apply.
	OnChange func(Change)
	// OnApplied, if set, is called inside Apply and ApplyBatch with the last index the
	// FSM has applied, whether or not anything changed (waiters on AppliedIndex need it).
	// It must not block.
	OnApplied func(index uint64)
}

// FSM is the replicated affinity state. Apply, ApplyBatch, Snapshot and Restore are
// serialized (Raft calls them from one goroutine; a mutex makes other callers safe too);
// the read methods are safe at any time, concurrently with them, and never wait for a
// whole Apply batch.
type FSM struct {
	opts Options

	st      atomic.Pointer[state]
	reg     atomic.Pointer[registry]
	applied atomic.Uint64
	count   atomic.Int64

	// amu serializes the applier side; the fields below belong to the holder.
	amu     sync.Mutex
	gen     uint64
	intern  *interner
	models  *interner
	pending []Change
}

// registry is one immutable version of the worker registry, the member list and the
// model aliases.
type registry struct {
	workers map[string]Worker
	members map[string]Member
	aliases map[string]Alias
}

func newRegistry() *registry {
	return &registry{workers: map[string]Worker{}, members: map[string]Member{}, aliases: map[string]Alias{}}
}

func (r *registry) clone() *registry {
	return &registry{workers: maps.Clone(r.workers), members: maps.Clone(r.members), aliases: maps.Clone(r.aliases)}
}

// New returns an empty FSM.
func New(opts Options) *FSM {
	f := &FSM{opts: opts, intern: newInterner(), models: newInterner()}
	f.st.Store(newState(0))
	f.reg.Store(newRegistry())
	return f
}

var (
	_ raft.FSM         = (*FSM)(nil)
	_ raft.BatchingFSM = (*FSM)(nil)
)

// Apply applies one log entry. For a command it returns *Result; for any other entry
// type, nil. An entry whose type byte is unknown and lacks the ignore-if-unknown flag
// panics: this replica runs older code than the leader and must stop, not diverge.
func (f *FSM) Apply(l *raft.Log) interface{} {
	f.amu.Lock()
	defer f.amu.Unlock()
	res := f.applyLog(l)
	if f.opts.OnApplied != nil {
		f.opts.OnApplied(f.applied.Load())
	}
	if res == nil {
		return nil
	}
	return res
}

// ApplyBatch applies entries in order and answers one response per entry, as Apply does.
func (f *FSM) ApplyBatch(logs []*raft.Log) []interface{} {
	f.amu.Lock()
	defer f.amu.Unlock()
	out := make([]interface{}, len(logs))
	for i, l := range logs {
		if res := f.applyLog(l); res != nil {
			out[i] = res
		}
	}
	if f.opts.OnApplied != nil && len(logs) > 0 {
		f.opts.OnApplied(f.applied.Load())
	}
	return out
}

func (f *FSM) applyLog(l *raft.Log) *Result {
	if l.Type != raft.LogCommand {
		if l.Index > f.applied.Load() {
			f.applied.Store(l.Index)
		}
		return nil
	}
	res := f.applyCommand(l.Index, l.Data)
	f.applied.Store(l.Index)
	f.emit()
	return res
}

func (f *FSM) applyCommand(index uint64, data []byte) *Result {
	if len(data) == 0 {
		return &Result{Status: Invalid, Err: fmt.Errorf("entry %d: %w: empty command", index, ErrMalformed)}
	}
	t := data[0] &^ flagIgnorable
	if !knownType(t) {
		if data[0]&flagIgnorable != 0 {
			return &Result{Status: Ignored}
		}
		panic(fmt.Sprintf("fsm: log entry %d has unknown command type 0x%02x without the ignore-if-unknown flag: "+
			"this replica runs older code than the leader and stops rather than diverge; upgrade it", index, data[0]))
	}
	cmd, err := decodeBody(t, data[1:])
	if err != nil {
		return &Result{Status: Invalid, Err: fmt.Errorf("entry %d: %w", index, err)}
	}
	return cmd.apply(f, index)
}

// track reports whether changes are wanted (building them costs allocations).
func (f *FSM) track() bool { return f.opts.OnChange != nil }

func (f *FSM) note(c Change) {
	if f.opts.OnChange != nil {
		f.pending = append(f.pending, c)
	}
}

// emit reports the changes of the entry just applied, now that readers can see it.
func (f *FSM) emit() {
	if len(f.pending) == 0 {
		return
	}
	for _, c := range f.pending {
		f.opts.OnChange(c)
	}
	if cap(f.pending) > 4096 {
		f.pending = nil
	} else {
		clear(f.pending)
		f.pending = f.pending[:0]
	}
}

// writable returns shard si ready for writing: a frozen shard (one a snapshot holds) is
// cloned and the clone published first. Table positions and slot indexes stay valid.
func (f *FSM) writable(si int) *shard {
	st := f.st.Load()
	s := st.shards[si]
	if s.gen == f.gen {
		return s
	}
	c := s.clone(f.gen)
	next := &state{shards: st.shards}
	next.shards[si] = c
	f.st.Store(next)
	return c
}

func (c *Bind) apply(f *FSM, index uint64) *Result {
	h := hashKey(c.Session)
	si := shardOf(h)
	s := f.st.Load().shards[si]
	_, i := s.find(c.Session, h)
	if c.ExpectRevision == 0 {
		if i >= 0 && !brokenSkipCAS {
			return &Result{Status: Exists, Binding: s.binding(i, c.Session), Found: true}
		}
	} else {
		if i < 0 {
			return &Result{Status: Conflict}
		}
		if s.slots[i].revision != c.ExpectRevision {
			return &Result{Status: Conflict, Binding: s.binding(i, c.Session), Found: true}
		}
	}
	if w, ok := f.reg.Load().workers[c.Worker]; ok && w.Draining {
		r := &Result{Status: Rejected}
		if i >= 0 {
			r.Binding, r.Found = s.binding(i, c.Session), true
		}
		return r
	}
	if i < 0 && c.MaxBindings > 0 && uint64(f.count.Load()) >= c.MaxBindings {
		return &Result{Status: Full}
	}
	if _, known := f.models.lookup(c.Model); c.Model != "" && !known && len(f.models.ids) >= MaxBoundModels {
		return &Result{Status: Invalid, Err: fmt.Errorf("entry %d: %w: bindings already record %d distinct models", index, ErrInvalid, MaxBoundModels)}
	}

	nb := Binding{Session: c.Session, Worker: c.Worker, DPRank: c.DPRank, Revision: index, TTL: c.TTL, Model: c.Model}
	sl := slot{revision: index, ttl: int64(c.TTL), dpRank: c.DPRank, worker: f.intern.acquire(c.Worker)}
	if c.Model != "" {
		sl.model = uint16(f.models.acquire(c.Model) + 1)
	}
	s = f.writable(si)
	if i < 0 {
		s.mu.Lock()
		s.names, s.models = f.intern.names, f.models.names
		insert(s, c.Session, h, sl)
		s.mu.Unlock()
		f.count.Add(1)
		f.note(Change{Kind: Bound, Reason: NewBinding, Binding: nb, Index: index})
		return &Result{Status: Created, Binding: nb, Found: true}
	}
	old := s.slots[i]
	prev := s.binding(i, c.Session)
	sl.keyOff, sl.keyLen = old.keyOff, old.keyLen
	s.mu.Lock()
	s.names, s.models = f.intern.names, f.models.names
	s.slots[i] = sl
	s.mu.Unlock()
	f.intern.release(old.worker)
	f.releaseModel(old.model)
	f.note(Change{Kind: Bound, Reason: Replaced, Binding: nb, Previous: prev, Index: index})
	return &Result{Status: Created, Binding: nb, Found: true}
}

func (c *Invalidate) apply(f *FSM, index uint64) *Result {
	return f.unbind(c.Session, c.Revision, Invalidated, index)
}

func (c *Expire) apply(f *FSM, index uint64) *Result {
	return f.unbind(c.Session, c.Revision, Expired, index)
}

// unbind removes session's binding if its revision is rev.
func (f *FSM) unbind(session string, rev uint64, reason Reason, index uint64) *Result {
	h := hashKey(session)
	si := shardOf(h)
	s := f.st.Load().shards[si]
	pos, i := s.find(session, h)
	if i < 0 {
		return &Result{Status: NotFound}
	}
	b := s.binding(i, session)
	if b.Revision != rev {
		return &Result{Status: Conflict, Binding: b, Found: true}
	}
	wid, mid := s.slots[i].worker, s.slots[i].model
	s = f.writable(si)
	s.mu.Lock()
	s.remove(pos, i)
	s.mu.Unlock()
	f.intern.release(wid)
	f.releaseModel(mid)
	f.count.Add(-1)
	f.note(Change{Kind: Unbound, Reason: reason, Binding: b, Index: index})
	return &Result{Status: Removed, Binding: b, Found: true}
}

// releaseModel drops a slot's reference to its model (0: none).
func (f *FSM) releaseModel(m uint16) {
	if m != 0 {
		f.models.release(uint32(m - 1))
	}
}

// unbindWorker removes every binding of worker and returns how many.
func (f *FSM) unbindWorker(worker string, reason Reason, index uint64) int {
	wid, ok := f.intern.lookup(worker)
	if !ok {
		return 0
	}
	n := 0
	for si := range numShards {
		s := f.st.Load().shards[si]
		if !slices.ContainsFunc(s.slots, func(sl slot) bool { return sl.worker == wid }) {
			continue
		}
		s = f.writable(si)
		s.mu.Lock()
		// Downwards, so the slot a removal moves into the hole was already looked at.
		for i := len(s.slots) - 1; i >= 0; i-- {
			if s.slots[i].worker != wid {
				continue
			}
			if f.track() {
				f.pending = append(f.pending, Change{Kind: Unbound, Reason: reason, Binding: s.binding(i, ""), Index: index})
			}
			f.releaseModel(s.slots[i].model)
			key := s.key(i)
			pos, _ := s.findBytes(key, hashBytes(key))
			s.remove(pos, i)
			n++
		}
		s.mu.Unlock()
	}
	for range n {
		f.intern.release(wid)
	}
	f.count.Add(int64(-n))
	return n
}

func (c *InvalidateWorker) apply(f *FSM, index uint64) *Result {
	return &Result{Status: OK, Count: f.unbindWorker(c.Worker, WorkerInvalidated, index)}
}

func (c *Checkpoint) apply(f *FSM, _ uint64) *Result {
	if c.Aged > 0 {
		f.age(int64(c.Aged))
	}
	n := 0
	for _, e := range c.Entries {
		h := hashKey(e.Session)
		si := shardOf(h)
		_, i := f.st.Load().shards[si].find(e.Session, h)
		if i < 0 || f.st.Load().shards[si].slots[i].revision != e.Revision {
			continue
		}
		s := f.writable(si)
		s.mu.Lock()
		s.slots[i].remaining = int64(e.Remaining)
		s.mu.Unlock()
		n++
	}
	return &Result{Status: OK, Count: n}
}

// age takes d off every checkpointed binding's remaining TTL, down to a millisecond at least
// (a binding never checkpointed keeps 0: its whole TTL).
func (f *FSM) age(d int64) {
	for si := range numShards {
		if !slices.ContainsFunc(f.st.Load().shards[si].slots, func(sl slot) bool { return sl.remaining > 0 }) {
			continue
		}
		s := f.writable(si)
		s.mu.Lock()
		for i := range s.slots {
			if r := s.slots[i].remaining; r > 0 {
				s.slots[i].remaining = max(r-d, int64(time.Millisecond))
			}
		}
		s.mu.Unlock()
	}
}

func (c *AddWorker) apply(f *FSM, index uint64) *Result {
	r := f.reg.Load().clone()
	_, found := r.workers[c.ID]
	r.workers[c.ID] = Worker{ID: c.ID, Spec: slices.Clip(slices.Clone(c.Spec))}
	f.reg.Store(r)
	f.noteWorkers(c.ID, index)
	return &Result{Status: OK, Found: found}
}

// noteWorkers reports a change of the worker registry.
func (f *FSM) noteWorkers(id string, index uint64) {
	f.note(Change{Kind: WorkersChanged, Binding: Binding{Worker: id}, Index: index})
}

// DrainWorker and RemoveWorker remove the worker's bindings even when the registry does
// not know it (a worker configured by flags): a binding to it must not outlive the order.
// Status NotFound then tells the caller the registry had no such worker.

func (c *DrainWorker) apply(f *FSM, index uint64) *Result {
	res := &Result{Status: NotFound}
	if w, ok := f.reg.Load().workers[c.ID]; ok {
		res.Status, res.Found = OK, true
		if !w.Draining {
			r := f.reg.Load().clone()
			w.Draining = true
			r.workers[c.ID] = w
			f.reg.Store(r)
			f.noteWorkers(c.ID, index)
		}
	}
	res.Count = f.unbindWorker(c.ID, Drained, index)
	return res
}

func (c *RemoveWorker) apply(f *FSM, index uint64) *Result {
	res := &Result{Status: NotFound}
	if _, ok := f.reg.Load().workers[c.ID]; ok {
		res.Status, res.Found = OK, true
		r := f.reg.Load().clone()
		delete(r.workers, c.ID)
		f.reg.Store(r)
		f.noteWorkers(c.ID, index)
	}
	res.Count = f.unbindWorker(c.ID, WorkerRemoved, index)
	return res
}

func (c *SetMember) apply(f *FSM, _ uint64) *Result {
	r := f.reg.Load().clone()
	_, found := r.members[c.Member.ID]
	r.members[c.Member.ID] = c.Member
	f.reg.Store(r)
	return &Result{Status: OK, Found: found}
}

func (c *RemoveMember) apply(f *FSM, _ uint64) *Result {
	if _, ok := f.reg.Load().members[c.ID]; !ok {
		return &Result{Status: NotFound}
	}
	r := f.reg.Load().clone()
	delete(r.members, c.ID)
	f.reg.Store(r)
	return &Result{Status: OK, Found: true}
}

func (c *SetAlias) apply(f *FSM, index uint64) *Result {
	r := f.reg.Load()
	a := c.Alias
	for _, t := range a.Targets {
		if _, ok := r.aliases[t.Model]; ok {
			return &Result{Status: Invalid, Err: fmt.Errorf("entry %d: %w: alias %q: target %q is an alias (no alias of an alias)", index, ErrInvalid, a.Name, t.Model)}
		}
	}
	for _, o := range r.aliases {
		if o.Name == a.Name {
			continue
		}
		for _, t := range o.Targets {
			if t.Model == a.Name {
				return &Result{Status: Invalid, Err: fmt.Errorf("entry %d: %w: %q is a target of alias %q (no alias of an alias)", index, ErrInvalid, a.Name, o.Name)}
			}
		}
	}
	_, found := r.aliases[a.Name]
	if !found && len(r.aliases) >= MaxAliases {
		return &Result{Status: Invalid, Err: fmt.Errorf("entry %d: %w: %d aliases already, the most there may be", index, ErrInvalid, MaxAliases)}
	}
	r = r.clone()
	a.Targets = slices.Clip(slices.Clone(a.Targets))
	r.aliases[a.Name] = a
	f.reg.Store(r)
	return &Result{Status: OK, Found: found}
}

func (c *DeleteAlias) apply(f *FSM, _ uint64) *Result {
	if _, ok := f.reg.Load().aliases[c.Name]; !ok {
		return &Result{Status: NotFound}
	}
	r := f.reg.Load().clone()
	delete(r.aliases, c.Name)
	f.reg.Store(r)
	return &Result{Status: OK, Found: true}
}

// Aliases returns the model aliases, sorted by name.
func (f *FSM) Aliases() []Alias {
	r := f.reg.Load()
	out := make([]Alias, 0, len(r.aliases))
	for _, a := range r.aliases {
		a.Targets = slices.Clone(a.Targets)
		out = append(out, a)
	}
	slices.SortFunc(out, func(a, b Alias) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Alias returns one model alias.
func (f *FSM) Alias(name string) (Alias, bool) {
	a, ok := f.reg.Load().aliases[name]
	a.Targets = slices.Clone(a.Targets)
	return a, ok
}

// Get returns session's binding. It takes one shard's read lock and allocates nothing.
func (f *FSM) Get(session string) (Binding, bool) {
	h := hashKey(session)
	s := f.st.Load().shards[shardOf(h)]
	s.mu.RLock()
	defer s.mu.RUnlock()
	_, i := s.find(session, h)
	if i < 0 {
		return Binding{}, false
	}
	return s.binding(i, session), true
}

// Len is the number of bindings.
func (f *FSM) Len() int { return int(f.count.Load()) }

// AppliedIndex is the index of the last log entry applied (or restored from a snapshot).
// Raft hands the FSM command and configuration entries only: a no-op or barrier entry
// does not advance it, so compare it with indexes of commands, or use raft's own
// AppliedIndex for a commit index.
func (f *FSM) AppliedIndex() uint64 { return f.applied.Load() }

// Range calls fn with every binding until fn returns false. Each shard is read
// consistently, under its read lock, but fn runs outside any lock, so it may call the
// FSM; bindings changed by entries applied meanwhile may or may not be seen.
func (f *FSM) Range(fn func(Binding) bool) {
	st := f.st.Load()
	var buf []Binding
	for _, s := range st.shards {
		s.mu.RLock()
		buf = buf[:0]
		for i := range s.slots {
			buf = append(buf, s.binding(i, ""))
		}
		s.mu.RUnlock()
		for _, b := range buf {
			if !fn(b) {
				return
			}
		}
	}
}

// Workers returns the registry's workers, sorted by id.
func (f *FSM) Workers() []Worker {
	r := f.reg.Load()
	out := make([]Worker, 0, len(r.workers))
	for _, w := range r.workers {
		w.Spec = slices.Clone(w.Spec)
		out = append(out, w)
	}
	slices.SortFunc(out, func(a, b Worker) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// Worker returns one registry worker.
func (f *FSM) Worker(id string) (Worker, bool) {
	w, ok := f.reg.Load().workers[id]
	w.Spec = slices.Clone(w.Spec)
	return w, ok
}

// Members returns the cluster's members, sorted by id.
func (f *FSM) Members() []Member {
	r := f.reg.Load()
	out := make([]Member, 0, len(r.members))
	for _, m := range r.members {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// Member returns one member.
func (f *FSM) Member(id string) (Member, bool) {
	m, ok := f.reg.Load().members[id]
	return m, ok
}
