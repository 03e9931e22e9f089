package sim

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

func TestFIFOSemGrantsInArrivalOrder(t *testing.T) {
	s := newFIFOSem(1)
	if err := s.acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	const n = 5
	order := make(chan int, n)
	for i := range n {
		go func() {
			if err := s.acquire(context.Background()); err == nil {
				order <- i
			}
		}()
		// Queue them one at a time so arrival order is known.
		poll.Holds(t, 10*time.Second, "waiter queued", func() bool { _, w := s.counts(); return w == i+1 })
	}
	for want := range n {
		s.release()
		if got := <-order; got != want {
			t.Fatalf("granted %d, want %d", got, want)
		}
	}
	s.release()
	if held, waiting := s.counts(); held != 0 || waiting != 0 {
		t.Fatalf("held %d waiting %d, want 0 0", held, waiting)
	}
}

func TestFIFOSemWaiterLeavesOnCancel(t *testing.T) {
	s := newFIFOSem(1)
	if err := s.acquire(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.acquire(ctx) }()
	poll.Holds(t, 10*time.Second, "waiter queued", func() bool { _, w := s.counts(); return w == 1 })
	cancel()
	if err := <-errc; err == nil {
		t.Fatal("cancelled acquire succeeded")
	}
	s.release()
	if held, waiting := s.counts(); held != 0 || waiting != 0 {
		t.Fatalf("held %d waiting %d, want 0 0", held, waiting)
	}
}
