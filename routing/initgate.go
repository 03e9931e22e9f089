package routing

import "context"

// InitGate is one session's initializer slot, the mechanism both affinity stores share
// (MemoryAffinity, and the Raft-backed store in cluster): the request that finds a session
// without a binding, or reopens one (Lease.Reopen), holds the gate while it initialises; the
// session's other requests wait until it commits or gives up, then look again. The zero
// value is open. Its methods are called with the owning store's lock held.
type InitGate struct{ done chan struct{} }

// Busy reports whether an initializer holds the gate.
func (g *InitGate) Busy() bool { return g.done != nil }

// Take makes the caller the initializer; the gate must be open.
func (g *InitGate) Take() { g.done = make(chan struct{}) }

// Open ends the initialization (committed or given up) and wakes the waiters; an open gate
// stays open.
func (g *InitGate) Open() {
	if g.done != nil {
		close(g.done)
		g.done = nil
	}
}

// Wait releases the store's lock (unlock) and waits until the initializer opens the gate or
// ctx ends; the caller takes the lock again and looks afresh.
func (g *InitGate) Wait(ctx context.Context, unlock func()) error {
	done := g.done
	unlock()
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
