package h1

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// servers are the two client-port servers every test here runs on.
var servers = []string{"net", "fast"}

// start serves h on a loopback port with the server named kind (net: net/http's, fast:
// this package's), both with the same timeouts, and returns its address.
func start(t *testing.T, kind string, h http.Handler, timeouts ...time.Duration) string {
	t.Helper()
	header, idle := 10*time.Second, 90*time.Second
	if len(timeouts) == 2 {
		header, idle = timeouts[0], timeouts[1]
	}
	ln, err := listenLoopback()
	if err != nil {
		t.Fatal(err)
	}
	var stop func() error
	switch kind {
	case "net":
		hs := &http.Server{Handler: h, ReadHeaderTimeout: header, IdleTimeout: idle}
		go func() { _ = hs.Serve(ln) }()
		stop = hs.Close
	case "fast":
		s, err := New(Config{Handler: h, HeaderTimeout: header, IdleTimeout: idle})
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = s.Serve(ln) }()
		stop = s.Close
	default:
		t.Fatalf("no server %q", kind)
	}
	t.Cleanup(func() { _ = stop() })
	return ln.Addr().String()
}

func listenLoopback() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }

// rawClient is one connection that sends bytes as given and reads answers.
type rawClient struct {
	c  net.Conn
	br *bufio.Reader
}

func dial(t *testing.T, addr string) *rawClient {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return &rawClient{c: c, br: bufio.NewReader(c)}
}

func (r *rawClient) send(t *testing.T, s string) {
	t.Helper()
	if _, err := io.WriteString(r.c, s); err != nil {
		t.Fatal(err)
	}
}

// answer reads one answer (nil at the connection's end) and its whole body.
func (r *rawClient) answer(t *testing.T) (*http.Response, string) {
	t.Helper()
	return r.answerTo(t, http.MethodGet)
}

// answerTo is answer for a request of the given method (a HEAD's answer has no body).
func (r *rawClient) answerTo(t *testing.T, method string) (*http.Response, string) {
	t.Helper()
	resp, err := http.ReadResponse(r.br, &http.Request{Method: method})
	if err != nil {
		return nil, ""
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading an answer's body: %v", err)
	}
	return resp, string(b)
}

// echo answers each request with its method, path and body, and records the paths seen.
type echo struct {
	mu    sync.Mutex
	paths []string
}

func (e *echo) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	e.paths = append(e.paths, r.URL.Path)
	e.mu.Unlock()
	b, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "body: "+err.Error(), http.StatusBadRequest)
		return
	}
	fmt.Fprintf(w, "%s %s %q", r.Method, r.URL.Path, b)
}

func (e *echo) seen() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.paths)
}

