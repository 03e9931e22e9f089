package h1

import (
	"context"
	"sync"
	"sync/atomic"
)

// requestContext is a request's context: done when the client hangs up, a write to it
// fails, the handler returns or the server closes. Its AfterFunc method (which
// context.AfterFunc asks, and transport/openai's exchange directly) registers a function in
// the request's own list: no child context, no map entry, no closure but the stop function.
// Everything else is the cancelCtx it wraps, so that a context derived from it, through a
// value context too (a tracing span's), registers with that cancelCtx as with any, and no
// goroutine waits on it. Its parent is no other context: the server's Close cancels the
// requests in flight one by one, so no request registers with a context every request of a
// connection (or of the server) shares.
type requestContext struct {
	context.Context
	cancelInner context.CancelFunc

	mu    sync.Mutex
	ended bool
	// funcs are the registered functions, a stopped one nil; first holds the first two.
	funcs []func()
	first [2]func()
}

// init makes r a request's context not done yet (in memory of the caller's).
func (r *requestContext) init() {
	r.Context, r.cancelInner = context.WithCancel(context.Background())
	r.funcs = r.first[:0]
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
	r.mu.Unlock()
	r.cancelInner()
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
