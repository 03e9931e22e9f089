package h1

import (
	"errors"
	"io"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// serveFast serves h with cfg on a loopback port and returns the server and its address.
func serveFast(t *testing.T, cfg Config) (*Server, string) {
	t.Helper()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := listenLoopback()
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = s.Serve(ln) }()
	t.Cleanup(func() { _ = s.Close() })
	return s, ln.Addr().String()
}

// onlyConn is the server's one connection.
func onlyConn(t *testing.T, s *Server) *conn {
	t.Helper()
	var c *conn
	poll.Until(t, 5*time.Second, func() error {
		s.mu.Lock()
		defer s.mu.Unlock()
		for k := range s.conns {
			c = k
		}
		if len(s.conns) != 1 {
			return errors.New("not one connection")
		}
		return nil
	})
	return c
}

// TestQuickAnswersStartNoWatch: requests answered within a tick leave the connection
// unwatched (no watcher goroutine, no deadline); a handler that runs longer has it watched,
// and the connection serves on after the watch's answer.
func TestQuickAnswersStartNoWatch(t *testing.T) {
	slow := make(chan struct{})
	s, addr := serveFast(t, Config{Tick: 50 * time.Millisecond, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-slow
		}
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, "ok")
	})})
	c := dial(t, addr)
	for range 20 {
		c.send(t, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
		if resp, body := c.answer(t); resp == nil || body != "ok" {
			t.Fatalf("answer %v %q", resp, body)
		}
	}
	conn := onlyConn(t, s)
	conn.wmu.Lock()
	watched := conn.watcher
	conn.wmu.Unlock()
	if watched {
		t.Fatal("quick answers started a watch")
	}
	c.send(t, "GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
	poll.Until(t, 5*time.Second, func() error {
		if phaseOf(conn.state.Load()) != phaseWatched {
			return errors.New("the slow request is not watched yet")
		}
		return nil
	})
	close(slow)
	if resp, body := c.answer(t); resp == nil || body != "ok" {
		t.Fatalf("slow answer %v %q", resp, body)
	}
	c.send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp, body := c.answer(t); resp == nil || body != "ok" {
		t.Fatalf("answer after the watch %v %q", resp, body)
	}
}

// TestBodyTimeoutCutsATricklingBody: a body not in within BodyTimeout of its head fails the
// handler's read with a deadline error; one that comes in time is read whole.
func TestBodyTimeoutCutsATricklingBody(t *testing.T) {
	got := make(chan error, 2)
	_, addr := serveFast(t, Config{BodyTimeout: 200 * time.Millisecond, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, err := io.ReadAll(r.Body)
		got <- err
		if err != nil {
			w.WriteHeader(http.StatusRequestTimeout)
		}
	})})
	quick := dial(t, addr)
	quick.send(t, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi")
	if err := <-got; err != nil {
		t.Fatalf("a body in time: %v", err)
	}
	trickle := dial(t, addr)
	trickle.send(t, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nh")
	select {
	case err := <-got:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a trickling body: %v; want a deadline error", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a trickling body was not cut within 5s")
	}
	if resp, _ := trickle.answer(t); resp == nil || resp.StatusCode != http.StatusRequestTimeout {
		t.Fatalf("answer %v; want 408", resp)
	}
}

// TestAConnectionAfterAQuietSpellIsTimedFromNow: the clock stops with no connection; the
// first connection after it is timed from its own arrival, not from the clock's last tick.
func TestAConnectionAfterAQuietSpellIsTimedFromNow(t *testing.T) {
	s, addr := serveFast(t, Config{HeaderTimeout: time.Second, Tick: 20 * time.Millisecond,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })})
	// An hour of quiet, as the stopped clock last read it.
	s.clock.Store(time.Now().Add(-time.Hour).UnixMilli())
	arrived := time.Now().UnixMilli()
	c := dial(t, addr)
	onlyConn(t, s)
	// Two ticks after the arrival, the clock has looked at the connection with a fresh time
	// (an expiry from the stale one would have ended it).
	poll.Until(t, 5*time.Second, func() error {
		if s.nowMs() < arrived+2*20 {
			return errors.New("the clock has not ticked twice since the connection came")
		}
		return nil
	})
	c.send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp, body := c.answer(t); resp == nil || body != "ok" {
		t.Fatalf("answer %v %q; the connection was timed from the stale clock", resp, body)
	}
}

// TestShutdownEndsAWatchedIdleConnection: a connection whose watch waits for the next
// request ends at Shutdown, as an unwatched idle one does.
func TestShutdownEndsAWatchedIdleConnection(t *testing.T) {
	slow := make(chan struct{})
	s, addr := serveFast(t, Config{Tick: 20 * time.Millisecond, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-slow
		_, _ = io.WriteString(w, "ok")
	})})
	c := dial(t, addr)
	c.send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
	conn := onlyConn(t, s)
	poll.Until(t, 5*time.Second, func() error {
		if phaseOf(conn.state.Load()) != phaseWatched {
			return errors.New("not watched yet")
		}
		return nil
	})
	close(slow)
	if resp, _ := c.answer(t); resp == nil {
		t.Fatal("no answer")
	}
	poll.Until(t, 5*time.Second, func() error {
		if phaseOf(conn.state.Load()) != phaseWatchedIdle {
			return errors.New("not idle under its watch yet")
		}
		return nil
	})
	done := make(chan error, 1)
	go func() { done <- s.Shutdown(t.Context()) }()
	_ = c.c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.br.ReadByte(); !isReset(err) {
		t.Fatalf("read %v; want the server's close", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestARepeatedTargetIsTheRequestsOwnURL: a connection's requests for one target each get
// their own URL, whatever a handler did to the one before.
func TestARepeatedTargetIsTheRequestsOwnURL(t *testing.T) {
	_, addr := serveFast(t, Config{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, r.URL.Path+"?"+r.URL.RawQuery+" "+r.RequestURI)
		r.URL.Path, r.URL.RawQuery = "/changed", "by=handler"
	})})
	c := dial(t, addr)
	for _, tc := range []struct{ target, want string }{
		{"/v1/completions?a=1", "/v1/completions?a=1 /v1/completions?a=1"},
		{"/v1/completions?a=1", "/v1/completions?a=1 /v1/completions?a=1"},
		{"/v1/completions?a=1", "/v1/completions?a=1 /v1/completions?a=1"},
		{"/v1/completions?a=2", "/v1/completions?a=2 /v1/completions?a=2"},
		{"/v1/completions?a=2", "/v1/completions?a=2 /v1/completions?a=2"},
	} {
		c.send(t, "GET "+tc.target+" HTTP/1.1\r\nHost: a\r\n\r\n")
		if resp, body := c.answer(t); resp == nil || body != tc.want {
			t.Fatalf("%s: answer %v %q; want %q", tc.target, resp, body, tc.want)
		}
	}
}
