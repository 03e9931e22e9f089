package fsm

import (
	"slices"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
)

// The binding store is numShards shards. A shard keeps its bindings pointer-free, so a
// million of them cost the garbage collector nothing to scan and a copy-on-write clone is
// three memmoves:
//
//   - slots: the bindings, dense (a removal moves the last slot into the hole);
//   - table: an open-addressing hash table (linear probing, backward-shift deletion, no
//     tombstones) whose entries are hash<<32 | slot+1, so most misses never touch a key;
//   - arena: the session keys, back to back; removals leave garbage that is compacted
//     once it outweighs the live keys.
//
// Worker ids are interned to small integers (interner); a shard keeps the name table that
// was current at its last write, so a reader resolves ids without another lock.

const (
	shardBits = 8
	numShards = 1 << shardBits
	// minTable is the smallest non-empty hash table.
	minTable = 16
)

// hashKey is the one hash of a session key: its top bits pick the shard, its low 32 bits
// are the table tag (and home position). xxhash is seedless, so every replica agrees.
func hashKey(s string) uint64 { return xxhash.Sum64String(s) }

func hashBytes(b []byte) uint64 { return xxhash.Sum64(b) }

func shardOf(h uint64) int { return int(h >> (64 - shardBits)) }

// slot is one binding, 40 bytes (model fits in what was padding).
type slot struct {
	revision  uint64
	ttl       int64
	remaining int64
	keyOff    uint32
	dpRank    uint32
	worker    uint32
	keyLen    uint16
	// model is the binding's model as its id in the model interner plus one; 0: none.
	model uint16
}

// shard is one part of the bindings. Only the applier writes it, under mu; readers hold
// mu.RLock. A shard whose gen is older than the FSM's is frozen (a snapshot holds it) and
// is cloned before any write.
type shard struct {
	mu      sync.RWMutex
	gen     uint64
	names   []string
	models  []string
	slots   []slot
	table   []uint64
	arena   []byte
	garbage int
}

func (s *shard) key(i int) []byte {
	sl := &s.slots[i]
	return s.arena[sl.keyOff : sl.keyOff+uint32(sl.keyLen)]
}

// find returns the table position of key (or of the empty entry where it would go) and
// its slot, -1 when absent. The table must be non-empty for the position to mean anything.
func (s *shard) find(key string, h uint64) (pos, idx int) { return findKey(s, key, h) }

// findKey is find over either spelling of a key; comparing string(key) allocates nothing.
func findKey[K string | []byte](s *shard, key K, h uint64) (pos, idx int) {
	if len(s.table) == 0 {
		return -1, -1
	}
	mask := len(s.table) - 1
	tag := uint32(h)
	for p := int(tag) & mask; ; p = (p + 1) & mask {
		e := s.table[p]
		if e == 0 {
			return p, -1
		}
		if uint32(e>>32) == tag {
			i := int(uint32(e)) - 1
			sl := &s.slots[i]
			if int(sl.keyLen) == len(key) && string(s.arena[sl.keyOff:sl.keyOff+uint32(sl.keyLen)]) == string(key) {
				return p, i
			}
		}
	}
}

// findBytes is find for a key held as bytes (Restore).
func (s *shard) findBytes(key []byte, h uint64) (pos, idx int) { return findKey(s, key, h) }

// needGrow reports whether one more binding would push the load factor past 3/4.
func (s *shard) needGrow() bool {
	return (len(s.slots)+1)*4 > len(s.table)*3
}

// rehash rebuilds the table at size n (a power of two) from the slots.
func (s *shard) rehash(n int) {
	t := make([]uint64, n)
	mask := n - 1
	for i := range s.slots {
		tag := uint32(hashBytes(s.key(i)))
		p := int(tag) & mask
		for t[p] != 0 {
			p = (p + 1) & mask
		}
		t[p] = uint64(tag)<<32 | uint64(i+1)
	}
	s.table = t
}

// insert adds a binding for key, which must be absent. The caller holds mu.
func insert[K string | []byte](s *shard, key K, h uint64, sl slot) {
	if s.needGrow() {
		s.rehash(max(minTable, 2*len(s.table)))
	}
	mask := len(s.table) - 1
	tag := uint32(h)
	p := int(tag) & mask
	for s.table[p] != 0 {
		p = (p + 1) & mask
	}
	sl.keyOff = uint32(len(s.arena))
	sl.keyLen = uint16(len(key))
	s.arena = append(s.arena, key...)
	s.slots = append(s.slots, sl)
	s.table[p] = uint64(tag)<<32 | uint64(len(s.slots))
}

