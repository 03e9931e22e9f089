package kvevents

import (
	"math/rand/v2"
	"testing"
)

// TestTableMatchesMapModel runs random operations against a table and a Go map side by side.
func TestTableMatchesMapModel(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	tb := newTable()
	model := map[uint64]uint64{}
	// Small key ranges force collisions, key 0 and long probe runs across the wrap-around.
	for _, keyRange := range []uint64{50, 5000, 1 << 62} {
		for i := range 200000 {
			k := r.Uint64N(keyRange)
			switch op := r.IntN(10); {
			case op < 4:
				v := r.Uint64()
				old, had := tb.put(k, v)
				mold, mhad := model[k]
				if old != mold || had != mhad {
					t.Fatalf("op %d put(%d): %d %v, model %d %v", i, k, old, had, mold, mhad)
				}
				model[k] = v
			case op < 7:
				v, ok := tb.take(k)
				mv, mok := model[k]
				if v != mv || ok != mok {
					t.Fatalf("op %d take(%d): %d %v, model %d %v", i, k, v, ok, mv, mok)
				}
				delete(model, k)
			case op < 8:
				tb.incr(k)
				model[k]++
			case op < 9:
				gone := tb.decr(k)
				if model[k] <= 1 {
					delete(model, k)
				} else {
					model[k]--
				}
				if _, ok := model[k]; gone == ok {
					t.Fatalf("op %d decr(%d): gone %v", i, k, gone)
				}
			default:
				v, ok := tb.get(k)
				mv, mok := model[k]
				if v != mv || ok != mok {
					t.Fatalf("op %d get(%d): %d %v, model %d %v", i, k, v, ok, mv, mok)
				}
			}
			if tb.Len() != len(model) {
				t.Fatalf("op %d: len %d, model %d", i, tb.Len(), len(model))
			}
		}
		seen := 0
		tb.each(func(k, v uint64) {
			seen++
			if mv, ok := model[k]; !ok || mv != v {
				t.Fatalf("each: %d=%d, model %d %v", k, v, mv, ok)
			}
		})
		if seen != len(model) {
			t.Fatalf("each saw %d of %d", seen, len(model))
		}
		tb.reset()
		clear(model)
	}
}

func BenchmarkTableChurn(b *testing.B) {
	tb := newTable()
	const live = 16384
	keys := make([]uint64, live)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range keys {
		keys[i] = r.Uint64()
		tb.put(keys[i], 1)
	}
	b.ResetTimer()
	for i := range b.N {
		j := i % live
		tb.take(keys[j])
		keys[j] = r.Uint64()
		tb.put(keys[j], 1)
	}
}

func BenchmarkGoMapChurn(b *testing.B) {
	m := map[uint64]uint64{}
	const live = 16384
	keys := make([]uint64, live)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range keys {
		keys[i] = r.Uint64()
		m[keys[i]] = 1
	}
	b.ResetTimer()
	for i := range b.N {
		j := i % live
		delete(m, keys[j])
		keys[j] = r.Uint64()
		m[keys[j]] = 1
	}
}
