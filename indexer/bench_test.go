package indexer

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
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
// own cost, about 140 ns on the reference VM, is included).
//
//   - shared-fleet: cycles through all ~500 prompts of the fill, so most reads miss the cache;
//     this measures the machine's memory latency as much as the index.
//   - popular-16: cycles through 16 of them, as a router sees a few hot system prompts.
//   - all-64-holders: the worst case, every prompt held by all 64 workers at 64 depths.
func BenchmarkFindMatches512(b *testing.B) {
	shared := func(n int) func(*Index) [][]uint64 {
		return func(x *Index) [][]uint64 {
			f := newSharedFleet(1)
			f.fill(x)
			return f.prompts[:min(n, len(f.prompts))]
		}
	}
	cases := []struct {
		name  string
		build func(*Index) [][]uint64
	}{
		{"shared-fleet", shared(benchEntries)},
		{"popular-16", shared(16)},
		{"all-64-holders", allHolders},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			x := New(Options{TTL: 120 * time.Second})
			prompts := c.build(x)
			if x.Len() != benchEntries {
				b.Fatalf("index holds %d entries", x.Len())
			}
			dst := make([]Match, 0, benchWorkers)
			lat := make([]time.Duration, 0, 1<<20)
			matches := 0
			i := 0
			for b.Loop() {
				p := prompts[i%len(prompts)]
				i++
				t0 := time.Now()
				dst = x.FindMatches(p, dst)
				lat = append(lat, time.Since(t0))
				matches += len(dst)
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
			b.ReportMetric(float64(matches)/float64(len(lat)), "matches/op")
		})
	}
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
