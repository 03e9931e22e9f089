package hints

import (
	"math/rand/v2"
	"testing"
)

// TestHashSetAgreesWithAMap drives the set and a map through the same random adds and
// deletes, with hashes that collide on their homes, and compares them throughout.
func TestHashSetAgreesWithAMap(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	var s hashSet
	m := map[uint64]bool{}
	pool := make([]uint64, 3000)
	for i := range pool {
		pool[i] = r.Uint64() >> (r.IntN(4) * 20) // some small values, so homes collide
	}
	pool[0] = 0
	for step := range 200_000 {
		h := pool[r.IntN(len(pool))]
		if r.IntN(3) == 0 {
			s.del(h)
			delete(m, h)
		} else {
			s.add(h)
			m[h] = true
		}
		if step%1000 == 0 {
			for _, h := range pool {
				if s.has(h) != m[h] {
					t.Fatalf("step %d: has(%x) = %v, map says %v", step, h, s.has(h), m[h])
				}
			}
			if s.len() != len(m) {
				t.Fatalf("step %d: len %d, map %d", step, s.len(), len(m))
			}
		}
	}
}