// TestSmugglingCasesAreRefused sends the request-smuggling cases HAProxy's and the RFC's
// lists name, each followed on the same connection by a request a front proxy would not
// have seen (GET /smuggled): the fast server refuses every ambiguous framing and never
// serves /smuggled. net/http's own reading is recorded beside it: where it is lenient it
// reads one framing consistently, which is safe behind no proxy, not behind one that reads
// the other.
func TestSmugglingCasesAreRefused(t *testing.T) {
	// The smuggled request ends the connection, so that the test reads to its end.
	const smuggled = "GET /smuggled HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
	// cl is the length a proxy reading Content-Length takes for "0\r\n\r\n" + smuggled.
	cl := strconv.Itoa(len("0\r\n\r\n" + smuggled))
	type outcome struct {
		status int
		paths  []string
	}
	for _, tc := range []struct {
		name, req string
		net, fast outcome
	}{
		{"content-length then transfer-encoding",
			"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: " + cl + "\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled,
			outcome{200, []string{"/", "/smuggled"}}, outcome{400, nil}},
		{"transfer-encoding then content-length",
			"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: " + cl + "\r\n\r\n0\r\n\r\n" + smuggled,
			outcome{200, []string{"/", "/smuggled"}}, outcome{400, nil}},
		{"two content-lengths that disagree",
			"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: " + cl + "\r\n\r\n" + smuggled,
			outcome{400, nil}, outcome{400, nil}},
		{"two content-lengths that agree",
			"POST / HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
			outcome{200, []string{"/"}}, outcome{200, []string{"/"}}},
		{"content-length list",
			"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2, 2\r\n\r\nhi" + smuggled,
			outcome{400, nil}, outcome{400, nil}},
		{"signed content-length",
			"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +2\r\n\r\nhi" + smuggled,
			outcome{400, nil}, outcome{400, nil}},
		{"space before the colon",
			"POST / HTTP/1.1\r\nHost: a\r\nContent-Length : 2\r\n\r\nhi" + smuggled,
			outcome{400, nil}, outcome{400, nil}},
		{"obs-fold of a header",
			"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n" + smuggled,
			outcome{200, []string{"/", "/smuggled"}}, outcome{400, nil}},
		{"obs-fold of transfer-encoding",
			"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: " + cl + "\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n" + smuggled,
			outcome{200, []string{"/", "/smuggled"}}, outcome{400, nil}},
		{"transfer-encoding that is not chunked",
			"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n" + smuggled,
			outcome{501, nil}, outcome{501, nil}},
		{"chunked not last",
			"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n" + smuggled,
			outcome{501, nil}, outcome{501, nil}},
		{"two transfer-encodings",
			"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled,
			outcome{501, nil}, outcome{501, nil}},
		{"transfer-encoding in HTTP/1.0",
			"POST / HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n" + smuggled,
			outcome{200, []string{"/"}}, outcome{400, nil}},
		{"bare LF line ends",
			"GET / HTTP/1.1\nHost: a\n\n" + smuggled,
			outcome{200, []string{"/", "/smuggled"}}, outcome{400, nil}},
		{"bare CR in a value",
			"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\rc\r\n\r\n" + smuggled,
			outcome{400, nil}, outcome{400, nil}},
		{"NUL in a value",
			"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x00c\r\n\r\n" + smuggled,
			outcome{400, nil}, outcome{400, nil}},
		{"no host",
			"GET / HTTP/1.1\r\n\r\n" + smuggled,
			outcome{400, nil}, outcome{400, nil}},
		{"two hosts",
			"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n" + smuggled,
			outcome{400, nil}, outcome{400, nil}},
		{"chunk size with a bad extension length",
			"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhiXX0\r\n\r\n" + smuggled,
			outcome{400, []string{"/"}}, outcome{400, []string{"/"}}},
	} {
		for _, kind := range servers {
			t.Run(tc.name+"/"+kind, func(t *testing.T) {
				e := &echo{}
				addr := start(t, kind, e)
				c := dial(t, addr)
				c.send(t, tc.req)
				resp, _ := c.answer(t)
				want := map[string]outcome{"net": tc.net, "fast": tc.fast}[kind]
				if resp == nil {
					t.Fatalf("no answer; want %d", want.status)
				}
				if resp.StatusCode != want.status {
					t.Errorf("status %d; want %d", resp.StatusCode, want.status)
				}
				// Read what else comes (the smuggled request's answer) to the connection's end.
				for range 2 {
					if r, _ := c.answer(t); r == nil {
						break
					}
				}
				if got := e.seen(); !slices.Equal(got, want.paths) {
					t.Errorf("the handler saw %q; want %q", got, want.paths)
				}
			})
		}
	}
}

// TestBothServersAnswerAlike runs the same exchanges on both servers: keep-alive, chunked
// and sized bodies, HEAD, an answer held whole or streamed, a status without a body.
func TestBothServersAnswerAlike(t *testing.T) {
	mux := http.NewServeMux()
	mux.Handle("/echo", &echo{})
	mux.HandleFunc("/big", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, strings.Repeat("x", 10000))
	})
	mux.HandleFunc("/sized", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "5")
		_, _ = io.WriteString(w, "hello")
	})
	mux.HandleFunc("/empty", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	mux.HandleFunc("/close", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "close")
		_, _ = io.WriteString(w, "bye")
	})
	for _, kind := range servers {
		t.Run(kind, func(t *testing.T) {
			c := dial(t, start(t, kind, mux))
			for _, step := range []struct {
				req, body string
				status    int
				chunked   bool
			}{
				{"GET /echo HTTP/1.1\r\nHost: a\r\n\r\n", `GET /echo ""`, 200, false},
				{"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc", `POST /echo "abc"`, 200, false},
				{"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nT: v\r\n\r\n", `POST /echo "abcde"`, 200, false},
				{"GET /big HTTP/1.1\r\nHost: a\r\n\r\n", strings.Repeat("x", 10000), 200, true},
				{"GET /sized HTTP/1.1\r\nHost: a\r\n\r\n", "hello", 200, false},
				{"HEAD /sized HTTP/1.1\r\nHost: a\r\n\r\n", "", 200, false},
				{"GET /empty HTTP/1.1\r\nHost: a\r\n\r\n", "", 204, false},
				{"GET /nothing HTTP/1.1\r\nHost: a\r\n\r\n", "404 page not found\n", 404, false},
				{"GET /close HTTP/1.1\r\nHost: a\r\n\r\n", "bye", 200, false},
			} {
				c.send(t, step.req)
				resp, body := c.answerTo(t, strings.Fields(step.req)[0])
				if resp == nil {
					t.Fatalf("%q: no answer", step.req)
				}
				if resp.StatusCode != step.status || body != step.body {
					t.Errorf("%q: %d %q; want %d %q", step.req, resp.StatusCode, body, step.status, step.body)
				}
				if chunked := slices.Equal(resp.TransferEncoding, []string{"chunked"}); chunked != step.chunked {
					t.Errorf("%q: chunked %v; want %v", step.req, chunked, step.chunked)
				}
			}
			if resp, _ := c.answer(t); resp != nil {
				t.Errorf("the connection stayed open after Connection: close")
			}
		})
	}
}

