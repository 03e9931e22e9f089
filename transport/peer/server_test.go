package peer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"reflect"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestEveryCallRoundTripsThroughTheHandler(t *testing.T) {
	want := Status{
		ID: "r1", RaftAddr: "127.0.0.1:7001", PeerAddr: "127.0.0.1:7002", State: "Leader",
		LeaderID: "r1", LeaderPeerAddr: "127.0.0.1:7002", Term: 7, CommitIndex: 42, AppliedIndex: 41,
		LastContactMs: 3, ClusterID: "c-1", Version: "0.4.0",
		Discovery: []DiscoverySource{
			{Source: "file:/etc/fleet.json", LastGood: time.UnixMilli(1_700_000_000_123).UTC(), FailingSince: time.UnixMilli(1_700_000_001_456).UTC(),
				Failures: 3, LastError: "invalid worker spec: unexpected EOF", SuspectDrains: 2},
			{Source: "dns:vllm:8000"},
		},
	}
	h := &fakeHandler{status: want}
	c := dial(t, serve(t, h, ServerOptions{}), ClientOptions{})
	ctx := testCtx(t)

	res, idx, err := c.Apply(ctx, []byte{1, 2, 3})
	if err != nil || !bytes.Equal(res, []byte("applied:\x01\x02\x03")) || idx != 1 {
		t.Fatalf("Apply = %q, %d, %v", res, idx, err)
	}
	if ri, err := c.ReadIndex(ctx); err != nil || ri != 101 {
		t.Fatalf("ReadIndex = %d, %v; want 101", ri, err)
	}
	// A touch's age travels; a negative one (a sender's bug) arrives as 0, now.
	sent := []Touch{{Session: "s1", Revision: 5}, {Session: "s2", Revision: 9, End: true, Age: 1500 * time.Millisecond}, {Session: "s3", Revision: 2, Age: -time.Second}}
	touches := []Touch{sent[0], sent[1], {Session: "s3", Revision: 2}}
	if err := c.Touch(ctx, sent); err != nil {
		t.Fatal(err)
	}
	got, err := c.Status(ctx)
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("Status = %+v, %v; want %+v", got, err, want)
	}
	join := JoinRequest{ID: "r4", RaftAddr: "10.0.0.4:7001", PeerAddr: "10.0.0.4:7002", ClusterID: "c-1", Voter: true}
	if err := c.Join(ctx, join); err != nil {
		t.Fatal(err)
	}
	if err := c.Leave(ctx, "r3"); err != nil {
		t.Fatal(err)
	}

	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.applied) != 1 || !bytes.Equal(h.applied[0], []byte{1, 2, 3}) {
		t.Errorf("handler applied %q", h.applied)
	}
	if !reflect.DeepEqual(h.touches, touches) {
		t.Errorf("handler touches %+v, want %+v", h.touches, touches)
	}
	if len(h.joins) != 1 || h.joins[0] != join {
		t.Errorf("handler joins %+v, want %+v", h.joins, join)
	}
	if !reflect.DeepEqual(h.leaves, []string{"r3"}) {
		t.Errorf("handler leaves %v", h.leaves)
	}
}

func TestNotLeaderErrorSurvivesTheWire(t *testing.T) {
	redirect := &NotLeaderError{LeaderID: "r2", LeaderAddr: "127.0.0.1:9999"}
	h := &fakeHandler{redirect: redirect}
	c := dial(t, serve(t, h, ServerOptions{}), ClientOptions{})
	ctx := testCtx(t)

	calls := map[string]func() error{
		"Apply":     func() error { _, _, err := c.Apply(ctx, []byte{1}); return err },
		"ReadIndex": func() error { _, err := c.ReadIndex(ctx); return err },
		"Touch":     func() error { return c.Touch(ctx, []Touch{{Session: "s"}}) },
		"Join":      func() error { return c.Join(ctx, JoinRequest{ID: "x", RaftAddr: "y"}) },
		"Leave":     func() error { return c.Leave(ctx, "x") },
	}
	for name, call := range calls {
		t.Run(name, func(t *testing.T) {
			err := call()
			var nl *NotLeaderError
			if !errors.As(err, &nl) {
				t.Fatalf("err = %v (%T), want *NotLeaderError", err, err)
			}
			if *nl != *redirect {
				t.Fatalf("redirect = %+v, want %+v", nl, redirect)
			}
		})
	}
	if n := h.appliedCount(); n != 0 {
		t.Fatalf("a follower applied %d commands", n)
	}

	// No leader known: still a redirect, with empty fields.
	h.setRedirect(&NotLeaderError{})
	_, _, err := c.Apply(ctx, []byte{1})
	var nl *NotLeaderError
	if !errors.As(err, &nl) || nl.LeaderAddr != "" || nl.LeaderID != "" {
		t.Fatalf("err = %v, want an empty *NotLeaderError", err)
	}
}

