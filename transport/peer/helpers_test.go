package peer

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"
)

// fakeHandler records what reaches it. With redirect set it behaves as a follower:
// every leader-only call answers with the redirect and changes nothing.
type fakeHandler struct {
	mu       sync.Mutex
	redirect *NotLeaderError
	fail     error // returned by every call when set
	applied  [][]byte
	touches  []Touch
	joins    []JoinRequest
	leaves   []string
	reads    int
	status   Status
	// readIndex, when set, answers ReadIndex (after the leader checks).
	readIndex func(ctx context.Context) (uint64, error)
}

func (h *fakeHandler) check() error {
	if h.fail != nil {
		return h.fail
	}
	if h.redirect != nil {
		return h.redirect
	}
	return nil
}

func (h *fakeHandler) setRedirect(nl *NotLeaderError) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.redirect = nl
}

func (h *fakeHandler) Apply(_ context.Context, cmd []byte) ([]byte, uint64, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.check(); err != nil {
		return nil, 0, err
	}
	h.applied = append(h.applied, append([]byte(nil), cmd...))
	return append([]byte("applied:"), cmd...), uint64(len(h.applied)), nil
}

func (h *fakeHandler) ReadIndex(ctx context.Context) (uint64, error) {
	h.mu.Lock()
	if err := h.check(); err != nil {
		h.mu.Unlock()
		return 0, err
	}
	h.reads++
	n, fn := h.reads, h.readIndex
	h.mu.Unlock()
	if fn != nil {
		return fn(ctx)
	}
	return uint64(100 + n), nil
}

func (h *fakeHandler) Touch(_ context.Context, ts []Touch) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.check(); err != nil {
		return err
	}
	h.touches = append(h.touches, ts...)
	return nil
}

func (h *fakeHandler) Status(context.Context) (Status, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.fail != nil {
		return Status{}, h.fail
	}
	return h.status, nil
}

func (h *fakeHandler) Join(_ context.Context, req JoinRequest) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.check(); err != nil {
		return err
	}
	h.joins = append(h.joins, req)
	return nil
}

func (h *fakeHandler) Leave(_ context.Context, id string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.check(); err != nil {
		return err
	}
	h.leaves = append(h.leaves, id)
	return nil
}

func (h *fakeHandler) appliedCount() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.applied)
}

// serve starts a Server for h on 127.0.0.1:0 and returns its address; the server stops
// when the test ends.
func serve(t testing.TB, h Handler, opts ServerOptions) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := NewServer(h, opts)
	done := make(chan error, 1)
	go func() { done <- s.Serve(l) }()
	t.Cleanup(func() {
		s.Stop()
		if err := <-done; err != nil {
			t.Errorf("Serve returned %v after Stop", err)
		}
	})
	return l.Addr().String()
}

// dial connects a Client to addr, closed when the test ends.
func dial(t testing.TB, addr string, opts ClientOptions) *Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Dial(ctx, addr, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// testCtx is a context bounded well inside the test timeout.
func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

var errBoom = errors.New("boom")
