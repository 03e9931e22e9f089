package indexer

import "math/bits"

// probeStride is the distance between the first round's reads. Between two reads whose worker
// sets agree nothing more is looked up.
const probeStride = 64

// roundReads is the number of reads a round of cuts aims at, shared among the stretches being
// cut; each stretch gets at least one cut.
const roundReads = 8

// exactMax is the longest prompt FindMatches reads block by block: short prompts cost one
// round of lookups either way, and get exact answers whatever the holdings.
const exactMax = 32

// hintRounds is the last round that follows hints. A hint moves a stretch's start by as
// little as one block, so past this round only cuts, which halve every stretch, are made.
const hintRounds = 16

// maxRounds bounds the rounds: hintRounds, then enough halvings for any stretch between two
// first-round reads.
const maxRounds = hintRounds + 16

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
// looks inside every stretch whose end sets differ until each worker that drops out is pinned
// to the first block it lacks. Each block's slot carries a hint, written by the Store that
// last passed through it: where the next two changes of the worker set came along that Store's
// blocks. A stretch whose first block has a hint reads the blocks just before and at each
// predicted change; if the hint is right (the usual case when the blocks were stored and not
// evicted since) that pins both changes in one round with four reads. A stretch where a hint
// proved wrong, or predicted nothing, is cut into pieces instead, as many as the round's
// budget allows. A round's reads are independent and issued together, so the processor
// overlaps their cache misses.
//
// Hints only choose which blocks to read: the answer follows from the worker sets read, so a
// stale hint costs reads, never accuracy. When the prefix-closed assumption is broken (a worker
// misses a block between two reads whose worker sets agree) the hole goes unseen and the worker
// is credited with the blocks past it: the router overestimates that worker's overlap, which
// costs prefill time, never a wrong answer to the client. A hole at a block that is read is
// seen, and ends that worker's run there.
func (x *Index) FindMatches(seq []uint64, dst []Match) []Match {
	dst, _ = x.find(seq, dst)
	return dst
}

// cost is what one FindMatches read: blocks and rounds of reads, over all pages.
type cost struct {
	reads, rounds int
}

// find is FindMatches, also returning its cost for tests and benchmarks.
func (x *Index) find(seq []uint64, dst []Match) ([]Match, cost) {
	dst = dst[:0]
	if len(seq) == 0 {
		return dst, cost{}
	}
	ids := *x.byID.Load()
	if len(ids) == 0 {
		return dst, cost{}
	}
	sc, _ := x.scratch.Get().(*scratch)
	if sc == nil {
		sc = new(scratch)
	}
	sc.size(len(seq))
	s := search{x: x, seq: seq, ids: ids, dst: dst, sc: sc}
	for p := range (len(ids) + pageBits - 1) / pageBits {
		s.page = p
		s.run()
	}
	x.scratch.Put(sc)
	return s.dst, s.cost
}

// span is a stretch (lo, hi) of the prompt between two read blocks across which the alive set
// changes: in is the alive set at lo, and some of it is gone at hi. trust says lo's hint may
// be tried: it has not been yet, and no hint around it has proved stale. c1 and c2 are the
// changes lo's hint predicted, if the round follows it (0 if not); k is the number of the
// round's reads that are the span's own.
type span struct {
	in     uint64
	lo, hi int32
	c1, c2 int32
	k      int16
	trust  bool
}

// scratch is a lookup's working memory, pooled so lookups do not allocate.
type scratch struct {
	words []uint64   // words[i] is the page's worker set at block i, for the blocks marked in read
	hints []hint     // hints[i] is block i's hint, for the blocks marked in read
	read  []uint64   // bitmap of the blocks read
	batch []int      // the blocks of one round's reads
	reads []slotRead // the reads of the batch's blocks in flight
	spans []span     // the stretches still to look into
	next  []span
}

