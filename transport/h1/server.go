// Package h1 is an HTTP/1.1 server for the client port's hot path that is not net/http's:
// one goroutine per connection that reads a request head with a strict parser, hands the
// handler an *http.Request and an http.ResponseWriter (the handlers are the same as under
// net/http), and watches for the client's hang-up with one long-lived read per connection
// rather than a goroutine per request. TLS works through the listener (HTTP/1.1 only);
// HTTP/2, Hijack and trailers are not served. Its timeouts and the start of a watch are
// kept by one clock per server rather than by a deadline per request. DESIGN.md says why it
// exists and what it costs in correctness risk.
package h1

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Config tunes a Server. Zero durations and sizes take the defaults named.
type Config struct {
	// Handler answers every request.
	Handler http.Handler
	// HeaderTimeout bounds reading a request's head (10s), IdleTimeout the wait for the next
	// request on a keep-alive connection (90s), BodyTimeout reading a request's body from
	// the end of its head (none; a handler may set its own with
	// http.ResponseController.SetReadDeadline). Answers are not bounded. Each ends within
	// two ticks after its time.
	HeaderTimeout, IdleTimeout, BodyTimeout time.Duration
	// Tick is the period of the server's clock (DefaultTick): the precision of the timeouts,
	// and how long a handler runs before its connection is watched for the client's
	// hang-up (between one and three ticks).
	Tick time.Duration
	// MaxHeaderBytes bounds a request head (1 MiB, as net/http's default).
	MaxHeaderBytes int
	// Logger receives the server's own complaints (nil: discarded).
	Logger *slog.Logger
	// Refusal, when set, is the JSON body of the answer to a request refused before any
	// handler (its status and why); nil answers plain text.
	Refusal func(status int, why string) []byte
}

// Server serves HTTP/1.1 on the listeners given to Serve, until Shutdown or Close.
type Server struct {
	cfg    Config
	log    *slog.Logger
	base   context.Context
	cancel context.CancelFunc

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	shutting  atomic.Bool
	// dates caches the Date header's value for a second.
	dates atomic.Pointer[dateCache]
	// clock is the time of the clock's last tick, in unix milliseconds; clockOnce starts the
	// clock, wake restarts it when a first connection comes (it stops with none).
	clock     atomic.Int64
	clockOnce sync.Once
	wake      chan struct{}
}

// New returns a server for cfg.
func New(cfg Config) (*Server, error) {
	if cfg.Handler == nil {
		return nil, errors.New("h1: a handler is required")
	}
	if cfg.HeaderTimeout < 0 || cfg.IdleTimeout < 0 || cfg.BodyTimeout < 0 || cfg.Tick < 0 || cfg.MaxHeaderBytes < 0 {
		return nil, errors.New("h1: negative timeout or size")
	}
	if cfg.HeaderTimeout == 0 {
		cfg.HeaderTimeout = 10 * time.Second
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = 90 * time.Second
	}
	if cfg.Tick == 0 {
		cfg.Tick = DefaultTick
	}
	if cfg.MaxHeaderBytes == 0 {
		cfg.MaxHeaderBytes = 1 << 20
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{cfg: cfg, log: cfg.Logger, base: ctx, cancel: cancel, wake: make(chan struct{}, 1),
		listeners: map[net.Listener]struct{}{}, conns: map[*conn]struct{}{}}
	s.setClock(time.Now())
	return s, nil
}

// Serve accepts connections on ln until Shutdown or Close, which make it return
// http.ErrServerClosed; it closes ln.
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.shutting.Load() {
		s.mu.Unlock()
		_ = ln.Close()
		return http.ErrServerClosed
	}
	s.listeners[ln] = struct{}{}
	s.mu.Unlock()
	s.clockOnce.Do(func() { go s.runClock() })
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
		_ = ln.Close()
	}()
	var backoff time.Duration
	for {
		rwc, err := ln.Accept()
		if err != nil {
			if s.shutting.Load() {
				return http.ErrServerClosed
			}
			if ne, ok := err.(net.Error); ok && ne.Timeout() || errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.log.Debug("h1: accept failed; retrying", "err", err, "in", backoff)
				t := time.NewTimer(backoff)
				select {
				case <-t.C:
				case <-s.base.Done():
					t.Stop()
					return http.ErrServerClosed
				}
				continue
			}
			return err
		}
		backoff = 0
		c := s.newConn(rwc)
		if c == nil {
			continue
		}
		go c.serve()
	}
}

