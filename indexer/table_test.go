package indexer

import (
	"math/rand/v2"
	"testing"
	"unsafe"
)

func TestShardIsTwoCacheLines(t *testing.T) {
	if got := unsafe.Sizeof(shard{}); got != 128 {
		t.Fatalf("shard is %d bytes, want 128 (adjust the padding)", got)
	}
}

// TestShardMatchesMapModel drives one shard's table with random adds and removes, with keys
// crowded into few home positions so that probe runs wrap and backward shifts cross the end,
// and ids on four pages so that the table widens, and compares every set with a plain map.
func TestShardMatchesMapModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var s shard
	model := map[uint64]map[int]bool{}
	// Keys differ only in their low bits: after the shard bits are shifted out they share the
	// top of the word, so most land on the same few home slots.
	keys := make([]uint64, 300)
	for i := range keys {
		keys[i] = uint64(i+1) | uint64(rng.IntN(4))<<50
	}
	keys[0] = zeroKey
	ids := []int{0, 1, 63, 64, 65, 130, 200}
	for step := range 20000 {
		key := keys[rng.IntN(len(keys))]
		id := ids[rng.IntN(len(ids))]
		if rng.IntN(3) > 0 {
			had, _, _ := s.add(key, id, link{})
			if had != model[key][id] {
				t.Fatalf("step %d: add(%#x, %d) reported had=%v, model says %v", step, key, id, had, !had)
			}
			if model[key] == nil {
				model[key] = map[int]bool{}
			}
			model[key][id] = true
		} else {
			had := s.remove(key, id)
			if had != model[key][id] {
				t.Fatalf("step %d: remove(%#x, %d) reported had=%v", step, key, id, had)
			}
			delete(model[key], id)
			if len(model[key]) == 0 {
				delete(model, key)
			}
		}
		if step%499 == 0 || step > 19980 {
			checkShard(t, &s, model, keys, ids)
		}
	}
	// Empty it completely: the table must shrink back and forget the overflow map.
	for key, set := range model {
		for id := range set {
			s.remove(key, id)
		}
	}
	if tab := s.tab.Load(); s.n != 0 || tab.size > minSlots {
		t.Fatalf("after removing everything: n=%d slots=%d", s.n, tab.size)
	}
}

func checkShard(t *testing.T, s *shard, model map[uint64]map[int]bool, keys []uint64, ids []int) {
	t.Helper()
	if s.n != len(model) {
		t.Fatalf("shard holds %d keys, model %d", s.n, len(model))
	}
	if tab := s.tab.Load(); tab != nil && s.n*5 > tab.size*4 {
		t.Fatalf("load %d/%d is over 4/5", s.n, s.tab.Load().size)
	}
	for _, key := range keys {
		for _, id := range ids {
			p, bit := id/pageBits, uint64(1)<<(id%pageBits)
			set, _ := s.get(key, p)
			if got := set&bit != 0; got != model[key][id] {
				t.Fatalf("key %#x id %d: present=%v, model %v", key, id, got, model[key][id])
			}
		}
	}
}

func TestTableWidensForHighIDsAndNarrowsWhenTheyLeave(t *testing.T) {
	var s shard
	for k := range uint64(1000) {
		s.add(k+1, 0, link{})
		s.add(k+1, 150, link{})
	}
	if p := s.tab.Load().pages; p != 3 {
		t.Fatalf("ids up to 150 need 3 pages, table has %d", p)
	}
	for k := range uint64(1000) {
		s.remove(k+1, 150)
	}
	for k := range uint64(2000) {
		s.add(k+5000, 0, link{}) // grows the table, which rehashes
	}
	if p := s.tab.Load().pages; p != 1 {
		t.Fatalf("with only id 0 left the regrown table has %d pages", p)
	}
	if a, _ := s.get(1, 0); a != 1 {
		t.Fatal("narrowing lost the bits of id 0")
	}
	if c, _ := s.get(1, 2); c != 0 {
		t.Fatal("narrowing lost or kept the wrong bits")
	}
}

func TestNormKeyKeepsZeroOutOfTheTable(t *testing.T) {
	if normKey(0) == 0 {
		t.Fatal("hash 0 maps to the empty-slot marker")
	}
	if normKey(42) != 42 {
		t.Fatal("a nonzero hash was changed")
	}
}
