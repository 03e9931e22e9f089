package routing

import (
	"fmt"
	"math"
	"sort"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"
)

// candidate is a target with what the policies weigh.
type candidate struct {
	target  *Target // in the routable slice, which is never modified
	overlap int
	load    Load
	pos     int // position in the routable slice
}

// policy picks one of cands (never empty) for req and returns its index.
type policy interface {
	choose(req *Request, promptBlocks int, cands []candidate, r *Router) int
}

// Policies lists the policy names New accepts.
func Policies() []string {
	names := make([]string, 0, 7)
	for n := range policyMakers {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

var policyMakers = map[string]func() policy{
	"kv":           func() policy { return kvPolicy{} },
	"round-robin":  func() policy { return &roundRobin{} },
	"random":       func() policy { return randomPolicy{} },
	"least-loaded": func() policy { return leastLoaded{} },
	"power-of-two": func() policy { return powerOfTwo{} },
	"session-hash": func() policy { return sessionHash{} },
	"cache-aware":  func() policy { return cacheAware{balanceAbs: 64, balanceRel: 1.5, cacheThreshold: 0.3} },
}

func newPolicy(name string) (policy, error) {
	if name == "" {
		name = "kv"
	}
	mk, ok := policyMakers[name]
	if !ok {
		return nil, fmt.Errorf("unknown policy %q (one of %v)", name, Policies())
	}
	return mk(), nil
}

// DefaultOverlapWeight is Config.OverlapWeight's default, chosen with the capacity sweep
// (routing/DESIGN.md, "Policies").
const DefaultOverlapWeight = 3

// kvPolicy is the reference router's cost model (DESIGN.md section 7), lower is better, with
// three corrections measured by the capacity sweep (routing/DESIGN.md, "Policies"): a prompt
// block the worker does not cache weighs OverlapWeight blocks of queued prefill, the request's
// own decode blocks are only those its worker does not already cache, and a worker's decode
// blocks weigh by how full its KV cache would be.
type kvPolicy struct{}

func (kvPolicy) choose(req *Request, promptBlocks int, cands []candidate, r *Router) int {
	bs := float64(r.cfg.BlockSize)
	pw, ow := r.cfg.PrefillWeight, r.cfg.OverlapWeight
	var costs [64]float64
	cost := costs[:0]
	if len(cands) > len(costs) {
		cost = make([]float64, 0, len(cands))
	}
	// A prefill leg is weighed on prefill alone: a prefill worker's decode load (its legs'
	// one token each) is not what delays the request.
	decodeWeight := 1.0
	if req.Role == RolePrefill {
		decodeWeight = 0
	}
	for i := range cands {
		c := &cands[i]
		uncached := float64(promptBlocks - c.overlap)
		prefill := float64(c.load.PrefillTokens)/bs + ow*uncached
		cost = append(cost, pw*prefill+decodeWeight*decodeCost(float64(c.load.DecodeBlocks)+uncached, c.target.Spec.CapacityBlocks))
	}
	if r.cfg.Temperature > 0 {
		return r.softmin(cost, r.cfg.Temperature)
	}
	return r.argminPreferring(cost, cands)
}

// decodeCost is what a worker's KV blocks in use, blocks of them with the request (its own
// uncached ones included), cost in the kv policy: the blocks themselves when the worker's
// capacity is not known, as the reference router weighs them, else the blocks times the
// share of the cache they fill. Blocks in use delay a first token only by crowding the cache
// (an engine with no free blocks queues or preempts); a worker a few percent full is not
// slower to prefill than an idle one, and weighing its blocks in full sent a conversation's
// next turn away from the worker holding its prefix whenever one other request ran there.
func decodeCost(blocks float64, capacity int) float64 {
	if capacity <= 0 {
		return blocks
	}
	return blocks * blocks / float64(capacity)
}

// argminPreferring is argmin where a tie in cost goes to the candidate with the longer
// overlap, then at random. Ties are common: a cached prompt's saved prefill is exactly what
// the request already occupying that worker costs while its prefill counts (for a
// non-streaming request, until its answer ends), so a duplicate costs on its worker what it
// costs on an idle one. Sending it where the prefix is keeps one copy in the fleet's caches.
func (r *Router) argminPreferring(cost []float64, cands []candidate) int {
	best, ties := 0, 1
	for i := 1; i < len(cost); i++ {
		switch {
		case cost[i] < cost[best] || cost[i] == cost[best] && cands[i].overlap > cands[best].overlap:
			best, ties = i, 1
		case cost[i] == cost[best] && cands[i].overlap == cands[best].overlap:
			ties++
			if r.intn(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// argmin returns the index of the smallest value, ties broken at random.
func (r *Router) argmin(vals []float64) int {
	best, ties := 0, 1
	for i := 1; i < len(vals); i++ {
		switch {
		case vals[i] < vals[best]:
			best, ties = i, 1
		case vals[i] == vals[best]:
			// Reservoir sampling over the ties keeps the choice uniform in one pass.
			ties++
			if r.intn(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// softmin samples an index with probability proportional to exp(-normalised cost / t).
func (r *Router) softmin(cost []float64, t float64) int {
	lo, hi := cost[0], cost[0]
	for _, c := range cost {
		lo, hi = math.Min(lo, c), math.Max(hi, c)
	}
	if hi == lo {
		return r.intn(len(cost))
	}
	var sum float64
	w := make([]float64, len(cost))
	for i, c := range cost {
		w[i] = math.Exp(-((c - lo) / (hi - lo)) / t)
		sum += w[i]
	}
	x := r.float64() * sum
	for i, v := range w {
		if x < v {
			return i
		}
		x -= v
	}
	return len(w) - 1
}

type roundRobin struct{ next atomic.Uint64 }

func (p *roundRobin) choose(_ *Request, _ int, cands []candidate, _ *Router) int {
	return int((p.next.Add(1) - 1) % uint64(len(cands)))
}

type randomPolicy struct{}

func (randomPolicy) choose(_ *Request, _ int, cands []candidate, r *Router) int {
	return r.intn(len(cands))
}

type leastLoaded struct{}

func (leastLoaded) choose(_ *Request, _ int, cands []candidate, r *Router) int {
	var buf [64]float64
	v := buf[:0]
	for _, c := range cands {
		v = append(v, float64(c.load.Requests))
	}
	return r.argmin(v)
}

type powerOfTwo struct{}

func (powerOfTwo) choose(_ *Request, _ int, cands []candidate, r *Router) int {
	if len(cands) == 1 {
		return 0
	}
	a := r.intn(len(cands))
	b := r.intn(len(cands) - 1)
	if b >= a {
		b++
	}
	if cands[b].load.Requests < cands[a].load.Requests {
		return b
	}
	return a
}

// sessionHash places a key by rendezvous hashing: every replica computes the same worker for a
// session without shared state, and removing a worker moves only its own sessions.
type sessionHash struct{}

func (sessionHash) choose(req *Request, _ int, cands []candidate, _ *Router) int {
	key := req.Session
	if key == "" && len(req.Hashes) > 0 {
		return rendezvous(req.Hashes[0], cands)
	}
	return rendezvous(xxhash.Sum64String(key), cands)
}

func rendezvous(key uint64, cands []candidate) int {
	best, bestScore := 0, uint64(0)
	for i, c := range cands {
		s := xxhash.Sum64String(c.target.Worker.ID) ^ key
		s ^= uint64(c.target.Worker.DPRank) * 0x9e3779b97f4a7c15
		s = mix64(s)
		if i == 0 || s > bestScore {
			best, bestScore = i, s
		}
	}
	return best
}

// mix64 is a 64-bit finaliser (splitmix64's) so nearby inputs land far apart.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// cacheAware is SGLang's cache-aware policy: while the load is balanced, go where the prefix
// is (if enough of it matches) or else to the worker with the least cached; once it is
// imbalanced, go to the least loaded.
type cacheAware struct {
	balanceAbs     int64
	balanceRel     float64
	cacheThreshold float64
}

func (p cacheAware) choose(req *Request, promptBlocks int, cands []candidate, r *Router) int {
	lo, hi := cands[0].load.Requests, cands[0].load.Requests
	for _, c := range cands {
		lo, hi = min(lo, c.load.Requests), max(hi, c.load.Requests)
	}
	if hi-lo > p.balanceAbs && float64(hi) > float64(lo)*p.balanceRel {
		return leastLoaded{}.choose(req, promptBlocks, cands, r)
	}
	best := 0
	for i, c := range cands {
		if c.overlap > cands[best].overlap {
			best = i
		}
	}
	if promptBlocks > 0 && float64(cands[best].overlap)/float64(promptBlocks) > p.cacheThreshold {
		return best
	}
	// SGLang sends a low-match request to the worker with the smallest tree, the one with
	// the most room; without an index-size view here the least-loaded worker stands in.
	if sizer, ok := r.deps.Index.(interface {
		Blocks(w workerKey) int
	}); ok {
		var buf [64]float64
		v := buf[:0]
		for _, c := range cands {
			v = append(v, float64(sizer.Blocks(c.target.Worker)))
		}
		return r.argmin(v)
	}
	return leastLoaded{}.choose(req, promptBlocks, cands, r)
}
