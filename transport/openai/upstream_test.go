package openai

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// connCounter counts the connections a test server accepts and closes.
type connCounter struct {
	opened, closed atomic.Int64
}

func (c *connCounter) track(_ net.Conn, s http.ConnState) {
	switch s {
	case http.StateNew:
		c.opened.Add(1)
	case http.StateClosed, http.StateHijacked:
		c.closed.Add(1)
	}
}

// lastSeen is what a test worker saw of the latest request it served.
type lastSeen struct {
	mu   sync.Mutex
	last string
}

func (l *lastSeen) set(v string) { l.mu.Lock(); l.last = v; l.mu.Unlock() }
func (l *lastSeen) get() string  { l.mu.Lock(); defer l.mu.Unlock(); return l.last }

// countedServer serves h and counts its connections.
func countedServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *connCounter) {
	t.Helper()
	cc := &connCounter{}
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ConnState = cc.track
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, cc
}

func testUpstream(t *testing.T) *upstream {
	t.Helper()
	u := newUpstream(2*time.Second, nil)
	t.Cleanup(u.close)
	return u
}

func post(body string) outbound {
	return outbound{method: http.MethodPost, target: "/v1/completions", body: []byte(body),
		forwarding: forwardContentType([]string{"application/json"})}
}

// trip makes one request with a first-byte deadline a minute away.
func trip(ctx context.Context, u *upstream, base string, req outbound) (*http.Response, error) {
	resp, _, err := u.roundTrip(ctx, base, req, time.Now().Add(time.Minute))
	return resp, err
}

// send makes one request and reads the answer to its end.
func send(t *testing.T, u *upstream, base string, req outbound) (*http.Response, string) {
	t.Helper()
	resp, err := trip(context.Background(), u, base, req)
	if err != nil {
		t.Fatalf("roundTrip: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read body: %v", err)
	}
	return resp, string(b)
}

// okAnswer is a worker's whole answer "ok", as raw HTTP.
const okAnswer = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

// withOnlyPooled runs f on the one connection pooled for base, under its pool's lock, and
// fails unless there is exactly one.
func withOnlyPooled(t *testing.T, u *upstream, base string, f func(c *upConn)) {
	t.Helper()
	p, err := u.host(base)
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.idle) != 1 {
		t.Fatalf("%d pooled connections, want 1", len(p.idle))
	}
	f(p.idle[0])
}

func idleConns(t *testing.T, u *upstream, base string) int {
	t.Helper()
	p, err := u.host(base)
	if err != nil {
		t.Fatal(err)
	}
	return p.idleCount()
}

func TestUpstreamSendsTheRequestAndReusesTheConnection(t *testing.T) {
	var seen lastSeen
	srv, cc := countedServer(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		seen.set(r.Method + " " + r.URL.RequestURI() + " " + r.Host + " " + r.Header.Get("Content-Type") + " " + string(body))
		if r.URL.Query().Get("chunked") != "" {
			_, _ = io.WriteString(w, "part1,")
			http.NewResponseController(w).Flush()
		}
		_, _ = io.WriteString(w, "answer")
	})
	u := testUpstream(t)
	host := strings.TrimPrefix(srv.URL, "http://")
	for i, target := range []string{"/v1/completions", "/v1/completions?chunked=1", "/v1/chat/completions"} {
		req := post(`{"n":1}`)
		req.target = target
		_, body := send(t, u, srv.URL+"/", req)
		want := "answer"
		if strings.Contains(target, "chunked") {
			want = "part1,answer"
		}
		if body != want {
			t.Fatalf("request %d: body %q, want %q", i, body, want)
		}
		if line, wantLine := seen.get(), "POST "+target+" "+host+" application/json "+`{"n":1}`; line != wantLine {
			t.Fatalf("worker saw %q, want %q", line, wantLine)
		}
	}
	if n := cc.opened.Load(); n != 1 {
		t.Fatalf("%d connections for three requests in turn, want 1", n)
	}
	if n := idleConns(t, u, srv.URL+"/"); n != 1 {
		t.Fatalf("%d idle connections, want 1", n)
	}
}

