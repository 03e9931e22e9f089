package routing

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// racedStore is an affinity store whose first request's Commit loses the race to bound
// (ErrBoundElsewhere) and adopts it, as the Raft-backed lease does.
type racedStore struct {
	bound   Binding
	reopens int
}

func (s *racedStore) Acquire(context.Context, string, *indexer.Worker) (Lease, error) {
	return &racedLease{s: s}, nil
}
func (s *racedStore) Peek(context.Context, string) (Binding, bool, error) {
	return Binding{}, false, nil
}
func (s *racedStore) Invalidate(context.Context, string, uint64) error { return nil }

type racedLease struct {
	s       *racedStore
	adopted bool
}

func (l *racedLease) Binding() (Binding, bool) {
	if l.adopted {
		return l.s.bound, true
	}
	return Binding{}, false
}
func (l *racedLease) Commit(context.Context, indexer.Worker, string) (Binding, error) {
	l.adopted = true
	return l.s.bound, ErrBoundElsewhere
}
func (l *racedLease) Reopen() bool               { l.s.reopens++; return false }
func (l *racedLease) Invalidate(context.Context) {}
func (l *racedLease) Release()                   {}

// drainingStore wraps a MemoryAffinity whose first Commit is refused because the worker
// began draining (the lease stays the initializer, as the Raft-backed one does).
type drainingStore struct {
	*MemoryAffinity
	refused bool
}

func (s *drainingStore) Acquire(ctx context.Context, key string, explicit *indexer.Worker) (Lease, error) {
	l, err := s.MemoryAffinity.Acquire(ctx, key, explicit)
	if err != nil {
		return nil, err
	}
	return &drainingLease{Lease: l, s: s}, nil
}

type drainingLease struct {
	Lease
	s *drainingStore
}

func (l *drainingLease) Commit(ctx context.Context, w indexer.Worker, model string) (Binding, error) {
	if !l.s.refused {
		l.s.refused = true
		return Binding{}, fmt.Errorf("bind %s: %w", w, ErrWorkerDraining)
	}
	return l.Lease.Commit(ctx, w, model)
}

// TestARetryTakesTheOutcomeOfTheBindingProposedAtDispatch: a dispatch that fails before
// its first byte while its session's binding was being proposed (Propose) retries from
// that binding's outcome: bound to the failed worker, the binding moves by compare-and-set
// (a higher revision, the new worker); bound elsewhere by a concurrent request, the retry
// goes to that worker without replacing its binding; refused because the worker began
// draining, the next choice binds.
func TestARetryTakesTheOutcomeOfTheBindingProposedAtDispatch(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name  string
		store func(*rig) AffinityStore
		// want: the worker the retry goes to ("" any other than the first), and whether
		// it goes there as the session's bound worker.
		want      string
		wantBound bool
		// wantRevision: the revision the retry's binding has (the first binding's is 1).
		wantRevision uint64
	}{
		{name: "bound to the failed worker: moved by compare-and-set", wantRevision: 2,
			store: func(rg *rig) AffinityStore { return rg.affinity }},
		{name: "bound elsewhere by a concurrent request: the retry goes there", want: "w3", wantBound: true,
			store: func(*rig) AffinityStore {
				return &racedStore{bound: Binding{Session: "s", Worker: worker("w3"), Revision: 9}}
			}},
		{name: "refused by a worker that began draining: the next choice binds", wantRevision: 1,
			store: func(rg *rig) AffinityStore { return &drainingStore{MemoryAffinity: rg.affinity} }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rg := newRig(t, 4, Config{MaxRetries: 2})
			store := tc.store(rg)
			router, err := New(Config{MaxRetries: 2}, Deps{Index: rg.index, Recorder: rg.index, Workers: rg.reg, Tracker: rg.tracker, Affinity: store})
			if err != nil {
				t.Fatal(err)
			}
			h := hashes(700, 4)
			rg.index.Record(worker("w1"), h)
			a := route(t, router, Request{Session: "s", PromptTokens: 64, Hashes: h})
			defer a.Finish()
			first := a.Decision().Target.Worker
			a.Propose(ctx)
			if err := a.Retry(ctx, errors.New("worker died before its first byte")); err != nil {
				t.Fatalf("retry: %v", err)
			}
			d := a.Decision()
			switch {
			case tc.want != "" && d.Target.Worker.ID != tc.want:
				t.Fatalf("retry went to %s, want %s", d.Target.Worker, tc.want)
			case tc.want == "" && d.Target.Worker == first:
				t.Fatalf("retry went back to the failed worker %s", first)
			case d.Bound != tc.wantBound:
				t.Fatalf("retry's decision bound %v, want %v", d.Bound, tc.wantBound)
			}
			if rs, ok := store.(*racedStore); ok {
				if rs.reopens != 0 {
					t.Fatalf("the concurrent request's binding was reopened %d times", rs.reopens)
				}
				return
			}
			a.Propose(ctx)
			b, err := a.Commit(ctx)
			if err != nil || b.Worker != d.Target.Worker || b.Revision != tc.wantRevision {
				t.Fatalf("commit after the retry: %+v, %v; want bound to %s at revision %d", b, err, d.Target.Worker, tc.wantRevision)
			}
			if got, ok, _ := rg.affinity.Peek(ctx, "s"); !ok || got != b {
				t.Fatalf("store holds %+v (%v), want %+v", got, ok, b)
			}
		})
	}
}

