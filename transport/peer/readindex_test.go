package peer

import (
	"context"
	"errors"
	"testing"
)

// gatedReadIndex makes the fake leader's ReadIndex report each call on entered, answer
// only with the index the test sends on release, and report on left when it returns.
func gatedReadIndex(h *fakeHandler) (entered, left chan struct{}, release chan uint64) {
	entered, left, release = make(chan struct{}, 64), make(chan struct{}, 64), make(chan uint64)
	h.readIndex = func(ctx context.Context) (uint64, error) {
		entered <- struct{}{}
		defer func() { left <- struct{}{} }()
		select {
		case v := <-release:
			return v, nil
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	return entered, left, release
}

type readResult struct {
	index uint64
	err   error
}

func TestReadIndexBatcherCoalescesAndLateCallersWaitForTheNextRound(t *testing.T) {
	const late = 16
	h := &fakeHandler{}
	entered, _, release := gatedReadIndex(h)
	c := dial(t, serve(t, h, ServerOptions{}), ClientOptions{})
	b := NewReadIndexBatcher(c.ReadIndex)
	joined := make(chan struct{}, late+1)
	b.onJoin = func() { joined <- struct{}{} }
	ctx := testCtx(t)

	first := make(chan readResult, 1)
	go func() {
		i, err := b.ReadIndex(ctx)
		first <- readResult{i, err}
	}()
	<-joined
	<-entered // round 1 is on the leader

	lates := make(chan readResult, late)
	for range late {
		go func() {
			i, err := b.ReadIndex(ctx)
			lates <- readResult{i, err}
		}()
	}
	for range late {
		<-joined // every late caller asked while round 1 was in flight
	}

	release <- 10 // round 1 answers
	if r := <-first; r.err != nil || r.index != 10 {
		t.Fatalf("first caller = %+v, want index 10", r)
	}
	<-entered // round 2 started only now, after every late caller asked
	select {
	case r := <-lates:
		t.Fatalf("a late caller returned %+v before its round answered", r)
	default:
	}
	release <- 20
	for range late {
		if r := <-lates; r.err != nil || r.index != 20 {
			t.Fatalf("late caller = %+v, want index 20 from round 2", r)
		}
	}
	h.mu.Lock()
	rpcs := h.reads
	h.mu.Unlock()
	if rpcs != 2 || b.Rounds() != 2 {
		t.Fatalf("%d callers took %d RPCs (%d rounds), want 2", late+1, rpcs, b.Rounds())
	}
}

func TestReadIndexBatcherRoundEndsWhenItsLastCallerGivesUp(t *testing.T) {
	h := &fakeHandler{}
	entered, left, release := gatedReadIndex(h)
	c := dial(t, serve(t, h, ServerOptions{}), ClientOptions{})
	b := NewReadIndexBatcher(c.ReadIndex)

	ctx, cancel := context.WithCancel(testCtx(t))
	done := make(chan error, 1)
	go func() {
		_, err := b.ReadIndex(ctx)
		done <- err
	}()
	<-entered
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want Canceled", err)
	}
	<-left // the cancellation reached the leader: the abandoned RPC ended
	// The abandoned round's RPC was cancelled, so the next caller gets a fresh round
	// rather than waiting behind it for ever.
	next := make(chan readResult, 1)
	go func() {
		i, err := b.ReadIndex(testCtx(t))
		next <- readResult{i, err}
	}()
	<-entered
	release <- 7
	if r := <-next; r.err != nil || r.index != 7 {
		t.Fatalf("next caller = %+v, want 7", r)
	}
}

func TestReadIndexBatcherSharesARoundsError(t *testing.T) {
	redirect := &NotLeaderError{LeaderID: "r2", LeaderAddr: "127.0.0.1:1"}
	h := &fakeHandler{redirect: redirect}
	c := dial(t, serve(t, h, ServerOptions{}), ClientOptions{})
	b := NewReadIndexBatcher(c.ReadIndex)
	_, err := b.ReadIndex(testCtx(t))
	var nl *NotLeaderError
	if !errors.As(err, &nl) || *nl != *redirect {
		t.Fatalf("err = %v, want the redirect", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := b.ReadIndex(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("ended context: err = %v, want Canceled", err)
	}
	if b.Rounds() != 1 {
		t.Fatalf("rounds = %d; a caller with an ended context must not start one", b.Rounds())
	}
}
