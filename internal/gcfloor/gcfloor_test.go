package gcfloor

import (
	"context"
	"fmt"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

func TestPercent(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		name        string
		live, floor uint64
		base, want  int
	}{
		{"no floor", 4 * mib, 0, 100, 100},
		{"GOGC off", 4 * mib, 64 * mib, -1, -1},
		{"small heap: the goal is the floor", 4 * mib, 64 * mib, 100, 1500},
		{"heap at half the floor", 32 * mib, 64 * mib, 100, 100},
		{"heap past the floor", 100 * mib, 64 * mib, 100, 100},
		{"a higher GOGC stays", 16 * mib, 64 * mib, 400, 400},
		{"nothing live is capped", 0, 64 * mib, 100, maxPercent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Percent(tc.live, tc.floor, tc.base); got != tc.want {
				t.Errorf("Percent(%d, %d, %d) = %d, want %d", tc.live, tc.floor, tc.base, got, tc.want)
			}
		})
	}
}

// heapGoal is the runtime's current heap goal.
func heapGoal() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/goal:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

func TestRunFollowsTheLiveHeapAndGivesGOGCBack(t *testing.T) {
	base := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(base) })
	runtime.GC()
	const floor = 96 << 20
	if g := heapGoal(); g >= floor/2 {
		t.Fatalf("heap goal %d before the floor is set: the test needs a smaller heap", g)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		Run(ctx, floor)
	}()
	goal := func(what string, ok func(g uint64) bool) {
		t.Helper()
		poll.Until(t, 10*time.Second, func() error {
			if g := heapGoal(); !ok(g) {
				return fmt.Errorf("%s: heap goal %d (GOGC %d, floor %d)", what, g, gogc(), uint64(floor))
			}
			return nil
		})
	}
	// A small live heap: the goal is the floor, set at once and kept past a collection.
	goal("small heap", func(g uint64) bool { return g >= floor*9/10 })
	runtime.GC()
	goal("small heap after a collection", func(g uint64) bool { return g >= floor*9/10 })

	// A live heap of two thirds of the floor: the next collection gives GOGC back, so the
	// goal is twice the live heap, not the small heap's percentage over it.
	held := make([]byte, 64<<20)
	runtime.GC()
	goal("large heap", func(g uint64) bool { return gogc() == 100 && g < 3*uint64(len(held)) })
	runtime.KeepAlive(held)
	held = nil
	runtime.GC()
	goal("small heap again", func(g uint64) bool { return g >= floor*9/10 })

	cancel()
	<-done
	if got := gogc(); got != 100 {
		t.Errorf("GOGC after Run returned = %d, want 100 back", got)
	}
	if g := heapGoal(); g >= floor/2 {
		t.Errorf("heap goal after Run returned = %d, want the small heap's again", g)
	}
}