// remove deletes slot idx, whose table entry is at pos. The caller holds mu.
func (s *shard) remove(pos, idx int) {
	mask := len(s.table) - 1
	// Backward-shift deletion: pull later entries of the probe run into the hole unless
	// their home position lies cyclically in (hole, j].
	hole := pos
	for j := (pos + 1) & mask; ; j = (j + 1) & mask {
		e := s.table[j]
		if e == 0 {
			break
		}
		home := int(uint32(e>>32)) & mask
		var stays bool
		if hole <= j {
			stays = hole < home && home <= j
		} else {
			stays = hole < home || home <= j
		}
		if !stays {
			s.table[hole] = e
			hole = j
		}
	}
	s.table[hole] = 0
	s.garbage += int(s.slots[idx].keyLen)

	last := len(s.slots) - 1
	if idx != last {
		// Re-point the last slot's table entry at the hole it moves into.
		tag := uint32(hashBytes(s.key(last)))
		for p := int(tag) & mask; ; p = (p + 1) & mask {
			if uint32(s.table[p]) == uint32(last+1) {
				s.table[p] = uint64(tag)<<32 | uint64(idx+1)
				break
			}
		}
		s.slots[idx] = s.slots[last]
	}
	s.slots = s.slots[:last]

	switch {
	case len(s.slots) == 0:
		s.slots, s.table, s.arena, s.garbage = nil, nil, nil, 0
	case len(s.table) > minTable && len(s.slots)*8 < len(s.table):
		s.rehash(max(minTable, len(s.table)/4))
	}
	if s.garbage > 4096 && s.garbage > len(s.arena)/2 {
		s.compact()
	}
}

// compact drops removed keys from the arena and spare capacity from the slots.
func (s *shard) compact() {
	live := len(s.arena) - s.garbage
	arena := make([]byte, 0, live+live/8)
	for i := range s.slots {
		k := s.key(i)
		s.slots[i].keyOff = uint32(len(arena))
		arena = append(arena, k...)
	}
	s.arena, s.garbage = arena, 0
	if cap(s.slots) > 2*len(s.slots)+16 {
		s.slots = slices.Clip(slices.Clone(s.slots))
	}
}

// clone returns a writable copy at generation gen, with a compacted arena.
func (s *shard) clone(gen uint64) *shard {
	c := &shard{gen: gen, names: s.names, models: s.models}
	c.slots = make([]slot, len(s.slots), len(s.slots)+len(s.slots)/8)
	copy(c.slots, s.slots)
	c.table = slices.Clone(s.table)
	if s.garbage == 0 {
		c.arena = make([]byte, len(s.arena), len(s.arena)+len(s.arena)/8)
		copy(c.arena, s.arena)
		return c
	}
	live := len(s.arena) - s.garbage
	c.arena = make([]byte, 0, live+live/8)
	for i := range c.slots {
		k := s.key(i)
		c.slots[i].keyOff = uint32(len(c.arena))
		c.arena = append(c.arena, k...)
	}
	return c
}

// binding materializes slot i; session is the key when the caller already has it as a
// string (no allocation), else "" to copy it out of the arena.
func (s *shard) binding(i int, session string) Binding {
	sl := &s.slots[i]
	if session == "" {
		session = string(s.key(i))
	}
	b := Binding{
		Session:   session,
		Worker:    s.names[sl.worker],
		DPRank:    sl.dpRank,
		Revision:  sl.revision,
		TTL:       time.Duration(sl.ttl),
		Remaining: time.Duration(sl.remaining),
	}
	if sl.model != 0 {
		b.Model = s.models[sl.model-1]
	}
	return b
}

// state is one version of the shard set. A new version (a copy of 256 pointers) is
// published whenever a shard is replaced by its clone or by Restore.
type state struct {
	shards [numShards]*shard
}

func newState(gen uint64) *state {
	st := &state{}
	for i := range st.shards {
		st.shards[i] = &shard{gen: gen}
	}
	return st
}

// interner maps worker ids to small integers for the applier. Freed ids are reused. The
// names slice is never modified once published (every change copies it), so a shard or a
// snapshot that holds an older version keeps resolving its own ids correctly.
type interner struct {
	ids   map[string]uint32
	names []string
	refs  []uint32
	free  []uint32
}

func newInterner() *interner { return &interner{ids: make(map[string]uint32)} }

// lookup returns the id of name, if any binding uses it.
func (in *interner) lookup(name string) (uint32, bool) {
	id, ok := in.ids[name]
	return id, ok
}

// acquire returns name's id, adding a reference.
func (in *interner) acquire(name string) uint32 {
	if id, ok := in.ids[name]; ok {
		in.refs[id]++
		return id
	}
	var id uint32
	if n := len(in.free); n > 0 {
		id = in.free[n-1]
		in.free = in.free[:n-1]
		names := slices.Clone(in.names)
		names[id] = name
		in.names = names
		in.refs[id] = 1
	} else {
		id = uint32(len(in.names))
		names := make([]string, len(in.names)+1)
		copy(names, in.names)
		names[id] = name
		in.names = names
		in.refs = append(in.refs, 1)
	}
	in.ids[name] = id
	return id
}

// release drops a reference to id, freeing it at zero.
func (in *interner) release(id uint32) {
	in.refs[id]--
	if in.refs[id] == 0 {
		delete(in.ids, in.names[id])
		in.free = append(in.free, id)
	}
}
