package benchreport

import (
	"runtime"
	"slices"
	"time"
)

// Timing is one microsecond-scale operation timed call by call, beside its noise floor: a
// fixed chain of multiplications (BenchmarkNoiseFloor's) calibrated to the operation's median
// (and re-calibrated after every round to that round's), timed in the same rounds,
// interleaved with it in blocks, so that both meet the same moods of a shared machine. Percentiles are in nanoseconds; Rounds rounds give the median and the best
// of each p99.
type Timing struct {
	Name   string `json:"name"`
	Rounds int    `json:"rounds"`
	// Calls is the operation's timed calls per round (the fewest of any round).
	Calls int `json:"calls_per_round"`

	P50       float64 `json:"p50_ns"`
	P90       float64 `json:"p90_ns"`
	P99       float64 `json:"p99_ns"`
	P99Best   float64 `json:"p99_best_ns"`
	P99Worst  float64 `json:"p99_worst_ns"`
	FloorIter int     `json:"floor_iterations"`
	FloorP50  float64 `json:"floor_p50_ns"`
	FloorP90  float64 `json:"floor_p90_ns"`
	FloorP99  float64 `json:"floor_p99_ns"`
	// FloorP99Best is the floor's best p99 over the rounds.
	FloorP99Best float64 `json:"floor_p99_best_ns"`
	// Neighbours is how busy the rest of the machine was during the rounds.
	Neighbours Neighbours `json:"neighbours"`
}

// measureOpts bound one Timing.
type measureOpts struct {
	rounds    int
	calls     int           // most timed calls of the operation per round
	roundTime time.Duration // most time per round
}

// block is how many calls in a row one side (the operation or the floor) gets before the
// other's turn: long enough for the code to be warm, short enough for both to share the
// machine's moods.
const block = 16

// floorSink keeps the floor's chain from being optimised away.
var floorSink uint64

// floorChain runs n steps of a 64-bit linear congruential generator: no memory traffic, no
// allocation, nothing shared, so whatever spread its latencies show is the machine's.
func floorChain(n int) {
	x := floorSink | 1
	for range n {
		x = x*6364136223846793005 + 1442695040888963407
	}
	floorSink = x
}

// calibrateFloor returns how many chain steps take about target.
func calibrateFloor(target time.Duration) int {
	// The fastest of a few long runs is the step's cost without interruptions.
	const probe = 200_000
	best := time.Duration(1 << 62)
	for range 5 {
		t0 := time.Now()
		floorChain(probe)
		best = min(best, time.Since(t0))
	}
	perStep := float64(best) / probe
	n := max(1, int(float64(target)/perStep))
	// One correction against the median of single calls, whose overhead (the clock reads)
	// the long runs do not show.
	lat := make([]time.Duration, 301)
	for i := range lat {
		t0 := time.Now()
		floorChain(n)
		lat[i] = time.Since(t0)
	}
	slices.Sort(lat)
	if med := lat[len(lat)/2]; med > 0 {
		n = max(1, int(float64(n)*float64(target)/float64(med)))
	}
	return n
}

// measure times op (after an untimed prep before each call, if any) as Timing says.
func measure(name string, o measureOpts, prep, op func()) Timing {
	if prep == nil {
		prep = func() {}
	}
	// Warm up, and find the median the floor is calibrated to.
	warm := make([]time.Duration, 0, 401)
	deadline := time.Now().Add(max(o.roundTime/4, 10*time.Millisecond))
	for len(warm) < cap(warm) && (len(warm) < 21 || time.Now().Before(deadline)) {
		prep()
		t0 := time.Now()
		op()
		warm = append(warm, time.Since(t0))
	}
	slices.Sort(warm)
	iters := calibrateFloor(warm[len(warm)/2])

	opLat := make([]time.Duration, 0, o.calls+block)
	flLat := make([]time.Duration, 0, o.calls+block)
	// interleave times blocks of the operation and of the floor in turns, at most calls of
	// each or until end.
	interleave := func(calls int, end time.Time) {
		opLat, flLat = opLat[:0], flLat[:0]
		for len(opLat) < calls && time.Now().Before(end) {
			for range block {
				prep()
				t0 := time.Now()
				op()
				opLat = append(opLat, time.Since(t0))
			}
			for range block {
				t0 := time.Now()
				floorChain(iters)
				flLat = append(flLat, time.Since(t0))
			}
		}
	}
	// The operation's median alone and beside the floor differ (what the other side leaves
	// in the caches, the clock's speed), so the floor's length is corrected twice against
	// the operation's median in interleaved passes like the rounds'.
	for range 2 {
		interleave(min(o.calls, 2000), time.Now().Add(max(o.roundTime/4, 10*time.Millisecond)))
		slices.Sort(opLat)
		slices.Sort(flLat)
		if fm := quantile(flLat, 0.5); fm > 0 {
			iters = max(1, int(float64(iters)*quantile(opLat, 0.5)/fm))
		}
	}

	t := Timing{Name: name, Rounds: o.rounds, Calls: o.calls}
	var p50s, p90s, p99s, f50s, f90s, f99s []float64
	cpu := readCPU()
	for range o.rounds {
		runtime.GC()
		interleave(o.calls, time.Now().Add(o.roundTime))
		t.Calls = min(t.Calls, len(opLat))
		slices.Sort(opLat)
		slices.Sort(flLat)
		p50s = append(p50s, quantile(opLat, 0.50))
		p90s = append(p90s, quantile(opLat, 0.90))
		p99s = append(p99s, quantile(opLat, 0.99))
		f50s = append(f50s, quantile(flLat, 0.50))
		f90s = append(f90s, quantile(flLat, 0.90))
		f99s = append(f99s, quantile(flLat, 0.99))
		// The operation's median drifts with the machine (a collector or a neighbour
		// finishing): the next round's floor follows this round's median.
		if fm := quantile(flLat, 0.5); fm > 0 {
			iters = max(1, int(float64(iters)*quantile(opLat, 0.5)/fm))
		}
	}
	t.Neighbours, t.FloorIter = cpu.since(), iters
	t.P50, t.P90, t.P99 = median(p50s), median(p90s), median(p99s)
	t.P99Best, t.P99Worst = slices.Min(p99s), slices.Max(p99s)
	t.FloorP50, t.FloorP90, t.FloorP99 = median(f50s), median(f90s), median(f99s)
	t.FloorP99Best = slices.Min(f99s)
	return t
}

// quantile is the nearest-rank quantile of sorted latencies, in ns.
func quantile(sorted []time.Duration, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := min(len(sorted)-1, max(0, int(q*float64(len(sorted)))))
	return float64(sorted[i].Nanoseconds())
}

// median is the median of xs (the lower middle for an even count); 0 for none.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[(len(s)-1)/2]
}