func (s *Server) newConn(rwc net.Conn) *conn {
	c := &conn{srv: s, rwc: rwc, remote: rwc.RemoteAddr().String(),
		watchStart: make(chan struct{}, 1), watchDone: make(chan readResult, 1)}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shutting.Load() {
		_ = rwc.Close()
		return nil
	}
	s.conns[c] = struct{}{}
	if len(s.conns) == 1 {
		// The clock stopped with no connection: its time is read again before this one's
		// first wait is timed by it, and it starts again.
		s.setClock(time.Now())
		s.signalClock()
	}
	return c
}

// signalClock wakes the clock if it waits.
func (s *Server) signalClock() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *Server) forget(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

// Shutdown stops accepting, closes idle connections, lets each request in flight finish
// (its connection closes after it) and returns when none is left, or with ctx's error.
func (s *Server) Shutdown(ctx context.Context) error {
	s.stopListening()
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		s.mu.Lock()
		left := len(s.conns)
		for c := range s.conns {
			// A connection whose read waits for a next request ends now.
			c.expireIdle()
		}
		s.mu.Unlock()
		if left == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Close stops accepting, closes every connection and cancels every request in flight.
func (s *Server) Close() error {
	s.stopListening()
	s.cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		_ = c.rwc.Close()
		c.req.cancel()
	}
	return nil
}

func (s *Server) stopListening() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.shutting.Store(true)
	for ln := range s.listeners {
		_ = ln.Close()
	}
	s.signalClock()
}

// aLongTimeAgo is a deadline that has passed: a read under it returns at once.
var aLongTimeAgo = time.Unix(1, 0)

// readResult is what the connection's watching read got.
type readResult struct {
	n   int
	err error
}

// conn is one client connection. Its serve goroutine reads requests and runs the handler.
// A handler that runs for a tick (the server's clock starts it) has the connection watched
// by its watcher goroutine, which reads the connection on its behalf: an error there is the
// client's hang-up (the request's context is cancelled at once), bytes are the next
// request's first (kept for serve, which waits on them after the answer, under the idle
// timeout). So a request answered within a tick costs no second goroutine, and a long one
// no read to abort after its answer.
type conn struct {
	srv    *Server
	rwc    net.Conn
	remote string
	tls    *tls.ConnectionState
	br     *bufio.Reader
	bw     *bufio.Writer
	// state is the phase and its time (clock.go).
	state atomic.Uint64
	// pending are bytes the watcher read that serve has not consumed.
	pending []byte
	wbuf    [1024]byte
	// watchStart starts one watching read; watchDone receives its result. req is the
	// request in flight, which the watcher ends on a hang-up. watching (serve's): a watch's
	// result is still to be received.
	watchStart chan struct{}
	watchDone  chan readResult
	watching   bool
	req        current
	// wmu guards starting a watch (the clock's) against the connection's end (serve's):
	// watcher, the watcher goroutine runs; ended, watchStart is closed.
	wmu            sync.Mutex
	watcher, ended bool
	// broken: a write failed; the connection ends after the handler.
	broken bool
	// hold is the buffer of an answer's held bytes, reused by the connection's answers.
	hold []byte
	// head is the request head being served (its fields are copied into the request).
	head head
	// answerHeader is the answers' header map, lent to one answer at a time.
	answerHeader spareHeader
}

// exchange is one request's own memory, in one allocation: its answer's writer, its body's
// reader, its context and its URL. Nothing in it is reused by the next request: a handler's goroutine
// that outlives its request finds that request's, done.
type exchange struct {
	w    response
	body body
	ctx  requestContext
	// url is the request's URL, a copy of its head's.
	url url.URL
}

// Read implements io.Reader for br: the watcher's bytes first, then the connection. The
// first bytes of a next request start its head's time.
func (c *conn) Read(p []byte) (int, error) {
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	n, err := c.rwc.Read(p)
	if n > 0 && phaseOf(c.state.Load()) == phaseIdle &&
		!c.move(phases(phaseIdle), phaseHead, c.srv.after(c.srv.cfg.HeaderTimeout)) {
		return 0, os.ErrDeadlineExceeded
	}
	return n, err
}

func (c *conn) watch() {
	for range c.watchStart {
		n, err := c.rwc.Read(c.wbuf[:])
		if n == 0 && err != nil {
			if !isTimeout(err) {
				c.req.cancel()
			}
		}
		c.watchDone <- readResult{n, err}
	}
}

// startWatch hands the connection's reading to the watcher (the clock's, once it moved the
// connection to phaseWatched), unless the connection is ending.
func (c *conn) startWatch() {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.ended {
		return
	}
	if !c.watcher {
		c.watcher = true
		go c.watch()
	}
	c.watchStart <- struct{}{}
}