// TestClientHangUpCancelsTheRequest: a client that goes away while its answer is pending
// cancels the request's context (the worker's request with it), with a body or without.
func TestClientHangUpCancelsTheRequest(t *testing.T) {
	for _, kind := range servers {
		for _, req := range []string{
			"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
			"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi",
			"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
		} {
			t.Run(kind, func(t *testing.T) {
				started, cancelled := make(chan struct{}), make(chan error, 1)
				addr := start(t, kind, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					_, _ = io.ReadAll(r.Body)
					w.Header().Set("Content-Type", "text/event-stream")
					_, _ = io.WriteString(w, "data: 1\n\n")
					_ = http.NewResponseController(w).Flush()
					close(started)
					select {
					case <-r.Context().Done():
						cancelled <- nil
					case <-time.After(10 * time.Second):
						cancelled <- errors.New("not cancelled within 10s of the hang-up")
					}
				}))
				c := dial(t, addr)
				c.send(t, req)
				<-started
				c.c.Close()
				if err := <-cancelled; err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

// TestExpectContinueWaitsForTheHandlersRead: 100 Continue goes out when the handler reads
// the body, not before; a handler that answers without reading sends none.
func TestExpectContinueWaitsForTheHandlersRead(t *testing.T) {
	for _, kind := range servers {
		t.Run(kind, func(t *testing.T) {
			mux := http.NewServeMux()
			mux.Handle("/echo", &echo{})
			mux.HandleFunc("/refuse", func(w http.ResponseWriter, r *http.Request) {
				http.Error(w, "too large", http.StatusRequestEntityTooLarge)
			})
			c := dial(t, start(t, kind, mux))
			c.send(t, "POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
			line, err := c.br.ReadString('\n')
			if err != nil || line != "HTTP/1.1 100 Continue\r\n" {
				t.Fatalf("first line %q, %v; want 100 Continue", line, err)
			}
			if blank, _ := c.br.ReadString('\n'); blank != "\r\n" {
				t.Fatalf("after 100 Continue: %q", blank)
			}
			c.send(t, "abc")
			if resp, body := c.answer(t); resp == nil || body != `POST /echo "abc"` {
				t.Fatalf("answer %v %q", resp, body)
			}
			c = dial(t, start(t, kind, mux))
			c.send(t, "POST /refuse HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
			if resp, _ := c.answer(t); resp == nil || resp.StatusCode != http.StatusRequestEntityTooLarge {
				t.Fatalf("answer %v; want 413 without 100 Continue", resp)
			}
		})
	}
}

// TestStreamedAnswerArrivesBeforeTheHandlerEnds: a flushed write reaches the client while
// the handler still runs (SSE passes through unbuffered).
func TestStreamedAnswerArrivesBeforeTheHandlerEnds(t *testing.T) {
	for _, kind := range servers {
		t.Run(kind, func(t *testing.T) {
			release := make(chan struct{})
			addr := start(t, kind, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				_, _ = io.WriteString(w, "data: first\n\n")
				_ = http.NewResponseController(w).Flush()
				<-release
				_, _ = io.WriteString(w, "data: second\n\n")
			}))
			c := dial(t, addr)
			c.send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
			resp, err := http.ReadResponse(c.br, nil)
			if err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, len("data: first\n\n"))
			if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != "data: first\n\n" {
				t.Fatalf("first event %q, %v", buf, err)
			}
			close(release)
			rest, err := io.ReadAll(resp.Body)
			if err != nil || string(rest) != "data: second\n\n" {
				t.Fatalf("rest %q, %v", rest, err)
			}
		})
	}
}

// TestQuietConnectionsAreClosed: a connection that sends no head within the header timeout,
// or nothing within the idle timeout after an answer, is closed.
func TestQuietConnectionsAreClosed(t *testing.T) {
	for _, kind := range servers {
		t.Run(kind, func(t *testing.T) {
			addr := start(t, kind, &echo{}, 200*time.Millisecond, 300*time.Millisecond)
			slow := dial(t, addr)
			slow.send(t, "GET / HTTP/1.1\r\nHost: a\r\n")
			idle := dial(t, addr)
			idle.send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
			if resp, _ := idle.answer(t); resp == nil {
				t.Fatal("no answer")
			}
			for name, c := range map[string]*rawClient{"half a head": slow, "idle": idle} {
				// The client's own deadline (10 s) bounds the wait; the server's end is EOF.
				_, err := c.br.ReadByte()
				if !errors.Is(err, io.EOF) && !isReset(err) {
					t.Errorf("%s: read %v; want the server's close", name, err)
				}
			}
		})
	}
}

func isReset(err error) bool {
	return err != nil && (strings.Contains(err.Error(), "reset") || strings.Contains(err.Error(), "EOF"))
}

// TestOversizedHeadIsRefused: a head past MaxHeaderBytes gets 431 and no handler.
func TestOversizedHeadIsRefused(t *testing.T) {
	e := &echo{}
	s, err := New(Config{Handler: e, MaxHeaderBytes: 8 << 10})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = s.Serve(ln) }()
	t.Cleanup(func() { _ = s.Close() })
	c := dial(t, ln.Addr().String())
	c.send(t, "GET / HTTP/1.1\r\nHost: a\r\nX-Big: "+strings.Repeat("b", 16<<10)+"\r\n\r\n")
	resp, _ := c.answer(t)
	if resp == nil || resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("answer %v; want 431", resp)
	}
	if len(e.seen()) != 0 {
		t.Fatal("the handler saw the request")
	}
}

