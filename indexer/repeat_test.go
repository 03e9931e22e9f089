package indexer

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// TestARepeatedStoreTakesNoLock is what the skip is for: routing records a request's prompt
// at dispatch and again at completion, and a worker serving one conversation (or one hot
// prompt) gets the same Store over and over. A Store that changes nothing must return while
// another writer holds the worker's mutex.
func TestARepeatedStoreTakesNoLock(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1000, 0)}
	x := New(Options{TTL: time.Minute, MaxBlocksPerWorker: 1000, Now: clk.Now})
	long := prompt(1, 40)
	x.Store(wk("b"), long[:10])
	x.Store(wk("a"), long)      // adds the blocks
	x.Store(wk("a"), long)      // refreshes them: the record of a's last Store
	x.Store(wk("a"), long[:20]) // a prefix of it: skipped, and the record stays
	st := x.byName[wk("a")]
	st.mu.Lock()
	defer st.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		x.Store(wk("a"), long[:30])
		x.Store(wk("a"), long)
	}()
	poll.Holds(t, 10*time.Second, "the repeated Stores returned while the worker was locked", poll.Closed(done))
}

// TestStoresOfTheSameSequenceWaitForTheLockedOneNotTheLock: at a tick's start the requests in
// flight all miss the last record; the first takes the lock, and the others, storing the same
// prompt, wait for it to end (all at once) instead of queueing on the lock one by one.
func TestStoresOfTheSameSequenceWaitForTheLockedOneNotTheLock(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1000, 0)}
	x := New(Options{TTL: time.Minute, Now: clk.Now})
	long := prompt(6, 20)
	x.Store(wk("a"), long)
	clk.Advance(tickUnit)
	// A locked Store of long at the new tick, stopped before it writes.
	st := x.byName[wk("a")]
	st.mu.Lock()
	defer st.mu.Unlock()
	st.last.change()
	version := st.last.current()
	f := st.last.begin(long, x.storeTick())
	done := make(chan struct{})
	go func() {
		defer close(done)
		x.Store(wk("a"), long)
	}()
	poll.Holds(t, 10*time.Second, "the second Store is waiting", func() bool { return f.waiting() > 0 })
	st.last.stored(f, long, x.storeTick(), version, 0) // the locked Store ends (its blocks were held: no writes)
	poll.Holds(t, 10*time.Second, "the second Store returned while the worker was locked", poll.Closed(done))
}

// TestAStoreRepeatsOnlyWhenItWouldChangeNothing lists what makes a Store of a's prompt write
// again: anything that changed a's entries or the blocks' sets or hints since a's last Store.
func TestAStoreRepeatsOnlyWhenItWouldChangeNothing(t *testing.T) {
	long, other := prompt(2, 40), prompt(3, 5)
	tests := []struct {
		name    string
		between func(x *Index, clk *fakeClock)
		seq     []uint64
		repeats bool
	}{
		{"the same prompt", nil, long, true},
		{"a prefix of it", nil, long[:7], true},
		{"a longer prompt", nil, append(slices.Clone(long), 1), false},
		{"a prompt that differs at its last block", nil, append(slices.Clone(long[:9]), 1), false},
		{"another worker refreshed the blocks", func(x *Index, _ *fakeClock) { x.Store(wk("b"), long[:5]) }, long, true},
		{"another worker added itself to a block", func(x *Index, _ *fakeClock) { x.Store(wk("c"), long[:3]) }, long, false},
		{"a stored another prompt", func(x *Index, _ *fakeClock) { x.Store(wk("a"), other) }, long, false},
		{"a removed a block", func(x *Index, _ *fakeClock) { x.Remove(wk("a"), long[39:]) }, long, false},
		{"a removed a block it does not hold", func(x *Index, _ *fakeClock) { x.Remove(wk("a"), other) }, long, false},
		{"a was cleared", func(x *Index, _ *fakeClock) { x.Clear(wk("a")) }, long, false},
		{"a snapshot brought more of a's blocks", func(x *Index, clk *fakeClock) {
			// Restored records are queued after a's last Store's, with their own ages.
			y := New(Options{TTL: time.Minute, MaxBlocksPerWorker: 1000, Now: clk.Now})
			y.Store(wk("a"), prompt(5, 3))
			var buf bytes.Buffer
			if err := y.WriteSnapshot(&buf); err != nil {
				panic(err)
			}
			if err := x.ReadSnapshot(&buf); err != nil {
				panic(err)
			}
		}, long, false},
		{"the next tick", func(_ *Index, clk *fakeClock) { clk.Advance(tickUnit) }, long, false},
		{"expiry dropped a block of a's", func(x *Index, clk *fakeClock) {
			clk.Advance(time.Minute + 2*tickUnit)
			x.Store(wk("b"), long[:5])
			x.Expire()
		}, long[:5], false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			clk := &fakeClock{t: time.Unix(1000, 0)}
			x := New(Options{TTL: time.Minute, MaxBlocksPerWorker: 1000, Now: clk.Now})
			x.Store(wk("b"), long[:5])
			x.Store(wk("a"), long)
			x.Store(wk("a"), long) // a refresh: kept as a's last Store
			if tc.between != nil {
				tc.between(x, clk)
			}
			st := x.byName[wk("a")]
			if got := x.repeats(st, tc.seq, x.storeTick()); got != tc.repeats {
				t.Fatalf("repeats = %v, want %v", got, tc.repeats)
			}
		})
	}
}