// size readies the scratch for a prompt of n blocks.
func (sc *scratch) size(n int) {
	if cap(sc.words) < n {
		sc.words = make([]uint64, n)
		sc.hints = make([]hint, n)
	}
	sc.words, sc.hints = sc.words[:n], sc.hints[:n]
	if w := (n + 63) / 64; cap(sc.read) < w {
		sc.read = make([]uint64, w)
	} else {
		sc.read = sc.read[:w]
	}
}

// search is one FindMatches over one page (64 worker ids) of the block sets.
type search struct {
	x    *Index
	seq  []uint64
	ids  []*workerState
	page int
	dst  []Match
	sc   *scratch
	sink uint64 // where reads put the words they start with, so the loads are not optimised away
	cost cost
}

// run finds, for every worker of the page that holds seq[0], where its run of blocks ends.
func (s *search) run() {
	n := len(s.seq)
	sc := s.sc
	words, hints := sc.words, sc.hints
	clear(sc.read)

	step := probeStride
	if n <= exactMax {
		step = 1
	}
	batch := sc.batch[:0]
	for p := 0; ; p = min(p+step, n-1) {
		batch = append(batch, p)
		if p == n-1 {
			break
		}
	}
	s.fill(batch)

	spans := sc.spans[:0]
	alive := words[0]
	for i := 1; i < len(batch) && alive != 0; i++ {
		lo, hi := batch[i-1], batch[i]
		b := words[hi] & alive
		if b != alive && hi-lo > 1 {
			spans = append(spans, span{in: alive, lo: int32(lo), hi: int32(hi), trust: true})
		}
		alive = b
	}

	next := sc.next[:0]
	for round := range maxRounds {
		if len(spans) == 0 {
			break
		}
		cuts := max(1, roundReads/len(spans))
		batch = batch[:0]
		for i := range spans {
			sp := &spans[i]
			lo, hi := int(sp.lo), int(sp.hi)
			before := len(batch)
			sp.c1, sp.c2 = 0, 0
			if h := hints[lo]; sp.trust && round < hintRounds && lo+h.first() <= hi {
				// Read the block before each predicted change, where the set should still be
				// what it was after the last change, and the change itself. The second
				// change only matters if more than one worker drops out in the span.
				c1, c2 := lo+h.first(), lo+h.second()
				batch = appendInside(batch, c1-1, lo, hi)
				batch = appendInside(batch, c1, lo, hi)
				sp.c1 = int32(c1)
				if h.second() < farHint && c2 <= hi && bits.OnesCount64(sp.in&^words[hi]) > 1 {
					batch = appendInside(batch, c2-1, c1, hi)
					batch = appendInside(batch, c2, c1, hi)
					sp.c2 = int32(c2)
				}
			} else {
				// No hint to follow, or one that says nothing changes here although something
				// does: the hints hereabouts are stale, so cut the stretch instead.
				sp.trust = false
				batch = appendCuts(batch, lo, hi, cuts)
			}
			sp.k = int16(len(batch) - before)
		}
		s.fill(batch)

		// Split every span at its reads, keeping the pieces the alive set changes across. A
		// piece that starts at a block read this round has a fresh hint to try, unless the
		// span's own hint proved stale (the set changed before a predicted change, or not at
		// one): the hints around it were most likely written by the same outdated Store. A
		// span that was cut passes its distrust on to every piece.
		next = next[:0]
		j := 0
		for _, sp := range spans {
			reads := batch[j : j+int(sp.k)]
			j += int(sp.k)
			trust := sp.trust && !hintFailed(words, reads, sp)
			cur, prev := sp.in, int(sp.lo)
			for _, m := range reads {
				if b := words[m] & cur; b != cur {
					if m-prev > 1 {
						next = append(next, span{in: cur, lo: int32(prev), hi: int32(m), trust: trust && prev != int(sp.lo)})
					}
					cur = b
				}
				prev = m
			}
			if b := words[sp.hi] & cur; b != cur && int(sp.hi)-prev > 1 {
				next = append(next, span{in: cur, lo: int32(prev), hi: sp.hi, trust: trust && prev != int(sp.lo)})
			}
		}
		spans, next = next, spans
	}
	sc.batch, sc.spans, sc.next = batch, spans, next

	// Every change of the alive set is now between neighbouring read blocks: walk the read
	// blocks in order and report each worker at the first one it lacks.
	alive = words[0]
	sc.read[0] &^= 1 // block 0 starts the walk
	for i, r := range sc.read {
		for r != 0 && alive != 0 {
			pos := i*64 + bits.TrailingZeros64(r)
			r &= r - 1
			if b := words[pos] & alive; b != alive {
				s.emit(alive&^b, pos)
				alive = b
			}
		}
		if alive == 0 {
			break
		}
	}
	if alive != 0 {
		s.emit(alive, n)
	}
}

