package indexer

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

const (
	benchEntries = 1_000_000
	benchWorkers = 64
	benchPrompt  = 512
)

// benchWorkerNames returns n workers, eight data-parallel ranks per host.
func benchWorkerNames(n int) []Worker {
	ws := make([]Worker, n)
	for i := range ws {
		ws[i] = Worker{ID: fmt.Sprintf("host-%02d:8000", i/8), DPRank: uint32(i % 8)}
	}
	return ws
}

// sharedFleet is the lookup workload: 512-block prompts, each held by 1 to 16 of the 64
// workers at uniformly random depths (prefix-closed, as engines keep them), until the index
// holds exactly benchEntries (block, worker) entries. Each prompt thus has as many points
// where a worker drops out as it has holders.
type sharedFleet struct {
	workers []Worker
	prompts [][]uint64
	stores  []fleetStore
}

type fleetStore struct {
	worker, prompt, depth int
}

func newSharedFleet(seed uint64) *sharedFleet {
	rng := rand.New(rand.NewPCG(seed, 99))
	f := &sharedFleet{workers: benchWorkerNames(benchWorkers)}
	total := 0
	for total < benchEntries {
		p := make([]uint64, benchPrompt)
		for i := range p {
			p[i] = rng.Uint64()
		}
		f.prompts = append(f.prompts, p)
		holders := 1 + rng.IntN(16)
		for _, w := range rng.Perm(benchWorkers)[:holders] {
			d := min(1+rng.IntN(benchPrompt), benchEntries-total)
			f.stores = append(f.stores, fleetStore{worker: w, prompt: len(f.prompts) - 1, depth: d})
			total += d
			if total == benchEntries {
				break
			}
		}
	}
	return f
}

func (f *sharedFleet) fill(x *Index) {
	for _, s := range f.stores {
		x.Store(f.workers[s.worker], f.prompts[s.prompt][:s.depth])
	}
}

// allHolders is the worst case for the jump search: one prompt held by all 64 workers at 64
// different depths, on top of unrelated entries up to benchEntries.
func allHolders(x *Index) [][]uint64 {
	rng := rand.New(rand.NewPCG(3, 4))
	workers := benchWorkerNames(benchWorkers)
	var prompts [][]uint64
	total := 0
	for total < benchEntries {
		p := make([]uint64, benchPrompt)
		for i := range p {
			p[i] = rng.Uint64()
		}
		prompts = append(prompts, p)
		for i, d := range rng.Perm(benchPrompt)[:benchWorkers] {
			d = min(d+1, benchEntries-total)
			x.Store(workers[i], p[:d])
			total += d
			if total == benchEntries {
				break
			}
		}
	}
	return prompts
}

// BenchmarkFindMatches512 looks up 512-block prompts in an index of 1,000,000 entries over 64
// workers and reports the latency percentiles of single calls, each timed with time.Now (whose
// own cost, about 110 ns on the reference VM, is included), and the blocks and rounds of reads
// a lookup takes (FindMatches is find without the count). Before each call the prompt's
// hashes are copied, untimed, into one buffer: a router hashes a prompt just before it looks
// it up, so the hashes are in the cache; reading them cold from 500 prompts' worth of memory
// would double the time measured and none of that is the index's.
//
//   - shared-fleet: cycles through all ~500 prompts of the fill, so most reads miss the cache;
//     this measures the machine's memory latency as much as the index.
//   - popular-16: cycles through 16 of them, as a router sees a few hot system prompts.
//   - all-64-holders: the worst case, every prompt held by all 64 workers at 64 depths.
//   - evicted-tails: the shared fleet after every holder has lost the tail of its holding, so
//     that the hints of the blocks before each cut are stale (see DESIGN.md).
func BenchmarkFindMatches512(b *testing.B) {
	shared := func(n int) func(*Index) [][]uint64 {
		return func(x *Index) [][]uint64 {
			f := newSharedFleet(1)
			f.fill(x)
			return f.prompts[:min(n, len(f.prompts))]
		}
	}
	cases := []struct {
		name    string
		build   func(*Index) [][]uint64
		entries int
	}{
		{"shared-fleet", shared(benchEntries), benchEntries},
		{"popular-16", shared(16), benchEntries},
		{"all-64-holders", allHolders, benchEntries},
		{"evicted-tails", evictedTails, 0},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			x := New(Options{TTL: 120 * time.Second})
			prompts := c.build(x)
			if c.entries > 0 && x.Len() != c.entries {
				b.Fatalf("index holds %d entries", x.Len())
			}
			dst := make([]Match, 0, benchWorkers)
			buf := make([]uint64, benchPrompt)
			var lat latencies
			matches, reads, rounds := 0, 0, 0
			i := 0
			for b.Loop() {
				buf = append(buf[:0], prompts[i%len(prompts)]...)
				i++
				t0 := time.Now()
				var c cost
				dst, c = x.find(buf, dst)
				lat.add(time.Since(t0))
				matches += len(dst)
				reads += c.reads
				rounds += c.rounds
			}
			n := float64(lat.n)
			b.ReportMetric(lat.quantile(0.5), "p50-ns")
			b.ReportMetric(lat.quantile(0.99), "p99-ns")
			b.ReportMetric(float64(matches)/n, "matches/op")
			b.ReportMetric(float64(reads)/n, "reads/op")
			b.ReportMetric(float64(rounds)/n, "rounds/op")
		})
	}
}

