// Package gcfloor keeps the garbage collector from running more often than a heap of a
// given size needs. Go collects when the heap has grown by GOGC percent over what the last
// collection left live; a router's live heap is often a few megabytes (its index is small
// until a fleet's events fill it) while every request allocates a kilobyte or two, so at
// tens of thousands of requests a second it collects several times a second, and marking,
// sweeping and scanning stacks take a sixth of its CPU. A floor raises GOGC while the live
// heap is small, so that the next collection comes only once the heap reaches the floor,
// and gives the configured GOGC back as soon as the live heap alone would reach it. The
// floor is garbage the process may hold between collections: its resident memory grows by
// up to the floor, and never past GOMEMLIMIT, which the runtime still enforces.
package gcfloor

import (
	"context"
	"math"
	"runtime/debug"
	"runtime/metrics"
	"time"
)

// maxPercent caps the GOGC the floor sets: a live heap of almost nothing must not make the
// percentage overflow or the goal jump with the first allocation.
const maxPercent = 100_000

// Percent is the GOGC that puts the next collection at floor bytes of heap for a live heap
// of live bytes, and never below base (the GOGC the process was given). A floor of 0 or
// less, or a base below 0 (GOGC=off), leaves base as it is.
func Percent(live, floor uint64, base int) int {
	if floor == 0 || base < 0 {
		return base
	}
	if live == 0 {
		live = 1
	}
	if live >= floor {
		return base
	}
	// The heap goal is live * (1 + GOGC/100).
	p := math.Ceil((float64(floor)/float64(live) - 1) * 100)
	if p > maxPercent {
		p = maxPercent
	}
	return max(base, int(p))
}

// Run keeps the floor until ctx ends, then gives the process its GOGC back. It sets GOGC at
// once from the live heap of the last collection, then again within pollEvery of the end of
// every collection (the runtime's cycle count says when one ended), so a live heap that grew
// keeps the raised percentage for a few milliseconds of allocation at most. A floor of 0
// returns at once.
func Run(ctx context.Context, floor uint64) {
	if floor == 0 {
		return
	}
	base := gogc()
	if base < 0 {
		return // GOGC=off: the operator runs the collector by GOMEMLIMIT alone
	}
	t := &tuner{floor: floor, base: base}
	t.sample[0].Name = "/gc/heap/live:bytes"
	t.sample[1].Name = "/gc/cycles/total:gc-cycles"
	t.adjust()
	defer debug.SetGCPercent(base)
	tick := time.NewTicker(pollEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			t.adjust()
		}
	}
}

// pollEvery is how often Run looks for a finished collection: one read of two runtime
// metrics, fifty times a second.
const pollEvery = 20 * time.Millisecond

// gogc is the collector's current GOGC (negative when off).
func gogc() int {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 100
	}
	v := s[0].Value.Uint64()
	if v > math.MaxInt32 {
		return -1
	}
	return int(v)
}

// tuner is one Run's state.
type tuner struct {
	floor  uint64
	base   int
	set    int    // the GOGC last set (0: none yet)
	cycles uint64 // the collections counted when it was set
	sample [2]metrics.Sample
}

// adjust sets GOGC for the live heap the last collection left, once per collection.
func (t *tuner) adjust() {
	metrics.Read(t.sample[:])
	if t.sample[0].Value.Kind() != metrics.KindUint64 || t.sample[1].Value.Kind() != metrics.KindUint64 {
		return
	}
	cycles := t.sample[1].Value.Uint64()
	if t.set != 0 && cycles == t.cycles {
		return // no collection since: the live heap is the one GOGC was set for
	}
	t.cycles = cycles
	if p := Percent(t.sample[0].Value.Uint64(), t.floor, t.base); p != t.set {
		debug.SetGCPercent(p)
		t.set = p
	}
}
