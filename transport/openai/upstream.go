package openai

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// The upstream client is the proxy's HTTP/1.1 client for workers. net/http's Transport
// hands every request to a connection's writer goroutine and every response back from its
// reader goroutine; on an otherwise idle machine each hand-off is a thread wake-up, and
// together they cost more than the router's own work (see BenchmarkAddedLatencyFloor). This
// client writes the request and reads the answer on the handler's goroutine, over pooled
// keep-alive connections, and leaves the HTTP parsing of the answer to net/http.
//
// It speaks only what the proxy needs: one request at a time per connection, a body known
// in full, identity encoding. Anything else that talks to workers (health probes, the model
// list) keeps using net/http.

const (
	// maxIdlePerWorker caps the idle connections kept per worker URL.
	maxIdlePerWorker = 256
	// idleConnTimeout closes a connection left idle this long.
	idleConnTimeout = 90 * time.Second
	// maxResponseHead caps a worker's status line and headers (1xx answers included), so a
	// worker cannot make the router buffer without end.
	maxResponseHead = 1 << 20
	// readBufferSize is each connection's read buffer; large reads bypass it.
	readBufferSize = 8 << 10
	// maxInformational bounds the 1xx answers skipped before the real one.
	maxInformational = 8
	// maxPooledHead is the largest request head buffer kept for reuse.
	maxPooledHead = 64 << 10
	// inlineBody is the largest request body copied behind its head to go in one write.
	inlineBody = 8 << 10
)

// Causes that end an exchange with a worker.
var (
	errResponseHeadTooLarge = fmt.Errorf("worker response headers exceed %d bytes", maxResponseHead)
	errNoAnswer             = errors.New("worker sent no answer within the first-byte timeout")
)

// aLongTimeAgo is a deadline in the past, which wakes any blocked read or write at once.
var aLongTimeAgo = time.Unix(1, 0)

// upstream pools connections per worker URL.
type upstream struct {
	dialer      net.Dialer
	tlsConfig   *tls.Config
	maxIdle     int
	idleTimeout time.Duration
	heads       sync.Pool // of *[]byte, request heads being built
	// postProbe tells http.ReadResponse the request was a POST, as nearly all are; it only
	// reads it.
	postProbe *http.Request
	hosts     sync.Map // worker URL -> *hostPool
	closed    atomic.Bool
}

func newUpstream(connectTimeout time.Duration, tlsConfig *tls.Config) *upstream {
	return &upstream{
		dialer:      net.Dialer{Timeout: connectTimeout, KeepAlive: 30 * time.Second},
		tlsConfig:   tlsConfig,
		maxIdle:     maxIdlePerWorker,
		idleTimeout: idleConnTimeout,
		postProbe:   &http.Request{Method: http.MethodPost},
	}
}

// outbound is a request for a worker. Its head carries, when from is set, the forwarded
// headers of a client request (see forwarding); the client writes Host and Content-Length.
type outbound struct {
	method string
	// target is the path and query, beginning with "/", that follow the worker URL's path.
	target string
	forwarding
	body []byte
	// at is when the caller read the clock for the first-byte deadline (zero: not said), the
	// exchange's now when it goes out at once on a pooled connection.
	at time.Time
	// answer is memory for the worker's answer (a zero one), for one exchange: the request's
	// scratch's, the first time; nil: the exchange allocates its own.
	answer *answer
}