func TestUpstreamKeepsTheWorkerURLPathAndSpeaksTLS(t *testing.T) {
	paths := make(chan string, 1)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		paths <- r.URL.Path
		_, _ = io.WriteString(w, "ok")
	}))
	// The refused handshake below is expected; keep it out of the test output.
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	roots := srv.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	u := newUpstream(2*time.Second, &tls.Config{RootCAs: roots})
	t.Cleanup(u.close)
	resp, body := send(t, u, srv.URL+"/engine/", post("{}"))
	if resp.StatusCode != http.StatusOK || body != "ok" {
		t.Fatalf("status %d body %q", resp.StatusCode, body)
	}
	if p := <-paths; p != "/engine/v1/completions" {
		t.Fatalf("worker saw path %q, want /engine/v1/completions", p)
	}
	if resp.Proto != "HTTP/1.1" {
		t.Fatalf("spoke %s to an https worker, want HTTP/1.1", resp.Proto)
	}

	// Without the test CA the worker's certificate is refused.
	strict := testUpstream(t)
	if _, err := trip(context.Background(), strict, srv.URL, post("{}")); err == nil {
		t.Fatal("an unknown certificate was accepted")
	}
}

func TestUpstreamRetriesOnceWhenAPooledConnectionWasClosed(t *testing.T) {
	var requests atomic.Int64
	srv, cc := countedServer(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		requests.Add(1)
		_, _ = io.WriteString(w, "ok")
	})
	u := testUpstream(t)
	send(t, u, srv.URL, post("{}"))
	// The worker drops its idle connections, as at a keep-alive timeout or a restart.
	srv.CloseClientConnections()
	poll.Holds(t, 10*time.Second, "the worker to close its side", func() bool { return cc.closed.Load() == 1 })
	if _, body := send(t, u, srv.URL, post("{}")); body != "ok" {
		t.Fatalf("body %q", body)
	}
	if n := requests.Load(); n != 2 {
		t.Fatalf("worker served %d requests, want 2", n)
	}
	if n := cc.opened.Load(); n != 2 {
		t.Fatalf("%d connections, want 2 (one new after the close)", n)
	}
}

// rawWorker answers every connection with handle, which speaks raw HTTP.
func rawWorker(t *testing.T, handle func(conn net.Conn, br *bufio.Reader)) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		_ = l.Close()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer conn.Close()
				handle(conn, bufio.NewReader(conn))
			}()
		}
	}()
	return "http://" + l.Addr().String()
}

// readRequest consumes one request from br.
func readRequest(t *testing.T, br *bufio.Reader) bool {
	req, err := http.ReadRequest(br)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, req.Body)
	return true
}

func TestUpstreamDropsConnectionsItCannotTrust(t *testing.T) {
	tests := []struct {
		name   string
		answer string
		// readAll reads the body to its end; otherwise the body is closed after 2 bytes.
		readAll bool
	}{
		{"connection close", "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", true},
		{"http/1.0 without keep-alive", "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", true},
		{"bytes after the answer", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n", true},
		{"body left unread", "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789", false},
		{"end by close", "HTTP/1.1 200 OK\r\n\r\nuntil the end", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base := rawWorker(t, func(conn net.Conn, br *bufio.Reader) {
				if readRequest(t, br) {
					_, _ = io.WriteString(conn, tt.answer)
				}
			})
			u := testUpstream(t)
			resp, err := trip(context.Background(), u, base, post("{}"))
			if err != nil {
				t.Fatal(err)
			}
			if tt.readAll {
				if _, err := io.ReadAll(resp.Body); err != nil {
					t.Fatal(err)
				}
			} else if _, err := io.ReadFull(resp.Body, make([]byte, 2)); err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if n := idleConns(t, u, base); n != 0 {
				t.Fatalf("%d connections pooled, want 0", n)
			}
		})
	}
}

