package routing

import (
	"context"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// TestTrackerSignalsEveryChangeOfLoad: Changes holds a token after each change of the
// counters (start, first token, end), none after a call that changes nothing, and one token
// stands for many changes.
func TestTrackerSignalsEveryChangeOfLoad(t *testing.T) {
	tr := NewTracker()
	w := indexer.Worker{ID: "w0"}
	var k *Ticket
	taken := func() bool {
		select {
		case <-tr.Changes():
			return true
		default:
			return false
		}
	}
	for _, step := range []struct {
		name   string
		do     func()
		signal bool
	}{
		{"nothing yet", func() {}, false},
		{"start", func() { k = tr.Start(w, 100, 10) }, true},
		{"first token", func() { k.FirstToken() }, true},
		{"first token again", func() { k.FirstToken() }, false},
		{"finish", func() { k.Finish() }, true},
		{"finish again", func() { k.Finish() }, false},
		{"many changes, one token", func() {
			for range 10 {
				tr.Start(w, 1, 1).Finish()
			}
		}, true},
	} {
		step.do()
		if got := taken(); got != step.signal {
			t.Fatalf("%s: a change was signalled: %v, want %v", step.name, got, step.signal)
		}
	}
}

// TestCompleteEndsTheLoadBeforeFinish: once the worker's answer is whole (Complete), the
// request counts no more on its worker, though the proxy finishes the attempt only after
// the client got the answer's last bytes: a next turn sent at that moment must find the
// worker free.
func TestCompleteEndsTheLoadBeforeFinish(t *testing.T) {
	for _, tc := range []struct {
		name       string
		firstToken bool
	}{
		{"streamed: past its first token", true},
		{"whole answer: first bytes and end together", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rg := newRig(t, 2, Config{})
			a := route(t, rg.router, Request{PromptTokens: 64, Hashes: hashes(9, 4)})
			w := a.Decision().Target.Worker
			if _, err := a.Commit(context.Background()); err != nil {
				t.Fatal(err)
			}
			if tc.firstToken {
				a.FirstToken()
			}
			if got := rg.tracker.Load(w); got.Requests != 1 {
				t.Fatalf("load while the worker runs it = %+v, want one request", got)
			}
			a.Complete(16)
			if got := rg.tracker.Load(w); got != (Load{}) {
				t.Fatalf("load once the answer is whole = %+v, want none", got)
			}
			a.Finish()
			if got := rg.tracker.Load(w); got != (Load{}) {
				t.Fatalf("load after Finish = %+v, want none", got)
			}
		})
	}
}