// roundTrip sends req to the worker at base and reads the answer's status and headers,
// all before the deadline firstBy. The body reads on the caller's goroutine, each read
// under a deadline the caller sets; closing it once read to the end returns the connection
// to the pool, closing it early drops the connection. The answer's Header map is the
// connection's, reused by its next exchange: it is the caller's until it closes the body
// (ownHead keeps a copy past that). Cancelling ctx aborts any read or write in
// progress; the error then wraps context.Cause(ctx). A missed deadline gives an error that
// wraps errNoAnswer and is a net.Error timeout.
func (u *upstream) roundTrip(ctx context.Context, base string, req outbound, firstBy time.Time) (*http.Response, *upBody, error) {
	p, err := u.host(base)
	if err != nil {
		return nil, nil, err
	}
	bp, _ := u.heads.Get().(*[]byte)
	if bp == nil {
		bp = new([]byte)
	}
	head := p.appendHead((*bp)[:0], req)
	// A small body goes behind the head in its buffer, for one write: a writev of the two
	// costs more than copying a few kilobytes (5.4 against 6.0 µs a message on loopback).
	body := req.body
	if len(body) <= inlineBody {
		head = append(head, body...)
		body = nil
	}
	defer func() {
		if cap(head) <= maxPooledHead {
			*bp = head[:0]
			u.heads.Put(bp)
		}
	}()
	// A pooled connection may have been closed by the worker while idle (keep-alive timeout,
	// restart); that shows as a failure before any answer, and the request goes once more
	// on a new connection. The worker may then see it twice, as it may when the router
	// retries on another worker; generation has no side effect to repeat.
	for attempt := 0; ; attempt++ {
		c, reused, err := p.get(ctx, attempt > 0, firstBy)
		if err != nil {
			if ctx.Err() != nil {
				return nil, nil, fmt.Errorf("connect to %s: %w", p.addr, context.Cause(ctx))
			}
			return nil, nil, err
		}
		// The caller's time serves as the exchange's now unless a dial or a failed
		// exchange came between.
		now := req.at
		if !reused || attempt > 0 || now.IsZero() {
			now = time.Now()
		}
		resp, answer, err := c.exchange(ctx, head, body, req, now, firstBy)
		switch {
		case err == nil:
			return resp, answer, nil
		case ctx.Err() != nil:
			return nil, nil, fmt.Errorf("exchange with %s: %w", p.addr, context.Cause(ctx))
		case errors.Is(err, os.ErrDeadlineExceeded):
			return nil, nil, fmt.Errorf("%w (%w)", errNoAnswer, err)
		case !reused || attempt > 0 || errors.Is(err, errResponseHeadTooLarge):
			return nil, nil, err
		}
	}
}

// host returns the pool for a worker URL, creating it on first use.
func (u *upstream) host(base string) (*hostPool, error) {
	if p, ok := u.hosts.Load(base); ok {
		return p.(*hostPool), nil
	}
	if u.closed.Load() {
		return nil, errors.New("upstream client is closed")
	}
	p, err := newHostPool(u, base)
	if err != nil {
		return nil, err
	}
	actual, _ := u.hosts.LoadOrStore(base, p)
	p = actual.(*hostPool)
	if u.closed.Load() {
		// close may have missed this pool: make sure its connections go.
		p.close()
	}
	return p, nil
}

// close drops every idle connection; connections in use are closed when their answer ends.
func (u *upstream) close() {
	u.closed.Store(true)
	u.hosts.Range(func(_, p any) bool {
		p.(*hostPool).close()
		return true
	})
}

// hostPool is the idle connections to one worker URL, most recently used last.
type hostPool struct {
	u      *upstream
	addr   string // host:port to dial
	host   string // Host header
	prefix string // the worker URL's path, without a trailing slash
	tls    *tls.Config

	mu     sync.Mutex
	idle   []*upConn
	sweep  *time.Timer
	armed  bool
	closed bool
}

func newHostPool(u *upstream, base string) (*hostPool, error) {
	pu, err := url.Parse(base)
	if err != nil {
		return nil, fmt.Errorf("worker url %q: %w", base, err)
	}
	if pu.Host == "" || (pu.Scheme != "http" && pu.Scheme != "https") {
		return nil, fmt.Errorf("worker url %q must be http(s)://host[:port]", base)
	}
	p := &hostPool{u: u, host: pu.Host, prefix: strings.TrimSuffix(pu.EscapedPath(), "/")}
	port := pu.Port()
	switch {
	case port != "":
	case pu.Scheme == "https":
		port = "443"
	default:
		port = "80"
	}
	p.addr = net.JoinHostPort(pu.Hostname(), port)
	if pu.Scheme == "https" {
		cfg := &tls.Config{}
		if u.tlsConfig != nil {
			cfg = u.tlsConfig.Clone()
		}
		if cfg.ServerName == "" {
			cfg.ServerName = pu.Hostname()
		}
		cfg.NextProtos = []string{"http/1.1"}
		p.tls = cfg
	}
	return p, nil
}

