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
