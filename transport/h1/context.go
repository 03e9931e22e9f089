package h1

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// requestContext is a request's context: done when the client hangs up, a write to it
// fails, the handler returns or the server closes. Its AfterFunc method (which
// context.AfterFunc asks, and transport/openai's exchange directly) registers a function in
// the request's own list: no child context, no map entry, no closure but the stop function.
// Its Done, and its Value once Done was asked, are those of a cancelCtx it makes on first
// demand (most requests never ask: a request answered without it costs no cancelCtx and no
// cancel function), so that a context derived from it, through a value context too (a
// tracing span's), registers with that cancelCtx as with any, and no goroutine waits on it.
// Its parent is no other context: the server's Close cancels the requests in flight one by
// one, so no request registers with a context every request of a connection (or of the
// server) shares.
type requestContext struct {
	// made: inner and cancelInner are set (under mu, before made is), and read freely after.
	made        atomic.Bool
	inner       context.Context
	cancelInner context.CancelFunc

	mu    sync.Mutex
	ended bool
	// funcs are the registered functions, a stopped one nil; first holds the first two.
	funcs []func()
	first [2]func()
}

// init makes r a request's context not done yet (in memory of the caller's, zeroed).
func (r *requestContext) init() {
	r.funcs = r.first[:0]
}

// cancelCtx returns r's cancelCtx, made on first demand; one made after r ended is
// cancelled before it is returned.
func (r *requestContext) cancelCtx() context.Context {
	if r.made.Load() {
		return r.inner
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.made.Load() {
		r.inner, r.cancelInner = context.WithCancel(context.Background())
		if r.ended {
			r.cancelInner()
		}
		r.made.Store(true)
	}
	return r.inner
}

// Deadline implements context.Context: a request's context has none.
func (r *requestContext) Deadline() (time.Time, bool) { return time.Time{}, false }

// Done implements context.Context (the cancelCtx's channel).
func (r *requestContext) Done() <-chan struct{} { return r.cancelCtx().Done() }

// Err implements context.Context: context.Canceled once r ended (the cancelCtx's, once made).
func (r *requestContext) Err() error {
	if r.made.Load() {
		return r.inner.Err()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.made.Load():
		return r.inner.Err()
	case r.ended:
		return context.Canceled
	}
	return nil
}

// Value implements context.Context: the cancelCtx's once made (which answers the context
// package's own lookup of it, asked only after Done), else nil, as it would answer every
// other key.
func (r *requestContext) Value(key any) any {
	if r.made.Load() {
		return r.inner.Value(key)
	}
	return nil
}

// AfterFunc runs f in its own goroutine once r is done (at once if it is), as
// context.AfterFunc does; stop unregisters f, and reports whether it did so before f ran.
func (r *requestContext) AfterFunc(f func()) (stop func() bool) {
	r.mu.Lock()
	if r.ended {
		r.mu.Unlock()
		go f()
		return func() bool { return false }
	}
	i := len(r.funcs)
	r.funcs = append(r.funcs, f)
	r.mu.Unlock()
	return func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.ended || r.funcs[i] == nil {
			return false
		}
		r.funcs[i] = nil
		return true
	}
}

// cancel ends r: its Done is closed and its registered functions start.
func (r *requestContext) cancel() {
	r.mu.Lock()
	if r.ended {
		r.mu.Unlock()
		return
	}
	r.ended = true
	funcs := r.funcs
	made := r.made.Load()
	r.mu.Unlock()
	if made {
		r.cancelInner()
	}
	for _, f := range funcs {
		if f != nil {
			go f()
		}
	}
}

// current is a connection's request in flight (nil between requests), which the watcher, a
// failed write and the server's Close cancel.
type current struct {
	p atomic.Pointer[requestContext]
}

// cancel cancels the request in flight, if any.
func (c *current) cancel() {
	if r := c.p.Load(); r != nil {
		r.cancel()
	}
}
