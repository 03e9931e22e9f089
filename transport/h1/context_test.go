package h1

import (
	"context"
	"errors"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

type ctxKey struct{}

// TestRequestContextEndsWhatHangsOnIt: its own AfterFunc functions run when it ends, not
// once stopped; context.AfterFunc and contexts derived from it, through a value context too,
// end with it; and none of them leaves a goroutine waiting on it.
func TestRequestContextEndsWhatHangsOnIt(t *testing.T) {
	before := runtime.NumGoroutine()
	r := new(requestContext)
	r.init()
	var ran, stoppedRan atomic.Int32
	r.AfterFunc(func() { ran.Add(1) })
	stop := r.AfterFunc(func() { stoppedRan.Add(1) })
	if !stop() {
		t.Fatal("stop of a function not run reported false")
	}
	viaContext := make(chan struct{})
	context.AfterFunc(r, func() { close(viaContext) })
	var derived []context.Context
	for range 100 {
		d, cancel := context.WithCancel(context.WithValue(r, ctxKey{}, 1))
		t.Cleanup(cancel)
		derived = append(derived, d)
	}
	if n := runtime.NumGoroutine(); n > before+10 {
		t.Fatalf("%d goroutines after deriving 100 contexts, %d before: they wait on the request's", n, before)
	}
	if r.Err() != nil {
		t.Fatal("done before its end")
	}
	r.cancel()
	for _, d := range derived {
		select {
		case <-d.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("a derived context did not end with the request's")
		}
	}
	<-viaContext
	poll.Until(t, 5*time.Second, func() error {
		if ran.Load() != 1 {
			return context.DeadlineExceeded
		}
		return nil
	})
	if stoppedRan.Load() != 0 || stop() {
		t.Fatal("a stopped function ran, or stopped twice")
	}
	late := make(chan struct{})
	if r.AfterFunc(func() { close(late) })() {
		t.Fatal("stop after the end reported true")
	}
	<-late
}

// TestRequestContextAskedAfterItsEnd: the cancelCtx a request's context makes on first
// demand, made after the request ended, is done at once, and so is what derives from it;
// before that, the context answers Err and Value as the cancelCtx would.
func TestRequestContextAskedAfterItsEnd(t *testing.T) {
	r := new(requestContext)
	r.init()
	if r.Err() != nil || r.Value(ctxKey{}) != nil || context.Cause(r) != nil {
		t.Fatal("a request's context not ended says it is, or has a value")
	}
	if _, ok := r.Deadline(); ok {
		t.Fatal("a request's context has a deadline")
	}
	r.cancel()
	if r.made.Load() {
		t.Fatal("ending a request's context nobody asked made its cancelCtx")
	}
	if !errors.Is(r.Err(), context.Canceled) || !errors.Is(context.Cause(r), context.Canceled) {
		t.Fatalf("ended, Err %v and Cause %v", r.Err(), context.Cause(r))
	}
	d, cancel := context.WithCancel(context.WithValue(r, ctxKey{}, 1))
	defer cancel()
	for _, c := range []context.Context{r, d} {
		select {
		case <-c.Done():
		default:
			t.Fatal("a context asked after the request ended is not done")
		}
	}
	if !errors.Is(r.Err(), context.Canceled) || !errors.Is(d.Err(), context.Canceled) {
		t.Fatalf("Err %v and the derived one's %v", r.Err(), d.Err())
	}
}

// TestRequestContextAskedWhileItEnds: goroutines that ask for Done while the request ends
// (the race detector watches the cancelCtx made on demand) all see it done.
func TestRequestContextAskedWhileItEnds(t *testing.T) {
	for range 50 {
		r := new(requestContext)
		r.init()
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				_ = r.Err()
				select {
				case <-r.Done():
				case <-time.After(5 * time.Second):
					t.Error("a context asked as the request ended never ended")
				}
			})
		}
		r.cancel()
		wg.Wait()
	}
}

// TestCloseCancelsTheRequestsInFlight: the server's Close ends every request's context.
func TestCloseCancelsTheRequestsInFlight(t *testing.T) {
	started, ended := make(chan struct{}, 2), make(chan struct{}, 2)
	s, addr := serveFast(t, Config{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		<-r.Context().Done()
		ended <- struct{}{}
	})})
	for range 2 {
		dial(t, addr).send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
		<-started
	}
	_ = s.Close()
	for range 2 {
		select {
		case <-ended:
		case <-time.After(5 * time.Second):
			t.Fatal("a request in flight was not cancelled by Close")
		}
	}
}
