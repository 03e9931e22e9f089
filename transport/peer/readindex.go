package peer

import (
	"context"
	"sync"
)

// ReadIndexBatcher lets concurrent linearizable reads on a follower share read-index
// rounds: at most one round (one call of the underlying function, typically
// Forwarder.ReadIndex) is in flight, and every caller that arrives while it is in flight
// waits for the NEXT round, which starts when the current one ends. A caller never takes
// the answer of a round that started before it asked: that leader confirmation could
// predate a write acknowledged just before the read, which would make the read stale.
//
// A round's error goes to every caller of that round; the batcher does not retry.
type ReadIndexBatcher struct {
	fn func(context.Context) (uint64, error)

	mu       sync.Mutex
	inflight bool
	next     *round // callers waiting for the round after the in-flight one
	rounds   uint64 // rounds started
	onJoin   func() // test hook, called under mu once a caller joined a round
}

// round is one shared read-index call and the callers waiting on it.
type round struct {
	done    chan struct{}
	index   uint64
	err     error
	waiters int
	cancel  context.CancelFunc // set when the round starts
}

// NewReadIndexBatcher returns a batcher over fn, which must return the leader's
// confirmed commit index.
func NewReadIndexBatcher(fn func(context.Context) (uint64, error)) *ReadIndexBatcher {
	return &ReadIndexBatcher{fn: fn}
}

// ReadIndex returns the index of a read-index round that started after this call began.
func (b *ReadIndexBatcher) ReadIndex(ctx context.Context) (uint64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	b.mu.Lock()
	if b.next == nil {
		b.next = &round{done: make(chan struct{})}
	}
	r := b.next
	r.waiters++
	if !b.inflight {
		b.startLocked()
	}
	if b.onJoin != nil {
		b.onJoin()
	}
	b.mu.Unlock()

	select {
	case <-r.done:
		return r.index, r.err
	case <-ctx.Done():
		b.mu.Lock()
		r.waiters--
		// Nobody waits on a round in flight any more: stop its call. A round not started
		// yet is skipped when its turn comes unless someone joined it meanwhile.
		if r.waiters == 0 && r.cancel != nil {
			r.cancel()
		}
		b.mu.Unlock()
		return 0, ctx.Err()
	}
}

// Rounds reports how many read-index rounds have started, for metrics (callers per
// round is the batching gain).
func (b *ReadIndexBatcher) Rounds() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.rounds
}

// startLocked moves b.next in flight; b.mu is held.
func (b *ReadIndexBatcher) startLocked() {
	r := b.next
	b.next = nil
	b.inflight = true
	b.rounds++
	// The round belongs to all its callers, so no one caller's cancellation may end it;
	// it ends when its last caller gives up.
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go b.run(ctx, r)
}

func (b *ReadIndexBatcher) run(ctx context.Context, r *round) {
	r.index, r.err = b.fn(ctx)
	r.cancel()
	close(r.done)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.inflight = false
	if b.next == nil {
		return
	}
	if b.next.waiters == 0 {
		b.next = nil
		return
	}
	b.startLocked()
}
