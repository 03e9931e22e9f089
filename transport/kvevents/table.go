package kvevents

import (
	"math/bits"
	"math/rand/v2"
	"slices"
)

// table is an open-addressing hash table from uint64 to uint64 (linear probing, backward-shift
// deletion, no tombstones), for the translator's per-block maps. Each slot is a key and its
// value side by side, so a lookup usually costs one cache miss where a Go map costs two (its
// control word, then the slot), and "replace and return the old value" or "remove and return
// the value" take one probe instead of a lookup and a write. That halves the translator's cost
// per block, which is most of applying an event.
//
// The keys are hashes already, but engine hashes come from the publisher, so the slot is
// chosen by a multiplicative hash with a random seed per table: crafted keys cannot pile up.
type table struct {
	slots   []uint64 // key, value, key, value...; key 0 marks an empty slot
	shift   uint     // 64 - log2(slot count)
	n       int      // keys stored in slots (key 0 is kept aside)
	seed    uint64
	hasZero bool
	zero    uint64 // the value of key 0
}

const minTableSlots = 64

func newTable() *table {
	t := &table{seed: rand.Uint64() | 1}
	t.alloc(minTableSlots)
	return t
}

func (t *table) alloc(slots int) {
	t.slots = make([]uint64, 2*slots)
	t.shift = uint(64 - bits.TrailingZeros(uint(slots)))
	t.n = 0
}

// Len is the number of keys.
func (t *table) Len() int {
	if t.hasZero {
		return t.n + 1
	}
	return t.n
}

func (t *table) home(k uint64) int { return int(((k ^ t.seed) * 0x9e3779b97f4a7c15) >> t.shift) }

// find returns the slot of k, or of the empty slot where k would go.
func (t *table) find(k uint64) (int, bool) {
	mask := len(t.slots)/2 - 1
	for i := t.home(k); ; i = (i + 1) & mask {
		switch t.slots[2*i] {
		case k:
			return i, true
		case 0:
			return i, false
		}
	}
}

// get returns the value of k.
func (t *table) get(k uint64) (uint64, bool) {
	if k == 0 {
		return t.zero, t.hasZero
	}
	i, ok := t.find(k)
	return t.slots[2*i+1], ok
}

// put sets k to v and returns the value it replaces.
func (t *table) put(k, v uint64) (uint64, bool) {
	if k == 0 {
		old, had := t.zero, t.hasZero
		t.zero, t.hasZero = v, true
		return old, had
	}
	i, ok := t.find(k)
	if ok {
		old := t.slots[2*i+1]
		t.slots[2*i+1] = v
		return old, true
	}
	t.insertAt(i, k, v)
	return 0, false
}

// insertAt puts k, which is not in the table, in the empty slot find returned for it.
func (t *table) insertAt(i int, k, v uint64) {
	if 4*(t.n+1) > 3*(len(t.slots)/2) {
		t.resize(len(t.slots)) // double: len(slots) is twice the slot count
		i, _ = t.find(k)
	}
	t.slots[2*i], t.slots[2*i+1] = k, v
	t.n++
}

// incr adds one to k's count (a missing key counts 0).
func (t *table) incr(k uint64) {
	if k == 0 {
		t.zero, t.hasZero = t.zero+1, true
		return
	}
	i, ok := t.find(k)
	if ok {
		t.slots[2*i+1]++
		return
	}
	t.insertAt(i, k, 1)
}

// decr takes one from k's count, removing k when it reaches 0 (or was missing), and reports
// whether k is gone.
func (t *table) decr(k uint64) bool {
	if k == 0 {
		if t.hasZero && t.zero > 1 {
			t.zero--
			return false
		}
		t.zero, t.hasZero = 0, false
		return true
	}
	i, ok := t.find(k)
	if !ok {
		return true
	}
	if t.slots[2*i+1] > 1 {
		t.slots[2*i+1]--
		return false
	}
	t.removeAt(i)
	return true
}

// take removes k and returns its value.
func (t *table) take(k uint64) (uint64, bool) {
	if k == 0 {
		v, had := t.zero, t.hasZero
		t.zero, t.hasZero = 0, false
		return v, had
	}
	i, ok := t.find(k)
	if !ok {
		return 0, false
	}
	v := t.slots[2*i+1]
	t.removeAt(i)
	return v, true
}

// removeAt removes the key in slot i, shrinking a table that has become mostly empty.
func (t *table) removeAt(i int) {
	t.deleteAt(i)
	t.n--
	if slots := len(t.slots) / 2; slots > minTableSlots && 8*t.n < slots {
		t.resize(slots / 2)
	}
}

// deleteAt empties slot i and moves later keys of its probe run back, so that every key stays
// reachable from its home without tombstones.
func (t *table) deleteAt(i int) {
	mask := len(t.slots)/2 - 1
	for j := (i + 1) & mask; ; j = (j + 1) & mask {
		k := t.slots[2*j]
		if k == 0 {
			break
		}
		// k may move to i if i lies on its probe path, between its home and j.
		if h := t.home(k); (j-h)&mask >= (j-i)&mask {
			t.slots[2*i], t.slots[2*i+1] = k, t.slots[2*j+1]
			i = j
		}
	}
	t.slots[2*i], t.slots[2*i+1] = 0, 0
}

// resize rehashes into the given number of slots.
func (t *table) resize(slots int) {
	old := t.slots
	t.alloc(slots)
	for i := 0; i < len(old); i += 2 {
		if k := old[i]; k != 0 {
			j, _ := t.find(k)
			t.slots[2*j], t.slots[2*j+1] = k, old[i+1]
			t.n++
		}
	}
}

// each calls fn for every key and value.
func (t *table) each(fn func(k, v uint64)) {
	if t.hasZero {
		fn(0, t.zero)
	}
	for i := 0; i < len(t.slots); i += 2 {
		if k := t.slots[i]; k != 0 {
			fn(k, t.slots[i+1])
		}
	}
}

// clone returns an independent copy. It is one copy of the slot array, a memcpy, where
// walking the table into a map costs a hash and an insert per key: the subscriber clones under
// its lock and builds the map after letting go, so a snapshot stalls the events only briefly.
func (t *table) clone() *table {
	c := *t
	c.slots = slices.Clone(t.slots)
	return &c
}

// reset empties the table and returns its memory.
func (t *table) reset() {
	t.alloc(minTableSlots)
	t.hasZero, t.zero = false, 0
}
