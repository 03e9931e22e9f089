package indexer

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// tickUnit is the resolution of entry ages: records carry 32-bit ticks instead of 24-byte
// time.Time values, and 10 ms is far finer than any useful TTL.
const tickUnit = 10 * time.Millisecond

// compactMin is the number of superseded recency records a worker tolerates before its queue
// is compacted, so small workers do not compact on every refresh.
const compactMin = 1024

// writeBatch is how many blocks a writer touches ahead of its locked writes (see shard.touch).
const writeBatch = 32

// storeAttempts bounds the retries of a Store or Clear that races RemoveWorker of the same
// worker; each retry sees the worker's replacement, so the second attempt normally succeeds.
const storeAttempts = 4

// Index maps block sequence hashes to the workers holding them. It is safe for concurrent use:
// lookups take no locks (each of 256 shards is read under a sequence lock, retried if a writer
// overlapped), and writers of different workers proceed in parallel, meeting only on a shard's
// mutex for the moment of one block's update. See FindMatches for the prefix-closed assumption
// the lookups rely on, and DESIGN.md in this directory for the layout.
type Index struct {
	shards [numShards]shard

	ttlTicks  uint32 // 0: entries never expire
	maxBlocks int    // 0: no per-worker cap
	// recency: workers keep recency queues, which only a TTL or a cap needs. Without either
	// (precise mode, where the engines' events say what leaves) the queues would cost 12
	// bytes per entry and a map update per removal, and Clear scans the tables instead.
	recency bool
	// noRepeat turns off the lock-free return of a Store that repeats the worker's last
	// (repeat.go), so that tests can compare the two.
	noRepeat bool
	now      func() time.Time
	base     time.Time
	total    atomic.Int64

	mu     sync.RWMutex // guards byName, free, nextID and writes of byID and named
	byName map[Worker]*workerState
	free   []int
	nextID int
	// named is a copy of byName, replaced on every change, so that writers find their
	// worker without taking mu (whose read lock is a word every Store would write).
	named atomic.Pointer[map[Worker]*workerState]
	// byID is an immutable slice, replaced on every change, so that lookups name the workers
	// of their matches without taking mu.
	byID atomic.Pointer[[]*workerState]

	scratch sync.Pool // of *scratch, FindMatches' working memory
}

// workerState is one worker's entries: an interned id that is its bit in the block sets, and
// its recency queue.
//
// The queue holds a record for every entry the worker holds, oldest first. Refreshing or
// removing an entry does not search the queue; it leaves the old record in place and counts it
// in pending, which maps a key to the number of its records that are superseded. Because a
// key's live record is always its newest, the oldest record of a key with a pending count is
// superseded, so popping the queue needs no per-entry timestamps in the block table.
type workerState struct {
	w  Worker
	id int

	// removed is set by RemoveWorker before the worker leaves byName, so a writer holding a
	// stale pointer retries and a lookup that sees both this state and its successor (the
	// same Worker, registered again) reports only the successor.
	removed atomic.Bool

	// last lets a Store that repeats the worker's last one skip the lock (see repeat.go). Its
	// own cache lines, apart from mu's, which every locked write changes.
	last lastStore

	mu      sync.Mutex // guards everything below and every bit of id in the block table
	live    int
	stale   int
	queue   recency
	pending map[uint64]uint32
	sink    uint64 // where touches put what they load, so the loads are not optimised away
}

// New returns an empty Index. Negative TTL or MaxBlocksPerWorker count as 0 (off). A TTL is
// kept at a resolution of 10 ms and rounded up, so an entry lives at least TTL.
func New(opts Options) *Index {
	x := &Index{
		now:    opts.Now,
		byName: make(map[Worker]*workerState),
	}
	if x.now == nil {
		x.now = time.Now
	}
	if opts.TTL > 0 {
		x.ttlTicks = uint32(min((opts.TTL+tickUnit-1)/tickUnit, 1<<30))
		x.base = x.now()
	}
	if opts.MaxBlocksPerWorker > 0 {
		x.maxBlocks = opts.MaxBlocksPerWorker
	}
	x.recency = x.ttlTicks > 0 || x.maxBlocks > 0
	x.byID.Store(&[]*workerState{})
	x.named.Store(&map[Worker]*workerState{})
	return x
}