// TestOnlyARefreshThatDropsNothingIsKept: a Store that added blocks, or during which the TTL
// dropped some of the worker's, is not kept as the worker's last Store.
func TestOnlyARefreshThatDropsNothingIsKept(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1000, 0)}
	x := New(Options{TTL: time.Minute, Now: clk.Now})
	long, other := prompt(4, 25), prompt(5, 3)
	x.Store(wk("a"), other)
	clk.Advance(30 * time.Second)
	x.Store(wk("a"), long)
	if x.repeats(x.byName[wk("a")], long, x.storeTick()) {
		t.Fatal("a Store that added blocks is kept")
	}
	clk.Advance(31 * time.Second)
	x.Store(wk("a"), long) // a refresh, but other expires during it
	if x.Blocks(wk("a")) != len(long) {
		t.Fatalf("a holds %d blocks, want %d: other has not expired", x.Blocks(wk("a")), len(long))
	}
	if x.repeats(x.byName[wk("a")], long, x.storeTick()) {
		t.Fatal("a refresh during which the TTL dropped blocks is kept")
	}
	x.Store(wk("a"), long)
	if !x.repeats(x.byName[wk("a")], long, x.storeTick()) {
		t.Fatal("a refresh that dropped nothing is not kept")
	}
}

// TestSkippedStoresLeaveTheIndexAsStoresWould runs the same random writes (repeats of a few
// prompts and their prefixes by a few workers, removals, clears, expiry, clock steps) on an
// index that skips repeated Stores and on one that does not, and compares after every write
// everything the index holds: each block's worker set and hint, each worker's live recency
// records in order with their ages (what TTL and cap evict next), and the counts.
func TestSkippedStoresLeaveTheIndexAsStoresWould(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 7))
			clk := &fakeClock{t: time.Unix(1000, 0)}
			opts := Options{TTL: 50 * time.Millisecond, MaxBlocksPerWorker: 60, Now: clk.Now}
			if seed%4 == 3 {
				opts = Options{Now: clk.Now} // precise mode: no recency at all
			}
			fast, slow := New(opts), New(opts)
			slow.noRepeat = true
			prompts := [][]uint64{prompt(10, 30), prompt(11, 30), prompt(12, 8)}
			// The third prompt branches off the first after 12 blocks.
			prompts = append(prompts, append(slices.Clone(prompts[0][:12]), prompt(13, 10)...))
			workers := []Worker{wk("a"), wk("b"), wk("c")}
			skips := 0
			for step := range 400 {
				w := workers[rng.IntN(len(workers))]
				p := prompts[rng.IntN(len(prompts))]
				n := 1 + rng.IntN(len(p))
				var op string
				switch r := rng.IntN(100); {
				case r < 75:
					op = fmt.Sprintf("store %s %d", w, n)
					if st := (*fast.named.Load())[w]; st != nil && fast.repeats(st, p[:n], fast.storeTick()) {
						skips++
					}
					fast.Store(w, p[:n])
					slow.Store(w, p[:n])
				case r < 83:
					op = fmt.Sprintf("remove %s %d..", w, n-1)
					fast.Remove(w, p[n-1:])
					slow.Remove(w, p[n-1:])
				case r < 93:
					op = "tick"
					clk.Advance(tickUnit)
				case r < 96:
					op = "expire"
					fast.Expire()
					slow.Expire()
				case r < 98:
					op = "clear " + w.String()
					fast.Clear(w)
					slow.Clear(w)
				default:
					op = "remove worker " + w.String()
					fast.RemoveWorker(w)
					slow.RemoveWorker(w)
				}
				if diff := indexDiff(fast, slow, prompts); diff != "" {
					t.Fatalf("step %d (%s): %s", step, op, diff)
				}
			}
			if skips == 0 {
				t.Fatal("no Store was skipped: the comparison proves nothing")
			}
			t.Logf("%d of the Stores skipped", skips)
		})
	}
}