func TestUpstreamRefusesEndlessHeaders(t *testing.T) {
	base := rawWorker(t, func(conn net.Conn, br *bufio.Reader) {
		if !readRequest(t, br) {
			return
		}
		bw := bufio.NewWriter(conn)
		_, _ = bw.WriteString("HTTP/1.1 200 OK\r\n")
		line := "X-Filler: " + strings.Repeat("f", 1000) + "\r\n"
		// Twice the limit, unless the router hangs up first.
		for range 2 * maxResponseHead / len(line) {
			if _, err := bw.WriteString(line); err != nil {
				return
			}
		}
		_ = bw.Flush()
	})
	u := testUpstream(t)
	_, err := trip(context.Background(), u, base, post("{}"))
	if !errors.Is(err, errResponseHeadTooLarge) {
		t.Fatalf("error %v, want %v", err, errResponseHeadTooLarge)
	}
}

func TestUpstreamSkipsInformationalAnswers(t *testing.T) {
	base := rawWorker(t, func(conn net.Conn, br *bufio.Reader) {
		if readRequest(t, br) {
			_, _ = io.WriteString(conn, "HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"+okAnswer)
		}
	})
	resp, body := send(t, testUpstream(t), base, post("{}"))
	if resp.StatusCode != http.StatusOK || body != "ok" {
		t.Fatalf("status %d body %q, want 200 ok", resp.StatusCode, body)
	}
}

func TestUpstreamPassesAnAnswerSentBeforeTheBodyWasRead(t *testing.T) {
	base := rawWorker(t, func(conn net.Conn, br *bufio.Reader) {
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		// Refuse at the headers and hang up with the body unread (the connection resets).
		_, _ = io.WriteString(conn, "HTTP/1.1 413 Request Entity Too Large\r\nContent-Length: 3\r\n\r\nbig")
	})
	u := testUpstream(t)
	// Far more than the socket buffers hold, so the write fails on the reset.
	resp, body := send(t, u, base, post(strings.Repeat("x", 32<<20)))
	if resp.StatusCode != http.StatusRequestEntityTooLarge || body != "big" {
		t.Fatalf("status %d body %q, want the worker's 413", resp.StatusCode, body)
	}
}

