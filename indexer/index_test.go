package indexer

import (
	"cmp"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"
)

// prompt returns n distinct pseudo-random sequence hashes named by tag.
func prompt(tag uint64, n int) []uint64 {
	rng := rand.New(rand.NewPCG(tag, 0x5eed))
	seq := make([]uint64, n)
	for i := range seq {
		seq[i] = rng.Uint64()
	}
	return seq
}

func wk(id string) Worker { return Worker{ID: id} }

// matchMap turns matches into worker -> blocks, failing on a worker reported twice.
func matchMap(t *testing.T, ms []Match) map[Worker]int {
	t.Helper()
	got := make(map[Worker]int, len(ms))
	for _, m := range ms {
		if _, dup := got[m.Worker]; dup {
			t.Fatalf("worker %s reported twice in %v", m.Worker, ms)
		}
		got[m.Worker] = m.Blocks
	}
	return got
}

func sortedMatches(ms []Match) []Match {
	ms = slices.Clone(ms)
	slices.SortFunc(ms, func(a, b Match) int {
		return cmp.Or(cmp.Compare(a.Worker.ID, b.Worker.ID), cmp.Compare(a.Worker.DPRank, b.Worker.DPRank))
	})
	return ms
}

// fakeClock is a settable clock for TTL tests.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func TestFindMatchesCountsLeadingBlocksPerWorker(t *testing.T) {
	// holding is a worker's blocks of the prompt: a prefix, or explicit block indexes.
	type holding struct {
		prefix int
		blocks []int
	}
	tests := []struct {
		name   string
		n      int
		holds  map[string]holding
		lookup int // how many leading blocks of the prompt to look up; 0 means n
		want   map[string]int
	}{
		{name: "nobody holds anything", n: 8, want: map[string]int{}},
		{name: "one worker holds all", n: 8, holds: map[string]holding{"a": {prefix: 8}}, want: map[string]int{"a": 8}},
		{
			name:  "per-worker depths",
			n:     20,
			holds: map[string]holding{"a": {prefix: 20}, "b": {prefix: 7}, "c": {prefix: 1}},
			want:  map[string]int{"a": 20, "b": 7, "c": 1},
		},
		{
			name:  "a worker without the first block is absent",
			n:     10,
			holds: map[string]holding{"a": {prefix: 4}, "b": {blocks: []int{1, 2, 3, 4, 5}}},
			want:  map[string]int{"a": 4},
		},
		{
			name:  "stops at the first block nobody holds",
			n:     12,
			holds: map[string]holding{"a": {blocks: []int{0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11}}, "b": {blocks: []int{0, 1, 2, 7, 8}}},
			want:  map[string]int{"a": 5, "b": 3},
		},
		{
			name:  "a hole of one worker ends only its own run",
			n:     12,
			holds: map[string]holding{"a": {prefix: 12}, "b": {blocks: []int{0, 1, 3, 4, 5}}},
			want:  map[string]int{"a": 12, "b": 2},
		},
		{
			name:   "a lookup shorter than the holdings",
			n:      30,
			holds:  map[string]holding{"a": {prefix: 30}, "b": {prefix: 5}},
			lookup: 10,
			want:   map[string]int{"a": 10, "b": 5},
		},
		{
			name:  "long prompt, prefix-closed holdings",
			n:     512,
			holds: map[string]holding{"a": {prefix: 512}, "b": {prefix: 511}, "c": {prefix: 64}, "d": {prefix: 65}, "e": {prefix: 300}, "f": {prefix: 1}},
			want:  map[string]int{"a": 512, "b": 511, "c": 64, "d": 65, "e": 300, "f": 1},
		},
		{
			name:  "long prompt, holes at probed blocks are seen",
			n:     512,
			holds: map[string]holding{"a": {prefix: 512}, "b": {blocks: append(seqInts(0, 64), seqInts(65, 512)...)}},
			want:  map[string]int{"a": 512, "b": 64},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			x := New(Options{})
			seq := prompt(1, tt.n)
			for id, h := range tt.holds {
				x.Store(wk(id), seq[:h.prefix])
				for _, b := range h.blocks {
					x.Store(wk(id), seq[b:b+1])
				}
			}
			look := seq
			if tt.lookup > 0 {
				look = seq[:tt.lookup]
			}
			got := matchMap(t, x.FindMatches(look, nil))
			want := make(map[Worker]int)
			for id, n := range tt.want {
				want[wk(id)] = n
			}
			if !maps.Equal(got, want) {
				t.Fatalf("got %v, want %v", got, want)
			}
		})
	}
}

