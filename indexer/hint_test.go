package indexer

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"testing"
)

// hintAt returns the hint of block key as the index holds it.
func hintAt(x *Index, key uint64) hint {
	key = normKey(key)
	_, h := x.shards[shardOf(key)].get(key, 0)
	return h
}

func TestStoreHintsPredictTheNextTwoChanges(t *testing.T) {
	// Workers hold prefixes of one 100-block prompt: a 100, b 60, c 60, d 30, e 10. Along the
	// prompt the worker set changes at blocks 10, 30 and 60 (and 100, past the end).
	depths := map[string]int{"a": 100, "b": 60, "c": 60, "d": 30, "e": 10}
	changes := []int{10, 30, 60, 100}
	for _, order := range [][]string{{"a", "b", "c", "d", "e"}, {"e", "d", "c", "b", "a"}, {"c", "e", "a", "d", "b"}} {
		t.Run(fmt.Sprint(order), func(t *testing.T) {
			x := New(Options{})
			seq := prompt(3, 100)
			for _, w := range order {
				x.Store(wk(w), seq[:depths[w]])
			}
			// The longest holder stored last sees every change; a shorter one sees the
			// changes inside its own prefix and keeps the older hints past it. Either way,
			// within the prefix stored last, each block predicts the changes after it.
			last := depths[order[len(order)-1]]
			for i := range last {
				var want []int
				for _, c := range changes {
					if c > i {
						want = append(want, c-i)
					}
				}
				if len(want) < 2 || i+want[1] > last && last < 100 {
					// The second change lies past the last Store's prefix, where that
					// Store saw no block; only the first is certain to be predicted.
					want = append(want[:1], -1)
				}
				h := hintAt(x, seq[i])
				if h.first() != want[0] {
					t.Fatalf("block %d: first change at +%d, want +%d", i, h.first(), want[0])
				}
				if want[1] >= 0 && h.second() != min(want[1], farHint) {
					t.Fatalf("block %d: second change at +%d, want +%d", i, h.second(), want[1])
				}
			}
		})
	}
}

func TestRefreshingAHeldPrefixKeepsTheHintPastIt(t *testing.T) {
	x := New(Options{})
	seq := prompt(4, 50)
	x.Store(wk("a"), seq)
	x.Store(wk("b"), seq[:20])
	// a refreshes a prefix it already holds: its last block still has the same set as the
	// next one, so the hint there must keep pointing at b's end, not at 30.
	x.Store(wk("a"), seq[:30])
	if h := hintAt(x, seq[29]); h.first() != 21 {
		t.Fatalf("block 29 predicts a change at +%d, want +21 (the prompt's end)", h.first())
	}
	if h := hintAt(x, seq[10]); h.first() != 10 || h.second() != 40 {
		t.Fatalf("block 10 predicts +%d and +%d, want +10 and +40", h.first(), h.second())
	}
}

func TestHintsSurviveTableGrowthAndShiftingDeletes(t *testing.T) {
	x := New(Options{})
	seq := prompt(5, 300)
	x.Store(wk("a"), seq[:200])
	x.Store(wk("b"), seq[:100])
	// Unrelated blocks grow every table (rehashing) and are then removed (backward shifts).
	noise := prompt(6, 20000)
	x.Store(wk("c"), noise)
	x.Remove(wk("c"), noise)
	// b's Store, the last to pass block 0, saw the change at 100 but not the one after it.
	if h := hintAt(x, seq[0]); h.first() != 100 || h.second() != farHint {
		t.Fatalf("block 0 predicts +%d and +%d, want +100 and nothing", h.first(), h.second())
	}
	if h := hintAt(x, seq[150]); h.first() != 50 || h.second() != farHint {
		t.Fatalf("block 150 predicts +%d and +%d, want +50 and nothing", h.first(), h.second())
	}
	if got := matchMap(t, x.FindMatches(seq, nil)); got[wk("a")] != 200 || got[wk("b")] != 100 || len(got) != 2 {
		t.Fatalf("got %v", got)
	}
}

