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

// zeroKey stands in for a block whose sequence hash is 0, because 0 marks an empty slot. The
// two then share an entry, a collision as likely as any other 64-bit one.
const zeroKey uint64 = 0x9e3779b97f4a7c15

// minSlots is the smallest table a shard allocates.
const minSlots = 16

// pageBits is how many worker ids one set word covers: page p holds ids 64p..64p+63.
const pageBits = 64

// optimisticReads bounds how often a reader retries a lookup that raced a writer before it
// takes the shard's lock instead.
const optimisticReads = 8

// table is one shard's open-addressing hash table, a flat array of slots of 1+pages words:
// the block's key, then its worker set, one bit per worker id, pages words long. With up to 64
// workers a slot is 16 bytes and there are no pointers for the garbage collector to scan.
// Linear probing with backward-shift deletion (no tombstones), grown by half when 4/5 full and
// shrunk when under 1/8 full.
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

// normKey maps a sequence hash to its table key.
func normKey(h uint64) uint64 {
	if h == 0 {
		return zeroKey
	}
	return h
}

// shardOf returns the index of the shard that owns key.
func shardOf(key uint64) int {
	return int(key >> (64 - shardBits))
}

// home is key's first probe position in a table of size slots; the shard bits are shifted out
// so that the position uses the bits that did not choose the shard.
func home(key uint64, size int) int {
	hi, _ := bits.Mul64(key<<shardBits, uint64(size))
	return int(hi)
}

// word returns page p of key's worker set, 0 if absent, with atomic loads. Racing a writer it
// may return garbage, which the caller's version check discards.
func (t *table) word(key uint64, p int) uint64 {
	if t == nil || p >= t.pages {
		return 0
	}
	w := 1 + t.pages
	i := home(key, t.size)
	for range t.size {
		k := atomic.LoadUint64(&t.a[i*w])
		if k == key {
			return atomic.LoadUint64(&t.a[i*w+1+p])
		}
		if k == 0 {
			return 0
		}
		if i++; i == t.size {
			i = 0
		}
	}
	return 0
}

// probe returns key's slot index and true, or the free slot that ends key's probe run and
// false. The table always has a free slot because its load stays under 4/5. Caller holds the
// shard's mu.
func (t *table) probe(key uint64) (int, bool) {
	w := 1 + t.pages
	i := home(key, t.size)
	for range t.size {
		k := t.a[i*w]
		if k == key {
			return i, true
		}
		if k == 0 {
			return i, false
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

// get returns page p of key's worker set without blocking writers: it retries a lookup that
// raced a writer a few times, then waits for the lock.
func (s *shard) get(key uint64, p int) uint64 {
	for range optimisticReads {
		v := s.ver.Load()
		if v&1 != 0 {
			continue
		}
		w := s.tab.Load().word(key, p)
		if s.ver.Load() == v {
			return w
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tab.Load().word(key, p)
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

// add puts worker id into key's set and reports whether it was already there. Caller holds
// the write lock.
func (s *shard) add(key uint64, id int) bool {
	p, bit := id/pageBits, uint64(1)<<(id%pageBits)
	t := s.tab.Load()
	if t == nil {
		t = s.resize(minSlots, p+1)
	} else if p >= t.pages {
		t = s.resize(t.size, p+1)
	}
	i, ok := t.probe(key)
	if !ok {
		if (s.n+1)*5 > t.size*4 {
			t = s.resize(t.size+t.size/2, p+1)
			i, _ = t.probe(key)
		}
		atomic.StoreUint64(&t.a[i*(1+t.pages)], key)
		s.n++
	}
	off := i*(1+t.pages) + 1 + p
	old := t.a[off]
	if old&bit != 0 {
		return true
	}
	atomic.StoreUint64(&t.a[off], old|bit)
	return false
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
	if old != nil {
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
		// Plain stores: readers cannot see nt before it is published.
		ow, nw := 1+old.pages, 1+pages
		for i := range old.size {
			key := old.a[i*ow]
			if key == 0 {
				continue
			}
			j, _ := nt.probe(key)
			nt.a[j*nw] = key
			copy(nt.a[j*nw+1:(j+1)*nw], old.a[i*ow+1:(i+1)*ow])
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