func seqInts(from, to int) []int {
	var s []int
	for i := from; i < to; i++ {
		s = append(s, i)
	}
	return s
}

func TestFindMatchesEmptyPrompt(t *testing.T) {
	x := New(Options{})
	x.Store(wk("a"), prompt(1, 4))
	if got := x.FindMatches(nil, make([]Match, 3)); len(got) != 0 {
		t.Fatalf("empty prompt matched %v", got)
	}
}

func TestDPRanksAreDistinctWorkers(t *testing.T) {
	x := New(Options{})
	seq := prompt(2, 40)
	r0, r1 := Worker{ID: "w", DPRank: 0}, Worker{ID: "w", DPRank: 1}
	x.Store(r0, seq[:40])
	x.Store(r1, seq[:3])
	got := matchMap(t, x.FindMatches(seq, nil))
	if want := map[Worker]int{r0: 40, r1: 3}; !maps.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	x.Remove(r1, seq[:3])
	if got := x.Blocks(r0); got != 40 {
		t.Fatalf("removing rank 1's blocks left rank 0 with %d blocks", got)
	}
	if w := x.Workers(); !slices.Equal(w, []Worker{r0, r1}) {
		t.Fatalf("Workers() = %v", w)
	}
	if r1.String() != "w/1" || r0.String() != "w" {
		t.Fatalf("String: %q %q", r0, r1)
	}
}

func TestStoreRefreshDoesNotCountTwice(t *testing.T) {
	x := New(Options{})
	seq := prompt(3, 10)
	x.Store(wk("a"), seq)
	x.Store(wk("a"), seq[:6])
	x.Record(wk("b"), seq[:4])
	if x.Len() != 14 || x.Blocks(wk("a")) != 10 || x.Blocks(wk("b")) != 4 {
		t.Fatalf("Len=%d a=%d b=%d, want 14, 10, 4", x.Len(), x.Blocks(wk("a")), x.Blocks(wk("b")))
	}
}

func TestRemoveDropsOnlyTheNamedBlocks(t *testing.T) {
	x := New(Options{})
	seq := prompt(4, 10)
	x.Store(wk("a"), seq)
	x.Store(wk("b"), seq)
	x.Remove(wk("a"), seq[6:])
	x.Remove(wk("a"), prompt(99, 3)) // not held: ignored
	x.Remove(wk("nobody"), seq)      // unknown worker: ignored
	got := matchMap(t, x.FindMatches(seq, nil))
	if want := map[Worker]int{wk("a"): 6, wk("b"): 10}; !maps.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if x.Len() != 16 {
		t.Fatalf("Len = %d, want 16", x.Len())
	}
	if slices.Contains(x.Workers(), wk("nobody")) {
		t.Fatal("Remove registered an unknown worker")
	}
}

func TestClearKeepsTheWorkerKnown(t *testing.T) {
	x := New(Options{})
	seq := prompt(5, 10)
	x.Store(wk("a"), seq)
	x.Store(wk("b"), seq[:2])
	x.Clear(wk("a"))
	if got := matchMap(t, x.FindMatches(seq, nil)); !maps.Equal(got, map[Worker]int{wk("b"): 2}) {
		t.Fatalf("after Clear: %v", got)
	}
	if x.Blocks(wk("a")) != 0 || x.Len() != 2 || !slices.Contains(x.Workers(), wk("a")) {
		t.Fatalf("after Clear: blocks=%d len=%d workers=%v", x.Blocks(wk("a")), x.Len(), x.Workers())
	}
	x.Store(wk("a"), seq[:3])
	if x.Blocks(wk("a")) != 3 {
		t.Fatalf("store after Clear: %d blocks", x.Blocks(wk("a")))
	}
}

