package routing

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// MemoryAffinity is the in-memory AffinityStore of one replica: the reference router's
// semantics without replication. Revisions come from a counter, so they only ever grow.
type MemoryAffinity struct {
	ttl time.Duration
	max int
	now func() time.Time

	mu       sync.Mutex
	sessions map[string]*session
	revision uint64
}

// session is one session's state: bound to a worker, or being initialised by one request.
type session struct {
	binding Binding
	bound   bool
	// init is held while a request initialises (or replaces) the binding.
	init   InitGate
	active int // leases in flight
	idle   time.Time
}

// NewMemoryAffinity returns a store whose bindings idle out ttl after their last request
// ends, holding at most max sessions (0: no cap).
func NewMemoryAffinity(ttl time.Duration, max int) *MemoryAffinity {
	return &MemoryAffinity{ttl: ttl, max: max, now: time.Now, sessions: make(map[string]*session)}
}

// WithClock replaces the clock (tests).
func (m *MemoryAffinity) WithClock(now func() time.Time) *MemoryAffinity {
	m.now = now
	return m
}

func (m *MemoryAffinity) expired(s *session, now time.Time) bool {
	return s.bound && s.active == 0 && m.ttl > 0 && now.Sub(s.idle) > m.ttl
}

// Acquire implements AffinityStore.
func (m *MemoryAffinity) Acquire(ctx context.Context, key string, explicit *indexer.Worker) (Lease, error) {
	for {
		m.mu.Lock()
		now := m.now()
		s := m.sessions[key]
		if s != nil && m.expired(s, now) {
			delete(m.sessions, key)
			s = nil
		}
		switch {
		case s == nil:
			if m.max > 0 && len(m.sessions) >= m.max {
				m.sweepLocked(now)
				if len(m.sessions) >= m.max {
					m.mu.Unlock()
					return nil, fmt.Errorf("%d sessions bound: %w", m.max, ErrTooManySessions)
				}
			}
			// The key outlives the request: its own copy, not a slice of the request's head.
			key = strings.Clone(key)
			s = &session{binding: Binding{Session: key}, active: 1}
			s.init.Take()
			m.sessions[key] = s
			m.mu.Unlock()
			return &memoryLease{store: m, s: s}, nil
		case s.bound:
			if explicit != nil && *explicit != s.binding.Worker {
				b := s.binding
				m.mu.Unlock()
				return nil, fmt.Errorf("session bound to %s at revision %d, target %s: %w",
					b.Worker, b.Revision, explicit, ErrTargetConflict)
			}
			s.active++
			m.mu.Unlock()
			return &memoryLease{store: m, s: s, bound: true, binding: s.binding}, nil
		default:
			if err := s.init.Wait(ctx, m.mu.Unlock); err != nil {
				return nil, err
			}
		}
	}
}

// Peek implements AffinityStore.
func (m *MemoryAffinity) Peek(_ context.Context, key string) (Binding, bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.sessions[key]
	if s == nil || !s.bound || m.expired(s, m.now()) {
		return Binding{}, false, nil
	}
	return s.binding, true, nil
}

// Invalidate implements AffinityStore.
func (m *MemoryAffinity) Invalidate(_ context.Context, key string, revision uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s := m.sessions[key]; s != nil && s.bound && s.binding.Revision == revision {
		delete(m.sessions, key)
	}
	return nil
}

// Expire drops bindings idle past the TTL and returns how many.
func (m *MemoryAffinity) Expire() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sweepLocked(m.now())
}

func (m *MemoryAffinity) sweepLocked(now time.Time) int {
	n := 0
	for k, s := range m.sessions {
		if m.expired(s, now) {
			delete(m.sessions, k)
			n++
		}
	}
	return n
}

// Len is the number of sessions held (bound or initialising).
func (m *MemoryAffinity) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.sessions)
}

