package sim

import (
	"container/list"
	"context"
	"sync"
	"time"
)

// fifoSem is a counting semaphore that grants in arrival order and lets a waiter leave
// when its context ends.
type fifoSem struct {
	mu      sync.Mutex
	size    int
	used    int
	waiters list.List // of chan struct{}
}

func newFIFOSem(size int) *fifoSem { return &fifoSem{size: size} }

// acquire takes a unit, waiting in line for one; it fails only when ctx ends first.
func (s *fifoSem) acquire(ctx context.Context) error {
	s.mu.Lock()
	if s.used < s.size && s.waiters.Len() == 0 {
		s.used++
		s.mu.Unlock()
		return nil
	}
	ready := make(chan struct{})
	elem := s.waiters.PushBack(ready)
	s.mu.Unlock()

	select {
	case <-ready:
		return nil
	case <-ctx.Done():
	}
	s.mu.Lock()
	select {
	case <-ready:
		// Granted while we were giving up: pass the unit on.
		s.mu.Unlock()
		s.release()
	default:
		s.waiters.Remove(elem)
		s.mu.Unlock()
	}
	return ctx.Err()
}

// release returns a unit, handing it straight to the longest waiter if there is one.
func (s *fifoSem) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if front := s.waiters.Front(); front != nil {
		close(s.waiters.Remove(front).(chan struct{}))
		return
	}
	s.used--
}

// counts reports the units held and the waiters in line.
func (s *fifoSem) counts() (held, waiting int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used, s.waiters.Len()
}

// sleepUntil waits for the deadline t or for ctx to end, whichever is first.
func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