func TestRemoveWorkerForgetsItAndItsIDIsNotInherited(t *testing.T) {
	x := New(Options{})
	seqA, seqB := prompt(6, 50), prompt(7, 50)
	x.Store(wk("a"), seqA)
	x.RemoveWorker(wk("a"))
	x.RemoveWorker(wk("never-seen"))
	x.Store(wk("b"), seqB) // takes a's freed id
	if got := x.FindMatches(seqA, nil); len(got) != 0 {
		t.Fatalf("a's prompt still matches %v after RemoveWorker", got)
	}
	if got := matchMap(t, x.FindMatches(seqB, nil)); !maps.Equal(got, map[Worker]int{wk("b"): 50}) {
		t.Fatalf("b's prompt: %v", got)
	}
	if x.Len() != 50 || !slices.Equal(x.Workers(), []Worker{wk("b")}) {
		t.Fatalf("Len=%d Workers=%v", x.Len(), x.Workers())
	}
}

func TestApplyDispatchesEventsAndRejectsUnknownKinds(t *testing.T) {
	x := New(Options{})
	seq := prompt(8, 6)
	steps := []struct {
		ev   Event
		want int // blocks of w after the event
	}{
		{Event{Kind: Stored, Worker: wk("w"), Blocks: seq}, 6},
		{Event{Kind: Removed, Worker: wk("w"), Blocks: seq[4:]}, 4},
		{Event{Kind: Cleared, Worker: wk("w")}, 0},
	}
	for i, s := range steps {
		if err := x.Apply(s.ev); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if got := x.Blocks(wk("w")); got != s.want {
			t.Fatalf("step %d: %d blocks, want %d", i, got, s.want)
		}
	}
	x.Store(wk("w"), seq)
	for _, k := range []EventKind{0, 4, 255} {
		if err := x.Apply(Event{Kind: k, Worker: wk("w"), Blocks: seq}); err == nil {
			t.Errorf("kind %d accepted", k)
		}
	}
	if x.Blocks(wk("w")) != 6 {
		t.Fatalf("a rejected event changed state: %d blocks", x.Blocks(wk("w")))
	}
}

func TestHashZeroIsIndexed(t *testing.T) {
	x := New(Options{})
	seq := []uint64{0, 1, 2}
	x.Store(wk("a"), seq)
	if got := matchMap(t, x.FindMatches(seq, nil)); got[wk("a")] != 3 {
		t.Fatalf("got %v", got)
	}
	x.Remove(wk("a"), seq[:1])
	if got := x.FindMatches(seq, nil); len(got) != 0 {
		t.Fatalf("after removing block 0: %v", got)
	}
}

func TestExpireDropsEntriesPastTheTTL(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	x := New(Options{TTL: 10 * time.Second, Now: clock.Now})
	old, fresh := prompt(9, 8), prompt(10, 8)
	x.Store(wk("a"), old)
	clock.Advance(5 * time.Second)
	x.Store(wk("b"), fresh)
	x.Store(wk("a"), old[:3]) // refresh restarts the TTL of these three

	clock.Advance(4 * time.Second) // 9 s after the first store: nothing is past 10 s
	if n := x.Expire(); n != 0 {
		t.Fatalf("Expire at 9 s dropped %d", n)
	}
	clock.Advance(2 * time.Second) // 11 s: a's unrefreshed blocks expire
	if n := x.Expire(); n != 5 {
		t.Fatalf("Expire at 11 s dropped %d, want 5", n)
	}
	if got := matchMap(t, x.FindMatches(old, nil)); !maps.Equal(got, map[Worker]int{wk("a"): 3}) {
		t.Fatalf("after the first expiry: %v", got)
	}
	clock.Advance(5 * time.Second) // 16 s: everything stored at 5 s expires
	if n := x.Expire(); n != 11 {
		t.Fatalf("Expire at 16 s dropped %d, want 11", n)
	}
	if x.Len() != 0 || len(x.FindMatches(fresh, nil)) != 0 {
		t.Fatalf("after the last expiry: Len=%d", x.Len())
	}
	if !slices.Equal(x.Workers(), []Worker{wk("a"), wk("b")}) {
		t.Fatalf("expiry forgot workers: %v", x.Workers())
	}
}

func TestExpireWithoutTTLKeepsEverything(t *testing.T) {
	clock := &fakeClock{t: time.Unix(0, 0)}
	x := New(Options{Now: clock.Now, TTL: -time.Second})
	x.Store(wk("a"), prompt(11, 5))
	clock.Advance(1000 * time.Hour)
	if n := x.Expire(); n != 0 || x.Len() != 5 {
		t.Fatalf("Expire dropped %d, Len=%d", n, x.Len())
	}
}

