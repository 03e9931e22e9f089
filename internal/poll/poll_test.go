package poll

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

func TestWaitReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	err := Wait(5*time.Second, func() error {
		if calls.Add(1) < 3 {
			return errors.New("not yet")
		}
		return nil
	})
	if err != nil || calls.Load() != 3 {
		t.Fatalf("Wait: %v after %d calls, want nil after 3", err, calls.Load())
	}
}

func TestWaitGivesTheLastErrorAtTheDeadline(t *testing.T) {
	want := errors.New("never")
	if err := Wait(30*time.Millisecond, func() error { return want }); err != want {
		t.Fatalf("Wait: %v, want %v", err, want)
	}
}
