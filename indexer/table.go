package indexer

import (
	"math/bits"
	"sync"
	"sync/atomic"
)

// shardBits picks a block's shard from the top bits of its key: 256 shards keep two busy
// writers apart while the per-shard overhead stays a few kilobytes.
const shardBits = 8

// numShards is the number of independently locked tables.
const numShards = 1 << shardBits

// hintBits is the top of a slot's key word that holds the block's hints instead of key bits:
// the shard's 8 bits, which every key of a shard shares, and 8 more. A slot thus tells keys
// apart by 56 bits (48 stored, 8 implied by the shard), so a lookup of an absent block matches
// a stranger about once in 10^16 comparisons, and two of a million blocks share a slot with
// probability about 10^-5 (they then share a worker set, as two blocks with the same hash do).
const hintBits = 16

// keyMask keeps the key bits of a key word.
const keyMask = 1<<(64-hintBits) - 1

// zeroKey stands in for the key bits of a block whose sequence hash has none set, because a
// zero key word marks an empty slot. The two then share an entry, a collision as likely as
// any other.
const zeroKey uint64 = 0x9e3779b97f4a7c15 & keyMask

// farHint is the largest change offset a hint holds; it also means "no change known within
// the next 255 blocks".
const farHint = 255

// minSlots is the smallest table a shard allocates.
const minSlots = 16

// pageBits is how many worker ids one set word covers: page p holds ids 64p..64p+63.
const pageBits = 64

// optimisticReads bounds how often a reader retries a lookup that raced a writer before it
// takes the shard's lock instead.
const optimisticReads = 8

// table is one shard's open-addressing hash table, a flat array of slots of 1+pages words:
// the block's key word, then its worker set, one bit per worker id, pages words long. With up
// to 64 workers a slot is 16 bytes and there are no pointers for the garbage collector to scan.
// Linear probing with backward-shift deletion (no tombstones), grown by half when 4/5 full and
// shrunk when under 1/8 full.
//
// The key word is the key with its top 16 bits replaced by the block's hint (see hint and
// shard.add): the top 8 are the shard's, the same for every key of the shard, so only 8 bits
// of key are given up. Keys are compared on the rest, and a zero key word is an empty slot.
//
// Readers use atomic loads only and never write; writers hold the shard's mutex and store
// with atomic stores, so that a reader racing a writer reads whole words and the shard's
// version tells it to retry.
type table struct {
	size  int
	pages int
	a     []uint64
}

// shard is one lock's worth of the block table, read without locking through a sequence
// lock: ver is odd while a writer changes the table, and a reader that sees ver change
// across its lookup retries.
type shard struct {
	mu  sync.Mutex // serializes writers
	ver atomic.Uint64
	tab atomic.Pointer[table]
	n   int // occupied slots; guarded by mu
	// Pad to two cache lines so neighbouring shards' versions do not share a line (or the
	// adjacent line the prefetcher pulls in).
	_ [128 - 8 - 8 - 8 - 8]byte
}

// normKey maps a sequence hash to its table key: the hash itself unless its key bits are all
// zero, which would make an empty key word.
func normKey(h uint64) uint64 {
	if h&keyMask == 0 {
		return h | zeroKey
	}
	return h
}

// hint is what a slot predicts about the blocks that followed it in the Store that last set
// it: the offsets (1 to farHint) of the first two blocks whose worker sets differ from their
// predecessors', first in the low byte, second in the high byte.
type hint uint16

// noHint predicts nothing: both changes are far.
const noHint = hint(farHint | farHint<<8)

// first returns the offset of the first predicted change.
func (h hint) first() int { return int(h & 0xff) }

// second returns the offset of the second predicted change.
func (h hint) second() int { return int(h >> 8) }

// sameKey reports whether key word k holds key, ignoring the hints in its top bits.
func sameKey(k, key uint64) bool {
	return (k^key)&keyMask == 0
}