// panicHandler panics on Apply; the server must answer Internal and keep serving.
type panicHandler struct{ fakeHandler }

func (*panicHandler) Apply(context.Context, []byte) ([]byte, uint64, error) {
	panic("handler bug")
}

func TestHandlerErrorsMapToCodes(t *testing.T) {
	cases := []struct {
		name     string
		err      error
		code     codes.Code
		sentinel error // errors.Is must find it on the client side; nil: none
	}{
		{"invalid", fmt.Errorf("%w: bad session", ErrInvalid), codes.InvalidArgument, ErrInvalid},
		{"unavailable", fmt.Errorf("%w: no quorum", ErrUnavailable), codes.Unavailable, ErrUnavailable},
		{"canceled", fmt.Errorf("apply: %w", context.Canceled), codes.Canceled, context.Canceled},
		{"deadline", fmt.Errorf("apply: %w", context.DeadlineExceeded), codes.DeadlineExceeded, context.DeadlineExceeded},
		{"other", errBoom, codes.Internal, nil},
		{"grpc status kept", status.Error(codes.ResourceExhausted, "too many bindings"), codes.ResourceExhausted, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := dial(t, serve(t, &fakeHandler{fail: tc.err}, ServerOptions{}), ClientOptions{})
			_, _, err := c.Apply(testCtx(t), []byte{1})
			var ce *CallError
			if !errors.As(err, &ce) {
				t.Fatalf("err = %v (%T), want *CallError", err, err)
			}
			if ce.Code != tc.code || status.Code(err) != tc.code {
				t.Fatalf("code = %v (status.Code %v), want %v", ce.Code, status.Code(err), tc.code)
			}
			if tc.sentinel != nil && !errors.Is(err, tc.sentinel) {
				t.Fatalf("errors.Is(%v, %v) = false", err, tc.sentinel)
			}
			for _, s := range []error{ErrInvalid, ErrUnavailable, context.Canceled, context.DeadlineExceeded} {
				if s != tc.sentinel && errors.Is(err, s) {
					t.Fatalf("%v also matches %v", err, s)
				}
			}
		})
	}

	t.Run("panic", func(t *testing.T) {
		c := dial(t, serve(t, &panicHandler{}, ServerOptions{}), ClientOptions{})
		_, _, err := c.Apply(testCtx(t), []byte{1})
		if status.Code(err) != codes.Internal {
			t.Fatalf("err = %v, want Internal", err)
		}
		if _, err := c.ReadIndex(testCtx(t)); err != nil {
			t.Fatalf("server unusable after a handler panic: %v", err)
		}
	})
}

func TestMalformedRequestsAreInvalid(t *testing.T) {
	h := &fakeHandler{}
	c := dial(t, serve(t, h, ServerOptions{}), ClientOptions{})
	ctx := testCtx(t)
	if _, _, err := c.Apply(ctx, nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("empty command: err = %v, want ErrInvalid", err)
	}
	if err := c.Leave(ctx, ""); !errors.Is(err, ErrInvalid) {
		t.Errorf("empty leave id: err = %v, want ErrInvalid", err)
	}
	if n := h.appliedCount(); n != 0 {
		t.Errorf("handler applied %d commands", n)
	}
}

func TestCallerDeadlineComesBackAsDeadlineExceeded(t *testing.T) {
	h := &fakeHandler{readIndex: func(ctx context.Context) (uint64, error) {
		<-ctx.Done() // the caller's deadline propagates to the handler
		return 0, ctx.Err()
	}}
	c := dial(t, serve(t, h, ServerOptions{}), ClientOptions{})
	ctx, cancel := context.WithTimeout(testCtx(t), 50*time.Millisecond)
	defer cancel()
	_, err := c.ReadIndex(ctx)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want DeadlineExceeded", err)
	}
}

func TestPoolSharesOneClientPerAddress(t *testing.T) {
	addr := serve(t, &fakeHandler{}, ServerOptions{})
	p := NewPool(ClientOptions{})
	a, err := p.Get(addr)
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Get(addr)
	if err != nil {
		t.Fatal(err)
	}
	if a != b {
		t.Fatal("two clients for one address")
	}
	if err := a.Close(); err != nil { // a pooled client's Close leaves it usable
		t.Fatal(err)
	}
	if _, err := b.Status(testCtx(t)); err != nil {
		t.Fatalf("pooled client after Close: %v", err)
	}
	p.Forget(addr)
	c, err := p.Get(addr)
	if err != nil || c == a {
		t.Fatalf("after Forget: %p, %v; want a new client", c, err)
	}
	if _, err := p.Get(""); !errors.Is(err, ErrInvalid) {
		t.Fatalf("empty address: %v, want ErrInvalid", err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Get(addr); !errors.Is(err, ErrClosed) {
		t.Fatalf("Get after Close: %v, want ErrClosed", err)
	}
}
