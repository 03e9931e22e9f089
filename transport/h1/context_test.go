package h1

import (
	"context"
	"net/http"
	"runtime"
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