// keyWord returns the key word of key with hint h.
func keyWord(key uint64, h hint) uint64 {
	return key&keyMask | uint64(h)<<(64-hintBits)
}

// hintOf returns the hint of key word k.
func hintOf(k uint64) hint {
	return hint(k >> (64 - hintBits))
}

// shardOf returns the index of the shard that owns key.
func shardOf(key uint64) int {
	return int(key >> (64 - shardBits))
}

// home is key's first probe position in a table of size slots. It uses the key bits below
// those that chose the shard and below the hints, so a key word gives the same home as its key.
func home(key uint64, size int) int {
	hi, _ := bits.Mul64(key<<hintBits, uint64(size))
	return int(hi)
}

// word returns page p of key's worker set and the block's hint, or 0 and noHint if key is
// absent (0 if p is beyond the table's pages), with atomic loads. Racing a writer it may return
// garbage, which the caller's version check discards.
func (t *table) word(key uint64, p int) (uint64, hint) {
	if t == nil {
		return 0, noHint
	}
	return t.wordFrom(key, p, home(key, t.size)*(1+t.pages))
}

// wordFrom is word for a probe that starts at index j of t.a, key's home slot.
func (t *table) wordFrom(key uint64, p, j int) (uint64, hint) {
	a, w := t.a, 1+t.pages
	for range t.size {
		if j+w > len(a) {
			j = 0
		}
		k := atomic.LoadUint64(&a[j])
		if sameKey(k, key) {
			if p >= t.pages {
				return 0, hintOf(k)
			}
			return atomic.LoadUint64(&a[j+1+p]), hintOf(k)
		}
		if k == 0 {
			break
		}
		j += w
	}
	return 0, noHint
}

// probe returns key's slot index and true, or the free slot that ends key's probe run and
// false. The table always has a free slot because its load stays under 4/5. Caller holds the
// shard's mu.
func (t *table) probe(key uint64) (int, bool) {
	i := home(key, t.size)
	for range t.size {
		k := t.a[i*(1+t.pages)]
		if k == 0 || (k^key)&keyMask == 0 {
			return i, k != 0
		}
		if i++; i == t.size {
			i = 0
		}
	}
	return -1, false // unreachable
}

// find returns key's slot index, or -1. Caller holds the shard's mu.
func (t *table) find(key uint64) int {
	if t == nil {
		return -1
	}
	if i, ok := t.probe(key); ok {
		return i
	}
	return -1
}

