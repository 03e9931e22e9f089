package routing

import (
	"context"
	"errors"
	"testing"
)

// laggingStore is a MemoryAffinity that has not applied a binding made elsewhere until it is
// asked to Sync: a replica a moment behind the leader.
type laggingStore struct {
	*MemoryAffinity
	pending func() // applies what the store lags by
	syncs   int
}

func (l *laggingStore) Sync(context.Context) error {
	l.syncs++
	if l.pending != nil {
		l.pending()
		l.pending = nil
	}
	return nil
}

// TestAResumedSessionConfirmsItsMissBeforeRoutingFreely: a request that names state a worker
// made, whose binding this replica has not applied yet, finds it after a Sync and goes to
// its worker; a bound one asks nothing; without Resume a miss routes freely at once.
func TestAResumedSessionConfirmsItsMissBeforeRoutingFreely(t *testing.T) {
	tests := []struct {
		name      string
		resume    bool
		boundNow  bool // bound before the request, not only once synced
		wantSyncs int
		wantBound bool
	}{
		{"lagging, resumed", true, false, 1, true},
		{"bound already", true, true, 0, true},
		{"lagging, not resumed", false, false, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg, err := NewRegistry(specs(4))
			if err != nil {
				t.Fatal(err)
			}
			store := &laggingStore{MemoryAffinity: NewMemoryAffinity(0, 0)}
			session := ResponseSession("resp_1")
			// w3 holds the state; the index and load all favour others.
			bind := func() {
				if _, err := (&Router{deps: Deps{Affinity: store.MemoryAffinity}}).Pin(t.Context(), session, worker("w3")); err != nil {
					t.Fatal(err)
				}
			}
			if tt.boundNow {
				bind()
			} else {
				store.pending = bind
			}
			idx := newFakeIndex()
			idx.Record(worker("w0"), hashes(1, 8))
			r, err := New(Config{Seed: 1}, Deps{Index: idx, Recorder: idx, Workers: reg, Tracker: NewTracker(), Affinity: store})
			if err != nil {
				t.Fatal(err)
			}
			a, err := r.Route(t.Context(), &Request{Session: session, Resume: tt.resume, Hashes: hashes(1, 8), DPRank: -1})
			if err != nil {
				t.Fatal(err)
			}
			defer a.Finish()
			d := a.Decision()
			if store.syncs != tt.wantSyncs || d.Bound != tt.wantBound || tt.wantBound && d.Target.Worker != worker("w3") {
				t.Errorf("%d syncs, bound %v on %s; want %d syncs, bound %v (on w3)", store.syncs, d.Bound, d.Target.Worker, tt.wantSyncs, tt.wantBound)
			}
		})
	}
}

// TestPinBindsOnceAndRefusesAnotherWorker: Pin binds a free session, leaves one bound to its
// worker as it is, and refuses one bound to another worker; the lease is released either
// way (the session's TTL runs).
func TestPinBindsOnceAndRefusesAnotherWorker(t *testing.T) {
	rg := newRig(t, 3, Config{})
	first, err := rg.router.Pin(t.Context(), "s", worker("w1"))
	if err != nil || first.Revision == 0 || first.Worker != worker("w1") {
		t.Fatalf("first Pin: %+v %v", first, err)
	}
	again, err := rg.router.Pin(t.Context(), "s", worker("w1"))
	if err != nil || again != first {
		t.Errorf("Pin to the bound worker: %+v %v, want %+v", again, err, first)
	}
	if _, err := rg.router.Pin(t.Context(), "s", worker("w2")); !errors.Is(err, ErrTargetConflict) {
		t.Errorf("Pin to another worker: %v, want ErrTargetConflict", err)
	}
	if n := rg.affinity.Expire(); n != 0 || rg.affinity.Len() != 1 {
		t.Errorf("after the Pins: %d expired, %d held; want the one binding, idle", n, rg.affinity.Len())
	}
}
