package indexer

import "math/bits"

// probeStride is the distance between the first round's probes. Between two probes whose
// worker sets agree nothing more is looked up.
const probeStride = 64

// maxFanout is the most pieces a refinement round cuts one stretch into; roundReads is the
// number of reads a round aims at, shared among the stretches whose ends differ.
const (
	maxFanout  = 16
	roundReads = 8
)

// exactMax is the longest prompt FindMatches reads block by block: short prompts cost one
// round of lookups either way, and get exact answers whatever the holdings.
const exactMax = 32

// maxRounds bounds the refinement rounds; each at least halves the widest changed stretch, so
// no prompt that fits in memory needs more.
const maxRounds = 64

// FindMatches appends to dst[:0] one Match per worker holding seq[0], with the number of
// leading blocks of seq it holds, and returns it. Workers holding no leading block are absent;
// the order is unspecified. It does not allocate when dst has room for the matches (once the
// Index's first lookups have sized the pooled scratch memory).
//
// A prompt of up to 32 blocks is read block by block, exactly. A longer one is not: the lookup
// relies on each worker's holdings of a prompt being prefix-closed, a worker holding block i
// also holding blocks 0..i-1. That holds in practice because a block's key names its whole
// prefix, engines evict leaf blocks first, and this index queues a Store's blocks leaf-first
// for its cap. Under that assumption the set of workers holding block i only shrinks as i
// grows, so the lookup reads block 0, every 64th block and the last block, then in rounds
// cuts every stretch whose end sets differ and reads the cut points, until each worker that
// drops out is pinned to the first block it lacks. A round's reads are independent and issued
// together, so the processor overlaps their cache misses; few changed stretches are cut finely
// (fewer rounds), many are bisected (fewer reads). For 512 blocks: 9 reads when every holder
// holds the whole prompt, about 23 when one worker drops out, 51 for 8, 230 for 64.
//
// When the assumption is broken (a worker misses a block between two reads whose worker sets
// agree) the hole goes unseen and the worker is credited with the blocks past it: the router
// overestimates that worker's overlap, which costs prefill time, never a wrong answer to the
// client. A hole at a block that is read is seen, and ends that worker's run there.
func (x *Index) FindMatches(seq []uint64, dst []Match) []Match {
	dst = dst[:0]
	if len(seq) == 0 {
		return dst
	}
	ids := *x.byID.Load()
	if len(ids) == 0 {
		return dst
	}
	sc, _ := x.scratch.Get().(*scratch)
	if sc == nil {
		sc = new(scratch)
	}
	s := search{x: x, seq: seq, ids: ids, dst: dst, sc: sc}
	for p := range (len(ids) + pageBits - 1) / pageBits {
		s.page = p
		s.run()
	}
	x.scratch.Put(sc)
	return s.dst
}

// point is a block position and the page's worker set there.
type point struct {
	pos  int
	word uint64
}

// scratch is a lookup's working memory, pooled so lookups do not allocate.
type scratch struct {
	pts, next []point
	fresh     []int // indexes into next of the points whose words are still to be read
}

// search is one FindMatches over one page (64 worker ids) of the block sets.
type search struct {
	x    *Index
	seq  []uint64
	ids  []*workerState
	page int
	dst  []Match
	sc   *scratch
	sink uint64 // where prefetches put what they load, so the loads are not optimised away
}

// run finds, for every worker of the page that holds seq[0], where its run of blocks ends.
func (s *search) run() {
	n := len(s.seq)
	sc := s.sc
	pts := sc.pts[:0]
	step := probeStride
	if n <= exactMax {
		step = 1
	}
	for p := 0; ; p = min(p+step, n-1) {
		pts = append(pts, point{pos: p})
		if p == n-1 {
			break
		}
	}
	s.fill(pts, nil)

	next, fresh := sc.next[:0], sc.fresh[:0]
	for range maxRounds {
		f := fanoutFor(changes(pts))
		if f == 0 {
			break
		}
		// Rebuild the points: cut every changed stretch, and drop the points inside runs
		// where the alive set stays the same, which later rounds and the answer never need.
		next, fresh = next[:0], fresh[:0]
		alive := pts[0].word
		last, lastChanged := pts[0], true
		for i := 1; i < len(pts) && alive != 0; i++ {
			b := pts[i].word & alive
			changed := b != alive
			if lastChanged || changed {
				next = append(next, last)
			}
			if lo, hi := last.pos, pts[i].pos; changed && hi-lo > 1 {
				// Cut (lo, hi) into f pieces, or read all of it if it is that short.
				gap := hi - lo
				for j := 1; j <= min(gap-1, f-1); j++ {
					pos := lo + j
					if gap > f {
						pos = lo + j*gap/f
					}
					fresh = append(fresh, len(next))
					next = append(next, point{pos: pos})
				}
			}
			last, lastChanged = pts[i], changed
			alive = b
		}
		next = append(next, last)
		s.fill(next, fresh)
		pts, next = next, pts
	}

	// Every change of the alive set is now between neighbouring blocks.
	alive := pts[0].word
	for i := 1; i < len(pts) && alive != 0; i++ {
		b := pts[i].word & alive
		s.emit(alive&^b, pts[i].pos)
		alive = b
	}
	if alive != 0 {
		s.emit(alive, n)
	}
	sc.pts, sc.next, sc.fresh = pts, next, fresh
}

// changes counts the stretches between neighbouring points of pts that the alive set changes
// across and that have blocks inside, up to where nobody is alive.
func changes(pts []point) int {
	c := 0
	alive := pts[0].word
	for i := 1; i < len(pts) && alive != 0; i++ {
		b := pts[i].word & alive
		if b != alive && pts[i].pos-pts[i-1].pos > 1 {
			c++
		}
		alive = b
	}
	return c
}

// fanoutFor picks how many pieces to cut each of c changed stretches into this round, 0 if
// there are none. A round costs one memory latency plus the processor time of its reads, so a
// few stretches are cut finely (fewer rounds) and many are bisected (fewer reads).
func fanoutFor(c int) int {
	if c == 0 {
		return 0
	}
	return max(2, min(maxFanout, roundReads/c+1))
}

// fill reads the worker sets of pts[i] for every i in which (all of pts if which is nil). It
// first touches every block's home slot in a loop without branches on the loaded data, so
// that the processor has all the cache misses in flight at once and the lookups that follow
// find their slots cached.
func (s *search) fill(pts []point, which []int) {
	var sink uint64
	if which == nil {
		for _, pt := range pts {
			key := normKey(s.seq[pt.pos])
			sink ^= s.x.shards[shardOf(key)].touch(key)
		}
		for i := range pts {
			pts[i].word = s.get(pts[i].pos)
		}
	} else {
		for _, i := range which {
			key := normKey(s.seq[pts[i].pos])
			sink ^= s.x.shards[shardOf(key)].touch(key)
		}
		for _, i := range which {
			pts[i].word = s.get(pts[i].pos)
		}
	}
	s.sink ^= sink
}

// get returns the page's worker set of block i.
func (s *search) get(i int) uint64 {
	key := normKey(s.seq[i])
	return s.x.shards[shardOf(key)].get(key, s.page)
}

// emit appends a match of blocks leading blocks for every worker in set.
func (s *search) emit(set uint64, blocks int) {
	for set != 0 {
		id := s.page*pageBits + bits.TrailingZeros64(set)
		set &= set - 1
		if id < len(s.ids) && s.ids[id] != nil && !s.ids[id].removed.Load() {
			s.dst = append(s.dst, Match{Worker: s.ids[id].w, Blocks: blocks})
		}
	}
}
