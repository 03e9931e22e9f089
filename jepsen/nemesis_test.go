package jepsen

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestPlanIsReproducibleFromItsSeed(t *testing.T) {
	cfg := PlanConfig{Seed: 42, Kinds: nemesisKinds, Replicas: 5, Workers: 3, Duration: 10 * time.Minute, Warmup: 3 * time.Second, Cooldown: 8 * time.Second}
	a, err := Plan(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Plan(cfg)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed planned two different schedules")
	}
	cfg.Seed = 43
	c, _ := Plan(cfg)
	if reflect.DeepEqual(a, c) {
		t.Fatal("seeds 42 and 43 planned the same schedule")
	}
	// The kinds are given in another order: the plan must not depend on it.
	cfg.Seed = 42
	cfg.Kinds = []FaultKind{FaultWorker, FaultStale, FaultRestart, FaultDiscovery, FaultPartition, FaultStop, FaultKill}
	d, _ := Plan(cfg)
	if !reflect.DeepEqual(a, d) {
		t.Fatal("the order of --faults changed the schedule")
	}
}

func TestPlanHoldsEveryAskedKindAndFitsTheWindow(t *testing.T) {
	for seed := range int64(50) {
		cfg := PlanConfig{Seed: seed, Kinds: []FaultKind{FaultKill, FaultStop, FaultRestart}, Replicas: 3, Workers: 2,
			Duration: 2 * time.Minute, Warmup: 3 * time.Second, Cooldown: 8 * time.Second}
		steps, err := Plan(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var used time.Duration
		seen := map[FaultKind]bool{}
		for _, s := range steps {
			if !slices.Contains(cfg.Kinds, s.Kind) {
				t.Fatalf("seed %d planned %s, which was not asked for", seed, s.Kind)
			}
			lo, hi := holdRange(s.Kind)
			if s.Hold < lo || s.Hold >= hi || s.Gap < 2*time.Second || s.Index < 0 || s.Index >= cfg.Replicas {
				t.Fatalf("seed %d: step out of range: %+v", seed, s)
			}
			seen[s.Kind] = true
			used += s.Gap + s.Hold + recoveryEstimate
		}
		if len(seen) != len(cfg.Kinds) {
			t.Fatalf("seed %d planned kinds %v of %v", seed, seen, cfg.Kinds)
		}
		if window := cfg.Duration - cfg.Warmup - cfg.Cooldown; used > window {
			t.Fatalf("seed %d planned %s of faults into a %s window", seed, used, window)
		}
	}
}

func TestPlanRejectsBadInput(t *testing.T) {
	for _, cfg := range []PlanConfig{
		{Replicas: 0, Workers: 1, Kinds: []FaultKind{FaultKill}},
		{Replicas: 3, Workers: 0, Kinds: []FaultKind{FaultKill}},
		{Replicas: 3, Workers: 1, Kinds: []FaultKind{"meteor"}},
	} {
		if _, err := Plan(cfg); err == nil {
			t.Fatalf("planned %+v", cfg)
		}
	}
	if steps, err := Plan(PlanConfig{Replicas: 3, Workers: 1, Duration: time.Minute}); err != nil || len(steps) != 0 {
		t.Fatalf("no kinds: %v %v", steps, err)
	}
}

func TestParseFaults(t *testing.T) {
	cases := []struct {
		in   string
		want []FaultKind
		bad  bool
	}{
		{"kill,stop", []FaultKind{FaultKill, FaultStop}, false},
		{" stop , kill,kill ", []FaultKind{FaultKill, FaultStop}, false},
		{"all", []FaultKind{FaultDiscovery, FaultKill, FaultPartition, FaultRestart, FaultStale, FaultStop, FaultWorker}, false},
		{"discovery,kill", []FaultKind{FaultDiscovery, FaultKill}, false},
		{"", nil, false},
		{"kill,meteor", nil, true},
	}
	for _, tc := range cases {
		got, err := ParseFaults(tc.in)
		if (err != nil) != tc.bad || !slices.Equal(got, tc.want) {
			t.Fatalf("ParseFaults(%q) = %v, %v", tc.in, got, err)
		}
		if tc.bad && !strings.Contains(err.Error(), "meteor") {
			t.Fatalf("error does not name the bad kind: %v", err)
		}
	}
}

func TestPartitionSidesKeepAMajorityConnected(t *testing.T) {
	cases := []struct {
		mode     string
		n        int
		perm     []int
		leader   int
		cuts     int
		isolated []int
	}{
		{"minority", 3, []int{2, 0, 1}, 0, 2, []int{2}},
		{"minority", 5, []int{4, 1, 0, 2, 3}, 0, 6, []int{4, 1}},
		{"isolate-leader", 3, []int{0, 1, 2}, 1, 2, []int{1}},
		{"isolate-leader", 5, []int{0, 1, 2, 3, 4}, 3, 4, []int{3}},
		{"bridge", 3, []int{1, 0, 2}, 0, 1, nil},
		{"bridge", 5, []int{2, 0, 1, 3, 4}, 0, 4, nil},
	}
	for _, tc := range cases {
		cut, isolated, detail := partitionSides(Step{Mode: tc.mode, Perm: tc.perm}, tc.n, tc.leader)
		if len(cut) != tc.cuts || !slices.Equal(isolated, tc.isolated) || detail == "" {
			t.Fatalf("%s of %d: cut %v isolated %v (%s)", tc.mode, tc.n, cut, isolated, detail)
		}
		// Some replica still reaches a majority (itself included), so the cluster can serve.
		best := 0
		for x := range tc.n {
			reach := 1
			for y := range tc.n {
				if x != y && !slices.ContainsFunc(cut, func(c [2]int) bool { return c == [2]int{x, y} || c == [2]int{y, x} }) {
					reach++
				}
			}
			best = max(best, reach)
		}
		if best <= tc.n/2 {
			t.Fatalf("%s of %d leaves no majority: %v", tc.mode, tc.n, cut)
		}
		if tc.mode == "bridge" && slices.ContainsFunc(cut, func(c [2]int) bool { return c[0] == tc.perm[0] || c[1] == tc.perm[0] }) {
			t.Fatalf("the bridge r%d was cut: %v", tc.perm[0], cut)
		}
	}
}

func TestRebindRefusedAsGoneIsUnknownNotFailed(t *testing.T) {
	cases := []struct {
		name   string
		status int
		body   string
		want   Result
	}{
		{"the binding is gone (maybe by this very call, retried across a leader change)", 409,
			`{"error": "session \"c1-s57\" not invalidated: not found (current revision 0)"}`, ResultUnknown},
		{"the binding is another revision", 409, `{"error": "session \"s\" not invalidated: conflict (current revision 12)"}`, ResultFail},
		{"the replica had no binding to invalidate", 404, `{"error": "session \"s\" has no binding"}`, ResultFail},
		{"no leader", 503, `{"error": "not found (current revision 0)"}`, ResultFail},
		{"the replica stepped down and could not learn whether its entry committed", 503,
			`{"error": "the command's outcome is unknown (its leader stepped down before the entry committed; whether the next leader committed it was not learned in time): session bindings unavailable: entry 9 not applied here yet: context deadline exceeded"}`, ResultUnknown},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, msg := refusedRebind(tc.status, []byte(tc.body))
			if got != tc.want || !strings.Contains(msg, tc.body) {
				t.Fatalf("refusedRebind(%d, %s) = %v, %q; want %v with the answer quoted", tc.status, tc.body, got, msg, tc.want)
			}
		})
	}
}