// hintFailed reports whether the reads of a span that followed its hint contradict it: the
// alive set changed at a block just before a predicted change, or did not change at one.
func hintFailed(words []uint64, reads []int, sp span) bool {
	if sp.c1 == 0 {
		return false
	}
	cur := sp.in
	for _, m := range reads {
		b := words[m] & cur
		switch int32(m) { // a change predicted right after another is checked as a change
		case sp.c1, sp.c2:
			if b == cur {
				return true
			}
		case sp.c1 - 1, sp.c2 - 1:
			if b != cur {
				return true
			}
		}
		cur = b
	}
	return false
}

// appendInside appends p if it is strictly between lo and hi.
func appendInside(batch []int, p, lo, hi int) []int {
	if lo < p && p < hi {
		batch = append(batch, p)
	}
	return batch
}

// appendCuts appends the points that cut (lo, hi) into cuts+1 near-equal pieces, or every
// block inside it if it has no more than cuts.
func appendCuts(batch []int, lo, hi, cuts int) []int {
	gap := hi - lo
	if gap-1 <= cuts {
		for p := lo + 1; p < hi; p++ {
			batch = append(batch, p)
		}
		return batch
	}
	for j := 1; j <= cuts; j++ {
		batch = append(batch, lo+j*gap/(cuts+1))
	}
	return batch
}

// fill reads the page's worker sets and the hints of the blocks in batch into the scratch. It
// starts every read, which loads the block's home slot, before finishing any, so that the
// processor has all the cache misses in flight at once and the probes that follow find their
// slots cached.
func (s *search) fill(batch []int) {
	seq, shards := s.seq, &s.x.shards
	if cap(s.sc.reads) < len(batch) {
		s.sc.reads = make([]slotRead, len(batch), 2*len(batch))
	}
	reads := s.sc.reads[:len(batch)]
	var sink uint64
	for i, pos := range batch {
		key := normKey(seq[pos])
		sink ^= shards[shardOf(key)].start(key, &reads[i])
	}
	s.sink ^= sink
	s.cost.reads += len(batch)
	s.cost.rounds++
	words, hints, done := s.sc.words, s.sc.hints, s.sc.read
	for i, pos := range batch {
		words[pos], hints[pos] = reads[i].finish(normKey(seq[pos]), s.page)
		done[pos/64] |= 1 << (pos % 64)
	}
}

// emit appends a match of blocks leading blocks for every worker in set.
func (s *search) emit(set uint64, blocks int) {
	for set != 0 {
		id := s.page*pageBits + bits.TrailingZeros64(set)
		set &= set - 1
		if id < len(s.ids) && s.ids[id] != nil && !s.ids[id].removed.Load() {
			// Filled in place rather than appended as a literal, whose copy from the stack
			// stalls on store forwarding (see routing's selectWorker).
			s.dst = append(s.dst, Match{})
			m := &s.dst[len(s.dst)-1]
			m.Worker, m.Blocks, m.Slot = s.ids[id].w, blocks, id+1
		}
	}
}