// evictedTails fills the shared fleet, then has every holder of every prompt lose a random
// quarter to three quarters of its holding from the tail, as engines evict leaf blocks. Every
// block just before a cut keeps the hint of the longer holding, so the lookups meet stale hints.
func evictedTails(x *Index) [][]uint64 {
	f := newSharedFleet(1)
	f.fill(x)
	rng := rand.New(rand.NewPCG(5, 6))
	for _, s := range f.stores {
		keep := s.depth * (1 + rng.IntN(3)) / 4
		x.Remove(f.workers[s.worker], f.prompts[s.prompt][keep:s.depth])
	}
	return f.prompts
}

// latencies is a histogram of call latencies in 10 ns buckets up to 1 ms, so that recording
// a million calls neither allocates (a growing slice would set off the garbage collector in
// the middle of the measurement) nor needs a sort.
type latencies struct {
	buckets [100_001]int
	n       int
}

// add records one call.
func (l *latencies) add(d time.Duration) {
	l.buckets[min(int(d/10), len(l.buckets)-1)]++
	l.n++
}

// quantile returns the latency in ns below which a fraction q of the calls fell.
func (l *latencies) quantile(q float64) float64 {
	seen, want := 0, int(q*float64(l.n))
	for i, c := range l.buckets {
		if seen += c; seen > want {
			return float64(i * 10)
		}
	}
	return float64(len(l.buckets) * 10)
}

// BenchmarkFindMatches512Parallel runs the shared-fleet lookups from every core at once, to
// show that readers do not queue behind one another.
func BenchmarkFindMatches512Parallel(b *testing.B) {
	x := New(Options{TTL: 120 * time.Second})
	f := newSharedFleet(1)
	f.fill(x)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		dst := make([]Match, 0, benchWorkers)
		i := rand.IntN(len(f.prompts))
		for pb.Next() {
			dst = x.FindMatches(f.prompts[i%len(f.prompts)], dst)
			i++
		}
	})
}

