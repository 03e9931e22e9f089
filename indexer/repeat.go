package indexer

import (
	"slices"
	"sync"
	"sync/atomic"
)

// lastStore lets a Store that would change nothing return without the worker's lock.
//
// Every request writes its worker's entries twice (routing records the prompt at dispatch,
// and the prompt with its answer's stand-ins at completion), so every request took its
// worker's mutex twice, and with a handful of workers every core queued on a handful of
// locks. A Store of seq changes nothing when
//
//   - the worker's last write was a Store of a sequence that begins with seq (or is seq), in
//     the same tick, and nothing was written or removed for the worker since: that Store left
//     seq's blocks held, stamped this tick, and as the worker's newest records in the order
//     seq would queue them (a Store queues its blocks last to first, so a prefix's are the
//     newest of all); storing seq again would push the same records with the same tick behind
//     them and supersede the old ones, and its cap and TTL would find nothing new to drop;
//   - and no shard that Store wrote has been written since (its version is the one the Store
//     left): the blocks' worker sets are the ones it saw, so the hints a Store of seq would
//     write, computed from those sets and the hint of seq's last block (which a Store leaves
//     as it is when the worker holds the block), are the ones that Store wrote.
//
// So the skip leaves the index exactly as the Store would, but for the superseded recency
// records that Store would have added (which only ever cost memory and compaction).
//
// Only a Store that added no block (a refresh) is kept as the record: keeping one costs a copy
// of its sequence, which a Store of new blocks (a new prompt, or KV events) would pay on every
// call for nothing, since only a refresh is likely to come again. So a prompt's first Store
// writes, its second (a refresh) writes and is kept, and the ones after it are skipped.
//
// version counts the worker's writes: every locked writer bumps it before it changes anything
// (writeWorker; Store once it has found under the lock that it is no repeat), and removals
// inside a write (the cap's evictions, expiry) bump it again. A
// Store that ends with the version it began with, and wrote each shard with no other writer
// between its writes there, publishes what it stored. A reader that finds that record, the
// version unchanged and every shard at the version the Store left it returns (its Store
// ordered just after that one). A write that starts later changes a version before it
// changes anything, so a reader that saw the old versions is ordered before that write, as
// any two concurrent writes may be.
//
// Requests that arrive together at a tick's start all find the last record a tick old. The
// first takes the lock and stores; the others would queue on the lock and take it in turn
// only to find they repeat it, each waking the next (a cascade that an oversubscribed machine
// stretches to milliseconds). So a locked Store that refreshes the kept one at a new tick
// announces itself (writing: its tick, length and a fingerprint of its sequence) before it
// writes, and a Store of the same sequence at the
// same tick waits for it to finish, all such waiters together, and then checks again (a
// fingerprint that matches by chance costs a wait, never a skipped write).
//
// Its words are read by every Store of the worker and written only by the locked ones,
// so they sit on cache lines of their own, apart from the mutex's.
type lastStore struct {
	_       [64]byte
	version atomic.Uint64
	rec     atomic.Pointer[storeRecord]
	writing atomic.Pointer[inflight] // the locked Store in progress, if any
	_       [40]byte

	// The current Store's shards (guarded by the worker's mutex): shardVer[s] is the version
	// the Store's last write to shard s left it at plus one (0: not written yet), touched
	// lists the shards written, broken says another writer wrote one of them between two of
	// this Store's writes.
	shardVer *[numShards]uint64
	touched  []uint8
	broken   bool
}

// storeRecord is one Store as lastStore keeps it: immutable once published.
type storeRecord struct {
	version uint64
	tick    uint32
	seq     []uint64
	// shards are the shards the Store wrote, each with the version it left it at: the shard
	// in the top 8 bits, the version below (a version reaches 2^56 after a century of writes
	// at a billion a second).
	shards []uint64
}

// inflight announces a locked Store in progress: immutable but for done and waiters.
type inflight struct {
	tick    uint32
	n       int    // the sequence's length
	print   uint64 // seqPrint of the sequence
	done    sync.WaitGroup
	waiters atomic.Int32 // Stores waiting on done
}

