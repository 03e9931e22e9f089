package routing

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
)

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func TestFirstRequestInitializesThenBinds(t *testing.T) {
	m := NewMemoryAffinity(time.Minute, 0)
	ctx := context.Background()
	l, err := m.Acquire(ctx, "s", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, bound := l.Binding(); bound {
		t.Fatal("first lease must initialise")
	}
	b, err := l.Commit(ctx, worker("w1"), "")
	if err != nil || b.Worker != worker("w1") || b.Revision == 0 {
		t.Fatalf("commit = %+v, %v", b, err)
	}
	l.Release()
	l2, err := m.Acquire(ctx, "s", nil)
	if err != nil {
		t.Fatal(err)
	}
	got, bound := l2.Binding()
	if !bound || got != b {
		t.Fatalf("second acquire = %+v bound=%v, want %+v", got, bound, b)
	}
	if _, err := l2.Commit(ctx, worker("w2"), ""); err == nil {
		t.Fatal("a bound lease must not commit")
	}
}

func TestConcurrentFirstRequestsWaitForInitializer(t *testing.T) {
	m := NewMemoryAffinity(time.Minute, 0)
	ctx := context.Background()
	init, err := m.Acquire(ctx, "s", nil)
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 8
	results := make(chan Binding, waiters)
	errs := make(chan error, waiters)
	for range waiters {
		go func() {
			l, err := m.Acquire(ctx, "s", nil)
			if err != nil {
				errs <- err
				return
			}
			b, bound := l.Binding()
			if !bound {
				errs <- errors.New("waiter became an initializer while the first one was alive")
				return
			}
			l.Release()
			results <- b
		}()
	}
	select {
	case b := <-results:
		t.Fatalf("a waiter got %+v before the initializer committed", b)
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	want, err := init.Commit(ctx, worker("w3"), "")
	if err != nil {
		t.Fatal(err)
	}
	for range waiters {
		select {
		case b := <-results:
			if b != want {
				t.Fatalf("waiter saw %+v, want %+v", b, want)
			}
		case err := <-errs:
			t.Fatal(err)
		case <-time.After(10 * time.Second):
			t.Fatal("waiters never proceeded")
		}
	}
}

func TestInitializerGivingUpLetsAWaiterInitialize(t *testing.T) {
	m := NewMemoryAffinity(time.Minute, 0)
	ctx := context.Background()
	init, _ := m.Acquire(ctx, "s", nil)
	got := make(chan Lease, 1)
	go func() {
		l, err := m.Acquire(ctx, "s", nil)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	init.Invalidate(ctx)
	select {
	case l := <-got:
		if _, bound := l.Binding(); bound {
			t.Fatal("the waiter must become the initializer")
		}
		if _, err := l.Commit(ctx, worker("w2"), ""); err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("waiter stuck")
	}
}

func TestWaitingForInitializerHonoursCancellation(t *testing.T) {
	m := NewMemoryAffinity(time.Minute, 0)
	init, _ := m.Acquire(context.Background(), "s", nil)
	defer init.Release()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := m.Acquire(ctx, "s", nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want canceled", err)
	}
}

func TestInvalidateIsRevisionGuarded(t *testing.T) {
	m := NewMemoryAffinity(time.Minute, 0)
	ctx := context.Background()
	l, _ := m.Acquire(ctx, "s", nil)
	old, _ := l.Commit(ctx, worker("w1"), "")
	l.Release()
	// Someone invalidates and rebinds; a late invalidate of the old revision must not touch it.
	if err := m.Invalidate(ctx, "s", old.Revision); err != nil {
		t.Fatal(err)
	}
	l2, _ := m.Acquire(ctx, "s", nil)
	fresh, _ := l2.Commit(ctx, worker("w2"), "")
	l2.Release()
	if fresh.Revision <= old.Revision {
		t.Fatalf("revision went from %d to %d", old.Revision, fresh.Revision)
	}
	_ = m.Invalidate(ctx, "s", old.Revision)
	if b, ok, _ := m.Peek(ctx, "s"); !ok || b != fresh {
		t.Fatalf("stale invalidate removed %+v (ok=%v)", b, ok)
	}
	// A lease holding the old binding cannot drop the new one either.
	stale := &memoryLease{store: m, s: &session{binding: old, bound: true}, bound: true, binding: old}
	stale.Invalidate(ctx)
	if b, ok, _ := m.Peek(ctx, "s"); !ok || b != fresh {
		t.Fatalf("stale lease removed %+v (ok=%v)", b, ok)
	}
}

func TestTTLCountsFromTheEndOfTheLastRequest(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	m := NewMemoryAffinity(time.Minute, 0).WithClock(clock.now)
	ctx := context.Background()
	l, _ := m.Acquire(ctx, "s", nil)
	b, _ := l.Commit(ctx, worker("w1"), "")
	clock.add(10 * time.Minute) // a long request: never expires while active
	if got, ok, _ := m.Peek(ctx, "s"); !ok || got != b {
		t.Fatal("binding expired while its request was in flight")
	}
	l.Release()
	clock.add(59 * time.Second)
	if _, ok, _ := m.Peek(ctx, "s"); !ok {
		t.Fatal("binding expired before its TTL after the request ended")
	}
	clock.add(2 * time.Second)
	if _, ok, _ := m.Peek(ctx, "s"); ok {
		t.Fatal("binding still there past its TTL")
	}
	if n := m.Expire(); n != 1 {
		t.Fatalf("Expire = %d, want 1", n)
	}
	l3, _ := m.Acquire(ctx, "s", nil)
	if _, bound := l3.Binding(); bound {
		t.Fatal("expired session must initialise again")
	}
}

func TestExplicitTargetMustMatchALiveBinding(t *testing.T) {
	m := NewMemoryAffinity(time.Minute, 0)
	ctx := context.Background()
	w1, w2 := worker("w1"), worker("w2")
	l, err := m.Acquire(ctx, "s", &w1)
	if err != nil {
		t.Fatal(err)
	}
	if _, bound := l.Binding(); bound {
		t.Fatal("explicit target on a new session initialises it")
	}
	l.Commit(ctx, w1, "")
	l.Release()
	if _, err := m.Acquire(ctx, "s", &w2); !errors.Is(err, ErrTargetConflict) {
		t.Fatalf("err = %v, want ErrTargetConflict", err)
	}
	l2, err := m.Acquire(ctx, "s", &w1)
	if err != nil {
		t.Fatal(err)
	}
	if b, bound := l2.Binding(); !bound || b.Worker != w1 {
		t.Fatal("a matching explicit target must find the binding")
	}
}

func TestSessionCapAnswersTooManySessions(t *testing.T) {
	m := NewMemoryAffinity(time.Minute, 2)
	ctx := context.Background()
	for _, s := range []string{"a", "b"} {
		l, err := m.Acquire(ctx, s, nil)
		if err != nil {
			t.Fatal(err)
		}
		l.Commit(ctx, worker("w1"), "")
		l.Release()
	}
	if _, err := m.Acquire(ctx, "c", nil); !errors.Is(err, ErrTooManySessions) {
		t.Fatalf("err = %v, want ErrTooManySessions", err)
	}
	for _, s := range []string{"a", "b"} {
		if _, ok, _ := m.Peek(ctx, s); !ok {
			t.Fatalf("live session %s was evicted", s)
		}
	}
}

// TestABindingKeepsItsOwnCopyOfTheKey: the key a session is bound under is not the caller's
// string (a slice of a request's head, which it would keep alive as long as the binding).
func TestABindingKeepsItsOwnCopyOfTheKey(t *testing.T) {
	m := NewMemoryAffinity(time.Minute, 0)
	ctx := context.Background()
	head := "x-session-id: s1\r\n" + strings.Repeat("x", 4096)
	key := head[len("x-session-id: ") : len("x-session-id: ")+2]
	l, err := m.Acquire(ctx, key, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Commit(ctx, worker("w1"), ""); err != nil {
		t.Fatal(err)
	}
	l.Release()
	b, ok, err := m.Peek(ctx, "s1")
	if err != nil || !ok {
		t.Fatalf("peek = %v, %v", ok, err)
	}
	if b.Session != key {
		t.Fatalf("bound under %q, want %q", b.Session, key)
	}
	if unsafe.StringData(b.Session) == unsafe.StringData(key) {
		t.Fatal("the binding keeps the caller's string, and with it the whole head")
	}
}
