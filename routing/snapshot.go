package routing

import (
	"hash/maphash"
	"sync/atomic"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// routableView is what selection derives once per routable slice and per generation of the
// tracker's workers, instead of once per request: where each worker sits in the slice, and
// each position's load counters. Both change only when a worker is added, removed, drained or
// changes health, or when the tracker meets a worker for the first time or forgets one, and
// a selection otherwise paid a Go map lookup (hashing the worker's name) per match and per
// candidate: 128 of them, several microseconds, for a prompt that 64 workers share.
//
// A view is immutable once published; a selection that finds it stale builds another.
type routableView struct {
	first *Target // identity of the routable slice: its first element and length
	n     int
	// workers is the tracker's worker map the counters came from (identity only); nil when
	// the router's LoadView is not its Tracker, and then loads are read through the LoadView.
	workers *map[indexer.Worker]*counters

	seed  maphash.Seed
	slots []int32 // open addressing over positions: position+1, 0 empty; a power of two long
	// bySlot caches, by the index's Match.Slot, the position+1 found for that slot (0:
	// unknown), filled as matches come, so that a match costs an array read and a check of
	// its worker rather than hashing the worker's name. A slot the index reused for another
	// worker, or that another index of an Overlay gave to another worker, fails the check and
	// is looked up again.
	bySlot []atomic.Int32
	// meta[i] is what the filters read of routable[i]'s spec, side by side, so that filtering
	// reads one array rather than following a pointer to each spec.
	meta []targetMeta
	// prefill: some routable worker has the prefill role.
	prefill bool
	// counters[i] are routable[i]'s load counters, nil for a worker the tracker has not seen
	// (its load is zero until its first request, which also makes the view stale).
	counters []*counters
}

// view returns the routableView of routable, building it if the registry or the tracker
// changed since the last one.
func (r *Router) view(routable []Target) *routableView {
	var workers *map[indexer.Worker]*counters
	if r.loadIsTracker {
		workers = r.deps.Tracker.workers.Load()
	}
	v := r.viewCache.Load()
	if v != nil && v.n == len(routable) && v.workers == workers && (len(routable) == 0 || v.first == &routable[0]) {
		return v
	}
	v = newRoutableView(routable, workers)
	r.viewCache.Store(v)
	return v
}

func newRoutableView(routable []Target, workers *map[indexer.Worker]*counters) *routableView {
	v := &routableView{n: len(routable), workers: workers, seed: maphash.MakeSeed()}
	if len(routable) == 0 {
		return v
	}
	v.first = &routable[0]
	v.meta = make([]targetMeta, len(routable))
	for i := range routable {
		v.meta[i] = metaOf(&routable[i])
		v.prefill = v.prefill || v.meta[i].role == RolePrefill
	}
	size := 4
	for size < 2*len(routable) {
		size *= 2
	}
	v.slots = make([]int32, size)
	v.bySlot = make([]atomic.Int32, 2*len(routable)+64)
	for i, t := range routable {
		j := v.home(t.Worker)
		for v.slots[j] != 0 {
			j = (j + 1) & (size - 1)
		}
		v.slots[j] = int32(i + 1)
	}
	if workers != nil {
		v.counters = make([]*counters, len(routable))
		for i, t := range routable {
			v.counters[i] = (*workers)[t.Worker]
		}
	}
	return v
}

// targetMeta is a target's spec as the filters read it.
type targetMeta struct {
	role  Role
	loras []string // shared with the spec or Serving, which are never modified
	// models are the models the target serves; nil: not known, any.
	models []string
}

func metaOf(t *Target) targetMeta {
	var m targetMeta
	if t.Spec != nil {
		m.role, m.loras = t.Spec.Role, t.Spec.LoRAs
	}
	if t.Serves != nil {
		m.loras, m.models = t.Serves.LoRAs, t.Serves.Models
	}
	return m
}

func (v *routableView) home(w indexer.Worker) int {
	h := maphash.String(v.seed, w.ID) ^ uint64(w.DPRank)*0x9e3779b97f4a7c15
	return int(h & uint64(len(v.slots)-1))
}

// matchPosition returns the position in routable, the slice the view was built from, of the
// worker of m.
func (v *routableView) matchPosition(m *indexer.Match, routable []Target) (int, bool) {
	if m.Slot <= 0 || m.Slot > len(v.bySlot) {
		return v.position(m.Worker, routable)
	}
	c := &v.bySlot[m.Slot-1]
	if p := c.Load() - 1; p >= 0 && routable[p].Worker == m.Worker {
		return int(p), true
	}
	p, ok := v.position(m.Worker, routable)
	if ok {
		c.Store(int32(p + 1))
	}
	return p, ok
}

// position returns w's position in routable, the slice the view was built from.
func (v *routableView) position(w indexer.Worker, routable []Target) (int, bool) {
	if len(v.slots) == 0 {
		return 0, false
	}
	mask := len(v.slots) - 1
	for j, k := v.home(w), 0; k < len(v.slots); j, k = (j+1)&mask, k+1 {
		p := v.slots[j]
		if p == 0 {
			return 0, false
		}
		if routable[p-1].Worker == w {
			return int(p - 1), true
		}
	}
	return 0, false
}

// load returns the load of the target at position i through the cached counters, or through
// the router's LoadView when the view has none.
func (r *Router) load(v *routableView, i int, w indexer.Worker) Load {
	if v.counters == nil {
		return r.deps.Load.Load(w)
	}
	return v.counters[i].load()
}