// appendHead appends the request line and headers of req.
func (p *hostPool) appendHead(b []byte, req outbound) []byte {
	b = append(b, req.method...)
	b = append(b, ' ')
	b = append(b, p.prefix...)
	b = append(b, req.target...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	b = append(b, p.host...)
	b = append(b, "\r\n"...)
	b = req.forwarding.appendTo(b)
	if len(req.body) > 0 || req.method == http.MethodPost || req.method == http.MethodPut {
		b = append(b, "Content-Length: "...)
		b = strconv.AppendInt(b, int64(len(req.body)), 10)
		b = append(b, "\r\n"...)
	}
	return append(b, "\r\n"...)
}

// get returns an idle connection, or dials a new one (always, with fresh) before the
// deadline; reused tells which.
func (p *hostPool) get(ctx context.Context, fresh bool, deadline time.Time) (*upConn, bool, error) {
	p.mu.Lock()
	if n := len(p.idle); n > 0 && !fresh {
		c := p.idle[n-1]
		p.idle[n-1] = nil
		p.idle = p.idle[:n-1]
		p.mu.Unlock()
		return c, true, nil
	}
	p.mu.Unlock()
	c, err := p.dial(ctx, deadline)
	return c, false, err
}

func (p *hostPool) dial(ctx context.Context, deadline time.Time) (*upConn, error) {
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	conn, err := p.u.dialer.DialContext(ctx, "tcp", p.addr)
	if err != nil {
		return nil, err
	}
	if p.tls != nil {
		tc := tls.Client(conn, p.tls)
		hctx := ctx
		if p.u.dialer.Timeout > 0 {
			var stop context.CancelFunc
			hctx, stop = context.WithTimeout(ctx, p.u.dialer.Timeout)
			defer stop()
		}
		if err := tc.HandshakeContext(hctx); err != nil {
			_ = conn.Close()
			return nil, fmt.Errorf("tls handshake with %s: %w", p.addr, err)
		}
		conn = tc
	}
	c := &upConn{pool: p, conn: conn, budget: -1}
	c.cancelFunc = c.cancel
	if tc, ok := conn.(*net.TCPConn); ok {
		if raw, err := tc.SyscallConn(); err == nil {
			c.raw = raw
			c.sendStep = c.step
		}
	}
	c.br = bufio.NewReaderSize(c, readBufferSize)
	return c, nil
}

// put returns a connection whose answer was read to the end.
func (p *hostPool) put(c *upConn) {
	if c.br.Buffered() > 0 {
		// The worker sent more than its answer: what it says next cannot be trusted.
		c.close()
		return
	}
	c.idleSince = time.Now()
	p.mu.Lock()
	if p.closed || len(p.idle) >= p.u.maxIdle {
		p.mu.Unlock()
		c.close()
		return
	}
	p.idle = append(p.idle, c)
	if !p.armed {
		p.armed = true
		if p.sweep == nil {
			p.sweep = time.AfterFunc(p.u.idleTimeout, p.expire)
		} else {
			p.sweep.Reset(p.u.idleTimeout)
		}
	}
	p.mu.Unlock()
}

// expire closes the connections idle past the timeout and re-arms for the oldest left.
func (p *hostPool) expire() {
	now := time.Now()
	p.mu.Lock()
	// idle is in order of return, so the stale ones are a prefix.
	n := 0
	for n < len(p.idle) && now.Sub(p.idle[n].idleSince) >= p.u.idleTimeout {
		n++
	}
	stale := make([]*upConn, n)
	copy(stale, p.idle[:n])
	rest := copy(p.idle, p.idle[n:])
	clear(p.idle[rest:])
	p.idle = p.idle[:rest]
	p.armed = false
	if len(p.idle) > 0 && !p.closed {
		p.armed = true
		p.sweep.Reset(p.u.idleTimeout - now.Sub(p.idle[0].idleSince))
	}
	p.mu.Unlock()
	for _, c := range stale {
		c.close()
	}
}

func (p *hostPool) close() {
	p.mu.Lock()
	p.closed = true
	idle := p.idle
	p.idle = nil
	if p.sweep != nil {
		p.sweep.Stop()
	}
	p.mu.Unlock()
	for _, c := range idle {
		c.close()
	}
}

// idleCount is the number of pooled connections.
func (p *hostPool) idleCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.idle)
}