// get returns page p of key's worker set and the block's hint without blocking writers: it
// retries a lookup that raced a writer a few times, then waits for the lock.
func (s *shard) get(key uint64, p int) (uint64, hint) {
	for range optimisticReads {
		v := s.ver.Load()
		if v&1 != 0 {
			continue
		}
		w, h := s.tab.Load().word(key, p)
		if s.ver.Load() == v {
			return w, h
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tab.Load().word(key, p)
}

// slotRead is one optimistic lookup split in two, so that a batch of lookups can start all their
// cache misses before finishing any: the shard, its version and table when the read began, and
// the index in the table of the key's home slot (-1 without a table).
type slotRead struct {
	sh *shard
	t  *table
	v  uint64
	j  int
}

// start begins a read of key into r and loads the home slot's key word, which it returns so
// that the load is not optimised away.
func (s *shard) start(key uint64, r *slotRead) uint64 {
	r.sh, r.v = s, s.ver.Load()
	t := s.tab.Load()
	r.t = t
	if t == nil {
		r.j = -1
		return 0
	}
	r.j = home(key, t.size) * (1 + t.pages)
	return atomic.LoadUint64(&t.a[r.j])
}

// finish completes r: page p of key's worker set and the block's hint. A read that overlapped
// a writer is done again by get.
func (r *slotRead) finish(key uint64, p int) (uint64, hint) {
	if r.v&1 == 0 && r.j >= 0 {
		w, h := r.t.wordFrom(key, p, r.j)
		if r.sh.ver.Load() == r.v {
			return w, h
		}
	}
	return r.sh.get(key, p)
}

// touch loads key's home slot and returns the word, so that a batch of touches brings the
// slots of a batch of writes into the cache in parallel before the locked writes, whose lock
// instructions would otherwise wait for each cache miss in turn.
func (s *shard) touch(key uint64) uint64 {
	t := s.tab.Load()
	if t == nil {
		return 0
	}
	return atomic.LoadUint64(&t.a[home(key, t.size)*(1+t.pages)])
}

// lock starts a write: readers that overlap it will retry.
func (s *shard) lock() {
	s.mu.Lock()
	s.ver.Add(1)
}

// unlock ends a write.
func (s *shard) unlock() {
	s.ver.Add(1)
	s.mu.Unlock()
}

// link is what a Store knows about the block after the one it adds: the fingerprint of its
// worker set and its hint. ok is false for a Store's last block, whose successor the Store
// does not know.
type link struct {
	fp uint64
	h  hint
	ok bool
}

// add puts worker id into key's set and reports whether it was already there. It also sets the
// block's hint from next, the block that follows it in the Store, and returns the link for the
// block before it: if the two blocks' worker sets are the same, the block predicts next's
// changes one block further on; if they differ, its first change is next itself and its second
// is next's first. A Store's last block predicts a change right after it (its worker leaves
// there) unless the worker already held it, in which case nothing about its successors changed
// and its hint stays. Caller holds mu but has not begun a write: add makes ver odd before it
// changes anything and reports whether it did (wrote; the caller then makes ver even again).
// A refresh of a held block whose hint stays changes nothing, and leaves readers undisturbed.
func (s *shard) add(key uint64, id int, next link) (had bool, _ link, wrote bool) {
	p, bit := id/pageBits, uint64(1)<<(id%pageBits)
	t := s.tab.Load()
	i, ok := -1, false
	if t != nil && p < t.pages {
		i, ok = t.probe(key)
		if base := i * (1 + t.pages); ok && t.a[base+1+p]&bit != 0 {
			fp := fingerprint(t.a[base+1 : base+1+t.pages])
			k := t.a[base]
			h := stepHint(hintOf(k), true, fp, next)
			if h != hintOf(k) {
				s.ver.Add(1)
				atomic.StoreUint64(&t.a[base], keyWord(k, h))
				wrote = true
			}
			return true, link{fp: fp, h: h, ok: true}, wrote
		}
	}
	s.ver.Add(1)
	if t == nil {
		t = s.resize(minSlots, p+1)
		i, ok = t.probe(key)
	} else if p >= t.pages {
		t = s.resize(t.size, p+1)
		i, ok = t.probe(key)
	}
	w := 1 + t.pages
	if !ok {
		if (s.n+1)*5 > t.size*4 {
			t = s.resize(t.size+t.size/2, p+1)
			w = 1 + t.pages
			i, _ = t.probe(key)
		}
		atomic.StoreUint64(&t.a[i*w], keyWord(key, noHint))
		s.n++
	}
	base := i * w
	atomic.StoreUint64(&t.a[base+1+p], t.a[base+1+p]|bit)
	fp := fingerprint(t.a[base+1 : base+w])
	k := t.a[base]
	h := stepHint(hintOf(k), false, fp, next)
	if h != hintOf(k) {
		atomic.StoreUint64(&t.a[base], keyWord(k, h))
	}
	return false, link{fp: fp, h: h, ok: true}, true
}

// stepHint is the hint add leaves on a block whose hint was h, whose worker set (after the
// add) has fingerprint fp, and which the worker held already (had) or not.
func stepHint(h hint, had bool, fp uint64, next link) hint {
	switch {
	case next.ok && fp == next.fp:
		return hint(min(next.h.first()+1, farHint) | min(next.h.second()+1, farHint)<<8)
	case next.ok:
		return hint(1 | min(next.h.first()+1, farHint)<<8)
	case !had:
		return hint(1 | farHint<<8)
	}
	return h
}

// fingerprint condenses a worker set to one word, exact for up to 64 worker ids; hints compare
// the fingerprints of neighbouring blocks (a rare false match only makes a hint wrong).
func fingerprint(set []uint64) uint64 {
	fp := set[0]
	for p, w := range set[1:] {
		fp ^= bits.RotateLeft64(w*0x9e3779b97f4a7c15, p+1)
	}
	return fp
}

// remove takes worker id out of key's set, dropping the block when nobody is left, and reports
// whether id was there. Caller holds the write lock.
func (s *shard) remove(key uint64, id int) bool {
	p, bit := id/pageBits, uint64(1)<<(id%pageBits)
	t := s.tab.Load()
	if t == nil || p >= t.pages {
		return false
	}
	i := t.find(key)
	if i < 0 {
		return false
	}
	w := 1 + t.pages
	off := i*w + 1 + p
	old := t.a[off]
	if old&bit == 0 {
		return false
	}
	atomic.StoreUint64(&t.a[off], old&^bit)
	if old&^bit == 0 && allZero(t.a[i*w+1:(i+1)*w]) {
		s.deleteAt(t, i)
	}
	return true
}

// resize rehashes every entry into a new table of size slots, publishes it and returns it.
// The new table has at least minPages set words per slot, and as many as its entries use, so
// that a table widened for worker ids from 64 up narrows again once those workers leave.
// Caller holds the write lock.
func (s *shard) resize(size, minPages int) *table {
	old := s.tab.Load()
	pages := minPages
	if old != nil && old.pages > pages {
		ow := 1 + old.pages
		for i := range old.size {
			for p := old.pages - 1; p >= pages; p-- {
				if old.a[i*ow+1+p] != 0 {
					pages = p + 1
					break
				}
			}
		}
	}
	nt := &table{size: size, pages: pages, a: make([]uint64, size*(1+pages))}
	if old != nil {
		// Plain stores: readers cannot see nt before it is published. The keys are distinct,
		// so each goes to the first free slot from its home without comparing keys.
		ow, nw := 1+old.pages, 1+pages
		oa, na := old.a, nt.a
		for i := 0; i+ow <= len(oa); i += ow {
			k := oa[i]
			if k == 0 {
				continue
			}
			j := home(k, size) * nw
			for na[j] != 0 {
				if j += nw; j+nw > len(na) {
					j = 0
				}
			}
			na[j] = k
			copy(na[j+1:j+nw], oa[i+1:i+ow])
		}
	}
	s.tab.Store(nt)
	return nt
}

// deleteAt empties slot i and shifts later members of its probe run back, so that lookups
// never need tombstones. Caller holds the write lock.
func (s *shard) deleteAt(t *table, i int) {
	w := 1 + t.pages
	j := i
	for range t.size {
		if j++; j == t.size {
			j = 0
		}
		k := t.a[j*w]
		if k == 0 {
			break
		}
		h := home(k, t.size)
		// The entry at j may fill the hole at i only if its home is not cyclically in (i, j].
		var stays bool
		if i <= j {
			stays = i < h && h <= j
		} else {
			stays = i < h || h <= j
		}
		if stays {
			continue
		}
		for o := range w {
			atomic.StoreUint64(&t.a[i*w+o], t.a[j*w+o])
		}
		i = j
	}
	for o := range w {
		atomic.StoreUint64(&t.a[i*w+o], 0)
	}
	s.n--
	if t.size > minSlots && s.n*8 < t.size {
		s.resize(max(minSlots, s.n*2), 1)
	}
}

func allZero(ws []uint64) bool {
	for _, w := range ws {
		if w != 0 {
			return false
		}
	}
	return true
}