// waiting returns how many Stores are waiting for this one to end.
func (f *inflight) waiting() int { return int(f.waiters.Load()) }

// seqPrint condenses a sequence to one word, for inflight.
func seqPrint(seq []uint64) uint64 {
	h := uint64(len(seq))
	for _, k := range seq {
		h = xxRound(h, k)
	}
	return h
}

// shardVerBits is how many low bits of a storeRecord.shards word hold the version.
const shardVerBits = 64 - shardBits

// current returns the worker's write version. Caller holds the worker's mutex.
func (l *lastStore) current() uint64 { return l.version.Load() }

// change notes that the worker's entries are about to change (or may have), so that no
// earlier Store stands for them. Caller holds the worker's mutex.
func (l *lastStore) change() { l.version.Add(1) }

// wrote notes the current Store's write to shard s, which found the shard at version before
// and left it at after. Caller holds the worker's mutex.
func (l *lastStore) wrote(s int, before, after uint64) {
	if l.shardVer == nil {
		l.shardVer = new([numShards]uint64)
	}
	switch prev := l.shardVer[s]; {
	case prev == 0:
		l.touched = append(l.touched, uint8(s))
	case before != prev-1:
		l.broken = true
	}
	l.shardVer[s] = after + 1
}

// begin announces the locked Store of seq at tick. Caller holds the worker's mutex, and calls
// stored next.
func (l *lastStore) begin(seq []uint64, tick uint32) *inflight {
	f := &inflight{tick: tick, n: len(seq), print: seqPrint(seq)}
	f.done.Add(1)
	l.writing.Store(f)
	return f
}

// sameSequence reports whether the kept Store's sequence begins with seq. Caller holds the
// worker's mutex.
func (l *lastStore) sameSequence(seq []uint64) bool {
	r := l.rec.Load()
	return r != nil && len(seq) <= len(r.seq) && slices.Equal(r.seq[:len(seq)], seq)
}

// stored ends the current Store of seq at tick, that began at version and added added blocks:
// it keeps it as the record if it added none and nothing else changed the worker's entries or
// its shards during it (its cap or TTL evicted some, or another writer wrote between two of
// its writes to a shard), and releases the Stores that waited for it (f, if it announced
// itself). Caller holds the worker's mutex.
func (l *lastStore) stored(f *inflight, seq []uint64, tick uint32, version uint64, added int) {
	var rec *storeRecord
	if added == 0 && !l.broken && l.version.Load() == version {
		// One allocation for both slices.
		buf := make([]uint64, len(seq)+len(l.touched))
		copy(buf, seq)
		rec = &storeRecord{version: version, tick: tick, seq: buf[:len(seq)], shards: buf[len(seq):]}
		for i, s := range l.touched {
			rec.shards[i] = uint64(s)<<shardVerBits | (l.shardVer[s]-1)&(1<<shardVerBits-1)
		}
	}
	for _, s := range l.touched {
		l.shardVer[s] = 0
	}
	l.touched, l.broken = l.touched[:0], false
	l.rec.Store(rec)
	if f != nil {
		l.writing.Store(nil)
		f.done.Done()
	}
}

// awaitSame waits for the locked Store in progress, if it stores seq at tick, and reports
// whether it waited.
func (l *lastStore) awaitSame(seq []uint64, tick uint32) bool {
	f := l.writing.Load()
	if f == nil || f.tick != tick || f.n != len(seq) || f.print != seqPrint(seq) {
		return false
	}
	f.waiters.Add(1)
	f.done.Wait()
	return true
}

// repeats reports whether storing seq for st's worker at tick would change nothing (see
// lastStore). Safe without the worker's mutex.
func (x *Index) repeats(st *workerState, seq []uint64, tick uint32) bool {
	r := st.last.rec.Load()
	if r == nil || r.tick != tick || len(seq) > len(r.seq) || st.last.version.Load() != r.version ||
		!slices.Equal(r.seq[:len(seq)], seq) {
		return false
	}
	for _, sv := range r.shards {
		if x.shards[sv>>shardVerBits].ver.Load()&(1<<shardVerBits-1) != sv&(1<<shardVerBits-1) {
			return false
		}
	}
	return true
}