// TestABindingProposedAtDispatchIsSeenOnlyOnceTheWorkerAccepted: the session's other
// requests wait while the binding proposed at dispatch is in flight and until the worker
// accepts the request (Commit), as they did when the binding was made after the worker's
// answer; a worker that refused the request (Refused) or failed (Retry) has the binding
// dropped or replaced before any of them saw it.
func TestABindingProposedAtDispatchIsSeenOnlyOnceTheWorkerAccepted(t *testing.T) {
	ctx := context.Background()
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	cases := []struct {
		name string
		// then ends the worker's part; want is the worker the next request finds the
		// session bound to ("" none, "retried" the retry's worker) and wantRevision its
		// revision.
		then         func(t *testing.T, a *Attempt)
		want         string
		wantRevision uint64
	}{
		{name: "accepted: the binding is the session's", want: "first", wantRevision: 1,
			then: func(t *testing.T, a *Attempt) {
				if _, err := a.Commit(ctx); err != nil {
					t.Fatal(err)
				}
			}},
		{name: "refused: the binding goes unseen", want: "",
			then: func(t *testing.T, a *Attempt) { a.Refused(ctx) }},
		{name: "failed: the binding moves unseen", want: "retried", wantRevision: 2,
			then: func(t *testing.T, a *Attempt) {
				if err := a.Retry(ctx, errors.New("worker died")); err != nil {
					t.Fatal(err)
				}
				a.Propose(ctx)
				if _, err := a.Commit(ctx); err != nil {
					t.Fatal(err)
				}
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rg := newRig(t, 3, Config{MaxRetries: 2})
			a := route(t, rg.router, Request{Session: "s", PromptTokens: 16, Hashes: hashes(900, 1)})
			first := a.Decision().Target.Worker
			a.Propose(ctx)
			<-a.pending.done // the binding is made (a Raft commit would be, during the prefill)
			if l, err := rg.affinity.Acquire(cancelled, "s", nil); err == nil {
				b, bound := l.Binding()
				t.Fatalf("another request saw the session (%+v, bound %v) before the worker accepted", b, bound)
			}
			tc.then(t, a)
			want := map[string]indexer.Worker{"first": first, "retried": a.Decision().Target.Worker}[tc.want]
			a.Finish()
			l, err := rg.affinity.Acquire(cancelled, "s", nil)
			if err != nil {
				t.Fatalf("the next request once the worker answered: %v", err)
			}
			defer l.Release()
			b, bound := l.Binding()
			if bound != (tc.want != "") || bound && (b.Worker != want || b.Revision != tc.wantRevision) {
				t.Fatalf("the next request found %+v (bound %v), want %q (%s) at revision %d", b, bound, tc.want, want, tc.wantRevision)
			}
		})
	}
}

// firstStore wraps a MemoryAffinity whose leases say whether a new binding must be
// committed before dispatch (bindFirster), as the cluster's do while the replica's contact
// with its quorum is not fresh, and whose Commit fails with fail when set.
type firstStore struct {
	*MemoryAffinity
	first bool
	fail  error
}

func (s *firstStore) Acquire(ctx context.Context, key string, explicit *indexer.Worker) (Lease, error) {
	l, err := s.MemoryAffinity.Acquire(ctx, key, explicit)
	if err != nil {
		return nil, err
	}
	return &firstLease{Lease: l, s: s}, nil
}

