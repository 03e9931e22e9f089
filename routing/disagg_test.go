package routing

import (
	"context"
	"testing"
)

// pdRig is two prefill workers (p0, p1) and two decode workers (d0, d1).
func pdRig(t *testing.T, disagg DisaggConfig, prefill bool) *rig {
	t.Helper()
	var ws []WorkerSpec
	if prefill {
		ws = append(ws, WorkerSpec{ID: "p0", URL: "http://127.0.0.1:1", Role: RolePrefill}, WorkerSpec{ID: "p1", URL: "http://127.0.0.1:2", Role: RolePrefill})
	}
	ws = append(ws, WorkerSpec{ID: "d0", URL: "http://127.0.0.1:3", Role: RoleDecode}, WorkerSpec{ID: "d1", URL: "http://127.0.0.1:4", Role: RoleDecode})
	reg, err := NewRegistry(ws)
	if err != nil {
		t.Fatal(err)
	}
	rg := &rig{reg: reg, tracker: NewTracker(), index: newFakeIndex(), affinity: NewMemoryAffinity(0, 0)}
	rg.router, err = New(Config{Disagg: disagg}, Deps{Index: rg.index, Recorder: rg.index, Workers: reg, Tracker: rg.tracker, Affinity: rg.affinity})
	if err != nil {
		t.Fatal(err)
	}
	return rg
}

// TestPlanPrefillDecidesWhenToDisaggregate: each mode and threshold gives its outcome; a
// disaggregated request's prefill goes to a prefill worker with its load there, and its
// decode worker stops counting the prompt as prefill to do.
func TestPlanPrefillDecidesWhenToDisaggregate(t *testing.T) {
	const prompt = 2000 // tokens: 125 blocks
	cases := []struct {
		name    string
		disagg  DisaggConfig
		noP     bool
		cached  int // blocks of the prompt both decode workers hold
		target  bool
		pLoad   int64 // prefill tokens in flight on each prefill worker
		want    string
		uncache int
	}{
		{name: "conditional, all uncached", want: OutcomeDisaggregated, uncache: 2000},
		{name: "conditional, mostly cached where it decodes", cached: 100, want: OutcomeCached, uncache: 400},
		{name: "always, mostly cached", disagg: DisaggConfig{Mode: DisaggAlways}, cached: 100, want: OutcomeDisaggregated, uncache: 400},
		{name: "never", disagg: DisaggConfig{Mode: DisaggNever}, want: OutcomeNever, uncache: 2000},
		{name: "no prefill worker", noP: true, want: OutcomeNoPrefill, uncache: 2000},
		{name: "explicit target", target: true, want: OutcomeTargeted, uncache: 2000},
		{name: "prefill queue over the limit", disagg: DisaggConfig{MaxPrefillQueueTokens: 1000}, pLoad: 1500, want: OutcomePrefillBusy, uncache: 2000},
		{name: "prefill queue under the limit", disagg: DisaggConfig{MaxPrefillQueueTokens: 1000}, pLoad: 500, want: OutcomeDisaggregated, uncache: 2000},
		{name: "lower threshold", disagg: DisaggConfig{MinUncachedTokens: 256}, cached: 100, want: OutcomeDisaggregated, uncache: 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rg := pdRig(t, tc.disagg, !tc.noP)
			hs := hashes(1, prompt/16)
			if tc.cached > 0 {
				rg.index.Record(worker("d0"), hs[:tc.cached])
				rg.index.Record(worker("d1"), hs[:tc.cached])
			}
			if tc.pLoad > 0 {
				defer rg.tracker.Start(worker("p0"), tc.pLoad, 0).Finish()
				defer rg.tracker.Start(worker("p1"), tc.pLoad, 0).Finish()
			}
			req := Request{PromptTokens: prompt, Hashes: hs, DPRank: -1}
			if tc.target {
				w := worker("d1")
				req.Target = &w
			}
			a, err := rg.router.Route(context.Background(), &req)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Finish()
			d := a.Decision().Target.Worker
			p, plan, err := a.PlanPrefill(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if plan.Outcome != tc.want || plan.Uncached != tc.uncache {
				t.Fatalf("plan %+v, want outcome %s with %d uncached", plan, tc.want, tc.uncache)
			}
			if tc.want != OutcomeDisaggregated {
				if p != nil {
					t.Fatal("an aggregated plan returned a prefill leg")
				}
				if got := rg.tracker.Load(d).PrefillTokens; got != int64(tc.uncache) {
					t.Fatalf("aggregated: the decode worker counts %d prefill tokens, want %d", got, tc.uncache)
				}
				return
			}
			pw := p.Decision().Target
			if pw.Spec.Role != RolePrefill {
				t.Fatalf("prefill leg went to %s (role %q)", pw.Worker, pw.Spec.Role)
			}
			if got := rg.tracker.Load(d).PrefillTokens; got != 0 {
				t.Fatalf("the decode worker still counts %d prefill tokens of a prompt it receives", got)
			}
			if got, want := rg.tracker.Load(pw.Worker).PrefillTokens, tc.pLoad+prompt; got != want {
				t.Fatalf("prefill worker load %d, want %d", got, want)
			}
			p.Finish()
			if got := rg.tracker.Load(pw.Worker).PrefillTokens; got != tc.pLoad {
				t.Fatalf("after the leg: prefill worker load %d, want %d", got, tc.pLoad)
			}
		})
	}
}

// TestPrefillLegIsChosenOnPrefillCost: the prefill worker holding the prefix wins though it
// has the larger decode load, and the session binds the decode worker, never the prefill one.
func TestPrefillLegIsChosenOnPrefillCost(t *testing.T) {
	rg := pdRig(t, DisaggConfig{Mode: DisaggAlways}, true)
	hs := hashes(1, 200)
	rg.index.Record(worker("p0"), hs[:150])
	busy := rg.tracker.Start(worker("p0"), 0, 5000)
	defer busy.Finish()
	ctx := context.Background()
	a, err := rg.router.Route(ctx, &Request{PromptTokens: 3200, Hashes: hs, Session: "s", DPRank: -1})
	if err != nil {
		t.Fatal(err)
	}
	p, _, err := a.PlanPrefill(ctx)
	if err != nil || p == nil {
		t.Fatalf("plan: %v %v", p, err)
	}
	if got := p.Decision().Target.Worker; got != worker("p0") {
		t.Fatalf("prefill leg on %s, want p0, which holds 150 of 200 blocks (its decode load is no prefill cost)", got)
	}
	if _, err := p.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	p.Finish()
	b, err := a.Commit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	a.Finish()
	if b.Worker != a.Decision().Target.Worker || (b.Worker.ID != "d0" && b.Worker.ID != "d1") {
		t.Fatalf("session bound to %s, want the decode worker %s", b.Worker, a.Decision().Target.Worker)
	}
	a2, err := rg.router.Route(ctx, &Request{PromptTokens: 3300, Hashes: hashes(1, 206), Session: "s", DPRank: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer a2.Finish()
	if !a2.Decision().Bound || a2.Decision().Target.Worker != b.Worker {
		t.Fatalf("follow-up turn went to %s (bound %v), want its decode worker %s", a2.Decision().Target.Worker, a2.Decision().Bound, b.Worker)
	}
}
