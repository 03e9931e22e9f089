package openai

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Limits of the proxy that are not worth a knob.
const (
	// maxDispatches caps the dispatch loop even if routing's retry bound were broken.
	maxDispatches = 16
	// maxBufferedResponse caps a non-streamed answer, which is read whole to check it.
	maxBufferedResponse = 64 << 20
	// copyBuffer is the read size for relaying a body.
	copyBuffer = 32 << 10
	// drainOnRetry is how much of a failed answer is read before dropping the connection.
	drainOnRetry = 4 << 10
)

// hopHeaders are the hop-by-hop headers (RFC 9110 section 7.6.1) a proxy must not forward,
// plus ones that describe this hop's framing.
var hopHeaders = [...]string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// Causes that end an upstream read.
var (
	errIdle      = errors.New("worker sent nothing within the idle timeout")
	errFirstByte = errors.New("worker sent no body within the first-byte timeout")
)

func newTransport(cfg Config) *http.Transport {
	// HTTP/1.1 only, even for https workers: one stream per connection keeps a slow stream
	// from holding up others, and matches what inference servers speak.
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	dialer := &net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}
	return &http.Transport{
		Proxy:                 nil,
		DialContext:           dialer.DialContext,
		MaxIdleConns:          4096,
		MaxIdleConnsPerHost:   256,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   cfg.ConnectTimeout,
		ResponseHeaderTimeout: cfg.FirstByteTimeout,
		ExpectContinueTimeout: 0,
		DisableCompression:    true,
		ForceAttemptHTTP2:     false,
		Protocols:             protocols,
	}
}

// outcome is how one dispatch ended.
type outcome int

const (
	done    outcome = iota // the client has its answer (or is gone)
	retry                  // nothing reached the client: try the next choice
	aborted                // the response had started when the worker broke off
)

// failure is a dispatch that may be retried.
type failure struct {
	cause string // metrics label
	err   error
}

// call is one client request on its way through the proxy.
type call struct {
	w       *recorder
	r       *http.Request
	p       *Request
	att     *routing.Attempt
	session string
	arrived time.Time
	// firstAt is when the current dispatch's first body bytes arrived (zero: not yet).
	firstAt time.Time
}

// firstBytes notes the first body bytes of a dispatch: the load moves from prefill to decode.
func (c *call) firstBytes() {
	if !c.firstAt.IsZero() {
		return
	}
	c.firstAt = time.Now()
	c.att.FirstToken()
}

// observeTTFT records the time to first byte of the answer the client is about to get.
func (c *call) observeTTFT(s *Server) {
	if !c.firstAt.IsZero() {
		s.metrics.ttft.Observe(c.firstAt.Sub(c.arrived).Seconds())
	}
}

// proxy dispatches to the attempt's decision, retrying before the first byte, and reports
// whether the client connection must be aborted. It always finishes the attempt.
func (s *Server) proxy(c *call) bool {
	// Finish is idempotent, so it is safe after a failed Retry has already ended the attempt;
	// deferring it frees the load on every path, panics included.
	defer c.att.Finish()
	ctx := c.r.Context()
	var last failure
	for range maxDispatches {
		res, fail := s.dispatch(c)
		switch res {
		case done:
			return false
		case aborted:
			return true
		}
		last = fail
		s.metrics.errors.WithLabelValues(fail.cause).Inc()
		if ctx.Err() != nil {
			s.fail(c.w, c.r, nil)
			return false
		}
		s.log.Info("dispatch failed before the first byte; retrying",
			"worker", c.att.Decision().Target.Worker.String(), "cause", fail.cause, "error", fail.err)
		if err := c.att.Retry(ctx, fail.err); err != nil {
			s.fail(c.w, c.r, retryError(err, last))
			return false
		}
		s.metrics.retries.Inc()
	}
	s.fail(c.w, c.r, retryError(routing.ErrRetriesExhausted, last))
	return false
}