func TestStoreExpiresTheWorkersOwnOldEntries(t *testing.T) {
	clock := &fakeClock{t: time.Unix(0, 0)}
	x := New(Options{TTL: time.Second, Now: clock.Now})
	x.Store(wk("a"), prompt(12, 5))
	clock.Advance(2 * time.Second)
	x.Store(wk("a"), prompt(13, 2))
	if got := x.Blocks(wk("a")); got != 2 {
		t.Fatalf("a holds %d blocks, want only the 2 fresh ones", got)
	}
}

func TestCapEvictsTheWorkersOldestEntriesFirst(t *testing.T) {
	x := New(Options{MaxBlocksPerWorker: 10})
	p1, p2, p3 := prompt(20, 5), prompt(21, 5), prompt(22, 3)
	x.Store(wk("a"), p1)
	x.Store(wk("a"), p2)
	x.Store(wk("other"), p2) // another worker's entries do not count against a's cap
	x.Store(wk("a"), p1[:2]) // refresh: p1's head becomes a's newest
	x.Store(wk("a"), p3)     // 13 > 10: evict 3, oldest first
	check := func(seq []uint64, want int) {
		t.Helper()
		if got := matchMap(t, x.FindMatches(seq, nil))[wk("a")]; got != want {
			t.Fatalf("a holds %d leading blocks of the prompt, want %d", got, want)
		}
	}
	// Oldest records, oldest first: p1[4] p1[3] p1[2] (p1[1] p1[0] superseded) p2[4]..p2[0]
	// p1[1] p1[0] p3[2..0]. The three oldest live ones are p1's tail, leaf first.
	check(p1, 2)
	check(p2, 5)
	check(p3, 3)
	x.Store(wk("a"), prompt(23, 4)) // evicts p2's tail, leaving its head: prefix-closed
	check(p2, 1)
	check(p1, 2)
	if got := x.Blocks(wk("a")); got != 10 {
		t.Fatalf("a holds %d blocks, cap is 10", got)
	}
	if got := x.Blocks(wk("other")); got != 5 {
		t.Fatalf("other holds %d blocks, want 5", got)
	}
	// A single store larger than the cap keeps the prompt's head.
	big := prompt(24, 25)
	x.Store(wk("b"), big)
	if got := matchMap(t, x.FindMatches(big, nil))[wk("b")]; got != 10 {
		t.Fatalf("b holds %d leading blocks of a 25-block store under a cap of 10", got)
	}
}

func TestSupersededRecordsAreCompacted(t *testing.T) {
	x := New(Options{MaxBlocksPerWorker: 1000})
	seq := prompt(30, 100)
	x.Store(wk("a"), seq)
	for range 200 {
		x.Remove(wk("a"), seq[90:])
		x.Store(wk("a"), seq[90:])
		x.Store(wk("a"), seq) // 100 refreshes each
	}
	x.mu.RLock()
	st := x.byName[wk("a")]
	x.mu.RUnlock()
	st.mu.Lock()
	qlen, live, stale, pending := st.queue.len(), st.live, st.stale, len(st.pending)
	st.mu.Unlock()
	if live != 100 || qlen != live+stale || qlen > live+compactMin+200 || pending > stale {
		t.Fatalf("queue %d records for %d live entries (%d stale, %d pending keys)", qlen, live, stale, pending)
	}
	// The order survives compaction: the cap still evicts the tail first.
	x.Store(wk("a"), prompt(31, 950))
	if got := matchMap(t, x.FindMatches(seq, nil))[wk("a")]; got != 50 {
		t.Fatalf("after eviction a holds %d leading blocks, want 50", got)
	}
}

