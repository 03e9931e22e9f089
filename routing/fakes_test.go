package routing

import (
	"fmt"
	"sync"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// fakeIndex is a plain map index for testing the layer above the real one.
type fakeIndex struct {
	mu      sync.Mutex
	blocks  map[uint64]map[indexer.Worker]bool
	records int // Record calls
}

func newFakeIndex() *fakeIndex { return &fakeIndex{blocks: map[uint64]map[indexer.Worker]bool{}} }

func (f *fakeIndex) Record(w indexer.Worker, seq []uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.records++
	for _, h := range seq {
		if f.blocks[h] == nil {
			f.blocks[h] = map[indexer.Worker]bool{}
		}
		f.blocks[h][w] = true
	}
}

func (f *fakeIndex) FindMatches(seq []uint64, dst []indexer.Match) []indexer.Match {
	f.mu.Lock()
	defer f.mu.Unlock()
	dst = dst[:0]
	counts := map[indexer.Worker]int{}
	for i, h := range seq {
		ws := f.blocks[h]
		if len(ws) == 0 {
			break
		}
		for w := range ws {
			if counts[w] == i {
				counts[w] = i + 1
			}
		}
	}
	for w, n := range counts {
		if n > 0 {
			dst = append(dst, indexer.Match{Worker: w, Blocks: n})
		}
	}
	return dst
}

func specs(n int) []WorkerSpec {
	out := make([]WorkerSpec, n)
	for i := range out {
		out[i] = WorkerSpec{ID: fmt.Sprintf("w%d", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 9000+i), CapacityBlocks: 1000}
	}
	return out
}

func worker(id string) indexer.Worker { return indexer.Worker{ID: id} }

// hashes returns n distinct fake sequence hashes starting at base.
func hashes(base uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = base + uint64(i)
	}
	return out
}

type rig struct {
	reg      *Registry
	tracker  *Tracker
	index    *fakeIndex
	affinity *MemoryAffinity
	router   *Router
}

func newRig(t interface {
	Helper()
	Fatal(...any)
}, n int, cfg Config) *rig {
	t.Helper()
	reg, err := NewRegistry(specs(n))
	if err != nil {
		t.Fatal(err)
	}
	rg := &rig{reg: reg, tracker: NewTracker(), index: newFakeIndex(), affinity: NewMemoryAffinity(0, 0)}
	rg.router, err = New(cfg, Deps{Index: rg.index, Recorder: rg.index, Workers: reg, Tracker: rg.tracker, Affinity: rg.affinity})
	if err != nil {
		t.Fatal(err)
	}
	return rg
}