// handling is the phase (and its time) of a request whose handler runs with its body read:
// watched from a tick on, unless bytes of a next request are already buffered (a
// pipelining client: those are served next, unwatched, as net/http does).
func (c *conn) handling() (uint64, int64) {
	if c.br.Buffered() > 0 || len(c.pending) > 0 {
		return phasePipelined, 0
	}
	return phaseHandling, c.srv.after(c.srv.cfg.Tick)
}

func (c *conn) serve() {
	s := c.srv
	c.br = bufio.NewReaderSize(c, 4096)
	c.bw = bufio.NewWriterSize(c.rwc, 4096)
	defer func() {
		if v := recover(); v != nil && v != http.ErrAbortHandler {
			s.log.Error("h1: handler panic", "panic", v, "stack", string(debug.Stack()))
		}
		c.state.Store(state(phaseClosed, 0))
		_ = c.rwc.Close()
		c.wmu.Lock()
		c.ended = true
		close(c.watchStart)
		c.wmu.Unlock()
		s.forget(c)
	}()
	if tc, ok := c.rwc.(*tls.Conn); ok {
		_ = tc.SetDeadline(time.Now().Add(s.cfg.HeaderTimeout))
		if err := tc.HandshakeContext(s.base); err != nil {
			s.log.Debug("h1: TLS handshake failed", "remote", c.remote, "err", err)
			return
		}
		_ = tc.SetDeadline(time.Time{})
		st := tc.ConnectionState()
		c.tls = &st
	}
	// The first request waits for its first byte within the header timeout, later ones
	// within the idle timeout (as net/http does).
	c.state.Store(state(phaseIdle, s.after(s.cfg.HeaderTimeout)))
	for {
		if c.watching {
			r := <-c.watchDone
			c.watching = false
			if r.n == 0 {
				return
			}
			c.pending = c.wbuf[:r.n]
			if !c.move(phases(phaseWatchedIdle), phaseHead, s.after(s.cfg.HeaderTimeout)) {
				return
			}
		}
		if !c.serveOne() {
			return
		}
		if s.shutting.Load() {
			return
		}
	}
}

// serveOne reads one request and answers it; false ends the connection.
func (c *conn) serveOne() bool {
	s := c.srv
	h := &c.head
	if err := h.read(c.br, s.cfg.MaxHeaderBytes); err != nil {
		var br *badRequest
		if errors.As(err, &br) {
			s.log.Debug("h1: request refused", "remote", c.remote, "status", br.status, "why", br.why)
			c.refuse(br)
		} else if !errors.Is(err, io.EOF) {
			s.log.Debug("h1: reading a request failed", "remote", c.remote, "err", err)
		}
		return false
	}
	x := new(exchange)
	ctx := &x.ctx
	ctx.init()
	defer ctx.cancel()
	c.req.p.Store(ctx)
	defer c.req.p.Store(nil)
	if s.base.Err() != nil {
		// Close came as the head did: it may have missed this request.
		ctx.cancel()
	}
	// The literal stays on the stack: WithContext below makes the one request allocated.
	proto := "HTTP/1.1"
	if h.minor == 0 {
		proto = "HTTP/1.0"
	}
	x.url = *h.url
	r := &http.Request{
		Method: h.method, URL: &x.url, Proto: proto, ProtoMajor: 1, ProtoMinor: h.minor,
		Header: h.header, ContentLength: h.length, Close: h.close, Host: h.host,
		RemoteAddr: c.remote, RequestURI: h.target, TLS: c.tls,
	}
	var b *body
	next, at := phaseBody, s.after(s.cfg.BodyTimeout)
	if h.chunked || h.length > 0 {
		b = &x.body
		*b = body{c: c, expect100: h.expect100}
		if h.chunked {
			b.r = newBodyReader(c.br, h, s.cfg.MaxHeaderBytes)
		} else {
			b.sized = lengthBody{br: c.br, left: h.length}
			b.r = &b.sized
		}
		if h.chunked {
			r.TransferEncoding = []string{"chunked"}
		}
		r.Body = b
	} else {
		r.Body = http.NoBody
		next, at = c.handling()
	}
	// The head may have come whole with a watch's bytes or a pipelined request (phaseHead or
	// phaseIdle); a failed move is the clock's expiry.
	if !c.move(phases(phaseHead, phaseIdle), next, at) {
		return false
	}
	req := r.WithContext(ctx)
	w := &x.w
	c.initResponse(w, req, h)
	w.reqBody = b
	s.cfg.Handler.ServeHTTP(w, req)
	w.finish()
	// The handler returned and its answer is out: its header maps are free for the next
	// request (spareHeader says why nothing holds them now).
	c.answerHeader.give(w.header)
	h.spare.give(h.header)
	if c.broken || w.closeAfter || h.close {
		return false
	}
	if b != nil && !b.done {
		// The handler left part of the body unread: what follows on the connection is not a
		// request's head, so the connection ends, gracefully: a close with unread bytes
		// would reset it, and the client, still sending, might lose the answer.
		c.lingerClose()
		return false
	}
	idle := s.after(s.cfg.IdleTimeout)
	if c.move(phases(phaseHandling, phasePipelined), phaseIdle, idle) {
		return true
	}
	// The watch of the answer goes on as the wait for the next request.
	c.watching = c.move(phases(phaseWatched), phaseWatchedIdle, idle)
	return c.watching
}