type firstLease struct {
	Lease
	s *firstStore
}

func (l *firstLease) BindFirst() bool { return l.s.first }

func (l *firstLease) Commit(ctx context.Context, w indexer.Worker, model string) (Binding, error) {
	if l.s.fail != nil {
		return Binding{}, l.s.fail
	}
	return l.Lease.Commit(ctx, w, model)
}

// TestABindingThatMustComeFirstIsCommittedBeforeDispatchAndRefusedWhenItFails: with contact
// fresh, Propose returns at once and a failed binding shows at Commit (the worker has the
// request by then); with contact not fresh (BindFirst), the binding is committed before
// Propose returns, and a failure is a Refusal ("bind_failed", ErrUnavailable) that leaves
// the session unbound and the attempt ended, except a full store (ErrTooManySessions, as a
// failed Route) and a session bound elsewhere (left for Commit, which moves the request).
func TestABindingThatMustComeFirstIsCommittedBeforeDispatchAndRefusedWhenItFails(t *testing.T) {
	ctx := context.Background()
	lost := errors.New("raft apply: leadership lost while committing log")
	cases := []struct {
		name  string
		first bool
		fail  error
		// wantPropose is what Propose returns: nil, a refusal, or an error it wraps.
		wantPropose error
		refusal     bool
		// boundAtPropose: the store holds the binding when Propose returns.
		boundAtPropose bool
	}{
		{name: "contact fresh: proposed beside the prefill, its failure seen at Commit", fail: lost},
		{name: "contact stale: committed before dispatch", first: true, boundAtPropose: true},
		{name: "contact stale, the bind fails: refused before any worker", first: true, fail: lost, refusal: true},
		{name: "contact stale, the store is full: too many sessions", first: true,
			fail: fmt.Errorf("bind: %w", ErrTooManySessions), wantPropose: ErrTooManySessions},
		{name: "contact stale, bound elsewhere: left for Commit", first: true,
			fail: fmt.Errorf("bind: %w", ErrBoundElsewhere), wantPropose: ErrBoundElsewhere},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rg := newRig(t, 2, Config{})
			store := &firstStore{MemoryAffinity: rg.affinity, first: tc.first, fail: tc.fail}
			router, err := New(Config{}, Deps{Index: rg.index, Recorder: rg.index, Workers: rg.reg, Tracker: rg.tracker, Affinity: store})
			if err != nil {
				t.Fatal(err)
			}
			a := route(t, router, Request{Session: "s", PromptTokens: 64})
			defer a.Finish()
			perr := a.Propose(ctx)
			_, bound, _ := rg.affinity.Peek(ctx, "s")
			if bound != tc.boundAtPropose {
				t.Fatalf("bound when Propose returned: %v, want %v", bound, tc.boundAtPropose)
			}
			var refusal *Refusal
			switch {
			case tc.refusal:
				if !errors.As(perr, &refusal) || refusal.Reason != "bind_failed" || !errors.Is(perr, ErrUnavailable) || !errors.Is(perr, lost) {
					t.Fatalf("Propose: %v, want a bind_failed refusal wrapping ErrUnavailable and the cause", perr)
				}
				if _, err := a.Commit(ctx); err == nil {
					t.Fatal("Commit after a refused binding succeeded: the attempt must be over")
				}
				if _, ok, _ := rg.affinity.Peek(ctx, "s"); ok {
					t.Fatal("a refused binding left the session bound")
				}
				return
			case tc.wantPropose != nil:
				if !errors.Is(perr, tc.wantPropose) || errors.As(perr, &refusal) {
					t.Fatalf("Propose: %v, want %v (not a refusal)", perr, tc.wantPropose)
				}
				return
			case perr != nil:
				t.Fatalf("Propose: %v, want nil", perr)
			}
			b, err := a.Commit(ctx)
			if tc.fail != nil {
				if !errors.Is(err, tc.fail) {
					t.Fatalf("Commit: %v, want the binding's failure %v", err, tc.fail)
				}
				return
			}
			if err != nil || b.Revision == 0 || b.Worker != a.Decision().Target.Worker {
				t.Fatalf("Commit: %+v %v, want the binding made before dispatch", b, err)
			}
		})
	}
}