// Apply applies one KV event: Stored stores its blocks, Removed removes them, Cleared clears
// the worker. An unknown kind is an error and changes nothing.
func (x *Index) Apply(ev Event) error {
	switch ev.Kind {
	case Stored:
		x.Store(ev.Worker, ev.Blocks)
	case Removed:
		x.Remove(ev.Worker, ev.Blocks)
	case Cleared:
		x.Clear(ev.Worker)
	default:
		return fmt.Errorf("indexer: unknown event kind %d for worker %s", ev.Kind, ev.Worker)
	}
	return nil
}

// Record stores a routing decision: the worker will hold seq once it has served the request.
// It is Store under the name routing's DecisionRecorder uses.
func (x *Index) Record(w Worker, seq []uint64) { x.Store(w, seq) }

// Store adds the blocks of seq to w's entries, registering w if it is new. A block w already
// holds is refreshed: its TTL restarts and it becomes w's newest for the cap. The blocks of one
// call are queued from the last to the first, so that a cap evicts a prompt's tail before its
// head and w's holdings stay prefix-closed.
func (x *Index) Store(w Worker, seq []uint64) { x.store(w, seq) }

// RecordRepeat is Record, and reports whether the call repeated the worker's last Store and
// changed nothing (see lastStore in repeat.go): seq's blocks were already held, stamped this
// tick, and the worker's newest, as this Store would have left them.
func (x *Index) RecordRepeat(w Worker, seq []uint64) bool { return x.store(w, seq) }

// store is Store, and reports whether it was a repeat that changed nothing.
func (x *Index) store(w Worker, seq []uint64) (repeat bool) {
	if len(seq) == 0 {
		return false
	}
	tick := x.storeTick()
	if st := (*x.named.Load())[w]; st != nil && !x.noRepeat {
		if x.repeats(st, seq, tick) || st.last.awaitSame(seq, tick) && x.repeats(st, seq, tick) {
			return true
		}
	}
	st, waited := x.lockWorker(w, true)
	if st == nil {
		return false
	}
	defer st.mu.Unlock()
	if waited {
		tick = x.storeTick()
	}
	if !x.noRepeat && x.repeats(st, seq, tick) {
		// Another Store made this one a repeat while it waited for the lock.
		return true
	}
	st.last.change()
	version := st.last.current()
	var f *inflight
	if !x.noRepeat && st.last.sameSequence(seq) {
		// A refresh of the kept Store at a new tick: the Stores of the same sequence that
		// arrive meanwhile wait for this one instead of queueing on the lock.
		f = st.last.begin(seq, tick)
	}
	added := 0
	var next link // the block after the one being added, for its hint (see shard.add)
	for end := len(seq); end > 0; {
		start := max(0, end-writeBatch)
		for _, h := range seq[start:end] {
			st.sink ^= x.touch(normKey(h))
		}
		for i := end - 1; i >= start; i-- {
			key := normKey(seq[i])
			had, nx, before, after := x.addBlock(st, key, tick, next)
			next = nx
			if !had {
				added++
			} else if added == 0 {
				// Only a Store that adds nothing is kept (see lastStore.stored).
				st.last.wrote(shardOf(key), before, after)
			}
		}
		end = start
	}
	x.settleAdded(st, added)
	if x.ttlTicks > 0 {
		x.expireWorker(st, tick)
	}
	x.compact(st)
	st.last.stored(f, seq, tick, version, added)
	return false
}

// Remove drops the blocks of seq from w's entries; blocks w does not hold are ignored.
func (x *Index) Remove(w Worker, seq []uint64) {
	if len(seq) == 0 {
		return
	}
	st := x.writeWorker(w, false)
	if st == nil {
		return
	}
	defer st.mu.Unlock()
	removed := 0
	for start := 0; start < len(seq); start += writeBatch {
		batch := seq[start:min(start+writeBatch, len(seq))]
		for _, h := range batch {
			st.sink ^= x.touch(normKey(h))
		}
		for _, h := range batch {
			key := normKey(h)
			sh := &x.shards[shardOf(key)]
			sh.lock()
			had := sh.remove(key, st.id)
			sh.unlock()
			if had {
				removed++
				if x.recency {
					st.supersede(key)
				}
			}
		}
	}
	st.live -= removed
	x.total.Add(-int64(removed))
	x.compact(st)
}

