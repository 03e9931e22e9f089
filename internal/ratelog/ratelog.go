// Package ratelog keeps repeated log lines from flooding a log: at most one line per key
// per interval, the next one saying how many were left out in between. A stranger who sends
// garbage to a port as fast as it can gets one line per interval, not one per attempt.
package ratelog

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// Limiter decides, per key, which lines are logged. The zero value is not usable: use New.
type Limiter struct {
	every   time.Duration
	maxKeys int

	mu   sync.Mutex
	keys map[string]*state
}

type state struct {
	last    time.Time
	dropped int
}

// New is a Limiter that logs at most one line per key every interval, remembering at most
// maxKeys keys (past them it forgets every key and starts again; <= 0: 1024).
func New(every time.Duration, maxKeys int) *Limiter {
	if maxKeys <= 0 {
		maxKeys = 1024
	}
	return &Limiter{every: every, maxKeys: maxKeys, keys: make(map[string]*state)}
}

// Allow reports whether a line for key may be logged at now and, when it may, how many
// lines for key were left out since the last one logged.
func (l *Limiter) Allow(key string, now time.Time) (ok bool, dropped int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	s, seen := l.keys[key]
	if seen && now.Sub(s.last) < l.every {
		s.dropped++
		return false, 0
	}
	if !seen {
		if len(l.keys) >= l.maxKeys {
			clear(l.keys)
		}
		s = &state{}
		l.keys[key] = s
	}
	dropped, s.last, s.dropped = s.dropped, now, 0
	return true, dropped
}

// Log logs msg with args at level through log, unless a line for key was logged less than
// the interval ago; a line after some were left out carries their count as "suppressed".
func (l *Limiter) Log(log *slog.Logger, key string, level slog.Level, msg string, args ...any) {
	ctx := context.Background()
	if !log.Enabled(ctx, level) {
		return
	}
	ok, dropped := l.Allow(key, time.Now())
	if !ok {
		return
	}
	if dropped > 0 {
		args = append(args, "suppressed", dropped)
	}
	log.Log(ctx, level, msg, args...)
}