// TestMoreThan64Workers puts 150 workers (three pages of ids) on shared prompts at varied
// depths and checks lookups, removal, clearing and id reuse across the pages.
func TestMoreThan64Workers(t *testing.T) {
	x := New(Options{})
	long, short := prompt(40, 512), prompt(41, 20)
	want := map[Worker]int{}
	wantShort := map[Worker]int{}
	for i := range 150 {
		w := Worker{ID: fmt.Sprintf("w%03d", i/2), DPRank: uint32(i % 2)}
		depth := 1 + (i*37)%512
		x.Store(w, long[:depth])
		want[w] = depth
		if i%3 == 0 {
			x.Store(w, short[:1+i%20])
			wantShort[w] = 1 + i%20
		}
	}
	if got := matchMap(t, x.FindMatches(long, nil)); !maps.Equal(got, want) {
		t.Fatalf("long prompt: %d matches, want %d; got %v", len(got), len(want), got)
	}
	if got := matchMap(t, x.FindMatches(short, nil)); !maps.Equal(got, wantShort) {
		t.Fatalf("short prompt: got %v, want %v", got, wantShort)
	}
	// Remove a worker on each page, clear one, trim one.
	for _, w := range []Worker{{ID: "w010"}, {ID: "w040", DPRank: 1}, {ID: "w070"}} {
		x.RemoveWorker(w)
		delete(want, w)
	}
	x.Clear(Worker{ID: "w050"})
	delete(want, Worker{ID: "w050"})
	x.Remove(Worker{ID: "w060", DPRank: 1}, long[5:])
	want[Worker{ID: "w060", DPRank: 1}] = min(5, want[Worker{ID: "w060", DPRank: 1}])
	// A newcomer takes the lowest freed id and must not inherit anything.
	x.Store(wk("newcomer"), short[:2])
	if got := matchMap(t, x.FindMatches(long, nil)); !maps.Equal(got, want) {
		t.Fatalf("after removals: got %v, want %v", got, want)
	}
	total := 0
	for _, w := range x.Workers() {
		total += x.Blocks(w)
	}
	if total != x.Len() {
		t.Fatalf("Len %d, sum of Blocks %d", x.Len(), total)
	}
}

// TestJumpSearchAgreesWithExactAnswer builds random prefix-closed holdings on a tree of shared
// prompts and checks FindMatches against the answer computed from the holdings.
func TestJumpSearchAgreesWithExactAnswer(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	x := New(Options{})
	root := prompt(50, 200)
	var prompts [][]uint64
	for i := range 12 {
		branch := rng.IntN(len(root))
		p := append(slices.Clone(root[:branch]), prompt(uint64(60+i), 512-branch)...)
		prompts = append(prompts, p)
	}
	depth := map[Worker][]int{} // worker -> depth per prompt
	for i := range 90 {
		w := wk(fmt.Sprintf("w%d", i))
		depth[w] = make([]int, len(prompts))
		for j, p := range prompts {
			if rng.IntN(3) == 0 {
				d := 1 + rng.IntN(len(p))
				if rng.IntN(4) == 0 {
					d = len(p)
				}
				x.Store(w, p[:d])
				depth[w][j] = d
			}
		}
	}
	isPrefix := func(a, b []uint64, n int) bool { return n <= len(a) && n <= len(b) && slices.Equal(a[:n], b[:n]) }
	for j, p := range prompts {
		want := map[Worker]int{}
		for w, ds := range depth {
			best := 0
			for k, d := range ds { // a worker holds the shared head of every prompt it stored
				n := min(d, len(p))
				for n > best && !isPrefix(prompts[k], p, n) {
					n--
				}
				best = max(best, n)
			}
			if best > 0 {
				want[w] = best
			}
		}
		if got := matchMap(t, x.FindMatches(p, nil)); !maps.Equal(got, want) {
			t.Fatalf("prompt %d: got %v\nwant %v", j, sortedMatches(toMatches(got)), sortedMatches(toMatches(want)))
		}
	}
}

func TestJumpSearchHandlesEveryPromptLength(t *testing.T) {
	for _, n := range []int{33, 63, 64, 65, 127, 128, 129, 513, 2000} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			x := New(Options{})
			seq := prompt(uint64(n), n)
			want := map[Worker]int{}
			depths := []int{1, 2, n / 2, n - 2, n - 1, n, min(64, n), min(65, n), min(63, n)}
			for i, d := range depths {
				w := wk(fmt.Sprint(i))
				x.Store(w, seq[:d])
				want[w] = d
			}
			if got := matchMap(t, x.FindMatches(seq, nil)); !maps.Equal(got, want) {
				t.Fatalf("got %v, want %v", got, want)
			}
		})
	}
}

func toMatches(m map[Worker]int) []Match {
	var ms []Match
	for w, n := range m {
		ms = append(ms, Match{Worker: w, Blocks: n})
	}
	return ms
}