// retryError is the answer when no retry is left, naming the last upstream failure.
func retryError(err error, last failure) *Error {
	apiErr := routeError(err)
	if apiErr == nil {
		return nil
	}
	if last.err != nil && errors.Is(err, routing.ErrRetriesExhausted) {
		apiErr.Message = fmt.Sprintf("%s; last upstream error: %v", apiErr.Message, last.err)
	}
	return apiErr
}

// dispatch sends the request to the current decision's worker once.
func (s *Server) dispatch(c *call) (outcome, failure) {
	ctx := c.r.Context()
	d := c.att.Decision()
	c.firstAt = time.Time{}
	if d.Target.Spec == nil {
		return retry, failure{cause: "internal", err: errors.New("routing chose a target without a spec")}
	}
	upCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)

	up, err := s.upstreamRequest(upCtx, c.r, c.p, d.Target)
	if err != nil {
		return retry, failure{cause: "upstream_connect", err: err}
	}
	dispatched := time.Now()
	resp, err := s.transport.RoundTrip(up)
	if err != nil {
		if ctx.Err() != nil {
			s.fail(c.w, c.r, nil)
			return done, failure{}
		}
		cause := "upstream_connect"
		var netErr net.Error
		if errors.As(err, &netErr) && netErr.Timeout() {
			cause = "upstream_timeout"
		}
		return retry, failure{cause: cause, err: fmt.Errorf("worker %s: %w", d.Target.Worker, err)}
	}
	defer resp.Body.Close()

	if resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests {
		_, _ = io.CopyN(io.Discard, resp.Body, drainOnRetry)
		return retry, failure{cause: "upstream_status",
			err: fmt.Errorf("worker %s answered %s", d.Target.Worker, resp.Status)}
	}

	rd := newUpstreamReader(resp.Body, cancel, dispatched.Add(s.cfg.FirstByteTimeout), s.cfg.IdleTimeout)
	defer rd.stop()

	if resp.StatusCode < 200 || resp.StatusCode >= 300 {
		// The worker refused the request itself: the client's fault, so it is theirs to see.
		s.writeHeaders(c, resp, d, routing.Binding{}, -1)
		return s.relay(c, rd, d, nil)
	}

	binding, err := c.att.Commit(ctx)
	if err != nil {
		cancel(err)
		s.fail(c.w, c.r, commitError(err))
		return done, failure{}
	}

	if c.p.Stream || isEventStream(resp.Header) {
		return s.relay(c, rd, d, func() {
			c.observeTTFT(s)
			s.writeHeaders(c, resp, d, binding, -1)
		})
	}

	body, err := s.readAll(c, rd)
	switch {
	case err != nil && ctx.Err() != nil:
		s.fail(c.w, c.r, nil)
		return done, failure{}
	case err != nil && rd.cause() != nil:
		return retry, s.badResponse(d, "upstream_timeout", err)
	case err != nil:
		return retry, s.badResponse(d, "upstream_garbage", err)
	case resp.Header.Get("Content-Encoding") == "" && !json.Valid(body):
		return retry, s.badResponse(d, "upstream_garbage", errors.New("a 2xx answer that is not JSON"))
	}
	c.observeTTFT(s)
	s.writeHeaders(c, resp, d, binding, len(body))
	if _, err := c.w.Write(body); err != nil {
		s.log.Debug("client write failed", "error", err)
	}
	return done, failure{}
}

// commitError maps a failed Commit: the worker accepted, but the binding could not be made.
func commitError(err error) *Error {
	switch {
	case errors.Is(err, context.Canceled):
		return nil
	case errors.Is(err, routing.ErrTooManySessions):
		return routeError(err)
	}
	return &Error{Status: http.StatusServiceUnavailable, Message: "could not bind the session: " + err.Error(),
		Type: TypeUnavailable, Code: "binding_failed", RetryAfter: "1", Cause: "commit"}
}

// badResponse takes a worker that answered garbage out of rotation until the health checker
// sees it well again.
func (s *Server) badResponse(d routing.Decision, cause string, err error) failure {
	id := d.Target.Worker.ID
	reason := "bad response: " + err.Error()
	if s.workers.SetHealthy(id, false, reason) {
		s.log.Warn("worker marked unhealthy", "worker", id, "reason", reason)
	}
	return failure{cause: cause, err: fmt.Errorf("worker %s: %s", d.Target.Worker, reason)}
}

