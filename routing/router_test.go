package routing

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

func route(t *testing.T, r *Router, req Request) *Attempt {
	t.Helper()
	if req.DPRank == 0 {
		req.DPRank = -1
	}
	a, err := r.Route(context.Background(), &req)
	if err != nil {
		t.Fatalf("route: %v", err)
	}
	return a
}

func TestKVPolicyPrefersTheWorkerHoldingThePrefix(t *testing.T) {
	rg := newRig(t, 4, Config{})
	prefix := hashes(100, 32)
	rg.index.Record(worker("w2"), prefix)
	for i := range 20 {
		req := Request{PromptTokens: 40 * 16, Hashes: append(append([]uint64{}, prefix...), hashes(uint64(1000*(i+1)), 8)...)}
		a := route(t, rg.router, req)
		if got := a.Decision().Target.Worker; got != worker("w2") {
			t.Fatalf("request %d went to %s, want w2", i, got)
		}
		if a.Decision().Overlap != 32 {
			t.Fatalf("overlap = %d, want 32", a.Decision().Overlap)
		}
		a.Finish()
	}
}

func TestKVPolicySpreadsDistinctPromptsByLoad(t *testing.T) {
	rg := newRig(t, 4, Config{})
	counts := map[string]int{}
	var open []*Attempt
	for i := range 40 {
		a := route(t, rg.router, Request{PromptTokens: 320, Hashes: hashes(uint64(i)<<20, 20)})
		counts[a.Decision().Target.Worker.ID]++
		open = append(open, a)
	}
	for _, a := range open {
		a.Finish()
	}
	for id, n := range counts {
		if n != 10 {
			t.Fatalf("distinct prompts in flight spread unevenly: %s got %d of 40 (%v)", id, n, counts)
		}
	}
	for w, l := range rg.tracker.Snapshot() {
		if l != (Load{}) {
			t.Fatalf("%s load %+v after all finished", w, l)
		}
	}
}

func TestKVCostWeighsOverlapAgainstLoad(t *testing.T) {
	rg := newRig(t, 2, Config{})
	prefix := hashes(1, 10)
	rg.index.Record(worker("w0"), prefix)
	// w0 holds 10 blocks, but carries 100 blocks of prefill work: the cost model sends the
	// request to the idle w1 (cost 2*10=20) rather than w0 (100+0+10=110).
	rg.tracker.Start(worker("w0"), 100*16, 0)
	a := route(t, rg.router, Request{PromptTokens: 160, Hashes: prefix})
	if got := a.Decision().Target.Worker; got != worker("w1") {
		t.Fatalf("went to %s, want the idle w1", got)
	}
}