// splitmix is a tiny generator for fresh block hashes inside timed loops.
func splitmix(s *uint64) uint64 {
	*s += 0x9e3779b97f4a7c15
	z := *s
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// BenchmarkApply stores new blocks, 64 per call, round-robin over 64 workers, and reports
// blocks per second on one goroutine. "approximate" runs at steady state with a TTL and a cap of
// 16384 blocks per worker (1,048,576 entries), so every stored block also evicts one;
// "precise" has neither and starts a new index every 2,000,000 entries (untimed).
func BenchmarkApply(b *testing.B) {
	const perCall = 64
	cases := []struct {
		name string
		opts Options
	}{
		{"approximate", Options{TTL: 120 * time.Second, MaxBlocksPerWorker: 16384}},
		{"precise", Options{}},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			workers := benchWorkerNames(benchWorkers)
			x := New(c.opts)
			var state uint64 = 1
			seq := make([]uint64, perCall)
			store := func(i int) {
				for j := range seq {
					seq[j] = splitmix(&state)
				}
				if err := x.Apply(Event{Kind: Stored, Worker: workers[i%len(workers)], Blocks: seq}); err != nil {
					b.Fatal(err)
				}
			}
			if c.opts.MaxBlocksPerWorker > 0 {
				for i := range benchWorkers * c.opts.MaxBlocksPerWorker / perCall {
					store(i)
				}
			}
			i := 0
			for b.Loop() {
				if c.opts.MaxBlocksPerWorker == 0 && x.Len() >= 2_000_000 {
					b.StopTimer()
					x = New(c.opts)
					runtime.GC()
					b.StartTimer()
				}
				store(i)
				i++
			}
			b.ReportMetric(float64(i*perCall)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// BenchmarkMemoryPerEntry measures the heap an index of 1,000,000 entries over 64 workers
// takes, per entry. "shared-fleet" is the lookup workload (blocks shared by several workers);
// "unique" gives every worker its own blocks, the worst case for the block table.
func BenchmarkMemoryPerEntry(b *testing.B) {
	cases := []struct {
		name  string
		setup func() func(*Index)
	}{
		{"shared-fleet", func() func(*Index) {
			f := newSharedFleet(1)
			return f.fill
		}},
		{"unique", func() func(*Index) {
			workers := benchWorkerNames(benchWorkers)
			return func(x *Index) {
				var state uint64 = 7
				seq := make([]uint64, benchPrompt)
				for i := range benchEntries / benchPrompt {
					for j := range seq {
						seq[j] = splitmix(&state)
					}
					x.Store(workers[i%len(workers)], seq)
				}
				rest := benchEntries % benchPrompt
				for j := range rest {
					seq[j] = splitmix(&state)
				}
				x.Store(workers[0], seq[:rest])
			}
		}},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			fill := c.setup()
			var perEntry float64
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				x := New(Options{TTL: 120 * time.Second})
				fill(x)
				runtime.GC()
				runtime.ReadMemStats(&after)
				if x.Len() != benchEntries {
					b.Fatalf("index holds %d entries", x.Len())
				}
				perEntry = float64(after.HeapAlloc-before.HeapAlloc) / float64(x.Len())
				runtime.KeepAlive(x)
			}
			b.ReportMetric(perEntry, "B/entry")
		})
	}
}

// BenchmarkSequenceHashes8k hashes an 8192-token prompt into 512 chained block hashes.
func BenchmarkSequenceHashes8k(b *testing.B) {
	tokens := make([]uint32, 8192)
	for i := range tokens {
		tokens[i] = uint32(i * 7919 % 128000)
	}
	dst := make([]uint64, 0, len(tokens)/DefaultBlockSize)
	b.SetBytes(int64(4 * len(tokens)))
	b.ReportAllocs()
	for b.Loop() {
		dst = SequenceHashes(tokens, DefaultBlockSize, BaseSeed, dst)
	}
	if len(dst) != 512 {
		b.Fatalf("got %d hashes", len(dst))
	}
}

// BenchmarkRecordParallel is the router's record on the hot path from every core at once:
// each request's prompt (8 blocks) stored for one of two workers, as routing records it at
// dispatch and again at completion, in an approximate index (TTL and cap). "repeat" stores
// one prompt over and over (a hot prompt, or one conversation's turns in flight: each Store
// changes nothing); "distinct" a new prompt each time (every Store writes), to show what the
// writes cost.
func BenchmarkRecordParallel(b *testing.B) {
	const blocks = 8
	for _, name := range []string{"repeat", "distinct"} {
		b.Run(name, func(b *testing.B) {
			x := New(Options{TTL: 2 * time.Minute, MaxBlocksPerWorker: 1 << 16})
			workers := benchWorkerNames(2)
			hot := prompt(1, blocks)
			for _, w := range workers {
				x.Store(w, hot)
			}
			var next atomic.Uint64
			b.RunParallel(func(pb *testing.PB) {
				state := next.Add(1) << 32
				seq := make([]uint64, blocks)
				copy(seq, hot)
				i := 0
				for pb.Next() {
					if name == "distinct" {
						for j := range seq {
							seq[j] = splitmix(&state)
						}
					}
					x.Record(workers[i%len(workers)], seq)
					i++
				}
			})
		})
	}
}
