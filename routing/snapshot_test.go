package routing

import (
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// TestReusedIndexSlotsLandOnTheirOwnWorker routes through a real index whose worker slots are
// reused: once w1 is removed from the index, its slot goes to w2, and the view that cached the
// slot for w1 must credit w2's match to w2.
func TestReusedIndexSlotsLandOnTheirOwnWorker(t *testing.T) {
	reg, err := NewRegistry(specs(4))
	if err != nil {
		t.Fatal(err)
	}
	idx := indexer.New(indexer.Options{})
	tracker := NewTracker()
	for _, tg := range reg.Routable() {
		tracker.Start(tg.Worker, 0, 0).Finish() // so that no selection here changes the view
	}
	r, err := New(Config{}, Deps{Index: idx, Workers: reg, Tracker: tracker})
	if err != nil {
		t.Fatal(err)
	}
	prompt := hashes(1<<40, 48)
	idx.Store(worker("w0"), prompt[:1])
	idx.Store(worker("w1"), prompt)
	for _, want := range []string{"w1", "w2"} {
		if want == "w2" {
			idx.RemoveWorker(worker("w1"))
			idx.Store(worker("w2"), prompt) // takes w1's slot
		}
		a := route(t, r, Request{PromptTokens: 48*16 + 1, Hashes: prompt})
		d := a.Decision()
		a.Finish()
		if d.Target.Worker != worker(want) || d.Overlap != len(prompt) {
			t.Fatalf("went to %s with overlap %d, want %s with %d", d.Target.Worker, d.Overlap, want, len(prompt))
		}
	}
}

// TestViewSeesLoadOfWorkersTheTrackerMeetsLater builds the view before the tracker knows a
// worker, then loads that worker heavily: the next selection must see the load.
func TestViewSeesLoadOfWorkersTheTrackerMeetsLater(t *testing.T) {
	rg := newRig(t, 2, Config{})
	prefix := hashes(7, 10)
	rg.index.Record(worker("w1"), prefix)
	a := route(t, rg.router, Request{PromptTokens: 160, Hashes: prefix})
	if got := a.Decision().Target.Worker; got != worker("w1") {
		t.Fatalf("first request went to %s, want w1 (it holds the prefix)", got)
	}
	a.Finish()
	// w0 was never started, so the view holds no counters for it; this Start changes the
	// tracker's workers. w1 gets 100 blocks of prefill: w0 costs 2*10, w1 100+10.
	rg.tracker.Start(worker("w0"), 0, 0)
	rg.tracker.Start(worker("w1"), 100*16, 0)
	a = route(t, rg.router, Request{PromptTokens: 160, Hashes: prefix})
	if got := a.Decision().Target.Worker; got != worker("w0") {
		t.Fatalf("went to the loaded %s, want w0", got)
	}
}

// TestViewFollowsTheRoutableSet changes the routable set after a selection built the view,
// keeping its length: w2, holding the prefix and loaded, is drained and an idle w9 takes its
// position. The next selections must neither pick w2 nor read its load for w9.
func TestViewFollowsTheRoutableSet(t *testing.T) {
	rg := newRig(t, 3, Config{})
	prefix := hashes(9, 10)
	rg.index.Record(worker("w2"), prefix)
	for _, id := range []string{"w0", "w1"} {
		rg.tracker.Start(worker(id), 100*16, 0) // 100 blocks of prefill each
	}
	rg.tracker.Start(worker("w2"), 1000*16, 0)
	route(t, rg.router, Request{PromptTokens: 160, Hashes: prefix}).Finish()
	if err := rg.reg.Drain("w2"); err != nil {
		t.Fatal(err)
	}
	if err := rg.reg.Add(WorkerSpec{ID: "w9", URL: "http://127.0.0.1:9009"}); err != nil {
		t.Fatal(err)
	}
	a := route(t, rg.router, Request{PromptTokens: 160, Hashes: prefix})
	if got := a.Decision().Target.Worker; got != worker("w9") {
		t.Fatalf("went to %s, want the idle w9", got)
	}
}

// heavyLoad is a LoadView that reports one worker as heavily loaded.
type heavyLoad struct{ busy indexer.Worker }

func (h heavyLoad) Load(w indexer.Worker) Load {
	if w == h.busy {
		return Load{Requests: 50, PrefillTokens: 1 << 20}
	}
	return Load{}
}

// TestALoadViewOtherThanTheTrackerIsRead checks that selection reads a merged LoadView (one that
// is not the router's own Tracker) rather than the view's cached counters.
func TestALoadViewOtherThanTheTrackerIsRead(t *testing.T) {
	reg, err := NewRegistry(specs(2))
	if err != nil {
		t.Fatal(err)
	}
	index := newFakeIndex()
	prefix := hashes(11, 10)
	index.Record(worker("w0"), prefix)
	r, err := New(Config{}, Deps{Index: index, Workers: reg, Tracker: NewTracker(), Load: heavyLoad{busy: worker("w0")}})
	if err != nil {
		t.Fatal(err)
	}
	a := route(t, r, Request{PromptTokens: 160, Hashes: prefix})
	if got := a.Decision().Target.Worker; got != worker("w1") {
		t.Fatalf("went to %s, which the LoadView reports loaded; want w1", got)
	}
}