// TestShutdownWaitsForTheRequestInFlight: Shutdown closes idle connections at once and
// returns once the answer in flight is out; Serve returns http.ErrServerClosed.
func TestShutdownWaitsForTheRequestInFlight(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	s, err := New(Config{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			close(started)
			<-release
		}
		_, _ = io.WriteString(w, "done")
	})})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(ln) }()
	idle := dial(t, ln.Addr().String())
	idle.send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp, _ := idle.answer(t); resp == nil {
		t.Fatal("no answer")
	}
	busy := dial(t, ln.Addr().String())
	busy.send(t, "GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
	// Its handler runs: a connection's phase would not say which one is in flight (the
	// first one's is not idle yet between its answer's flush and its wait for a next).
	<-started
	done := make(chan error, 1)
	go func() { done <- s.Shutdown(context.Background()) }()
	if _, err := idle.br.ReadByte(); err == nil {
		t.Fatal("the idle connection stayed open")
	}
	select {
	case err := <-done:
		t.Fatalf("Shutdown returned %v with a request in flight", err)
	default:
	}
	close(release)
	resp, body := busy.answer(t)
	if resp == nil || body != "done" || !resp.Close {
		t.Fatalf("in-flight answer %v %q; want done with Connection: close", resp, body)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		t.Fatalf("Serve: %v", err)
	}
}

// TestHandlerPanicClosesOnlyItsConnection: a panicking handler ends its connection; the
// server goes on serving.
func TestHandlerPanicClosesOnlyItsConnection(t *testing.T) {
	addr := start(t, "fast", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/panic" {
			panic("boom")
		}
		_, _ = io.WriteString(w, "ok")
	}))
	c := dial(t, addr)
	c.send(t, "GET /panic HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp, _ := c.answer(t); resp != nil {
		t.Fatalf("answer %v after a panic", resp)
	}
	c = dial(t, addr)
	c.send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp, body := c.answer(t); resp == nil || body != "ok" {
		t.Fatalf("after a panic: %v %q", resp, body)
	}
}