// upConn is one connection to a worker. Its reader counts down a budget while a response
// head is read. Deadlines do the waiting: the caller's, and one in the past once the
// request's context is cancelled, which no later deadline may undo.
type upConn struct {
	pool      *hostPool
	conn      net.Conn
	br        *bufio.Reader
	budget    int // bytes the head may still take; < 0: unlimited
	idleSince time.Time
	// cancelFunc is cancel, made into a func value once rather than on every exchange.
	cancelFunc func()

	out      net.Buffers // the request being written, over outArray
	outArray [2][]byte
	// raw is a plain TCP connection's descriptor (nil under TLS), through which send writes
	// the request from inside the wait for its answer; sendStep (a func value made once) is
	// that wait's step, and sendHead, sendBody, sent and sendErr its state for one request.
	raw                syscall.RawConn
	sendStep           func(uintptr) bool
	sendHead, sendBody []byte
	sent               bool
	sendErr            error
	// head is readCommonHead's copy of an answer head being canonicalised, body the answer
	// body it reads and header the answer's Header, reused by every exchange (only the
	// exchange's upBody reads the body; the Header is its holder's until it closes that).
	head   []byte
	body   fixedBody
	header http.Header

	mu        sync.Mutex
	cancelled bool
	// readBy and writeBy are the deadlines in force (zero: none), as set under mu.
	readBy, writeBy time.Time
}

// cancel ends whatever the connection is waiting for, for good.
func (c *upConn) cancel() {
	c.mu.Lock()
	c.cancelled = true
	_ = c.conn.SetDeadline(aLongTimeAgo)
	c.mu.Unlock()
}

// setReadDeadline sets the read deadline, unless the connection was cancelled.
func (c *upConn) setReadDeadline(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.cancelled {
		_ = c.conn.SetReadDeadline(t)
		c.readBy = t
	}
}

// exchangeDeadline sets the read and write deadlines for an exchange due by t to t plus a
// 64th of the time left (from now, the time it is), or leaves the ones in force when they
// are neither earlier than t nor later by more than that. Moving a deadline costs two timer
// updates, and on a busy connection each exchange's deadline is only a little later than
// the last one's, which then still serves: the time an exchange is allowed is between the
// one asked and a 64th more.
func (c *upConn) exchangeDeadline(now, t time.Time) {
	slack := t.Sub(now) / 64
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cancelled || withinSlack(c.readBy, t, slack) && withinSlack(c.writeBy, t, slack) {
		return
	}
	t = t.Add(slack)
	_ = c.conn.SetDeadline(t)
	c.readBy, c.writeBy = t, t
}

// withinSlack reports whether the deadline d in force serves for one asked at t: it is not
// earlier, nor later by more than slack.
func withinSlack(d, t time.Time, slack time.Duration) bool {
	return !d.Before(t) && d.Sub(t) <= slack
}

// Read implements io.Reader for the buffered reader.
func (c *upConn) Read(b []byte) (int, error) {
	if c.budget < 0 {
		return c.conn.Read(b)
	}
	if c.budget == 0 {
		return 0, errResponseHeadTooLarge
	}
	if len(b) > c.budget {
		b = b[:c.budget]
	}
	n, err := c.conn.Read(b)
	c.budget -= n
	return n, err
}