// upstreamRequest builds the worker's copy of the client request.
func (s *Server) upstreamRequest(ctx context.Context, r *http.Request, p *Request, t routing.Target) (*http.Request, error) {
	target := strings.TrimSuffix(t.Spec.URL, "/") + r.URL.Path
	if r.URL.RawQuery != "" {
		target += "?" + r.URL.RawQuery
	}
	up, err := http.NewRequestWithContext(ctx, r.Method, target, bytes.NewReader(p.Body))
	if err != nil {
		return nil, fmt.Errorf("build request for worker %s: %w", t.Worker, err)
	}
	copyHeaders(up.Header, r.Header)
	// Identity encoding lets the proxy check a buffered answer and pass SSE as it comes.
	up.Header.Del("Accept-Encoding")
	up.Header.Del("Expect")
	up.Header.Del("Content-Length")
	if max(t.Spec.DPSize, 1) > 1 {
		up.Header.Set(headerDPRank, strconv.FormatUint(uint64(t.Worker.DPRank), 10))
	} else {
		// A rank the client named means nothing to a worker without data parallelism.
		up.Header.Del(headerDPRank)
	}
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		if prior := r.Header.Values("X-Forwarded-For"); len(prior) > 0 {
			host = strings.Join(prior, ", ") + ", " + host
		}
		up.Header.Set("X-Forwarded-For", host)
	}
	return up, nil
}

// copyHeaders copies src into dst without hop-by-hop headers, including those the
// Connection header names.
func copyHeaders(dst, src http.Header) {
	var named []string
	for _, v := range src.Values("Connection") {
		for tok := range strings.SplitSeq(v, ",") {
			if tok = strings.TrimSpace(tok); tok != "" {
				named = append(named, tok)
			}
		}
	}
	for k, vs := range src {
		if isHop(k) || containsFold(named, k) {
			continue
		}
		dst[k] = append([]string(nil), vs...)
	}
}

func isHop(k string) bool {
	return containsFold(hopHeaders[:], k)
}

func containsFold(list []string, k string) bool {
	for _, v := range list {
		if strings.EqualFold(v, k) {
			return true
		}
	}
	return false
}

func isEventStream(h http.Header) bool {
	return strings.HasPrefix(strings.ToLower(h.Get("Content-Type")), "text/event-stream")
}

// writeHeaders sends the worker's status and headers plus the router's own. bodyLen < 0
// streams.
func (s *Server) writeHeaders(c *call, resp *http.Response, d routing.Decision, b routing.Binding, bodyLen int) {
	h := c.w.Header()
	copyHeaders(h, resp.Header)
	h.Del("Content-Length")
	if bodyLen >= 0 {
		h.Set("Content-Length", strconv.Itoa(bodyLen))
	}
	h.Set(HeaderWorker, d.Target.Worker.String())
	if s.cfg.ReplicaID != "" {
		h.Set(HeaderReplica, s.cfg.ReplicaID)
	}
	rev := b.Revision
	if rev == 0 {
		rev = d.Binding.Revision
	}
	// A session that is not bound yet (a refused first request) has no revision to tell.
	if c.session != "" && rev != 0 {
		h.Set(HeaderRevision, strconv.FormatUint(rev, 10))
	}
	h.Set(HeaderOverlap, strconv.Itoa(d.Overlap))
	c.w.WriteHeader(resp.StatusCode)
}