// TestClientsThatLeaveBetweenRequests: a client that connects and leaves before its first
// request, or after an answer, ends only its connection.
func TestClientsThatLeaveBetweenRequests(t *testing.T) {
	addr := start(t, "fast", &echo{})
	for range 3 {
		c := dial(t, addr)
		c.c.Close()
		c = dial(t, addr)
		c.send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
		if resp, _ := c.answer(t); resp == nil {
			t.Fatal("no answer")
		}
		c.c.Close()
	}
	c := dial(t, addr)
	c.send(t, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp, _ := c.answer(t); resp == nil {
		t.Fatal("no answer after clients left")
	}
}

// TestEdgesOfTheProtocolOnBothServers: pipelined requests answered in order, HTTP/1.0 answered
// in HTTP/1.0 with the connection closed after, and a handler's header value with CR or LF
// sent as one line (no answer splitting).
func TestEdgesOfTheProtocolOnBothServers(t *testing.T) {
	mux := http.NewServeMux()
	mux.Handle("/echo/", &echo{})
	mux.HandleFunc("/split", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-A", "a\r\nX-Injected: yes")
		_, _ = io.WriteString(w, "ok")
	})
	for _, kind := range servers {
		t.Run(kind, func(t *testing.T) {
			addr := start(t, kind, mux)
			c := dial(t, addr)
			c.send(t, "GET /echo/1 HTTP/1.1\r\nHost: a\r\n\r\nPOST /echo/2 HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\nxGET /echo/3 HTTP/1.1\r\nHost: a\r\n\r\n")
			for i, want := range []string{`GET /echo/1 ""`, `POST /echo/2 "x"`, `GET /echo/3 ""`} {
				if resp, body := c.answer(t); resp == nil || body != want {
					t.Fatalf("pipelined answer %d: %v %q; want %q", i, resp, body, want)
				}
			}

			c = dial(t, addr)
			c.send(t, "GET /echo/old HTTP/1.0\r\n\r\n")
			resp, body := c.answer(t)
			if resp == nil || resp.Proto != "HTTP/1.0" || body != `GET /echo/old ""` {
				t.Fatalf("HTTP/1.0: %v %q", resp, body)
			}
			if r, _ := c.answer(t); r != nil {
				t.Fatal("an HTTP/1.0 connection stayed open")
			}

			c = dial(t, addr)
			c.send(t, "GET /split HTTP/1.1\r\nHost: a\r\n\r\n")
			resp, body = c.answer(t)
			if resp == nil || body != "ok" || resp.Header.Get("X-Injected") != "" {
				t.Fatalf("a header value with CRLF split the answer: %v %q", resp, body)
			}
		})
	}
}

// TestAWriteAfterTheHandlerReturnedFails: a handler's goroutine that writes after its
// handler returned gets an error and writes nothing into the next answer.
func TestAWriteAfterTheHandlerReturnedFails(t *testing.T) {
	late := make(chan http.ResponseWriter, 1)
	addr := start(t, "fast", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, r.URL.Path)
		if r.URL.Path == "/first" {
			// Flushed: the answer is chunked, so a stray write would find room after it.
			_ = http.NewResponseController(w).Flush()
			late <- w
		}
	}))
	c := dial(t, addr)
	c.send(t, "GET /first HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp, body := c.answer(t); resp == nil || body != "/first" {
		t.Fatalf("first: %v %q", resp, body)
	}
	if _, err := (<-late).Write([]byte("stray")); err == nil {
		t.Fatal("a write after the handler returned succeeded")
	}
	c.send(t, "GET /second HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp, body := c.answer(t); resp == nil || body != "/second" {
		t.Fatalf("second: %v %q", resp, body)
	}
}

// TestHeaderMapsDoNotCarryIntoTheNextRequest: the fast server lends a connection's header
// maps to one request at a time (spareHeader); a request's fields, its answer's and a stray
// late caller's of Header() reach no later request on the connection.
func TestHeaderMapsDoNotCarryIntoTheNextRequest(t *testing.T) {
	for _, kind := range servers {
		t.Run(kind, func(t *testing.T) {
			late := make(chan http.ResponseWriter, 1)
			addr := start(t, kind, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				r.Header.Set("X-Added-By-Handler", "1")
				keys := slices.Sorted(maps.Keys(r.Header))
				if r.URL.Path == "/first" {
					w.Header().Set("X-First-Answer", "1")
					late <- w
				}
				_, _ = io.WriteString(w, strings.Join(keys, ","))
			}))
			c := dial(t, addr)
			c.send(t, "GET /first HTTP/1.1\r\nHost: a\r\nX-Only-First: yes\r\n\r\n")
			resp, body := c.answer(t)
			if resp == nil || resp.Header.Get("X-First-Answer") != "1" || body != "X-Added-By-Handler,X-Only-First" {
				t.Fatalf("first: %v %q", resp, body)
			}
			(<-late).Header().Set("X-Late", "1")
			c.send(t, "GET /second HTTP/1.1\r\nHost: a\r\nX-Only-Second: yes\r\n\r\n")
			resp, body = c.answer(t)
			if resp == nil {
				t.Fatal("no second answer")
			}
			if body != "X-Added-By-Handler,X-Only-Second" {
				t.Errorf("the second request's header: %q", body)
			}
			for _, k := range []string{"X-First-Answer", "X-Late"} {
				if v := resp.Header.Get(k); v != "" {
					t.Errorf("the second answer carries %s: %q", k, v)
				}
			}
		})
	}
}