// Clear drops every entry of w (vLLM's AllBlocksCleared). w stays known, with no blocks.
func (x *Index) Clear(w Worker) {
	st := x.writeWorker(w, true)
	if st == nil {
		return
	}
	defer st.mu.Unlock()
	x.dropAll(st)
}

// RemoveWorker forgets w and all its entries. Its id is reused only after its entries are gone,
// so a later worker never inherits them.
func (x *Index) RemoveWorker(w Worker) {
	x.mu.Lock()
	st := x.byName[w]
	if st != nil {
		st.removed.Store(true)
		delete(x.byName, w)
		x.publishNames()
	}
	x.mu.Unlock()
	if st == nil {
		return
	}
	st.mu.Lock()
	x.dropAll(st)
	st.mu.Unlock()

	x.mu.Lock()
	defer x.mu.Unlock()
	x.publish(st.id, nil)
	x.free = append(x.free, st.id)
}

// Expire drops every entry stored or refreshed longer than the TTL ago and returns how many it
// dropped; with no TTL it does nothing. The caller runs it periodically: Expire (and a Store to
// the same worker) is the only expiry, so until it runs FindMatches still reports entries past
// their TTL, and the TTL is a lower bound on an entry's life.
func (x *Index) Expire() int {
	if x.ttlTicks == 0 {
		return 0
	}
	now := x.tick()
	dropped := 0
	for _, st := range *x.byID.Load() {
		if st == nil {
			continue
		}
		st.mu.Lock()
		if !st.removed.Load() {
			dropped += x.expireWorker(st, now)
			x.compact(st)
		}
		st.mu.Unlock()
	}
	return dropped
}

// Len returns the number of (block, worker) entries.
func (x *Index) Len() int { return int(x.total.Load()) }

// Workers returns the known workers, sorted by ID and rank.
func (x *Index) Workers() []Worker {
	x.mu.RLock()
	ws := make([]Worker, 0, len(x.byName))
	for w := range x.byName {
		ws = append(ws, w)
	}
	x.mu.RUnlock()
	slices.SortFunc(ws, func(a, b Worker) int {
		return cmp.Or(cmp.Compare(a.ID, b.ID), cmp.Compare(a.DPRank, b.DPRank))
	})
	return ws
}