func (c *upConn) close() { _ = c.conn.Close() }

// exchange writes the request and reads the answer's head before the deadline; now is the
// time it is.
func (c *upConn) exchange(ctx context.Context, head, body []byte, req outbound, now, deadline time.Time) (*http.Response, *upBody, error) {
	stop := afterDone(ctx, c.cancelFunc)
	fail := func(err error) (*http.Response, *upBody, error) {
		stop()
		c.close()
		return nil, nil, err
	}
	c.exchangeDeadline(now, deadline)
	if werr := c.send(head, body, now); werr != nil {
		// A worker may answer (say, 413) and close before taking the whole body; its answer
		// is then already here and better than the write error.
		a, err := c.readHead(req.method, req.answer)
		if err != nil {
			return fail(fmt.Errorf("send request to %s: %w", c.pool.addr, werr))
		}
		a.body = upBody{src: a.resp.Body, conn: c, stop: stop}
		a.resp.Body = &a.body
		return &a.resp, &a.body, nil
	}
	a, err := c.readHead(req.method, req.answer)
	if err != nil {
		return fail(err)
	}
	a.body = upBody{src: a.resp.Body, conn: c, stop: stop, reuse: !a.resp.Close}
	a.resp.Body = &a.body
	return &a.resp, &a.body, nil
}

// rawWaitIdle is the longest a pooled connection may have been idle for send to wait for its
// answer before reading it (see send).
const rawWaitIdle = time.Second

// send writes the request (now is the time it is): one write for a head with its body in it,
// one writev for a head and a larger body (the writev's slices live in the connection so
// that they need no allocation, and are dropped once written).
//
// On a plain TCP connection it writes from inside a raw read that then waits, without
// reading, until the socket has something to read. Go's reads try the socket before they
// wait, and right after a request nothing has come yet: a system call that finds nothing on
// every exchange (1.6-1.9 µs on the 2-core machine). A raw read's wait begins by forgetting
// the readiness seen before it, so the write must come after that beginning, inside it, for
// no answer to be missed: what wakes the wait is the answer's first bytes, the worker's
// close or reset, or a deadline, and the buffered reader's read that follows finds which. A
// wait that ends in an error after the write leaves that error to the read, which meets it
// again.
//
// What that forgetting can lose is a close that came while the connection was idle: a worker
// that closes fully resets the request when it comes, which wakes the wait, but one that
// only stops sending and goes on reading (a lingering close) would leave the wait to the
// first-byte deadline rather than to the retry on a new connection that the read's end of
// file starts. Workers close idle connections after seconds of keep-alive, so a connection
// idle for more than rawWaitIdle reads first, as Go does.
func (c *upConn) send(head, body []byte, now time.Time) error {
	if c.raw == nil || !c.idleSince.IsZero() && now.Sub(c.idleSince) > rawWaitIdle {
		return c.write(head, body)
	}
	c.sendHead, c.sendBody, c.sent, c.sendErr = head, body, false, nil
	err := c.raw.Read(c.sendStep)
	sent, werr := c.sent, c.sendErr
	c.sendHead, c.sendBody, c.sendErr = nil, nil, nil
	if !sent {
		// The wait failed before its first step (a deadline passed, the connection closed):
		// nothing was written.
		return err
	}
	return werr
}

// step is send's raw read step: the first writes the request and asks for a wait, unless
// the write failed; the next, after the wait, ends it without reading.
func (c *upConn) step(uintptr) bool {
	if c.sent {
		return true
	}
	c.sent = true
	c.sendErr = c.write(c.sendHead, c.sendBody)
	return c.sendErr != nil
}

// write writes head and body.
func (c *upConn) write(head, body []byte) error {
	if len(body) == 0 {
		_, err := c.conn.Write(head)
		return err
	}
	c.out = append(c.outArray[:0], head, body)
	_, err := c.out.WriteTo(c.conn)
	c.outArray = [2][]byte{}
	return err
}

