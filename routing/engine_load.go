package routing

import (
	"maps"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// EngineSample is what one engine (one data-parallel rank, or a whole worker) reports of
// its own load on its metrics endpoint: the Gateway API Inference Extension's model-server
// protocol (vLLM's num_requests_running, num_requests_waiting, kv_cache_usage_perc and
// cache_config_info; SGLang's equivalents).
type EngineSample struct {
	// Running and Waiting are the requests the engine runs and queues, every client's.
	Running, Waiting float64
	// KVUsage is the share of the KV cache in use, 0 to 1; negative is unknown.
	KVUsage float64
	// KVBlocks is the KV cache's size in blocks of KVBlockSize tokens (0: unknown, then the
	// worker spec's CapacityBlocks stands in); KVBlockSize 0 is the router's block size.
	KVBlocks    float64
	KVBlockSize int
}

// EngineReport is one scrape of a worker's engine metrics.
type EngineReport struct {
	// Ranks are the samples of the data-parallel ranks the engine reports apart (vLLM
	// labels each engine's series with engine="<rank>"), by rank.
	Ranks map[int]EngineSample
	// Whole is the worker's sample when it reports no rank apart; nil for none. For a
	// worker of several ranks it is the total, spread evenly over them.
	Whole *EngineSample
}

// DefaultEngineRequestTokens is the size EngineLoad gives a request it cannot see when
// neither the engine's KV usage nor the router's own requests there tell it more.
const DefaultEngineRequestTokens = 1024

// EngineLoadConfig tunes an EngineLoad.
type EngineLoadConfig struct {
	// BlockSize is the router's block size in tokens (indexer.DefaultBlockSize when 0).
	BlockSize int
	// RequestTokens is the prompt size of a request the router cannot see, when nothing
	// better is known (DefaultEngineRequestTokens when 0).
	RequestTokens int
}

// EngineLoad is a LoadView that adds to another (the fleet's merged in-flight load) the
// load each worker's engine reports beyond it: requests from clients that do not go
// through this cluster, and the engine's queue. The policies and busy thresholds then see a
// worker loaded from outside as loaded.
//
// At each Observe, for each rank, the external requests are the engine's running plus
// waiting less the requests the inner view counts there at that moment (never below zero).
// Each counts as the router counts its own: one request, its blocks as decode load from
// admission to end, and, while it waits in the engine's queue, its prompt as prefill
// tokens. Which of the engine's requests wait is not known, so the external ones are taken
// to wait in the engine's proportion. A request's blocks are the engine's blocks in use per
// running request (KV usage times capacity, over running) when the engine reports usage and
// its capacity is known (from cache_config_info, or the worker spec), else the router's own
// requests' blocks on that rank, else RequestTokens. The external figures are fixed at
// Observe, so the requests this cluster sends there afterwards add to them instead of
// hiding them (the inner view counts a request before the engine does, and after: it
// subtracts no more than it should).
//
// Figures last until Expire drops them (the scraper calls it with a cut-off a few
// intervals back) or the next Observe of the worker replaces them. Load reads no clock and
// takes no lock.
type EngineLoad struct {
	inner         LoadView
	blockSize     float64
	requestBlocks float64

	mu      sync.Mutex
	workers map[string]engineWorker
	// cells are every target's external load, read without a lock; the map is copied on
	// write, only when a target gets external load for the first time.
	cells atomic.Pointer[map[indexer.Worker]*remoteCell]
}

// engineWorker is one worker's external load as last observed.
type engineWorker struct {
	at    time.Time
	ranks map[indexer.Worker]Load
}

// NewEngineLoad returns inner plus the engines' load beyond it.
func NewEngineLoad(inner LoadView, cfg EngineLoadConfig) *EngineLoad {
	bs := cfg.BlockSize
	if bs <= 0 {
		bs = indexer.DefaultBlockSize
	}
	tokens := cfg.RequestTokens
	if tokens <= 0 {
		tokens = DefaultEngineRequestTokens
	}
	e := &EngineLoad{inner: inner, blockSize: float64(bs), requestBlocks: math.Ceil(float64(tokens) / float64(bs)),
		workers: map[string]engineWorker{}}
	empty := map[indexer.Worker]*remoteCell{}
	e.cells.Store(&empty)
	return e
}

// Load implements LoadView: the inner load plus the engine's external load of w.
func (e *EngineLoad) Load(w indexer.Worker) Load {
	l := e.inner.Load(w)
	if m := *e.cells.Load(); len(m) > 0 {
		l = l.plus(m[w].load())
	}
	return l
}

// External returns the load the engine of w reports beyond the inner view, as last observed.
func (e *EngineLoad) External(w indexer.Worker) Load {
	return (*e.cells.Load())[w].load()
}

// Snapshot returns the external load of every target a live scrape covers, zeros included
// (for metrics).
func (e *EngineLoad) Snapshot() map[indexer.Worker]Load {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := map[indexer.Worker]Load{}
	for _, ew := range e.workers {
		maps.Copy(out, ew.ranks)
	}
	return out
}

// Observe records a scrape of spec's engine taken at `at`, replacing the worker's previous
// one. A rank the report says nothing of has no external load.
func (e *EngineLoad) Observe(spec WorkerSpec, rep EngineReport, at time.Time) {
	dp := max(spec.DPSize, 1)
	ranks := make(map[indexer.Worker]Load, dp)
	if len(rep.Ranks) > 0 {
		for r, s := range rep.Ranks {
			if r < 0 || r >= dp {
				continue
			}
			w := indexer.Worker{ID: spec.ID, DPRank: uint32(r)}
			ranks[w] = e.external(s, e.inner.Load(w), float64(spec.CapacityBlocks)).round()
		}
	} else if rep.Whole != nil {
		// The engine counts the worker as one: the router's own load is summed over the
		// ranks, and what lies beyond it is spread evenly, as a worker balances its ranks.
		var ours Load
		for r := range dp {
			ours = ours.plus(e.inner.Load(indexer.Worker{ID: spec.ID, DPRank: uint32(r)}))
		}
		s := *rep.Whole
		if s.KVBlocks > 0 {
			s.KVBlocks *= float64(dp) // a rank's cache, as cache_config_info gives it
		}
		x := e.external(s, ours, float64(spec.CapacityBlocks)*float64(dp))
		part := externalLoad{x.requests / float64(dp), x.prefill / float64(dp), x.decode / float64(dp)}.round()
		for r := range dp {
			ranks[indexer.Worker{ID: spec.ID, DPRank: uint32(r)}] = part
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	old := e.workers[spec.ID].ranks
	e.workers[spec.ID] = engineWorker{at: at, ranks: ranks}
	e.replaceLocked(old, ranks)
}

// Expire drops the figures observed before cutoff and returns how many workers it dropped.
func (e *EngineLoad) Expire(cutoff time.Time) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for id, ew := range e.workers {
		if ew.at.Before(cutoff) {
			delete(e.workers, id)
			e.replaceLocked(ew.ranks, nil)
			n++
		}
	}
	return n
}

// Forget drops a worker's figures (it was removed).
func (e *EngineLoad) Forget(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ew, ok := e.workers[id]; ok {
		delete(e.workers, id)
		e.replaceLocked(ew.ranks, nil)
	}
}

// externalLoad is a load before rounding.
type externalLoad struct{ requests, prefill, decode float64 }

func (x externalLoad) round() Load {
	return Load{Requests: int64(math.Round(x.requests)), PrefillTokens: int64(math.Round(x.prefill)), DecodeBlocks: int64(math.Round(x.decode))}
}

// maxEngineRequests bounds what an engine may claim to run or queue: a worker's figures are
// not trusted further.
const maxEngineRequests = 1 << 20

// external is the part of the engine's sample s beyond ours, the router's load there;
// capacity is the worker spec's KV capacity in router blocks (0: unknown).
func (e *EngineLoad) external(s EngineSample, ours Load, capacity float64) externalLoad {
	running, waiting := clampCount(s.Running), clampCount(s.Waiting)
	engine := running + waiting
	ext := engine - float64(max(ours.Requests, 0))
	if ext < 0.5 {
		return externalLoad{}
	}
	perRequest := 0.0
	if s.KVUsage >= 0 && s.KVUsage <= 1 && running >= 1 {
		blocks := capacity
		if s.KVBlocks > 0 && !math.IsInf(s.KVBlocks, 0) {
			bs := float64(s.KVBlockSize)
			if bs <= 0 {
				bs = e.blockSize
			}
			blocks = s.KVBlocks * bs / e.blockSize
		}
		perRequest = s.KVUsage * blocks / running
	}
	if perRequest <= 0 && ours.Requests > 0 && ours.DecodeBlocks > 0 {
		perRequest = float64(ours.DecodeBlocks) / float64(ours.Requests)
	}
	if perRequest <= 0 {
		perRequest = e.requestBlocks
	}
	// A request holds a block at least; a figure past any real cache is not believed.
	perRequest = min(max(perRequest, 1), 1<<24)
	return externalLoad{
		requests: ext,
		prefill:  ext * waiting / engine * perRequest * e.blockSize,
		decode:   ext * perRequest,
	}
}

// clampCount is a request count from a worker, NaN and negatives as 0, bounded.
func clampCount(v float64) float64 {
	if !(v > 0) {
		return 0
	}
	return min(v, maxEngineRequests)
}

// replaceLocked puts one worker's new figures in its targets' cells in place of its old
// ones (a target belongs to one worker, so no other worker's cells change).
func (e *EngineLoad) replaceLocked(old, now map[indexer.Worker]Load) {
	cells := *e.cells.Load()
	grown := false
	for w, l := range now {
		if cells[w] == nil && l != (Load{}) {
			if !grown {
				cells, grown = maps.Clone(cells), true
			}
			cells[w] = &remoteCell{}
		}
	}
	for w := range old {
		if _, kept := now[w]; !kept && cells[w] != nil {
			cells[w].store(Load{})
		}
	}
	for w, l := range now {
		if c := cells[w]; c != nil {
			c.store(l)
		}
	}
	if grown {
		e.cells.Store(&cells)
	}
	// Selections waiting for room wait on the tracker's releases; external load that shrank
	// may be the room they wait for.
	if t := trackerUnder(e.inner); t != nil {
		t.released()
	}
}

// trackerUnder finds the Tracker a LoadView reads, through the views this package stacks.
func trackerUnder(v LoadView) *Tracker {
	for range 8 {
		switch x := v.(type) {
		case *Tracker:
			return x
		case *RemoteLoad:
			v = x.local
		case *EngineLoad:
			v = x.inner
		default:
			return nil
		}
	}
	return nil
}
