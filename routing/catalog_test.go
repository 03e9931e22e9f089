package routing

import (
	"context"
	"errors"
	"fmt"
	"testing"
)

// modelFleet: a and b serve "small" (declared), c serves "large" (learned, with an adapter),
// o declares nothing and has learned nothing.
func modelFleet(t *testing.T, open bool) *Registry {
	t.Helper()
	specs := []WorkerSpec{
		{ID: "a", URL: "http://127.0.0.1:1", Models: []string{"small"}},
		{ID: "b", URL: "http://127.0.0.1:2", Models: []string{"small"}, LoRAs: []string{"sql"}},
		{ID: "c", URL: "http://127.0.0.1:3"},
	}
	if open {
		specs = append(specs, WorkerSpec{ID: "o", URL: "http://127.0.0.1:4"})
	}
	reg, err := NewRegistry(specs)
	if err != nil {
		t.Fatal(err)
	}
	if changed, err := reg.SetLearned("c", []Model{{ID: "large"}, {ID: "large-chat", Parent: "large"}}); !changed || err != nil {
		t.Fatalf("SetLearned = %v, %v", changed, err)
	}
	return reg
}

func TestModelFilterSendsARequestOnlyToItsModelsWorkers(t *testing.T) {
	tests := []struct {
		name string
		open bool
		req  Request
		want map[string]bool
	}{
		{"declared model", false, Request{Model: "small", DPRank: -1}, map[string]bool{"a": true, "b": true}},
		{"learned model", false, Request{Model: "large", DPRank: -1}, map[string]bool{"c": true}},
		{"learned adapter", false, Request{Model: "large-chat", LoRA: "large-chat", DPRank: -1}, map[string]bool{"c": true}},
		{"declared adapter", false, Request{Model: "sql", LoRA: "sql", DPRank: -1}, map[string]bool{"b": true}},
		{"unknown model", false, Request{Model: "huge", DPRank: -1}, map[string]bool{}},
		{"no model: any", false, Request{DPRank: -1}, map[string]bool{"a": true, "b": true, "c": true}},
		{"a worker of unknown models takes any", true, Request{Model: "huge", DPRank: -1}, map[string]bool{"o": true}},
		{"and a known one", true, Request{Model: "large", DPRank: -1}, map[string]bool{"c": true, "o": true}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			reg := modelFleet(t, tc.open)
			if got := eligibleTargets(reg, &tc.req); fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("eligible = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestCatalogIsTheFleetsModels(t *testing.T) {
	reg := modelFleet(t, false)
	reg.SetHealthy("a", false, "down")
	cat := reg.Catalog()
	tests := []struct {
		model           string
		known, adapter  bool
		label           string
		workers, routed int
		parent          string
	}{
		{"small", true, false, "small", 2, 1, ""},
		{"large", true, false, "large", 1, 1, ""},
		{"large-chat", true, true, "large-chat", 1, 1, "large"},
		{"sql", true, true, "sql", 1, 1, "small"},
		{"huge", false, false, OtherModel, 0, 0, ""},
	}
	for _, tc := range tests {
		t.Run(tc.model, func(t *testing.T) {
			m, _ := cat.Lookup(tc.model)
			if cat.Known(tc.model) != tc.known || cat.Adapter(tc.model) != tc.adapter || cat.Label(tc.model) != tc.label ||
				m.Workers != tc.workers || m.Routable != tc.routed || m.Parent != tc.parent {
				t.Fatalf("known %v adapter %v label %q entry %+v; want %+v", cat.Known(tc.model), cat.Adapter(tc.model), cat.Label(tc.model), m, tc)
			}
		})
	}
	if open := modelFleet(t, true).Catalog(); !open.Known("huge") || open.Label("huge") != OtherModel {
		t.Fatalf("a fleet with a worker of unknown models: Known(huge) = %v, label %q", open.Known("huge"), open.Label("huge"))
	}
}

func TestBadModelNamesChangeNothing(t *testing.T) {
	reg := modelFleet(t, false)
	long := make([]Model, MaxModels+1)
	for i := range long {
		long[i] = Model{ID: fmt.Sprint("m", i)}
	}
	for _, models := range [][]Model{{{ID: ""}}, {{ID: "a b"}}, {{ID: "x", Parent: "\n"}}, long} {
		if changed, err := reg.SetLearned("c", models); changed || err == nil {
			t.Fatalf("SetLearned(%.40v) = %v, %v; want an error", models, changed, err)
		}
	}
	if _, err := reg.SetLearned("nobody", []Model{{ID: "x"}}); err == nil {
		t.Fatal("SetLearned of an unknown worker: no error")
	}
	if !reg.Catalog().Known("large") || reg.Catalog().Known("x") {
		t.Fatal("a refused learned set changed the catalog")
	}
	if _, err := NewRegistry([]WorkerSpec{{ID: "w", URL: "http://127.0.0.1:1", Models: []string{"bad name"}}}); err == nil {
		t.Fatal("a declared model with a space: no error")
	}
}

func TestSessionBoundToAnotherModelsWorkerIsRebound(t *testing.T) {
	reg := modelFleet(t, false)
	affinity := NewMemoryAffinity(0, 0)
	r, err := New(Config{}, Deps{Workers: reg, Tracker: NewTracker(), Affinity: affinity})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a := route(t, r, Request{Session: "s", Model: "large", PromptTokens: 16, DPRank: -1})
	old, err := a.Commit(ctx)
	a.Finish()
	if err != nil || old.Worker.ID != "c" {
		t.Fatalf("first turn bound %+v, %v; want c", old, err)
	}
	a = route(t, r, Request{Session: "s", Model: "small", PromptTokens: 16, DPRank: -1})
	d := a.Decision()
	if d.Bound || (d.Target.Worker.ID != "a" && d.Target.Worker.ID != "b") {
		t.Fatalf("a turn for another model: decision %+v, want a or b, unbound", d)
	}
	fresh, err := a.Commit(ctx)
	a.Finish()
	if err != nil || fresh.Revision <= old.Revision || fresh.Worker != d.Target.Worker {
		t.Fatalf("rebind = %+v, %v (old %+v)", fresh, err, old)
	}
}

func TestAliasSessionsKeepTheirTargetAndTheRestSplitByWeight(t *testing.T) {
	reg := modelFleet(t, false)
	affinity := NewMemoryAffinity(0, 0)
	r, err := New(Config{Seed: 7}, Deps{Workers: reg, Tracker: NewTracker(), Affinity: affinity})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	alias := func(small, large uint32) *Alias {
		return &Alias{Name: "any", Targets: []AliasTarget{{Model: "small", Weight: small}, {Model: "large", Weight: large}}}
	}
	servedBy := map[string]string{"a": "small", "b": "small", "c": "large"}
	const sessions, turns = 400, 3
	first := map[string]string{}
	counts := map[string]int{}
	for turn := range turns {
		for i := range sessions {
			al := alias(90, 10)
			if turn > 0 {
				al = alias(0, 1) // a weight change after the first turn: sessions keep theirs
			}
			s := fmt.Sprintf("s%d", i)
			a := route(t, r, Request{Session: s, Model: "any", Alias: al, PromptTokens: 16, DPRank: -1})
			b, err := a.Commit(ctx)
			a.Finish()
			d := a.Decision()
			if err != nil || servedBy[d.Target.Worker.ID] != d.Model || b.Model != d.Model {
				t.Fatalf("session %s turn %d: decision %+v binding %+v %v", s, turn, d, b, err)
			}
			if turn == 0 {
				first[s] = d.Model
				counts[d.Model]++
			} else if first[s] != d.Model {
				t.Fatalf("session %s moved from %s to %s at turn %d", s, first[s], d.Model, turn)
			}
		}
	}
	if share := float64(counts["small"]) / sessions; share < 0.85 || share > 0.95 {
		t.Fatalf("90/10 split gave %v", counts)
	}
	// Without a session every request draws: weight 0 is never drawn.
	for range 200 {
		a := route(t, r, Request{Model: "any", Alias: alias(0, 1), PromptTokens: 16, DPRank: -1})
		if d := a.Decision(); d.Model != "large" || d.Target.Worker.ID != "c" {
			t.Fatalf("sessionless draw: %+v", d)
		}
		a.Finish()
	}
}

func TestAFirstRequestThatLostTheBindingRaceTakesTheSessionsTarget(t *testing.T) {
	reg := modelFleet(t, false)
	// Another replica bound the session to c, serving large, for the same alias.
	store := elsewhere{bound: Binding{Session: "s", Worker: worker("c"), Revision: 9, Model: "large"}}
	r, err := New(Config{Seed: 3}, Deps{Workers: reg, Tracker: NewTracker(), Affinity: store})
	if err != nil {
		t.Fatal(err)
	}
	al := &Alias{Name: "any", Targets: []AliasTarget{{Model: "small", Weight: 1}, {Model: "large"}}}
	a := route(t, r, Request{Session: "s", Model: "any", Alias: al, PromptTokens: 16, DPRank: -1})
	if d := a.Decision(); d.Model != "small" {
		t.Fatalf("first choice %+v: want small, the only target of positive weight", d)
	}
	if _, err := a.Commit(context.Background()); !errors.Is(err, ErrBoundElsewhere) {
		t.Fatalf("commit: %v", err)
	}
	a.Finish()
	if d := a.Decision(); d.Model != "large" || d.Target.Worker.ID != "c" {
		t.Fatalf("after the race: %+v, want the session's target large on c", d)
	}
}