// indexDiff describes the first difference between two indexes' holdings of prompts'
// blocks, hints, recency queues and counts ("" when none).
func indexDiff(a, b *Index, prompts [][]uint64) string {
	if a.Len() != b.Len() {
		return fmt.Sprintf("Len %d and %d", a.Len(), b.Len())
	}
	for _, p := range prompts {
		for i, key := range p {
			key = normKey(key)
			wa, ha := a.shards[shardOf(key)].get(key, 0)
			wb, hb := b.shards[shardOf(key)].get(key, 0)
			if wa != wb || ha != hb {
				return fmt.Sprintf("block %d of a prompt: set %b hint %x, and set %b hint %x", i, wa, ha, wb, hb)
			}
		}
	}
	qa, qb := a.snapshotQueues(), b.snapshotQueues()
	if len(qa) != len(qb) {
		return fmt.Sprintf("%d and %d recency queues", len(qa), len(qb))
	}
	for i := range qa {
		if qa[i].w != qb[i].w || !slices.Equal(qa[i].keys, qb[i].keys) || !slices.Equal(qa[i].ages, qb[i].ages) {
			return fmt.Sprintf("worker %s's live records %v %v, and %v %v", qa[i].w, qa[i].keys, qa[i].ages, qb[i].keys, qb[i].ages)
		}
	}
	for _, w := range a.Workers() {
		if a.Blocks(w) != b.Blocks(w) {
			return fmt.Sprintf("worker %s holds %d and %d blocks", w, a.Blocks(w), b.Blocks(w))
		}
	}
	return ""
}

// TestConcurrentRepeatsRemovalsAndLookups races Stores of one prompt's prefixes on two
// workers (mostly skipped) against removals, clears and lookups (run it with -race). Once
// the writers are done, a last Store of the whole prompt by each worker must leave it held:
// a Store skipped on a record that a removal had made stale would leave holes.
func TestConcurrentRepeatsRemovalsAndLookups(t *testing.T) {
	x := New(Options{TTL: time.Minute, MaxBlocksPerWorker: 1000})
	p := prompt(20, 64)
	workers := []Worker{wk("a"), wk("b")}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			var dst []Match
			for i := range 5000 {
				w := workers[rng.IntN(len(workers))]
				switch r := rng.IntN(100); {
				case g == 0 && r < 5:
					x.Remove(w, p[rng.IntN(len(p)):])
				case g == 0 && r < 6:
					x.Clear(w)
				case g == 1:
					dst = x.FindMatches(p, dst[:0])
				default:
					x.Store(w, p[:len(p)-i%3])
				}
			}
		})
	}
	wg.Wait()
	for _, w := range workers {
		x.Store(w, p)
	}
	got := matchMap(t, x.FindMatches(p, nil))
	for _, w := range workers {
		if got[w] != len(p) || x.Blocks(w) != len(p) {
			t.Fatalf("after a last Store of the whole prompt %s holds %d leading blocks (%d in all), want %d",
				w, got[w], x.Blocks(w), len(p))
		}
	}
}