// relay streams the worker's body to the client read by read, flushing each. hdr, when set,
// writes the headers at the first body bytes, so that a stream that fails before them can
// still be retried; without it the headers are already out.
func (s *Server) relay(c *call, rd *upstreamReader, d routing.Decision, hdr func()) (outcome, failure) {
	ctx := c.r.Context()
	rc := http.NewResponseController(c.w)
	buf := make([]byte, copyBuffer)
	started := hdr == nil
	// Each pass reads at least one byte or ends; the idle timeout bounds how long a pass waits.
	for {
		n, err := rd.read(buf)
		if n > 0 {
			c.firstBytes()
			if !started {
				hdr()
				started = true
			}
			if _, werr := c.w.Write(buf[:n]); werr != nil {
				s.log.Debug("client write failed", "error", werr)
				s.metrics.errors.WithLabelValues("client_cancel").Inc()
				return done, failure{}
			}
			if ferr := rc.Flush(); ferr != nil && !errors.Is(ferr, http.ErrNotSupported) {
				s.metrics.errors.WithLabelValues("client_cancel").Inc()
				return done, failure{}
			}
		}
		switch {
		case err == nil:
			continue
		case errors.Is(err, io.EOF) && started:
			return done, failure{}
		case errors.Is(err, io.EOF):
			return retry, s.badResponse(d, "upstream_garbage", errors.New("a 2xx stream with an empty body"))
		case ctx.Err() != nil:
			s.fail(c.w, c.r, nil)
			return done, failure{}
		}
		cause, why := "upstream_broken", err
		if tc := rd.cause(); tc != nil {
			cause, why = "upstream_timeout", tc
		}
		fail := s.badResponse(d, cause, fmt.Errorf("stream broke off: %w", why))
		if !started {
			return retry, fail
		}
		s.metrics.errors.WithLabelValues(cause).Inc()
		s.log.Warn("worker stream broke off mid-response", "worker", d.Target.Worker.String(), "error", why)
		return aborted, fail
	}
}

// readAll reads a whole non-streamed answer within maxBufferedResponse.
func (s *Server) readAll(c *call, rd *upstreamReader) ([]byte, error) {
	var out bytes.Buffer
	buf := make([]byte, copyBuffer)
	// Each pass reads at least one byte or ends; the size cap and the idle timeout bound it.
	for {
		n, err := rd.read(buf)
		if n > 0 {
			c.firstBytes()
			if out.Len()+n > maxBufferedResponse {
				return nil, fmt.Errorf("answer exceeds %d bytes", maxBufferedResponse)
			}
			out.Write(buf[:n])
		}
		switch {
		case errors.Is(err, io.EOF):
			return out.Bytes(), nil
		case err != nil && rd.cause() != nil:
			return nil, rd.cause()
		case err != nil:
			return nil, err
		}
	}
}

// upstreamReader reads a worker's body under the first-byte deadline, then the idle timeout
// between reads, by cancelling the upstream request when a read waits too long.
type upstreamReader struct {
	body     io.Reader
	cancel   context.CancelCauseFunc
	timer    *time.Timer
	why      atomic.Pointer[error]
	firstBy  time.Time
	idle     time.Duration
	gotBytes bool
	timedOut error
}

func newUpstreamReader(body io.Reader, cancel context.CancelCauseFunc, firstBy time.Time, idle time.Duration) *upstreamReader {
	u := &upstreamReader{body: body, cancel: cancel, firstBy: firstBy, idle: idle}
	u.timer = time.AfterFunc(time.Hour, func() {
		if why := u.why.Load(); why != nil {
			u.cancel(*why)
		}
	})
	u.timer.Stop()
	return u
}

// read reads once, cancelling the upstream request if the read outlives its timeout.
func (u *upstreamReader) read(buf []byte) (int, error) {
	if u.timedOut != nil {
		return 0, u.timedOut
	}
	timeout, why := u.idle, errIdle
	if !u.gotBytes {
		timeout, why = time.Until(u.firstBy), errFirstByte
	}
	if timeout <= 0 {
		u.timedOut = why
		u.cancel(why)
		return 0, why
	}
	u.why.Store(&why)
	u.timer.Reset(timeout)
	n, err := u.body.Read(buf)
	if !u.timer.Stop() {
		// The timer fired during the read: whatever this read returned, the request is
		// being cancelled.
		u.timedOut = why
	}
	if n > 0 {
		u.gotBytes = true
	}
	return n, err
}

// cause reports the timeout that cut the upstream request, if one did.
func (u *upstreamReader) cause() error { return u.timedOut }

func (u *upstreamReader) stop() { u.timer.Stop() }
