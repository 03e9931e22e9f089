// Package poll is the one retry helper of the project's tests: wait, with a deadline, for a
// condition that something else brings about, instead of sleeping for a guessed time.
package poll

import (
	"errors"
	"testing"
	"time"
)

// Interval is how often Until asks again.
const Interval = 10 * time.Millisecond

// Until calls cond until it returns nil, and fails t with cond's last error once within has
// passed. cond may itself call t.Fatal to stop at once on a state that waiting cannot fix.
func Until(t testing.TB, within time.Duration, cond func() error) {
	t.Helper()
	if err := Wait(within, cond); err != nil {
		t.Fatalf("condition not met within %s: %v", within, err)
	}
}

// Holds is Until for a condition that is true or not: what names it in the failure.
func Holds(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	Until(t, within, func() error {
		if !cond() {
			return errors.New(what)
		}
		return nil
	})
}

// Wait calls cond until it returns nil or within has passed, and returns cond's last error
// in the second case (benchmarks and helpers that report failure their own way).
func Wait(within time.Duration, cond func() error) error {
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(Interval)
	}
}

// Closed is a condition for Holds: whether done is closed (a goroutine that closes it on its
// way out has returned).
func Closed(done <-chan struct{}) func() bool {
	return func() bool {
		select {
		case <-done:
			return true
		default:
			return false
		}
	}
}
