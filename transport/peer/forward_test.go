package peer

import (
	"bytes"
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// leaderView is a LeaderFunc whose answer the test sets; every question is signalled on
// asked (without blocking) so a test can order its steps after the forwarder's.
type leaderView struct {
	addr  atomic.Pointer[string]
	asked chan struct{}
	n     atomic.Int64
}

func newLeaderView() *leaderView { return &leaderView{asked: make(chan struct{}, 1024)} }

func (v *leaderView) set(addr string) { v.addr.Store(&addr) }

func (v *leaderView) leader() (string, bool) {
	v.n.Add(1)
	select {
	case v.asked <- struct{}{}:
	default:
	}
	p := v.addr.Load()
	if p == nil {
		return "", false
	}
	return *p, true
}

func fastForwarder(t *testing.T, v *leaderView) *Forwarder {
	p := NewPool(ClientOptions{})
	t.Cleanup(func() { p.Close() })
	return NewForwarder(p, v.leader, ForwarderOptions{MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})
}

func TestForwarderFollowsRedirectAndOnlyTheLeaderApplies(t *testing.T) {
	leader := &fakeHandler{}
	leaderAddr := serve(t, leader, ServerOptions{})
	follower := &fakeHandler{redirect: &NotLeaderError{LeaderID: "r1", LeaderAddr: leaderAddr}}
	followerAddr := serve(t, follower, ServerOptions{})

	v := newLeaderView()
	v.set(followerAddr) // a stale view: the follower is thought to lead
	f := fastForwarder(t, v)
	res, idx, err := f.Forward(testCtx(t), []byte("bind s1"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(res, []byte("applied:bind s1")) || idx != 1 {
		t.Fatalf("Forward = %q, %d", res, idx)
	}
	if n := leader.appliedCount(); n != 1 {
		t.Errorf("leader applied %d commands, want 1", n)
	}
	if n := follower.appliedCount(); n != 0 {
		t.Errorf("follower applied %d commands, want 0", n)
	}

	// The other leader-only calls follow the same redirect.
	ctx := testCtx(t)
	if ri, err := f.ReadIndex(ctx); err != nil || ri == 0 {
		t.Fatalf("ReadIndex = %d, %v", ri, err)
	}
	if err := f.Touch(ctx, []Touch{{Session: "s1", Revision: 1}}); err != nil {
		t.Fatal(err)
	}
	if err := f.Leave(ctx, "r3"); err != nil {
		t.Fatal(err)
	}
	leader.mu.Lock()
	defer leader.mu.Unlock()
	if len(leader.touches) != 1 || len(leader.leaves) != 1 || leader.reads != 1 {
		t.Fatalf("leader saw touches %v, leaves %v, reads %d", leader.touches, leader.leaves, leader.reads)
	}
}

func TestForwarderJoinsViaASeedWhenNoLeaderIsKnown(t *testing.T) {
	leader := &fakeHandler{}
	leaderAddr := serve(t, leader, ServerOptions{})
	seed := &fakeHandler{redirect: &NotLeaderError{LeaderID: "r1", LeaderAddr: leaderAddr}}
	seedAddr := serve(t, seed, ServerOptions{})

	f := fastForwarder(t, newLeaderView()) // a fresh replica knows no leader
	req := JoinRequest{ID: "r4", RaftAddr: "127.0.0.1:1", PeerAddr: "127.0.0.1:2", Voter: true}
	if err := f.JoinVia(testCtx(t), seedAddr, req); err != nil {
		t.Fatal(err)
	}
	leader.mu.Lock()
	defer leader.mu.Unlock()
	if len(leader.joins) != 1 || leader.joins[0] != req {
		t.Fatalf("leader joins %+v", leader.joins)
	}
	if len(seed.joins) != 0 {
		t.Fatalf("seed (a follower) recorded joins %+v", seed.joins)
	}
}

// closedAddr is an address on which nothing listens.
func closedAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

func TestForwarderRetriesUntilALeaderIsKnown(t *testing.T) {
	cases := []struct {
		name string
		// setup leaves no leader usable and returns the step that makes one usable.
		setup func(t *testing.T, v *leaderView, leader *fakeHandler, leaderAddr string) (after func())
	}{
		{"no leader known", func(t *testing.T, v *leaderView, _ *fakeHandler, leaderAddr string) func() {
			return func() { v.set(leaderAddr) }
		}},
		{"election in progress", func(t *testing.T, v *leaderView, leader *fakeHandler, leaderAddr string) func() {
			leader.setRedirect(&NotLeaderError{}) // the replica knows no leader yet
			v.set(leaderAddr)
			return func() { leader.setRedirect(nil) }
		}},
		{"leader unreachable", func(t *testing.T, v *leaderView, _ *fakeHandler, leaderAddr string) func() {
			v.set(closedAddr(t))
			return func() { v.set(leaderAddr) }
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			leader := &fakeHandler{}
			leaderAddr := serve(t, leader, ServerOptions{})
			v := newLeaderView()
			after := tc.setup(t, v, leader, leaderAddr)
			f := fastForwarder(t, v)

			type result struct {
				res []byte
				err error
			}
			done := make(chan result, 1)
			go func() {
				res, _, err := f.Forward(testCtx(t), []byte("c"))
				done <- result{res, err}
			}()
			// Three questions to the view mean at least two rounds failed and were retried.
			for range 3 {
				<-v.asked
			}
			select {
			case r := <-done:
				t.Fatalf("Forward returned %q, %v before a leader was usable", r.res, r.err)
			default:
			}
			if n := leader.appliedCount(); n != 0 {
				t.Fatalf("applied %d before the leader was usable", n)
			}
			after()
			r := <-done
			if r.err != nil || string(r.res) != "applied:c" {
				t.Fatalf("Forward = %q, %v", r.res, r.err)
			}
			if n := leader.appliedCount(); n != 1 {
				t.Fatalf("leader applied %d, want 1", n)
			}
		})
	}
}

func TestForwarderGivesUpWhenTheContextEnds(t *testing.T) {
	// Two followers pointing at each other: redirects are bounded per round, rounds
	// back off, and the context ends it.
	a, b := &fakeHandler{}, &fakeHandler{}
	aAddr, bAddr := serve(t, a, ServerOptions{}), serve(t, b, ServerOptions{})
	a.setRedirect(&NotLeaderError{LeaderID: "b", LeaderAddr: bAddr})
	b.setRedirect(&NotLeaderError{LeaderID: "a", LeaderAddr: aAddr})
	v := newLeaderView()
	v.set(aAddr)
	f := fastForwarder(t, v)

	ctx, cancel := context.WithTimeout(testCtx(t), 100*time.Millisecond)
	defer cancel()
	_, _, err := f.Forward(ctx, []byte("c"))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want DeadlineExceeded", err)
	}
	if a.appliedCount()+b.appliedCount() != 0 {
		t.Fatal("a follower applied the command")
	}
}

func TestForwarderDoesNotRetryARefusal(t *testing.T) {
	leader := &fakeHandler{fail: ErrInvalid}
	v := newLeaderView()
	v.set(serve(t, leader, ServerOptions{}))
	f := fastForwarder(t, v)
	_, _, err := f.Forward(testCtx(t), []byte("c"))
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("err = %v, want ErrInvalid", err)
	}
	if n := v.n.Load(); n != 1 {
		t.Fatalf("asked for the leader %d times; a refusal must not be retried", n)
	}
}