// TestStaleHintsCostReadsNotAccuracy breaks hints in every way the index allows: tails evicted
// after the hints were written, prefixes refreshed, prompts that branch off a cached one, and
// holders removed; FindMatches must still give the exact prefix-closed answer.
func TestStaleHintsCostReadsNotAccuracy(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	x := New(Options{})
	base := prompt(20, 300)
	var prompts [][]uint64
	for i := range 8 {
		p := append([]uint64(nil), base[:40*i]...)
		prompts = append(prompts, append(p, prompt(uint64(30+i), 600-40*i)...))
	}
	// depth[w][j]: how many leading blocks of prompt j worker w holds. Only tails past every
	// branch point are removed, so that holdings stay prefix-closed along every prompt.
	workers := make([]Worker, 70)
	depth := make(map[Worker][]int)
	for i := range workers {
		workers[i] = wk(fmt.Sprintf("w%02d", i))
		depth[workers[i]] = make([]int, len(prompts))
	}
	branch := 40 * (len(prompts) - 1)
	exact := func(p int) map[Worker]int {
		want := map[Worker]int{}
		for w, ds := range depth {
			best := 0
			for j, d := range ds {
				n := min(d, len(prompts[p]))
				if j != p {
					n = min(n, 40*min(j, p)) // the prefix prompts j and p share
				}
				best = max(best, n)
			}
			if best > 0 {
				want[w] = best
			}
		}
		return want
	}
	for step := range 3000 {
		w := workers[rng.IntN(len(workers))]
		j := rng.IntN(len(prompts))
		p := prompts[j]
		switch op := rng.IntN(10); {
		case op < 5:
			d := 1 + rng.IntN(len(p))
			x.Store(w, p[:d])
			depth[w][j] = max(depth[w][j], d)
		case op < 8:
			if cut := branch + rng.IntN(len(p)-branch); cut < depth[w][j] {
				x.Remove(w, p[cut:depth[w][j]])
				depth[w][j] = cut
			}
		case op < 9:
			x.Clear(w)
			clear(depth[w])
		default:
			x.RemoveWorker(w)
			clear(depth[w])
		}
		if step%50 == 0 {
			for k := range prompts {
				if got, want := matchMap(t, x.FindMatches(prompts[k], nil)), exact(k); !maps.Equal(got, want) {
					t.Fatalf("step %d, prompt %d:\n got %v\nwant %v", step, k, sortedMatches(toMatches(got)), sortedMatches(toMatches(want)))
				}
			}
		}
	}
}

func TestFreshHintsPinEachChangeWithTwoReads(t *testing.T) {
	tests := []struct {
		name   string
		depths []int
		reads  int // at most
	}{
		// Block 0, every 64th and the last: 9 reads, nothing changes between them.
		{"one holder of everything", []int{512}, 9},
		{"a change at a first-round block", []int{512, 128}, 9 + 1},
		{"two changes", []int{512, 300, 100}, 9 + 2*2},
		// Changes at 16 distinct depths: two reads each, minus the few that fall next to
		// a first-round block or to another change.
		{"sixteen changes", []int{500, 470, 433, 401, 390, 350, 301, 257, 200, 190, 170, 130, 99, 60, 33, 7}, 9 + 2*16},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := New(Options{})
			seq := prompt(9, 512)
			want := map[Worker]int{}
			for i, d := range tt.depths {
				w := wk(fmt.Sprint(i))
				x.Store(w, seq[:d])
				want[w] = d
			}
			got, c := x.find(seq, nil)
			if m := matchMap(t, got); !maps.Equal(m, want) {
				t.Fatalf("got %v, want %v", m, want)
			}
			if c.reads > tt.reads {
				t.Fatalf("%d reads in %d rounds, want at most %d", c.reads, c.rounds, tt.reads)
			}
		})
	}
}

func TestHashesWithoutKeyBitsAreIndexedInTheirShard(t *testing.T) {
	x := New(Options{})
	// Only shard and hint bits set: as stored, their key bits would read as an empty slot.
	hashes := []uint64{0, 0xab00_0000_0000_0000, 0x00cd_0000_0000_0000, 0xffff_0000_0000_0000}
	for _, h := range hashes {
		if k := normKey(h); k&keyMask == 0 || shardOf(k) != shardOf(h) {
			t.Fatalf("normKey(%#x) = %#x", h, k)
		}
	}
	x.Store(wk("a"), hashes)
	if got := matchMap(t, x.FindMatches(hashes, nil)); got[wk("a")] != len(hashes) {
		t.Fatalf("got %v, want a holding all %d blocks", got, len(hashes))
	}
}