// Bounds of lingerClose: what it reads of a body the handler left, and for how long.
const (
	lingerBytes = 256 << 10
	lingerFor   = 500 * time.Millisecond
)

// lingerClose ends the connection's sending side and reads (and drops) what the client
// still sends, within bounds, so that the close that follows does not reset the answer
// away (net/http's server does the same).
func (c *conn) lingerClose() {
	c.state.Store(state(phaseClosed, 0))
	if c.broken {
		return
	}
	type closeWriter interface{ CloseWrite() error }
	cw, ok := c.rwc.(closeWriter)
	if !ok {
		return
	}
	_ = cw.CloseWrite()
	_ = c.rwc.SetReadDeadline(time.Now().Add(lingerFor))
	_, _ = io.CopyN(io.Discard, c.rwc, lingerBytes)
}

// refuse answers a request the parser refused, and the connection ends.
func (c *conn) refuse(br *badRequest) {
	w := c.newResponse(nil, nil)
	w.closeAfter = true
	if c.srv.cfg.Refusal != nil {
		w.header.Set("Content-Type", "application/json")
		w.WriteHeader(br.status)
		_, _ = w.Write(c.srv.cfg.Refusal(br.status, br.why))
	} else {
		w.header.Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(br.status)
		_, _ = io.WriteString(w, br.why)
	}
	w.finish()
}

// body is a request's body as the handler reads it: newBodyReader's bytes, 100 Continue
// before the first read when the client waits for it, and the hang-up watch from the read
// that finds the end.
type body struct {
	c         *conn
	r         io.Reader
	sized     lengthBody // r's, for a Content-Length
	expect100 bool
	done      bool
	closed    bool
	err       error
}

// Read implements io.Reader.
func (b *body) Read(p []byte) (int, error) {
	if b.closed {
		return 0, http.ErrBodyReadAfterClose
	}
	if b.err != nil {
		return 0, b.err
	}
	if b.done {
		return 0, io.EOF
	}
	if b.expect100 {
		b.expect100 = false
		if _, err := b.c.rwc.Write([]byte("HTTP/1.1 100 Continue\r\n\r\n")); err != nil {
			b.err = err
			return 0, err
		}
	}
	n, err := b.r.Read(p)
	if errors.Is(err, io.EOF) {
		if next, at := b.c.handling(); !b.c.move(phases(phaseBody), next, at) {
			// The body's time ran out as its end came.
			b.err = os.ErrDeadlineExceeded
			return n, b.err
		}
		b.done = true
		return n, io.EOF
	}
	if err != nil {
		b.err = err
	}
	return n, err
}

// Close implements io.Closer: later reads fail; what is left unread ends the connection
// after the answer.
func (b *body) Close() error {
	b.closed = true
	return nil
}

// newBodyReader reads the body h frames from br: Content-Length bytes, or chunks and a
// trailer section of at most maxTrailer bytes.
func newBodyReader(br *bufio.Reader, h *head, maxTrailer int) io.Reader {
	if h.chunked {
		return &chunkedBody{br: br, r: httputil.NewChunkedReader(br), max: maxTrailer}
	}
	return &lengthBody{br: br, left: h.length}
}

// lengthBody is a body of a known length.
type lengthBody struct {
	br   *bufio.Reader
	left int64
}

func (l *lengthBody) Read(p []byte) (int, error) {
	if l.left == 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > l.left {
		p = p[:l.left]
	}
	n, err := l.br.Read(p)
	l.left -= int64(n)
	switch {
	case l.left == 0:
		return n, io.EOF
	case errors.Is(err, io.EOF):
		return n, io.ErrUnexpectedEOF
	}
	return n, err
}

// isTimeout reports a deadline's error.
func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }
