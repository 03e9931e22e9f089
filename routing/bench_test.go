package routing

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// BenchmarkSelect8k is one request's whole selection on the hot path: hash an 8k-token prompt,
// look it up in an index of 64 workers, read the load of every worker, score with the kv cost model, start
// and finish the load accounting. It reports p50 and p99 of single calls.
func BenchmarkSelect8k(b *testing.B) { benchSelect8k(b, true) }

// BenchmarkSelect8kPrehashed is BenchmarkSelect8k with the prompt hashed once, before the
// loop: the selection proper, to tell its cost from the hashing's. Its caches are warmer than
// a router's, whose hashing of the prompt evicts much of what selection reads.
func BenchmarkSelect8kPrehashed(b *testing.B) { benchSelect8k(b, false) }

func benchSelect8k(b *testing.B, hashEach bool) {
	const workers, blockSize, tokens = 64, 16, 8192
	specs := make([]WorkerSpec, workers)
	for i := range specs {
		specs[i] = WorkerSpec{ID: fmt.Sprintf("w%d", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 10000+i), CapacityBlocks: 1 << 16}
	}
	reg, err := NewRegistry(specs)
	if err != nil {
		b.Fatal(err)
	}
	idx := indexer.New(indexer.Options{})
	prompt := make([]uint32, tokens)
	for i := range prompt {
		prompt[i] = uint32(1000 + i*7919%150000)
	}
	seq := indexer.SequenceHashes(prompt, blockSize, indexer.Seed("", ""), nil)
	// Every worker holds the prompt's first 16 blocks (a shared system prompt), eight hold
	// longer prefixes of it at eight depths, and each holds ~15k blocks of other prompts:
	// about 1M (block, worker) entries in all.
	other := make([]uint32, 16*1024*blockSize)
	for w := range workers {
		wk := indexer.Worker{ID: specs[w].ID}
		depth := 16
		if w < 8 {
			depth = (w + 1) * len(seq) / 8
		}
		idx.Store(wk, seq[:depth])
		for i := range other {
			other[i] = uint32(w*1_000_003 + i)
		}
		idx.Store(wk, indexer.SequenceHashes(other, blockSize, indexer.Seed("", ""), nil)[:15000])
	}
	tracker := NewTracker()
	for w := range workers {
		tracker.Start(indexer.Worker{ID: specs[w].ID}, int64(w*100), int64(w*10))
	}
	r, err := New(Config{}, Deps{Index: idx, Workers: reg, Tracker: tracker})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	hashes := make([]uint64, 0, tokens/blockSize)
	if !hashEach {
		hashes = r.HashTokens(prompt, "", hashes)
	}
	lat := make([]time.Duration, 0, 1<<20)
	b.ReportAllocs()
	for b.Loop() {
		start := time.Now()
		if hashEach {
			hashes = r.HashTokens(prompt, "", hashes)
		}
		a, err := r.Route(ctx, &Request{PromptTokens: len(prompt), Hashes: hashes, DPRank: -1})
		if err != nil {
			b.Fatal(err)
		}
		a.Finish()
		if len(lat) < cap(lat) {
			lat = append(lat, time.Since(start))
		}
	}
	reportQuantiles(b, lat)
}

// reportQuantiles reports p50, p90, p98 and p99 of single-call latencies. p98 is there because
// on a shared virtual machine the last percent is the host's: see BenchmarkNoiseFloor.
func reportQuantiles(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	for _, q := range []struct {
		per  int
		name string
	}{{50, "p50-ns"}, {90, "p90-ns"}, {98, "p98-ns"}, {99, "p99-ns"}} {
		b.ReportMetric(float64(lat[len(lat)*q.per/100].Nanoseconds()), q.name)
	}
}

// BenchmarkNoiseFloor times a fixed chain of arithmetic as long as BenchmarkSelect8k's median
// call (about 12 us here), with no memory traffic, no allocation and nothing shared: whatever
// spread its quantiles show is the machine's (vCPU steal, interrupts, the host's memory
// scanning), not the code's. Read Select8k's tail against it: a p99 below this floor's cannot
// be shown on the machine that measured it.
func BenchmarkNoiseFloor(b *testing.B) {
	lat := make([]time.Duration, 0, 1<<20)
	x := uint64(1)
	for b.Loop() {
		start := time.Now()
		for range 9000 {
			x = x*6364136223846793005 + 1442695040888963407
		}
		if len(lat) < cap(lat) {
			lat = append(lat, time.Since(start))
		}
	}
	if x == 0 { // keeps the loop from being optimised away
		b.Log(x)
	}
	reportQuantiles(b, lat)
}

// BenchmarkTicket is one request's load accounting (start, first token, end), with nothing
// taking the Changes signal (its token waits: a send costs no lock) and with a load sharer
// taking each token at once (the worst case: most sends find the channel empty).
func BenchmarkTicket(b *testing.B) {
	for _, tc := range []struct {
		name  string
		drain bool
	}{{"unread", false}, {"drained", true}} {
		b.Run(tc.name, func(b *testing.B) {
			tr := NewTracker()
			if tc.drain {
				done := make(chan struct{})
				defer close(done)
				go func() {
					for {
						select {
						case <-tr.Changes():
						case <-done:
							return
						}
					}
				}()
			}
			w := indexer.Worker{ID: "w0"}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					k := tr.Start(w, 1000, 64)
					k.FirstToken()
					k.Finish()
				}
			})
		})
	}
}