func TestUpstreamCancelEndsAWaitAndDropsTheConnection(t *testing.T) {
	release := make(chan struct{})
	srv, cc := countedServer(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, "first")
		http.NewResponseController(w).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	// Cleanups run last first: the handler must be let go before the server closes.
	t.Cleanup(func() { close(release) })
	u := testUpstream(t)
	ctx, cancel := context.WithCancelCause(context.Background())
	resp, err := trip(ctx, u, srv.URL, post("{}"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	if n, err := resp.Body.Read(buf); err != nil || string(buf[:n]) != "first" {
		t.Fatalf("first read %q, %v", buf[:n], err)
	}
	cancel(errIdle)
	if _, err := io.ReadAll(resp.Body); err == nil {
		t.Fatal("a read after cancel ended cleanly")
	}
	resp.Body.Close()
	poll.Holds(t, 10*time.Second, "the worker to see the connection close", func() bool { return cc.closed.Load() == 1 })
	if n := idleConns(t, u, srv.URL); n != 0 {
		t.Fatalf("%d connections pooled after a cancel, want 0", n)
	}

	// A cancel before the answer comes reports its cause.
	ctx, cancel = context.WithCancelCause(context.Background())
	cancel(errFirstByte)
	if _, err := trip(ctx, u, srv.URL, post("{}")); !errors.Is(err, errFirstByte) {
		t.Fatalf("error %v, want the cause %v", err, errFirstByte)
	}
}

func TestUpstreamClosesIdleConnectionsAfterTheTimeout(t *testing.T) {
	srv, cc := countedServer(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	u := testUpstream(t)
	u.idleTimeout = 20 * time.Millisecond
	send(t, u, srv.URL, post("{}"))
	poll.Holds(t, 10*time.Second, "the idle connection to be closed", func() bool {
		return cc.closed.Load() == 1 && idleConns(t, u, srv.URL) == 0
	})
	// The pool works on after a sweep.
	if _, body := send(t, u, srv.URL, post("{}")); body != "ok" {
		t.Fatalf("body %q", body)
	}
}

func TestUpstreamRejectsBadWorkerURLs(t *testing.T) {
	u := testUpstream(t)
	for _, base := range []string{"ftp://h/", "http://", "://x", "h:1"} {
		if _, err := trip(context.Background(), u, base, post("{}")); err == nil {
			t.Errorf("worker url %q accepted", base)
		}
	}
}

func TestUpstreamGivesUpAtTheDeadlines(t *testing.T) {
	release := make(chan struct{})
	srv, _ := countedServer(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.URL.Query().Get("stall") == "body" {
			w.WriteHeader(http.StatusOK)
			http.NewResponseController(w).Flush()
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	// Cleanups run last first: the handlers must be let go before the server closes.
	t.Cleanup(func() { close(release) })
	u := testUpstream(t)

	// No answer at all by the first-byte deadline.
	req := post("{}")
	req.target = "/?stall=head"
	_, _, err := u.roundTrip(context.Background(), srv.URL, req, time.Now().Add(20*time.Millisecond))
	var netErr net.Error
	if !errors.Is(err, errNoAnswer) || !errors.As(err, &netErr) || !netErr.Timeout() {
		t.Fatalf("error %v, want a timeout wrapping %v", err, errNoAnswer)
	}

	// Headers, then nothing: the caller's read deadline ends the read.
	req.target = "/?stall=body"
	resp, body, err := u.roundTrip(context.Background(), srv.URL, req, time.Now().Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body.setReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := body.Read(make([]byte, 8)); !errors.Is(err, os.ErrDeadlineExceeded) || body.conn.isCancelled() {
		t.Fatalf("read error %v (cancelled %v), want a deadline", err, body.conn.isCancelled())
	}
}

func TestUpstreamReusesAConnectionWhoseLastDeadlinePassed(t *testing.T) {
	srv, cc := countedServer(t, func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	u := testUpstream(t)
	send(t, u, srv.URL, post("{}"))
	// Pooled connections keep their last deadline; here it has passed while the connection
	// was idle, as it does after a long enough pause.
	var c *upConn
	withOnlyPooled(t, u, srv.URL, func(pc *upConn) { c = pc })
	c.mu.Lock()
	_ = c.conn.SetDeadline(aLongTimeAgo)
	c.readBy, c.writeBy = aLongTimeAgo, aLongTimeAgo
	c.mu.Unlock()
	if _, body := send(t, u, srv.URL, post("{}")); body != "ok" {
		t.Fatalf("body %q, want ok", body)
	}
	if n := cc.opened.Load(); n != 1 {
		t.Fatalf("%d connections, want the pooled one reused", n)
	}
}

// deadlineConn is a net.Conn that records the deadlines set on it.
type deadlineConn struct {
	net.Conn
	sets            int
	readBy, writeBy time.Time
}

func (c *deadlineConn) SetDeadline(t time.Time) error {
	c.sets++
	c.readBy, c.writeBy = t, t
	return nil
}

func (c *deadlineConn) SetReadDeadline(t time.Time) error {
	c.sets++
	c.readBy = t
	return nil
}

// TestExchangeKeepsADeadlineThatStillServes checks that an exchange moves the connection's
// deadlines only when the ones in force are earlier than asked or later by more than a 64th
// of the time left, and that what is in force afterwards is never earlier than asked.
func TestExchangeKeepsADeadlineThatStillServes(t *testing.T) {
	now := time.Now()
	base := now.Add(time.Hour)
	cases := []struct {
		name    string
		readBy  time.Time // in force before (writeBy the same unless readOnly)
		writeBy time.Time
		ask     time.Time
		moved   bool
	}{
		{name: "none in force", ask: base, moved: true},
		{name: "a later exchange on a busy connection", readBy: base, writeBy: base, ask: base.Add(-time.Second)},
		{name: "the same deadline", readBy: base, writeBy: base, ask: base},
		{name: "an earlier one in force", readBy: base, writeBy: base, ask: base.Add(time.Second), moved: true},
		{name: "too far out", readBy: base.Add(2 * time.Minute), writeBy: base.Add(2 * time.Minute), ask: base, moved: true},
		{name: "a stream's idle read deadline", readBy: base.Add(-time.Minute), writeBy: base, ask: base, moved: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dc := &deadlineConn{readBy: tc.readBy, writeBy: tc.writeBy}
			c := &upConn{conn: dc, readBy: tc.readBy, writeBy: tc.writeBy}
			c.exchangeDeadline(now, tc.ask)
			if moved := dc.sets > 0; moved != tc.moved {
				t.Fatalf("deadline moved: %v, want %v", moved, tc.moved)
			}
			if dc.readBy.Before(tc.ask) || dc.writeBy.Before(tc.ask) {
				t.Fatalf("deadlines in force %v (read), %v (write): earlier than the %v asked", dc.readBy, dc.writeBy, tc.ask)
			}
			if slack := tc.ask.Sub(now) / 64; dc.readBy.Sub(tc.ask) > slack {
				t.Fatalf("read deadline %v is %v past the one asked", dc.readBy, dc.readBy.Sub(tc.ask))
			}
		})
	}
}

// ownAfterFuncCtx is a request context that runs functions once it is cancelled through an
// AfterFunc method of its own, the kind a server can give its requests; Done and Value it
// does not serve (the exchange must not need them), and it counts the stops.
type ownAfterFuncCtx struct {
	t *testing.T
	context.Context
	mu      sync.Mutex
	err     error
	waiting map[int]func()
	next    int
	stops   int
}

func (c *ownAfterFuncCtx) Done() <-chan struct{} {
	c.t.Error("the exchange watched the context's Done channel instead of asking its AfterFunc")
	return nil
}

func (c *ownAfterFuncCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *ownAfterFuncCtx) AfterFunc(f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	id := c.next
	c.next++
	c.waiting[id] = f
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		_, ok := c.waiting[id]
		delete(c.waiting, id)
		c.stops++
		return ok
	}
}

// cancel ends the context and runs what waits for it.
func (c *ownAfterFuncCtx) cancel() {
	c.mu.Lock()
	c.err = context.Canceled
	fs := c.waiting
	c.waiting = nil
	c.mu.Unlock()
	for _, f := range fs {
		f()
	}
}

// TestUpstreamAsksAContextWithItsOwnAfterFunc: an exchange under a context that has an
// AfterFunc method registers its abort there (not through a child context that watches
// Done), stops it when the answer is read, and is cut at once when the context ends.
func TestUpstreamAsksAContextWithItsOwnAfterFunc(t *testing.T) {
	release := make(chan struct{})
	srv, cc := countedServer(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.URL.Query().Get("hang") == "" {
			_, _ = io.WriteString(w, "answer")
			return
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	t.Cleanup(func() { close(release) })
	u := testUpstream(t)
	// The connection is dialled under a plain context; the exchanges reuse it.
	send(t, u, srv.URL, post("{}"))

	ctx := &ownAfterFuncCtx{t: t, Context: context.Background(), waiting: map[int]func(){}}
	if _, body := send(t, u, srv.URL, post("{}")); body != "answer" {
		t.Fatalf("body %q", body)
	}
	resp, err := trip(ctx, u, srv.URL, post("{}"))
	if err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(resp.Body); err != nil || string(b) != "answer" {
		t.Fatalf("body %q, %v", b, err)
	}
	resp.Body.Close()
	ctx.mu.Lock()
	stops, waiting := ctx.stops, len(ctx.waiting)
	ctx.mu.Unlock()
	if stops != 1 || waiting != 0 {
		t.Fatalf("%d stops, %d functions left waiting; want the exchange's one registered and stopped", stops, waiting)
	}

	hang := post("{}")
	hang.target += "?hang=1"
	errc := make(chan error, 1)
	go func() {
		_, err := trip(ctx, u, srv.URL, hang)
		errc <- err
	}()
	poll.Holds(t, 10*time.Second, "the exchange to wait on the context", func() bool {
		ctx.mu.Lock()
		defer ctx.mu.Unlock()
		return len(ctx.waiting) == 1
	})
	ctx.cancel()
	select {
	case err := <-errc:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("error %v, want the context's", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the exchange went on after its context ended")
	}
	poll.Holds(t, 10*time.Second, "the worker to see the connection close", func() bool { return cc.closed.Load() >= 1 })
}

// TestUpstreamAnswerHeadersAreTheConnectionsUntilClose: an answer read to its end gives its
// connection back when its body is closed, not before (its holder may still read its
// headers); the connection's next exchange reuses the Header map, and ownHead's copy of the
// first answer's head keeps what it said.
func TestUpstreamAnswerHeadersAreTheConnectionsUntilClose(t *testing.T) {
	var n atomic.Int64
	srv, cc := countedServer(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("X-Answer", strconv.FormatInt(n.Add(1), 10))
		_, _ = io.WriteString(w, "answer")
	})
	u := testUpstream(t)
	first, err := trip(context.Background(), u, srv.URL, post("{}"))
	if err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(first.Body); err != nil || string(b) != "answer" {
		t.Fatalf("body %q, %v", b, err)
	}
	if n := idleConns(t, u, srv.URL); n != 0 {
		t.Fatalf("%d idle connections with the answer read but its body open, want 0", n)
	}
	own := ownHead(first)
	first.Body.Close()
	if n := idleConns(t, u, srv.URL); n != 1 {
		t.Fatalf("%d idle connections after the close, want 1", n)
	}
	second, _ := send(t, u, srv.URL, post("{}"))
	if n := cc.opened.Load(); n != 1 {
		t.Fatalf("%d connections, want the first one reused", n)
	}
	if got := second.Header.Get("X-Answer"); got != "2" {
		t.Fatalf("second answer's X-Answer %q, want 2", got)
	}
	if reflect.ValueOf(first.Header).UnsafePointer() != reflect.ValueOf(second.Header).UnsafePointer() {
		t.Fatal("the second exchange made a Header map of its own")
	}
	if got := own.Header.Get("X-Answer"); got != "1" || own.StatusCode != http.StatusOK {
		t.Fatalf("the first answer's own head: %d, X-Answer %q; want 200, 1", own.StatusCode, got)
	}
}

func TestUpstreamAnswerIsReadIntoTheMemoryTheRequestGives(t *testing.T) {
	tests := []struct {
		name, answer string
	}{
		{"common head", "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"},
		{"chunked, read by net/http", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"},
		{"after an informational answer", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base := rawWorker(t, func(conn net.Conn, br *bufio.Reader) {
				for readRequest(t, br) {
					if _, err := io.WriteString(conn, tt.answer); err != nil {
						return
					}
				}
			})
			u := testUpstream(t)
			var sc scratch
			for i, want := range []bool{true, false} {
				req := post(`{"prompt":"x"}`)
				req.answer = sc.answerMemory()
				resp, body := send(t, u, base, req)
				if body != "{}" || resp.StatusCode != http.StatusOK {
					t.Fatalf("answer %d: %d %q", i, resp.StatusCode, body)
				}
				if got := resp == &sc.answer.resp; got != want {
					t.Errorf("answer %d in the scratch's memory: %v, want %v", i, got, want)
				}
			}
		})
	}
}

func TestExchangeDeadlineCountsFromTheCallersTimeOnlyOnAPooledConnection(t *testing.T) {
	base := rawWorker(t, func(conn net.Conn, br *bufio.Reader) {
		for readRequest(t, br) {
			if _, err := io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"); err != nil {
				return
			}
		}
	})
	u := testUpstream(t)
	// The caller's time is an hour old: counted from it, the slack is a 64th of an hour
	// and the timeout (about a minute); counted from the clock, a 64th of the timeout (a few
	// seconds).
	tests := []struct {
		name string
		// timeout grows from one exchange to the next, so that each moves the deadline
		timeout   time.Duration
		fromAt    bool // the deadline's slack counts from the caller's time
		sayNoTime bool
	}{
		{name: "a dialed connection: the clock", timeout: time.Minute},
		{name: "a pooled connection: the caller's time", timeout: 2 * time.Minute, fromAt: true},
		{name: "no time said: the clock", timeout: 3 * time.Minute, sayNoTime: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			firstBy := time.Now().Add(tt.timeout)
			req := post(`{}`)
			if !tt.sayNoTime {
				req.at = firstBy.Add(-time.Hour - tt.timeout)
			}
			_, body, err := u.roundTrip(context.Background(), base, req, firstBy)
			if err != nil {
				t.Fatal(err)
			}
			c := body.conn
			c.mu.Lock()
			slack := c.readBy.Sub(firstBy)
			c.mu.Unlock()
			if _, err := io.Copy(io.Discard, body); err != nil {
				t.Fatal(err)
			}
			body.Close()
			if fromAt := slack > 30*time.Second; fromAt != tt.fromAt {
				t.Fatalf("deadline %v past the one asked: counted from the caller's time %v, want %v", slack, fromAt, tt.fromAt)
			}
		})
	}
}

// TestUpstreamSendsBodiesOfEverySizeWhole: a body small enough to go behind its head in one
// write and a larger one in a writev beside it both reach the worker whole, in turn on one
// connection, and no body is left in the pooled head buffer for the next request.
func TestUpstreamSendsBodiesOfEverySizeWhole(t *testing.T) {
	var seen lastSeen
	srv, cc := countedServer(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		seen.set(string(body))
		_, _ = io.WriteString(w, "ok")
	})
	u := testUpstream(t)
	for i, n := range []int{0, 1, 300, inlineBody, inlineBody + 1, 200 << 10, 7, 0} {
		body := strings.Repeat(string(rune('a'+i)), n)
		if _, answer := send(t, u, srv.URL, post(body)); answer != "ok" {
			t.Fatalf("body of %d bytes: answer %q", n, answer)
		}
		if got := seen.get(); got != body {
			t.Fatalf("body of %d bytes: the worker read %d bytes (%.20q...)", n, len(got), got)
		}
	}
	if n := cc.opened.Load(); n != 1 {
		t.Fatalf("%d connections for requests in turn, want 1", n)
	}
}

// readCalls is the number of read system calls this process has made (/proc/self/io's syscr),
// those that found nothing included.
func readCalls(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "syscr: "); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no syscr in /proc/self/io: %q", b)
	return 0
}

// TestUpstreamReadsAnAnswerOnlyOnceItCame: after sending a request the client waits for the
// worker's answer before reading, rather than reading first and finding nothing (Go's way):
// one read of the answer an exchange. The worker reads with blocking system calls, one a
// request, and answers after a moment, as a model does, so the process's reads are the
// client's and one per exchange.
func TestUpstreamReadsAnAnswerOnlyOnceItCame(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	// worker is the worker's descriptor while it is open (-1: none), under mu.
	var mu sync.Mutex
	worker := -1
	t.Cleanup(func() {
		_ = l.Close()
		// A shutdown wakes the worker's blocking read, if it still reads.
		mu.Lock()
		if worker >= 0 {
			_ = syscall.Shutdown(worker, syscall.SHUT_RDWR)
		}
		mu.Unlock()
		<-served
	})
	go func() {
		defer close(served)
		conn, err := l.Accept()
		if err != nil {
			return
		}
		f, err := conn.(*net.TCPConn).File()
		_ = conn.Close()
		if err != nil {
			return
		}
		fd := int(f.Fd()) // in blocking mode from here on
		mu.Lock()
		worker = fd
		mu.Unlock()
		defer func() {
			mu.Lock()
			worker = -1
			_ = f.Close()
			mu.Unlock()
		}()
		answer := []byte(okAnswer)
		buf := make([]byte, 64<<10)
		for {
			if n, err := syscall.Read(fd, buf); n <= 0 || err != nil {
				return
			}
			// A model takes time to answer: the client is at its read (or its wait)
			// before the answer comes. It computes rather than sleeps: a timer's wake-up
			// costs the runtime a read of its own.
			for start := time.Now(); time.Since(start) < 200*time.Microsecond; {
			}
			if _, err := syscall.Write(fd, answer); err != nil {
				return
			}
		}
	}()
	u := testUpstream(t)
	base := "http://" + l.Addr().String()
	send(t, u, base, post("{}")) // dials
	const exchanges = 100
	before := readCalls(t)
	for range exchanges {
		if _, body := send(t, u, base, post("{}")); body != "ok" {
			t.Fatalf("body %q", body)
		}
	}
	reads := readCalls(t) - before
	// Reading first would find nothing on nearly every exchange: three reads each.
	if per := float64(reads) / exchanges; per > 2.2 {
		t.Fatalf("%d read system calls for %d exchanges (%.2f each), want 2 each: the worker's and the answer's", reads, exchanges, per)
	}
}

// TestUpstreamCancelEndsTheWaitForAnAnswer: a request cancelled while its worker has it and
// has not answered ends at once, with the cancel's cause, and its connection is dropped.
func TestUpstreamCancelEndsTheWaitForAnAnswer(t *testing.T) {
	got := make(chan struct{}, 1)
	release := make(chan struct{})
	var closed atomic.Bool
	base := rawWorker(t, func(conn net.Conn, br *bufio.Reader) {
		if readRequest(t, br) {
			got <- struct{}{}
		}
		// The connection's end (or the test's) is the next thing the worker reads.
		_, err := br.ReadByte()
		closed.Store(err != nil)
		<-release
	})
	t.Cleanup(func() { close(release) })
	u := testUpstream(t)
	ctx, cancel := context.WithCancelCause(context.Background())
	go func() {
		<-got
		cancel(errIdle)
	}()
	if _, _, err := u.roundTrip(ctx, base, post("{}"), time.Now().Add(time.Minute)); !errors.Is(err, errIdle) {
		t.Fatalf("error %v, want the cancel's cause %v", err, errIdle)
	}
	poll.Holds(t, 10*time.Second, "the worker to see the connection close", closed.Load)
	if n := idleConns(t, u, base); n != 0 {
		t.Fatalf("%d connections pooled after a cancel, want 0", n)
	}
}

// TestUpstreamRetriesAtOnceWhenALongIdleConnectionWasHalfClosed: a worker that stops sending
// on an idle connection but goes on reading it (a lingering close) would never answer a
// request sent on it; a connection idle that long is read before the wait, whose end of
// file sends the request again on a new connection at once rather than at the first-byte
// deadline.
func TestUpstreamRetriesAtOnceWhenALongIdleConnectionWasHalfClosed(t *testing.T) {
	halfClosed := make(chan struct{}, 1)
	var conns atomic.Int64
	base := rawWorker(t, func(conn net.Conn, br *bufio.Reader) {
		first := conns.Add(1) == 1
		for readRequest(t, br) {
			if _, err := io.WriteString(conn, okAnswer); err != nil {
				return
			}
			if first {
				_ = conn.(*net.TCPConn).CloseWrite()
				halfClosed <- struct{}{}
				// Read (and drop) whatever comes until the client closes.
				_, _ = io.Copy(io.Discard, br)
				return
			}
		}
	})
	u := testUpstream(t)
	send(t, u, base, post("{}"))
	<-halfClosed
	withOnlyPooled(t, u, base, func(c *upConn) { c.idleSince = time.Now().Add(-2 * rawWaitIdle) })
	resp, _, err := u.roundTrip(context.Background(), base, post("{}"), time.Now().Add(20*time.Second))
	if err != nil {
		t.Fatalf("the request on a half-closed connection: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "ok" || conns.Load() != 2 {
		t.Fatalf("body %q over %d connections, want ok over a second one", b, conns.Load())
	}
}