func TestPolicies(t *testing.T) {
	tests := []struct {
		policy string
		check  func(t *testing.T, picks []string)
	}{
		{"round-robin", func(t *testing.T, picks []string) {
			for i, p := range picks {
				if p != picks[i%4] {
					t.Fatalf("round-robin broke its cycle at %d: %v", i, picks)
				}
			}
			seen := map[string]bool{}
			for _, p := range picks[:4] {
				seen[p] = true
			}
			if len(seen) != 4 {
				t.Fatalf("round-robin skipped a worker: %v", picks[:4])
			}
		}},
		{"session-hash", func(t *testing.T, picks []string) {
			for _, p := range picks {
				if p != picks[0] {
					t.Fatalf("one session key moved between workers: %v", picks)
				}
			}
		}},
		{"least-loaded", func(t *testing.T, picks []string) {
			seen := map[string]int{}
			for _, p := range picks[:4] {
				seen[p]++
			}
			if len(seen) != 4 {
				t.Fatalf("least-loaded doubled up while a worker was idle: %v", picks[:4])
			}
		}},
		{"random", func(t *testing.T, picks []string) {
			if len(picks) != 16 {
				t.Fatal("missing picks")
			}
		}},
		{"power-of-two", func(t *testing.T, picks []string) {
			seen := map[string]int{}
			for _, p := range picks {
				seen[p]++
			}
			for w, n := range seen {
				if n > 8 {
					t.Fatalf("power-of-two piled %d of 16 on %s", n, w)
				}
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.policy, func(t *testing.T) {
			rg := newRig(t, 4, Config{Policy: tc.policy, Seed: 7})
			var picks []string
			for i := range 16 {
				// Same "session key" for session-hash: the hash policy ignores affinity state.
				req := Request{PromptTokens: 64, Hashes: hashes(uint64(i)<<20, 4), DPRank: -1}
				if tc.policy == "session-hash" {
					req.Hashes = hashes(5, 4)
				}
				a := route(t, rg.router, req)
				picks = append(picks, a.Decision().Target.Worker.ID)
			}
			tc.check(t, picks)
		})
	}
}

func TestSessionHashMovesOnlyTheRemovedWorkersSessions(t *testing.T) {
	rg := newRig(t, 5, Config{Policy: "session-hash"})
	before := map[string]string{}
	for i := range 200 {
		key := fmt.Sprintf("s%d", i)
		d, _ := rg.router.selectWorker(context.Background(), &Request{Session: key, DPRank: -1}, nil, nil)
		before[key] = d.Target.Worker.ID
	}
	rg.reg.SetHealthy("w3", false, "test")
	for key, was := range before {
		d, _ := rg.router.selectWorker(context.Background(), &Request{Session: key, DPRank: -1}, nil, nil)
		if was != "w3" && d.Target.Worker.ID != was {
			t.Fatalf("session %s moved from %s to %s though %s is healthy", key, was, d.Target.Worker.ID, was)
		}
	}
}

func TestCacheAwareFollowsMatchUntilImbalanced(t *testing.T) {
	rg := newRig(t, 2, Config{Policy: "cache-aware"})
	prefix := hashes(1, 10)
	rg.index.Record(worker("w1"), prefix)
	a := route(t, rg.router, Request{PromptTokens: 160, Hashes: prefix})
	if a.Decision().Target.Worker != worker("w1") {
		t.Fatalf("balanced: went to %s, want the matching w1", a.Decision().Target.Worker)
	}
	a.Finish()
	for range 100 { // imbalance: w1 has 100 in flight, w0 none (100-0 > 64 and 100 > 0*1.5)
		rg.tracker.Start(worker("w1"), 0, 0)
	}
	a = route(t, rg.router, Request{PromptTokens: 160, Hashes: prefix})
	if a.Decision().Target.Worker != worker("w0") {
		t.Fatalf("imbalanced: went to %s, want the least loaded w0", a.Decision().Target.Worker)
	}
}

// eligibleTargets names the routable targets of reg that pass req's filters.
func eligibleTargets(reg *Registry, req *Request) map[string]bool {
	got := map[string]bool{}
	for _, tg := range reg.Routable() {
		if m := metaOf(&tg); eligible(req, &tg, &m, nil) {
			got[tg.Worker.String()] = true
		}
	}
	return got
}

func TestFiltersRoleLoRAAndRank(t *testing.T) {
	reg, err := NewRegistry([]WorkerSpec{
		{ID: "p", URL: "http://127.0.0.1:1", Role: RolePrefill},
		{ID: "d", URL: "http://127.0.0.1:2", Role: RoleDecode, DPSize: 2},
		{ID: "l", URL: "http://127.0.0.1:3", LoRAs: []string{"sql"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{}, Deps{Workers: reg, Tracker: NewTracker()})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		req  Request
		want map[string]bool
	}{
		{"aggregated skips prefill-only", Request{DPRank: -1}, map[string]bool{"d": true, "d/1": true, "l": true}},
		{"prefill leg: prefill-only workers", Request{Role: RolePrefill, DPRank: -1}, map[string]bool{"p": true}},
		{"decode leg: decode and aggregated workers", Request{Role: RoleDecode, DPRank: -1}, map[string]bool{"d": true, "d/1": true, "l": true}},
		{"lora", Request{LoRA: "sql", DPRank: -1}, map[string]bool{"l": true}},
		{"rank 1", Request{DPRank: 1}, map[string]bool{"d/1": true}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := eligibleTargets(reg, &tc.req); fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Fatalf("eligible = %v, want %v", got, tc.want)
			}
		})
	}
	if _, err := r.Route(context.Background(), &Request{LoRA: "nope", DPRank: -1}); !errors.Is(err, ErrNoWorker) {
		t.Fatalf("no eligible worker: err = %v, want ErrNoWorker", err)
	}
}

func TestAllBusyWaitsThenAnswersBusy(t *testing.T) {
	rg := newRig(t, 1, Config{BusyPrefillTokens: 100, QueueWait: 50 * time.Millisecond})
	hold := route(t, rg.router, Request{PromptTokens: 1000})
	if _, err := rg.router.Route(context.Background(), &Request{PromptTokens: 10, DPRank: -1}); !errors.Is(err, ErrBusy) {
		t.Fatalf("err = %v, want ErrBusy", err)
	}
	// A waiting request proceeds as soon as load is released.
	rg.router.cfg.QueueWait = time.Minute
	done := make(chan error, 1)
	go func() {
		a, err := rg.router.Route(context.Background(), &Request{PromptTokens: 10, DPRank: -1})
		if err == nil {
			a.Finish()
		}
		done <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for rg.router.queued.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	hold.FirstToken()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("queued request: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("queued request never proceeded after load was released")
	}
}

func TestBoundSessionStaysOnItsWorker(t *testing.T) {
	rg := newRig(t, 4, Config{})
	ctx := context.Background()
	a := route(t, rg.router, Request{Session: "chat-1", PromptTokens: 32, Hashes: hashes(1, 2)})
	b, err := a.Commit(ctx)
	if err != nil || b.Revision == 0 {
		t.Fatalf("commit = %+v, %v", b, err)
	}
	a.Finish()
	for i := range 10 {
		// Different prompts, busy elsewhere: a bound session ignores both.
		a := route(t, rg.router, Request{Session: "chat-1", PromptTokens: 32, Hashes: hashes(uint64(i)<<30, 2)})
		d := a.Decision()
		if d.Target.Worker != b.Worker || !d.Bound || d.Binding != b {
			t.Fatalf("request %d: decision %+v, want bound to %+v", i, d, b)
		}
		a.Finish()
	}
}

func TestFailedBoundWorkerIsInvalidatedAndReselectedOnce(t *testing.T) {
	rg := newRig(t, 3, Config{})
	ctx := context.Background()
	a := route(t, rg.router, Request{Session: "s", PromptTokens: 16})
	old, _ := a.Commit(ctx)
	a.Finish()
	rg.reg.SetHealthy(old.Worker.ID, false, "down")
	a = route(t, rg.router, Request{Session: "s", PromptTokens: 16})
	d := a.Decision()
	if d.Bound || d.Target.Worker == old.Worker {
		t.Fatalf("decision %+v still on the failed worker", d)
	}
	fresh, err := a.Commit(ctx)
	if err != nil || fresh.Revision <= old.Revision || fresh.Worker != d.Target.Worker {
		t.Fatalf("rebind = %+v, %v (old %+v)", fresh, err, old)
	}
}

func TestANotReadyBoundWorkerKeepsItsBindingAndTakesNoNewChoice(t *testing.T) {
	for _, tc := range []struct {
		name   string
		commit bool // the request served elsewhere is accepted by its worker
	}{{name: "served elsewhere", commit: true}, {name: "abandoned elsewhere"}} {
		t.Run(tc.name, func(t *testing.T) {
			rg := newRig(t, 3, Config{})
			ctx := context.Background()
			a := route(t, rg.router, Request{Session: "s", PromptTokens: 16})
			b, _ := a.Commit(ctx)
			a.Finish()
			if err := rg.reg.SetNotReady(b.Worker.ID, true); err != nil {
				t.Fatal(err)
			}
			if !rg.reg.NotReady(b.Worker.ID) || rg.reg.NotReady("nobody") {
				t.Fatal("NotReady does not say what SetNotReady set")
			}
			for i := range 20 {
				n := route(t, rg.router, Request{Session: fmt.Sprintf("new-%d", i), PromptTokens: 16})
				if n.Decision().Target.Worker.ID == b.Worker.ID {
					t.Fatalf("new session %d chose the not ready worker", i)
				}
				n.Finish()
			}
			a = route(t, rg.router, Request{Session: "s", PromptTokens: 16})
			d := a.Decision()
			if d.Bound || d.Target.Worker == b.Worker || d.Binding.Revision != 0 {
				t.Fatalf("decision %+v for a session bound to the not ready worker", d)
			}
			if tc.commit {
				if got, err := a.Commit(ctx); err != nil || got.Revision != 0 {
					t.Fatalf("commit elsewhere = %+v, %v: want no binding made", got, err)
				}
			}
			a.Finish()
			if got, ok, _ := rg.affinity.Peek(ctx, "s"); !ok || got != b {
				t.Fatalf("binding after a request while not ready = %+v, %v; want %+v kept", got, ok, b)
			}
			if err := rg.reg.SetNotReady(b.Worker.ID, false); err != nil {
				t.Fatal(err)
			}
			a = route(t, rg.router, Request{Session: "s", PromptTokens: 16})
			if d := a.Decision(); !d.Bound || d.Target.Worker != b.Worker || d.Binding != b {
				t.Fatalf("decision %+v once ready again, want bound to %+v", d, b)
			}
			a.Finish()
		})
	}
}

func TestRetryBeforeFirstByteMovesAndRebinds(t *testing.T) {
	rg := newRig(t, 3, Config{MaxRetries: 2})
	ctx := context.Background()
	a := route(t, rg.router, Request{Session: "s", PromptTokens: 16})
	old, _ := a.Commit(ctx)
	a.Finish()
	a = route(t, rg.router, Request{Session: "s", PromptTokens: 16})
	if err := a.Retry(ctx, errors.New("connection refused")); err != nil {
		t.Fatal(err)
	}
	second := a.Decision().Target.Worker
	if second == old.Worker {
		t.Fatal("retry chose the failed worker again")
	}
	if _, ok, _ := rg.affinity.Peek(ctx, "s"); ok {
		t.Fatal("the failed worker's binding survived the retry")
	}
	if err := a.Retry(ctx, errors.New("500")); err != nil {
		t.Fatal(err)
	}
	third := a.Decision().Target.Worker
	if third == old.Worker || third == second {
		t.Fatalf("retries went %s -> %s -> %s", old.Worker, second, third)
	}
	if err := a.Retry(ctx, errors.New("500")); !errors.Is(err, ErrRetriesExhausted) {
		t.Fatalf("err = %v, want ErrRetriesExhausted", err)
	}
	for w, l := range rg.tracker.Snapshot() {
		if l != (Load{}) {
			t.Fatalf("%s still loaded %+v after retries ended", w, l)
		}
	}
	// The session is free for the next request.
	a = route(t, rg.router, Request{Session: "s", PromptTokens: 16})
	if a.Decision().Bound {
		t.Fatal("session should initialise afresh")
	}
}

func TestCancellationDuringSelectionKeepsTheBinding(t *testing.T) {
	rg := newRig(t, 1, Config{BusyPrefillTokens: 10, QueueWait: time.Minute})
	bg := context.Background()
	a := route(t, rg.router, Request{Session: "s", PromptTokens: 16})
	b, _ := a.Commit(bg)
	a.Finish()
	hold := route(t, rg.router, Request{PromptTokens: 1000}) // makes the only worker busy
	defer hold.Finish()
	// A request with no session waits in the queue; cancelling it gives a cancellation error.
	ctx, cancel := context.WithCancel(bg)
	done := make(chan error, 1)
	go func() {
		_, err := rg.router.Route(ctx, &Request{PromptTokens: 16, DPRank: -1})
		done <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for rg.router.queued.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want canceled", err)
	}
	// A request of the bound session cancelled before its selection gets a cancellation error,
	// and the binding stays, bound to the same worker (the reference router's test).
	ctx2, cancel2 := context.WithCancel(bg)
	cancel2()
	if _, err := rg.router.Route(ctx2, &Request{Session: "s", PromptTokens: 16, DPRank: -1}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled bound request: err = %v, want canceled", err)
	}
	if got, ok, _ := rg.affinity.Peek(bg, "s"); !ok || got != b {
		t.Fatalf("binding after cancellation = %+v ok=%v, want %+v", got, ok, b)
	}
}

func TestExplicitTargetRouting(t *testing.T) {
	rg := newRig(t, 3, Config{})
	ctx := context.Background()
	w2 := worker("w2")
	a := route(t, rg.router, Request{Session: "s", Target: &w2, PromptTokens: 16})
	if a.Decision().Target.Worker != w2 {
		t.Fatalf("explicit target ignored: %s", a.Decision().Target.Worker)
	}
	b, _ := a.Commit(ctx)
	a.Finish()
	if b.Worker != w2 {
		t.Fatalf("explicit target created binding %+v", b)
	}
	w1 := worker("w1")
	if _, err := rg.router.Route(ctx, &Request{Session: "s", Target: &w1, DPRank: -1}); !errors.Is(err, ErrTargetConflict) {
		t.Fatalf("err = %v, want ErrTargetConflict", err)
	}
	unknown := worker("nope")
	if _, err := rg.router.Route(ctx, &Request{Target: &unknown, DPRank: -1}); !errors.Is(err, ErrUnknownTarget) {
		t.Fatalf("err = %v, want ErrUnknownTarget", err)
	}
	// An explicit target does not retry elsewhere.
	a = route(t, rg.router, Request{Target: &w1, PromptTokens: 16})
	if err := a.Retry(ctx, errors.New("refused")); !errors.Is(err, ErrRetriesExhausted) {
		t.Fatalf("err = %v, want ErrRetriesExhausted", err)
	}
}

func TestQueryOnlyChangesNothing(t *testing.T) {
	rg := newRig(t, 3, Config{})
	ctx := context.Background()
	a := route(t, rg.router, Request{Session: "new", QueryOnly: true, PromptTokens: 16, Hashes: hashes(9, 1)})
	if _, err := a.Commit(ctx); err == nil {
		t.Fatal("a query-only attempt committed")
	}
	a.Finish()
	if _, ok, _ := rg.affinity.Peek(ctx, "new"); ok {
		t.Fatal("query-only created a binding")
	}
	if len(rg.tracker.Snapshot()) != 0 {
		t.Fatalf("query-only counted load: %v", rg.tracker.Snapshot())
	}
	if m := rg.index.FindMatches(hashes(9, 1), nil); len(m) != 0 {
		t.Fatalf("query-only recorded a decision: %v", m)
	}
	// It reports an existing binding.
	b := route(t, rg.router, Request{Session: "old", PromptTokens: 16})
	bind, _ := b.Commit(ctx)
	b.Finish()
	q := route(t, rg.router, Request{Session: "old", QueryOnly: true, PromptTokens: 16})
	if d := q.Decision(); !d.Bound || d.Binding != bind || d.Target.Worker != bind.Worker {
		t.Fatalf("query-only decision %+v, want bound %+v", d, bind)
	}
}

// TestDispatchRecordsTheDecision: the decision enters the index as the request is sent, not
// when the worker first answers (for a non-streaming request that is the end of generation,
// and its prompt must be visible to the selections meanwhile); a retry records where the
// request went next.
func TestDispatchRecordsTheDecision(t *testing.T) {
	rg := newRig(t, 2, Config{MaxRetries: 1})
	h := hashes(77, 4)
	a := route(t, rg.router, Request{PromptTokens: 64, Hashes: h})
	first := a.Decision().Target.Worker
	m := rg.index.FindMatches(h, nil)
	if len(m) != 1 || m[0].Worker != first || m[0].Blocks != 4 {
		t.Fatalf("matches once dispatched, before any answer = %v, want 4 blocks on %s", m, first)
	}
	if err := a.Retry(context.Background(), errors.New("connection refused")); err != nil {
		t.Fatal(err)
	}
	second := a.Decision().Target.Worker
	if second == first {
		t.Fatalf("the retry went to %s again", first)
	}
	a.Commit(context.Background())
	a.Finish()
	found := map[indexer.Worker]int{}
	for _, x := range rg.index.FindMatches(h, nil) {
		found[x.Worker] = x.Blocks
	}
	if found[second] != 4 {
		t.Fatalf("matches after the retry = %v, want 4 blocks on %s", found, second)
	}
}

// TestCompleteRecordsThePromptAgain: a request the worker finished is recorded once more
// (the worker's cache used its blocks last at the end, so the index's recency must too),
// once, and not after Finish, nor in the comparison modes that leave it out.
func TestCompleteRecordsThePromptAgain(t *testing.T) {
	tests := []struct {
		name                         string
		cfg                          Config
		dispatched, committed, ended int
		finishFirst                  bool
	}{
		{name: "at dispatch and at the end", dispatched: 1, committed: 1, ended: 2},
		{name: "Complete after Finish records nothing", dispatched: 1, committed: 1, ended: 1, finishFirst: true},
		{name: "dispatch only", cfg: Config{NoRefreshAtEnd: true}, dispatched: 1, committed: 1, ended: 1},
		{name: "at commit only", cfg: Config{RecordAtCommit: true}, dispatched: 0, committed: 1, ended: 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rg := newRig(t, 2, tc.cfg)
			a := route(t, rg.router, Request{PromptTokens: 64, Hashes: hashes(9, 4)})
			counts := func() int {
				rg.index.mu.Lock()
				defer rg.index.mu.Unlock()
				return rg.index.records
			}
			if got := counts(); got != tc.dispatched {
				t.Fatalf("records once dispatched = %d, want %d", got, tc.dispatched)
			}
			if _, err := a.Commit(context.Background()); err != nil {
				t.Fatal(err)
			}
			if got := counts(); got != tc.committed {
				t.Fatalf("records once committed = %d, want %d", got, tc.committed)
			}
			if tc.finishFirst {
				a.Finish()
			}
			a.Complete(0)
			a.Complete(0)
			a.Finish()
			if got := counts(); got != tc.ended {
				t.Fatalf("records at the end = %d, want %d", got, tc.ended)
			}
		})
	}
}

func TestOutputBlockCount(t *testing.T) {
	tests := []struct{ prompt, output, want int }{
		{64, 48, 3},
		{70, 10, 1}, // the prompt's 6 left-over tokens and 10 generated fill a block
		{70, 9, 0},
		{64, 0, 0},
		{64, -5, 0},
		{0, 1 << 30, maxOutputBlocks},
	}
	for _, tc := range tests {
		if got := outputBlockCount(tc.prompt, tc.output, 16); got != tc.want {
			t.Errorf("outputBlockCount(%d, %d, 16) = %d, want %d", tc.prompt, tc.output, got, tc.want)
		}
	}
}

// TestOutputBlocksLeaveThePromptAlone: without room of their own (a Scratch's), the
// stand-ins go into a new slice, never into the spare room of the request's own hashes
// (which the request may still read).
func TestOutputBlocksLeaveThePromptAlone(t *testing.T) {
	backing := []uint64{1, 2, 3, 0, 0}
	prompt := backing[:3]
	seq := outputBlocks(prompt, 48, 2, nil)
	if len(seq) != 5 || !slices.Equal(seq[:3], prompt) || backing[3] != 0 || backing[4] != 0 {
		t.Fatalf("seq %v, backing %v: want the prompt then 2 stand-ins, the backing untouched", seq, backing)
	}
	if again := outputBlocks(prompt, 48, 2, nil); !slices.Equal(again, seq) {
		t.Fatalf("the same prompt's stand-ins differ: %v then %v", seq, again)
	}
}

// TestGeneratedBlocksAreRecordedAfterThePrompt: Complete records stand-ins for the blocks of
// the generated tokens after the prompt; they take room but match no prompt, and the same
// prompt's stand-ins are the same blocks again.
func TestGeneratedBlocksAreRecordedAfterThePrompt(t *testing.T) {
	rg := newRig(t, 1, Config{})
	prompt := hashes(5, 4)
	held := func() int {
		rg.index.mu.Lock()
		defer rg.index.mu.Unlock()
		return len(rg.index.blocks)
	}
	for range 2 {
		a := route(t, rg.router, Request{PromptTokens: 70, Hashes: prompt})
		if _, err := a.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
		a.Complete(58) // (6 + 58) / 16 = 4 blocks
		a.Finish()
		if got := held(); got != 8 {
			t.Fatalf("blocks recorded = %d, want the prompt's 4 and 4 generated", got)
		}
	}
	longer := append(slices.Clone(prompt), hashes(100, 4)...)
	if m := rg.index.FindMatches(longer, nil); len(m) != 1 || m[0].Blocks != 4 {
		t.Fatalf("a longer prompt matches %v, want the 4 prompt blocks only", m)
	}
}

func TestTrackerAccounting(t *testing.T) {
	tr := NewTracker()
	w := indexer.Worker{ID: "w"}
	k := tr.Start(w, 100, 7)
	if got := tr.Load(w); got != (Load{Requests: 1, PrefillTokens: 100, DecodeBlocks: 7}) {
		t.Fatalf("after start: %+v", got)
	}
	k.FirstToken()
	k.FirstToken()
	if got := tr.Load(w); got != (Load{Requests: 1, DecodeBlocks: 7}) {
		t.Fatalf("after first token: %+v", got)
	}
	k.Finish()
	k.Finish()
	if got := tr.Load(w); got != (Load{}) {
		t.Fatalf("after finish: %+v", got)
	}
	k2 := tr.Start(w, 50, 3)
	k2.Finish() // cancelled before its first token
	if got := tr.Load(w); got != (Load{}) {
		t.Fatalf("after cancel: %+v", got)
	}
}

func TestRegistryValidatesAndExpandsRanks(t *testing.T) {
	bad := []WorkerSpec{
		{ID: "", URL: "http://x:1"},
		{ID: "a b", URL: "http://x:1"},
		{ID: "a/b", URL: "http://x:1"},
		{ID: "a", URL: "ftp://x"},
		{ID: "a", URL: "http://x:1", Role: "teacher"},
		{ID: "a", URL: "http://x:1", DPSize: -1},
		{ID: "a", URL: "http://x:1", DPSize: MaxDPSize + 1},
	}
	for _, s := range bad {
		if _, err := NewRegistry([]WorkerSpec{s}); err == nil {
			t.Errorf("spec %+v accepted", s)
		}
	}
	if _, err := NewRegistry([]WorkerSpec{{ID: "a", URL: "http://x:1"}, {ID: "a", URL: "http://x:2"}}); err == nil {
		t.Error("duplicate id accepted")
	}
	reg, err := NewRegistry([]WorkerSpec{{ID: "a", URL: "http://x:1", DPSize: 3}, {ID: "b", URL: "http://x:2"}})
	if err != nil {
		t.Fatal(err)
	}
	if n := len(reg.Routable()); n != 4 {
		t.Fatalf("routable = %d, want 4 (3 ranks + 1)", n)
	}
	reg.Drain("a")
	if n := len(reg.Routable()); n != 1 {
		t.Fatalf("after drain routable = %d, want 1", n)
	}
	if !reg.SetHealthy("b", false, "probe failed") || len(reg.Routable()) != 0 {
		t.Fatal("unhealthy worker still routable")
	}
	if reg.SetHealthy("b", false, "again") {
		t.Fatal("no-op health change reported as a change")
	}
	if err := reg.Remove("zzz"); !errors.Is(err, ErrUnknownTarget) {
		t.Fatalf("remove unknown: %v", err)
	}
}

func TestRetryDropsARacingBindingToATriedWorker(t *testing.T) {
	rg := newRig(t, 3, Config{MaxRetries: 2})
	ctx := context.Background()
	a := route(t, rg.router, Request{Session: "s", PromptTokens: 16})
	first, _ := a.Commit(ctx)
	a.Finish()
	a = route(t, rg.router, Request{Session: "s", PromptTokens: 16})
	// Our dispatch to the bound worker fails; meanwhile another request rebinds the session to
	// that same worker (it has not seen it fail).
	rg.affinity.Invalidate(ctx, "s", first.Revision)
	l, _ := rg.affinity.Acquire(ctx, "s", nil)
	rebound, _ := l.Commit(ctx, first.Worker, "")
	l.Release()
	if err := a.Retry(ctx, errors.New("refused")); err != nil {
		t.Fatal(err)
	}
	if got := a.Decision().Target.Worker; got == first.Worker {
		t.Fatalf("retry went back to %s, which this request saw fail", got)
	}
	if b, ok, _ := rg.affinity.Peek(ctx, "s"); ok && b.Revision == rebound.Revision {
		t.Fatal("the racing binding to the failed worker survived")
	}
}

// TestKVCostTieGoesToTheLongerOverlap: a duplicate of a prompt decoding on its worker costs
// there what it costs on an idle worker (the first's decode load equals the duplicate's
// saved prefill, at the default prefill weight); the tie goes to the worker holding the
// prefix, every time.
func TestKVCostTieGoesToTheLongerOverlap(t *testing.T) {
	rg := newRig(t, 4, Config{})
	h := hashes(91, 8)
	first := route(t, rg.router, Request{PromptTokens: 8 * 16, Hashes: h})
	defer first.Finish()
	first.FirstToken()
	for range 20 {
		a := route(t, rg.router, Request{PromptTokens: 8 * 16, Hashes: h})
		// 7 of the 8 blocks: the engine computes the last prompt token, so reports 112 tokens.
		if a.Decision().Target.Worker != first.Decision().Target.Worker || a.Decision().Overlap != 7 {
			t.Fatalf("duplicate went to %s (overlap %d), the first is on %s", a.Decision().Target.Worker, a.Decision().Overlap, first.Decision().Target.Worker)
		}
		a.Finish()
	}
}

// elsewhere is an affinity store whose every first request loses the race: another
// replica bound the session to bound first.
type elsewhere struct{ bound Binding }

func (e elsewhere) Acquire(context.Context, string, *indexer.Worker) (Lease, error) {
	return &elsewhereLease{bound: e.bound}, nil
}
func (e elsewhere) Peek(context.Context, string) (Binding, bool, error) { return Binding{}, false, nil }
func (e elsewhere) Invalidate(context.Context, string, uint64) error    { return nil }

type elsewhereLease struct{ bound Binding }

func (l *elsewhereLease) Binding() (Binding, bool) { return Binding{}, false }
func (l *elsewhereLease) Commit(context.Context, indexer.Worker, string) (Binding, error) {
	return l.bound, ErrBoundElsewhere
}
func (l *elsewhereLease) Reopen() bool               { return false }
func (l *elsewhereLease) Invalidate(context.Context) {}
func (l *elsewhereLease) Release()                   {}

// TestAMovedRequestPredictsTheBoundWorkersOverlap: a first request that lost the binding
// race moves to the worker the session is bound to, and the overlap it reports is that
// worker's (2 blocks), not the first choice's (4): otherwise every such move counted as a
// misprediction of the whole prompt.
func TestAMovedRequestPredictsTheBoundWorkersOverlap(t *testing.T) {
	rg := newRig(t, 4, Config{})
	h := hashes(500, 4)
	rg.index.Record(worker("w1"), h)
	rg.index.Record(worker("w3"), h[:2])
	router, err := New(Config{}, Deps{Index: rg.index, Recorder: rg.index, Workers: rg.reg, Tracker: rg.tracker,
		Affinity: elsewhere{bound: Binding{Session: "s", Worker: worker("w3"), Revision: 9}}})
	if err != nil {
		t.Fatal(err)
	}
	a := route(t, router, Request{Session: "s", PromptTokens: 65, Hashes: h})
	if d := a.Decision(); d.Target.Worker != worker("w1") || d.Overlap != 4 {
		t.Fatalf("first choice %s with %d blocks, want w1 with 4", d.Target.Worker, d.Overlap)
	}
	if _, err := a.Commit(context.Background()); !errors.Is(err, ErrBoundElsewhere) {
		t.Fatalf("commit: %v, want ErrBoundElsewhere", err)
	}
	defer a.Finish()
	if d := a.Decision(); d.Target.Worker != worker("w3") || d.Overlap != 2 {
		t.Fatalf("after the move: %s with %d blocks predicted, want w3 with 2", d.Target.Worker, d.Overlap)
	}
}

func TestSubsetNarrowsCandidatesAndRebindsOutsideIt(t *testing.T) {
	rg := newRig(t, 4, Config{})
	ctx := context.Background()
	only := func(ids ...string) func(Target) bool {
		return func(t Target) bool { return slices.Contains(ids, t.Worker.ID) }
	}
	for i := range 20 {
		a := route(t, rg.router, Request{PromptTokens: 16, Hashes: hashes(uint64(i)<<20, 1), Subset: only("w1", "w2")})
		if id := a.Decision().Target.Worker.ID; id != "w1" && id != "w2" {
			t.Fatalf("request %d went to %s, outside the subset", i, id)
		}
		a.Finish()
	}
	// A session bound outside the subset moves inside it, and stays bound there.
	a := route(t, rg.router, Request{Session: "s", PromptTokens: 16, Subset: only("w0")})
	old, err := a.Commit(ctx)
	if err != nil || old.Worker.ID != "w0" {
		t.Fatalf("bind = %+v, %v", old, err)
	}
	a.Finish()
	a = route(t, rg.router, Request{Session: "s", PromptTokens: 16, Subset: only("w3")})
	if d := a.Decision(); d.Target.Worker.ID != "w3" || d.Bound {
		t.Fatalf("decision %+v, want w3 unbound", d)
	}
	fresh, err := a.Commit(ctx)
	if err != nil || fresh.Worker.ID != "w3" || fresh.Revision <= old.Revision {
		t.Fatalf("rebind = %+v, %v (old %+v)", fresh, err, old)
	}
	a.Finish()
	if _, err := rg.router.Route(ctx, &Request{PromptTokens: 16, Subset: only("nobody")}); !errors.Is(err, ErrNoWorker) {
		t.Fatalf("empty subset: %v, want ErrNoWorker", err)
	}
}

// TestMoveAfterTheFirstByteRebindsWithoutSpendingRetries: a committed request whose answer
// broke off moves to a worker not tried yet, by a compare-and-set rebind to a higher revision,
// even with no retries allowed; once every worker was tried it fails.
func TestMoveAfterTheFirstByteRebindsWithoutSpendingRetries(t *testing.T) {
	rg := newRig(t, 2, Config{MaxRetries: -1}) // negative: none
	ctx := context.Background()
	a := route(t, rg.router, Request{Session: "s", PromptTokens: 16})
	first, err := a.Commit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Move(ctx, errors.New("stream broke off")); err != nil {
		t.Fatalf("move with MaxRetries 0: %v", err)
	}
	if w := a.Decision().Target.Worker; w == first.Worker {
		t.Fatalf("moved to the failed worker %s again", w)
	}
	a.Propose(ctx)
	second, err := a.Commit(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if second.Worker == first.Worker || second.Revision <= first.Revision {
		t.Fatalf("binding after the move %+v, want another worker at a revision above %+v", second, first)
	}
	if b, _, _ := rg.affinity.Peek(ctx, "s"); b != second {
		t.Fatalf("stored binding %+v, want %+v", b, second)
	}
	if err := a.Move(ctx, errors.New("broke off again")); err == nil {
		t.Fatal("moved with every worker tried")
	}
	a.Finish()
}

// TestRouteScratchKeepsTheAttemptInTheScratch: RouteScratch routes the scratch's request as
// Route does, its first Attempt in the scratch's memory and a later one in its own, so that
// an Attempt still in use is never overwritten.
func TestRouteScratchKeepsTheAttemptInTheScratch(t *testing.T) {
	rg := newRig(t, 4, Config{})
	prefix := hashes(100, 32)
	rg.index.Record(worker("w2"), prefix)
	var s Scratch
	s.Request = Request{PromptTokens: 40 * 16, Hashes: prefix, DPRank: -1}
	for i, wantInScratch := range []bool{true, false} {
		a, err := rg.router.RouteScratch(context.Background(), &s)
		if err != nil {
			t.Fatalf("route %d: %v", i, err)
		}
		if got := a.Decision().Target.Worker; got != worker("w2") || a.Decision().Overlap != 32 {
			t.Fatalf("route %d: %s with overlap %d, want w2 with 32", i, got, a.Decision().Overlap)
		}
		if inScratch := a == &s.attempt; inScratch != wantInScratch {
			t.Fatalf("route %d: attempt in the scratch %v, want %v", i, inScratch, wantInScratch)
		}
		a.Finish()
	}
}

// lastRecord is a DecisionRecorder that keeps the slice of its last Record call itself (a
// real recorder must not), to show which memory a record came from.
type lastRecord struct {
	mu  sync.Mutex
	seq []uint64
}

func (l *lastRecord) Record(_ indexer.Worker, seq []uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seq = seq
}

// TestScratchAttemptRecordsTheEndInItsRoom: the Scratch's own Attempt records the prompt and
// its answer's stand-ins from the scratch's key room, after the prompt's keys and leaving
// them as they are; a second Attempt of the same scratch (a retry) records from a slice of
// its own and never writes into the room.
func TestScratchAttemptRecordsTheEndInItsRoom(t *testing.T) {
	reg, err := NewRegistry(specs(2))
	if err != nil {
		t.Fatal(err)
	}
	rec := &lastRecord{}
	router, err := New(Config{}, Deps{Recorder: rec, Workers: reg, Tracker: NewTracker()})
	if err != nil {
		t.Fatal(err)
	}
	var s Scratch
	prompt := []uint64{5, 6, 7, 8}
	s.Request = Request{PromptTokens: 70, Hashes: append(s.Keys(), prompt...), DPRank: -1}
	want := outputBlocks(prompt, 70, 4, nil) // (6 + 58) / 16 = 4 stand-ins
	for i, wantRoom := range []bool{true, false} {
		a, err := router.RouteScratch(context.Background(), &s)
		if err != nil {
			t.Fatalf("route %d: %v", i, err)
		}
		if _, err := a.Commit(context.Background()); err != nil {
			t.Fatalf("commit %d: %v", i, err)
		}
		a.Complete(58)
		a.Finish()
		if !slices.Equal(rec.seq, want) {
			t.Fatalf("attempt %d recorded %v, want %v", i, rec.seq, want)
		}
		if inRoom := &rec.seq[0] == &s.keys[0]; inRoom != wantRoom {
			t.Fatalf("attempt %d recorded from the scratch's room %v, want %v", i, inRoom, wantRoom)
		}
		if !slices.Equal(s.Request.Hashes, prompt) {
			t.Fatalf("attempt %d left the prompt's keys %v, want %v", i, s.Request.Hashes, prompt)
		}
		clear(s.keys[len(prompt):]) // what the second attempt must leave alone
	}
	if tail := s.keys[len(prompt):]; slices.ContainsFunc(tail, func(k uint64) bool { return k != 0 }) {
		t.Fatalf("the retry wrote into the scratch's room: %v", tail)
	}
}

// TestOutputBlocksFitOrLeaveTheRoom: a sequence longer than the scratch's room, or a prompt
// whose keys are not at its start, records from a new slice.
func TestOutputBlocksFitOrLeaveTheRoom(t *testing.T) {
	var s Scratch
	a := &Attempt{keys: &s.keys, req: &Request{Hashes: append(s.Keys(), 1, 2, 3)}}
	if room := a.endRoom(ScratchKeys - 3); len(room) != 3 || &room[0] != &s.keys[0] {
		t.Fatalf("endRoom for a sequence that fits = %v, want the prompt's keys in the room", room)
	}
	if room := a.endRoom(ScratchKeys - 2); room != nil {
		t.Fatalf("endRoom for a sequence longer than the room = %v, want nil", room)
	}
	a.req.Hashes = []uint64{1, 2, 3}
	if room := a.endRoom(1); room != nil {
		t.Fatalf("endRoom for a prompt elsewhere = %v, want nil", room)
	}
}