func TestFindMatchesDoesNotAllocateWithCapacity(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items; run without -race")
	}
	x := New(Options{})
	seq := prompt(70, 512)
	for i := range 100 {
		x.Store(wk(fmt.Sprint(i)), seq[:1+i*5])
	}
	dst := make([]Match, 0, 128)
	if n := testing.AllocsPerRun(50, func() { dst = x.FindMatches(seq, dst) }); n != 0 {
		t.Fatalf("FindMatches allocates %v times per call", n)
	}
	if len(dst) != 100 {
		t.Fatalf("got %d matches, want 100", len(dst))
	}
}

// TestConcurrentReadersAndWriters runs lookups against a stable worker while other workers
// store, remove, clear, expire and leave, and checks every answer is well formed.
func TestConcurrentReadersAndWriters(t *testing.T) {
	tests := []struct {
		name string
		opts func(now func() time.Time) Options
	}{
		{"ttl and cap", func(now func() time.Time) Options {
			return Options{TTL: time.Second, MaxBlocksPerWorker: 300, Now: now}
		}},
		// Without recency queues Clear and RemoveWorker scan the tables while others write.
		{"precise", func(now func() time.Time) Options { return Options{Now: now} }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clock := &fakeClock{t: time.Unix(0, 0)}
			testConcurrentReadersAndWriters(t, clock, New(tt.opts(clock.Now)))
		})
	}
}

func testConcurrentReadersAndWriters(t *testing.T, clock *fakeClock, x *Index) {
	seq := prompt(80, 256)
	stable := wk("stable")
	x.Store(stable, seq[:200])

	const writers, readers, rounds = 4, 3, 600
	var wg sync.WaitGroup
	errs := make(chan error, readers)
	for r := range writers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(r), 1))
			for i := range rounds {
				w := Worker{ID: fmt.Sprintf("churn%d", rng.IntN(6)), DPRank: uint32(rng.IntN(2))}
				switch rng.IntN(6) {
				case 0, 1:
					x.Store(w, seq[:1+rng.IntN(len(seq))])
				case 2:
					x.Remove(w, seq[rng.IntN(len(seq)):])
				case 3:
					x.Clear(w)
				case 4:
					x.RemoveWorker(w)
				default:
					x.Store(w, prompt(uint64(1000+i), 40))
					if r == 0 {
						// Refresh the stable worker so that only the churners expire.
						x.Store(stable, seq[:200])
						clock.Advance(400 * time.Millisecond)
						x.Expire()
					}
				}
			}
		})
	}
	for range readers {
		wg.Go(func() {
			dst := make([]Match, 0, 16)
			for range rounds * 2 {
				dst = x.FindMatches(seq, dst)
				seen := map[Worker]bool{}
				sawStable := false
				for _, m := range dst {
					if m.Blocks < 1 || m.Blocks > len(seq) || seen[m.Worker] {
						errs <- fmt.Errorf("malformed answer %v", dst)
						return
					}
					seen[m.Worker] = true
					sawStable = sawStable || (m.Worker == stable && m.Blocks == 200)
				}
				if !sawStable {
					errs <- fmt.Errorf("stable worker missing or wrong in %v", dst)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Once quiet, the counters agree with the per-worker state.
	total := 0
	for _, w := range x.Workers() {
		total += x.Blocks(w)
	}
	if total != x.Len() {
		t.Fatalf("Len %d, sum of Blocks %d", x.Len(), total)
	}
}

func TestMatchSlotsNameWorkersStably(t *testing.T) {
	x := New(Options{})
	seq := prompt(90, 40)
	for i := range 70 { // two pages of ids
		x.Store(Worker{ID: fmt.Sprintf("s%02d", i)}, seq[:1+i%40])
	}
	first := map[Worker]int{}
	for range 3 {
		bySlot := map[int]Worker{}
		for _, m := range x.FindMatches(seq, nil) {
			if m.Slot < 1 {
				t.Fatalf("%s has slot %d, want 1 or more", m.Worker, m.Slot)
			}
			if other, dup := bySlot[m.Slot]; dup {
				t.Fatalf("%s and %s share slot %d", m.Worker, other, m.Slot)
			}
			bySlot[m.Slot] = m.Worker
			if s, seen := first[m.Worker]; seen && s != m.Slot {
				t.Fatalf("%s moved from slot %d to %d", m.Worker, s, m.Slot)
			}
			first[m.Worker] = m.Slot
		}
	}
	if len(first) != 70 {
		t.Fatalf("%d workers matched, want 70", len(first))
	}
}