// memoryLease is one request's hold on a session of a MemoryAffinity.
type memoryLease struct {
	store   *MemoryAffinity
	s       *session
	bound   bool
	binding Binding
	done    bool
	// holdGate (HoldGate): a Commit keeps the gate; held: one did, and the binding is
	// the lease's alone (the session is not bound for others) until OpenGate or the end.
	holdGate, held bool
}

// HoldGate implements gateHolder: a later Commit binds for this lease alone, and the
// session's other requests wait until OpenGate (or the end) publishes the binding.
func (l *memoryLease) HoldGate() {
	l.store.mu.Lock()
	defer l.store.mu.Unlock()
	l.holdGate = true
}

// OpenGate implements gateHolder: a binding a Commit kept becomes the session's.
func (l *memoryLease) OpenGate() {
	l.store.mu.Lock()
	defer l.store.mu.Unlock()
	l.holdGate = false
	l.publishLocked()
}

// publishLocked makes a kept binding the session's and wakes the waiters.
func (l *memoryLease) publishLocked() {
	if l.held {
		l.held = false
		l.s.bound = true
		l.s.init.Open()
	}
}

func (l *memoryLease) Binding() (Binding, bool) { return l.binding, l.bound }

func (l *memoryLease) Commit(_ context.Context, w indexer.Worker, model string) (Binding, error) {
	m := l.store
	m.mu.Lock()
	defer m.mu.Unlock()
	if l.done || l.bound {
		return Binding{}, fmt.Errorf("commit of session %q: lease is not an open initializer", l.s.binding.Session)
	}
	m.revision++
	l.s.binding.Worker = w
	l.s.binding.Model = model
	l.s.binding.Revision = m.revision
	l.bound, l.binding = true, l.s.binding
	l.held = true
	if !l.holdGate {
		l.publishLocked()
	}
	return l.binding, nil
}

// Invalidate drops the lease's binding (revision-guarded) or gives up an initialization.
func (l *memoryLease) Invalidate(context.Context) { l.end(true) }

// Release ends the request; the binding's idle TTL counts from now.
func (l *memoryLease) Release() { l.end(false) }

// end finishes the lease once: an initializer that never committed gives up (the session,
// and a reopened binding with it, goes, and a waiter initialises instead); with drop, a
// bound lease drops its binding if it is still the session's.
func (l *memoryLease) end(drop bool) {
	m := l.store
	m.mu.Lock()
	defer m.mu.Unlock()
	if l.done {
		return
	}
	l.done = true
	l.s.active--
	key := l.s.binding.Session
	mine := m.sessions[key] == l.s
	if l.held && drop {
		// A kept binding no other request saw: the session goes, as for an initializer
		// that gives up.
		l.held = false
		l.s.init.Open()
		if mine {
			delete(m.sessions, key)
		}
		return
	}
	l.publishLocked()
	switch {
	case !l.bound:
		l.s.init.Open()
		if mine {
			delete(m.sessions, key)
		}
	case !drop:
		if l.s.active == 0 {
			l.s.idle = m.now()
		}
	case mine && l.s.bound && l.s.binding.Revision == l.binding.Revision:
		// (Not bound: another request is replacing the binding, and its outcome decides.)
		delete(m.sessions, key)
	}
}

// Reopen implements Lease: the session becomes unbound-while-initialising, as for a first
// request, and this lease its initializer.
func (l *memoryLease) Reopen() bool {
	m := l.store
	m.mu.Lock()
	defer m.mu.Unlock()
	if l.held {
		// A kept binding no other request saw: the lease holds the gate still, and
		// replaces its own binding.
		l.held, l.holdGate = false, false
		l.bound = false
		l.binding = Binding{Session: l.s.binding.Session}
		return true
	}
	if l.done || !l.bound || m.sessions[l.s.binding.Session] != l.s || !l.s.bound || l.s.binding.Revision != l.binding.Revision {
		return false
	}
	l.s.bound = false
	l.s.init.Take()
	l.bound = false
	l.binding = Binding{Session: l.s.binding.Session}
	return true
}
