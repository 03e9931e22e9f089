package cluster

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// TestABindingCommittedWithTheGateHeldIsSeenOnlyOnceOpened: routing proposes a new
// session's binding as the request is dispatched (HoldGate, then Commit beside the
// worker's prefill), and this replica's other requests of the session must see it only once
// the worker has accepted the request (OpenGate); before that the binding can be replaced
// (the worker failed: Reopen, a compare-and-set on its own revision) or dropped (the worker
// refused the request: Invalidate) without any of them having seen it.
func TestABindingCommittedWithTheGateHeldIsSeenOnlyOnceOpened(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	li, _ := c.leader()
	a := NewAffinity(c.nodes[(li+1)%3]) // a follower: its binds are forwarded
	w1, w2 := indexer.Worker{ID: "w1"}, indexer.Worker{ID: "w2"}
	ctx := context.Background()
	cases := []struct {
		name string
		// then is what the initializer does once its held Commit bound w1; want is the
		// worker the session's next request finds bound ("" none).
		then func(t *testing.T, l *lease)
		want string
	}{
		{name: "opened: the binding is the session's", want: "w1",
			then: func(t *testing.T, l *lease) { l.OpenGate(); l.Release() }},
		{name: "replaced before anyone saw it", want: "w2",
			then: func(t *testing.T, l *lease) {
				if !l.Reopen() {
					t.Fatal("a lease holding its gate past its commit did not reopen")
				}
				if b, err := l.Commit(ctx, w2, ""); err != nil || b.Worker != w2 {
					t.Fatalf("replacement: %+v %v", b, err)
				}
				l.Release()
			}},
		{name: "dropped before anyone saw it", want: "",
			then: func(t *testing.T, l *lease) { l.Invalidate(ctx) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			session := "held-" + tc.name[:4]
			ll, err := a.Acquire(ctx, session, nil)
			if err != nil {
				t.Fatal(err)
			}
			l := ll.(*lease)
			l.HoldGate()
			if b, err := l.Commit(ctx, w1, ""); err != nil || b.Worker != w1 {
				t.Fatalf("held commit: %+v %v", b, err)
			}
			// Another request of the session waits on the gate: it gives up at its deadline.
			short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
			if other, err := a.Acquire(short, session, nil); err == nil {
				b, bound := other.Binding()
				other.Release()
				t.Fatalf("another request saw the session (%+v, bound %v) while its gate was held", b, bound)
			}
			cancel()
			tc.then(t, l)
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			next, err := a.Acquire(wctx, session, nil)
			if err != nil {
				t.Fatalf("the next request once the gate opened: %v", err)
			}
			defer next.Release()
			b, bound := next.Binding()
			if bound != (tc.want != "") || bound && b.Worker.ID != tc.want {
				t.Fatalf("the next request found %+v (bound %v), want %q", b, bound, tc.want)
			}
		})
	}
}