// Blocks returns the number of blocks w holds (0 for an unknown worker).
func (x *Index) Blocks(w Worker) int {
	st := (*x.named.Load())[w]
	if st == nil {
		return 0
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.live
}

// touch loads key's home slot ahead of a write; see shard.touch.
func (x *Index) touch(key uint64) uint64 {
	return x.shards[shardOf(key)].touch(key)
}

// addBlock adds one block to st's worker (st locked): its shard entry with the hint next,
// and, when the index keeps recency, its queue entry stamped tick. It reports whether the
// worker held the block already, the link for the block before it, and the shard's versions
// as the write found and left it (the same when the block's slot did not change: a refresh
// of a held block whose hint stays, which leaves the shard's readers undisturbed).
func (x *Index) addBlock(st *workerState, key uint64, tick uint32, next link) (had bool, _ link, before, after uint64) {
	sh := &x.shards[shardOf(key)]
	sh.mu.Lock()
	before = sh.ver.Load()
	had, next, wrote := sh.add(key, st.id, next)
	if wrote {
		sh.ver.Add(1)
	}
	after = sh.ver.Load()
	sh.mu.Unlock()
	if x.recency {
		st.queue.push(key, tick)
		if had {
			st.supersede(key)
		}
	}
	return had, next, before, after
}

// settleAdded counts added new entries of st's worker (st locked) and evicts its oldest
// down to the per-worker cap.
func (x *Index) settleAdded(st *workerState, added int) {
	st.live += added
	x.total.Add(int64(added))
	if x.maxBlocks > 0 {
		for st.live > x.maxBlocks && st.queue.len() > 0 {
			x.popOldest(st, min(st.live-x.maxBlocks, writeBatch, st.queue.len()))
		}
	}
}

// writeWorker is lockWorker for a caller about to change w's entries: the worker's last Store
// no longer stands for its state (see lastStore).
func (x *Index) writeWorker(w Worker, create bool) *workerState {
	st, _ := x.lockWorker(w, create)
	if st != nil {
		st.last.change()
	}
	return st
}

// lockWorker returns w's state locked, registering w first if create is set; nil if w is
// unknown and create is not set, or if w kept being removed under it. waited says whether
// the lock was held by another. A caller that changes the worker's entries calls
// st.last.change() first (writeWorker does).
func (x *Index) lockWorker(w Worker, create bool) (st *workerState, waited bool) {
	for range storeAttempts {
		st := (*x.named.Load())[w]
		if st == nil {
			if !create {
				return nil, waited
			}
			st = x.register(w)
		}
		if !st.mu.TryLock() {
			st.mu.Lock()
			waited = true
		}
		if !st.removed.Load() {
			return st, waited
		}
		st.mu.Unlock()
	}
	return nil, waited
}

// register returns w's state, creating it with the smallest free id so that ids stay dense
// and a fleet of up to 64 workers stays in the first word of the block sets.
func (x *Index) register(w Worker) *workerState {
	x.mu.Lock()
	defer x.mu.Unlock()
	if st := x.byName[w]; st != nil {
		return st
	}
	id := x.nextID
	if len(x.free) > 0 {
		i := slices.Index(x.free, slices.Min(x.free))
		id = x.free[i]
		x.free = slices.Delete(x.free, i, i+1)
	} else {
		x.nextID++
	}
	st := &workerState{w: w, id: id}
	x.byName[w] = st
	x.publishNames()
	x.publish(id, st)
	return st
}

// publishNames replaces named with a copy of byName. Caller holds x.mu.
func (x *Index) publishNames() {
	named := maps.Clone(x.byName)
	x.named.Store(&named)
}

// publish replaces byID with a copy in which id names st, trimmed of trailing free ids so that
// lookups scan no empty pages. Caller holds x.mu.
func (x *Index) publish(id int, st *workerState) {
	old := *x.byID.Load()
	next := make([]*workerState, max(len(old), id+1))
	copy(next, old)
	next[id] = st
	for len(next) > 0 && next[len(next)-1] == nil {
		next = next[:len(next)-1]
	}
	x.byID.Store(&next)
}

// storeTick is the tick a Store stamps its records with: the current one, or 0 without a TTL
// (only the TTL reads ticks).
func (x *Index) storeTick() uint32 {
	if x.ttlTicks == 0 {
		return 0
	}
	return x.tick()
}

// tick returns the current time in ticks since the index was created.
func (x *Index) tick() uint32 {
	d := x.now().Sub(x.base)
	if d < 0 {
		return 0
	}
	return uint32(d / tickUnit)
}

// expired reports whether a record stamped at tick t is older than the TTL at tick now. The
// difference is taken modulo 2^32 so that the tick counter may wrap (after 497 days); one more
// tick than the TTL makes the TTL a lower bound despite the rounding of both stamps.
func (x *Index) expired(t, now uint32) bool {
	age := int32(now - t)
	return age > int32(x.ttlTicks)
}

// expireWorker pops st's records older than the TTL and returns how many entries it dropped.
// Caller holds st.mu.
func (x *Index) expireWorker(st *workerState, now uint32) int {
	dropped := 0
	for st.queue.len() > 0 {
		k := 0
		for k < writeBatch && k < st.queue.len() {
			if _, t := st.queue.at(k); !x.expired(t, now) {
				break
			}
			k++
		}
		if k == 0 {
			break
		}
		dropped += x.popOldest(st, k)
	}
	return dropped
}

// popOldest pops st's k oldest records (k at most its queue length) and drops the entries of
// those not superseded. It returns the number of entries dropped. Caller holds st.mu.
func (x *Index) popOldest(st *workerState, k int) int {
	st.last.change()
	for i := range k {
		key, _ := st.queue.at(i)
		st.sink ^= x.touch(key)
	}
	dropped := 0
	for range k {
		key, _ := st.queue.at(0)
		st.queue.pop()
		if st.unsupersede(key) {
			continue
		}
		sh := &x.shards[shardOf(key)]
		sh.lock()
		sh.remove(key, st.id)
		sh.unlock()
		dropped++
	}
	st.live -= dropped
	x.total.Add(-int64(dropped))
	return dropped
}

// dropAll removes every entry of st from the block table and empties its queue. Caller holds
// st.mu.
func (x *Index) dropAll(st *workerState) {
	st.last.change()
	if !x.recency {
		x.dropAllByScan(st)
		return
	}
	// Superseded records name blocks st may no longer hold; removing an absent bit is a no-op.
	n := st.queue.len()
	for start := 0; start < n; start += writeBatch {
		end := min(start+writeBatch, n)
		for i := start; i < end; i++ {
			key, _ := st.queue.at(i)
			st.sink ^= x.touch(key)
		}
		for i := start; i < end; i++ {
			key, _ := st.queue.at(i)
			sh := &x.shards[shardOf(key)]
			sh.lock()
			sh.remove(key, st.id)
			sh.unlock()
		}
	}
	x.total.Add(-int64(st.live))
	st.queue.reset()
	st.pending = nil
	st.live, st.stale = 0, 0
}

// dropAllByScan is dropAll for an index without recency queues: it finds st's entries by
// scanning every shard's table for its bit, a few milliseconds for a million entries. That is
// only paid when an engine clears its cache or a worker goes, and it spares every Store and
// Remove the queue. Caller holds st.mu, so st's bits do not change during the scan; other
// workers' writes may move slots, so each shard is scanned under its mutex (readers go on
// meanwhile: the scan writes nothing).
func (x *Index) dropAllByScan(st *workerState) {
	p, bit := st.id/pageBits, uint64(1)<<(st.id%pageBits)
	var keys []uint64
	for i := range x.shards {
		sh := &x.shards[i]
		keys = keys[:0]
		sh.mu.Lock()
		if t := sh.tab.Load(); t != nil && p < t.pages {
			w := 1 + t.pages
			for j := 0; j+w <= len(t.a); j += w {
				if k := t.a[j]; k != 0 && t.a[j+1+p]&bit != 0 {
					// The key bits of the word are all that probing and comparing use.
					keys = append(keys, k&keyMask)
				}
			}
		}
		sh.mu.Unlock()
		for _, key := range keys {
			sh.lock()
			sh.remove(key, st.id)
			sh.unlock()
		}
	}
	x.total.Add(-int64(st.live))
	st.live, st.stale = 0, 0
}

// compact rewrites st's queue without its superseded records once they outnumber a quarter of
// the live ones, so that a queue holds at most 1.25 records per entry (plus compactMin).
// Caller holds st.mu.
func (x *Index) compact(st *workerState) {
	if st.stale <= compactMin || st.stale*4 <= st.live {
		return
	}
	kept := 0
	for i := range st.queue.len() {
		key, t := st.queue.at(i)
		if st.unsupersede(key) {
			continue
		}
		st.queue.set(kept, key, t)
		kept++
	}
	st.queue.truncate(kept)
	st.pending = nil // a map never shrinks; drop it now that it is empty
	st.stale = 0
}

// supersede notes that one more record of key no longer stands for a live entry.
func (st *workerState) supersede(key uint64) {
	if st.pending == nil {
		st.pending = make(map[uint64]uint32)
	}
	st.pending[key]++
	st.stale++
}

// unsupersede is called for the oldest record of key as it leaves the queue: it reports whether
// that record was superseded, and if so uncounts it.
func (st *workerState) unsupersede(key uint64) bool {
	c, ok := st.pending[key]
	if !ok {
		return false
	}
	if c == 1 {
		delete(st.pending, key)
	} else {
		st.pending[key] = c - 1
	}
	st.stale--
	return true
}