// afterFuncer is a context that runs a function once it is done, and says so itself; it is
// the method context.AfterFunc looks for.
type afterFuncer interface {
	AfterFunc(f func()) (stop func() bool)
}

// afterDone runs f once ctx is done, as context.AfterFunc does; a context with an AfterFunc
// method of its own (transport/h1's request context) is asked directly. context.AfterFunc
// would ask it too, but through a child context of its own and the closures around it: four
// allocations on every exchange for nothing. (net/http's request context has no such
// method: it takes context.AfterFunc's way, a child in its children map.)
func afterDone(ctx context.Context, f func()) (stop func() bool) {
	if a, ok := ctx.(afterFuncer); ok {
		return a.AfterFunc(f)
	}
	return context.AfterFunc(ctx, f)
}

// readHead reads the answer's status line and headers, skipping informational answers.
func (c *upConn) readHead(method string, into *answer) (*answer, error) {
	// The budget covers what the buffered reader takes ahead of the head, too.
	c.budget = maxResponseHead + readBufferSize
	defer func() { c.budget = -1 }()
	probe := c.pool.u.postProbe
	if method != http.MethodPost {
		probe = &http.Request{Method: method}
	}
	for range maxInformational {
		a, ok, err := c.readCommonHead(probe, into)
		if err != nil {
			return nil, fmt.Errorf("read response from %s: %w", c.pool.addr, err)
		}
		if ok {
			return a, nil
		}
		resp, err := http.ReadResponse(c.br, probe)
		if err != nil {
			return nil, fmt.Errorf("read response from %s: %w", c.pool.addr, err)
		}
		switch {
		case resp.StatusCode == http.StatusSwitchingProtocols:
			return nil, fmt.Errorf("worker %s switched protocols", c.pool.addr)
		case resp.StatusCode >= 200:
			a := newAnswer(into)
			a.resp = *resp
			return a, nil
		}
		// 1xx answers other than 101 precede the real one.
	}
	return nil, fmt.Errorf("worker %s sent more than %d informational answers", c.pool.addr, maxInformational)
}

// upBody is a worker's response body. Closing it at its end gives the connection back to
// the pool.
type upBody struct {
	src   io.ReadCloser
	conn  *upConn
	stop  func() bool
	reuse bool
	done  bool
	eof   bool
}

// Read implements io.Reader.
func (b *upBody) Read(p []byte) (int, error) {
	if b.done {
		if b.eof {
			return 0, io.EOF
		}
		return 0, errors.New("read of a closed response body")
	}
	n, err := b.src.Read(p)
	if errors.Is(err, io.EOF) {
		// The connection goes back to the pool at Close: its holder may still read the
		// answer's Header, which the connection's next exchange reuses.
		b.eof = true
	}
	return n, err
}

// setReadDeadline bounds the reads that follow.
func (b *upBody) setReadDeadline(t time.Time) {
	if !b.done {
		b.conn.setReadDeadline(t)
	}
}

// Close implements io.Closer: an answer read to its end gives its connection back to the
// pool, one not read to its end takes its connection with it.
func (b *upBody) Close() error {
	b.release()
	return nil
}

func (b *upBody) release() {
	if b.done {
		return
	}
	b.done = true
	// stop fails once cancellation has poisoned the connection's deadline. A pooled
	// connection keeps its last deadline (clearing it costs timer updates): nothing waits on
	// it before the next exchange sets its own.
	if b.stop() && b.eof && b.reuse {
		b.conn.pool.put(b.conn)
		return
	}
	b.conn.close()
}

// isCancelled reports whether the request's context ended the connection's waits.
func (c *upConn) isCancelled() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cancelled
}

// ownHead is a copy of an answer's head that outlives its body: its Header is the
// connection's, which the connection's next exchange reuses once the body is closed.
func ownHead(resp *http.Response) *http.Response {
	own := *resp
	own.Header = resp.Header.Clone()
	own.Body = http.NoBody
	return &own
}
