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
	"net/textproto"
	"os"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Limits of the proxy that are not worth a knob.
const (
	// maxDispatches caps the dispatch loop even if routing's retry bound were broken.
	maxDispatches = 16
	// maxBufferedResponse caps a non-streamed answer, which is read whole to check it.
	maxBufferedResponse = 64 << 20
	// copyBuffer is the read size for relaying a body: streamed events are small, and a
	// non-streamed answer is read whole without it.
	copyBuffer = 16 << 10
	// keepFailedAnswer is how much of a worker's error answer is kept for the client.
	keepFailedAnswer = 64 << 10
	// maxPooledAnswer is the largest non-streamed answer buffer kept for reuse.
	maxPooledAnswer = 64 << 10
)

// Causes that end an upstream read.
var (
	errIdle      = errors.New("worker sent nothing within the idle timeout")
	errFirstByte = errors.New("worker sent no body within the first-byte timeout")
)

// newTransport is the net/http client for worker calls off the hot path (the model list).
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
		TLSClientConfig:       cfg.WorkerTLS,
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
	moved                  // another replica bound the session first: dispatch again to its worker
	migrate                // the stream broke off after it started: continue it at another worker
)

// failure is a dispatch that may be retried.
type failure struct {
	cause string // metrics label
	err   error
	// answer is the worker's own error answer (a 5xx or 429), kept for the client in case
	// no other worker can do better.
	answer *failedAnswer
}

// failedAnswer is a worker's error answer: its status, headers and the start of its body.
type failedAnswer struct {
	worker routing.Decision
	resp   *http.Response
	body   []byte
}

// call is one client request on its way through the proxy.
type call struct {
	w       *recorder
	r       *http.Request
	p       *Request
	att     *routing.Attempt
	session string
	// client is the request's client key (limits.go), "" without a session.
	client  string
	arrived time.Time
	// firstAt is when the current dispatch's first body bytes arrived (zero: not yet), and
	// boundAt when its binding was, the first byte's other condition (zero without a session).
	firstAt time.Time
	boundAt time.Time
	// ended: the current dispatch's answer reached its end (the worker finished it), with
	// generated output tokens (its usage's completion_tokens, else its stream's events).
	ended     bool
	generated int
	// body is what the current dispatch sends: the client's body, or for a disaggregated
	// request the decode leg's (the client's with the prefill worker's kv_transfer_params).
	body []byte
	// prefill names the current dispatch's prefill worker ("": aggregated), and decodeAt is
	// when its decode leg was sent.
	prefill  string
	decodeAt time.Time
	// watch reads a stored Responses stream for its id (nil: not watched).
	watch *responseWatch
	// mig follows a stream for its continuation at another worker (migrate.go); nil with
	// migration off.
	mig *migration
	// asked: a dispatch of this request went to a worker (or was about to), so the replica
	// may no longer refuse it (afterWorker).
	asked bool
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
		at := c.firstAt
		if c.boundAt.After(at) {
			at = c.boundAt
		}
		s.metrics.ttft.Observe(at.Sub(c.arrived).Seconds())
	}
}

// proxy dispatches to the attempt's decision, retrying before the first byte, and reports
// whether the client connection must be aborted. It always finishes the attempt.
func (s *Server) proxy(c *call) bool {
	// Finish is idempotent, so it is safe after a failed Retry has already ended the attempt;
	// deferring it frees the load on every path, panics included.
	defer c.att.Finish()
	ctx := c.r.Context()
	base := c.r
	c.mig = newMigration(c.p, s.cfg.MigrationLimit)
	var last failure
	for attempt := range maxDispatches {
		// Each attempt is a span of its own, the worker's traceparent its child.
		span := trace.SpanFromContext(context.Background())
		if s.tr != nil {
			var actx context.Context
			actx, span = s.tr.start(ctx, "dispatch", trace.SpanKindClient,
				append(decisionAttrs(c.att.Decision()), attrAttempt.Int(attempt+1))...)
			c.r = base.WithContext(actx)
		}
		if c.mig.moving() {
			span.SetAttributes(attrMoves.Int(c.mig.moves))
		}
		res, fail := s.dispatch(c)
		c.r = base
		if res == retry || res == migrate {
			failSpan(span, fail.cause, fail.err)
		}
		if c.prefill != "" {
			span.SetAttributes(attrPrefill.String(c.prefill))
		}
		span.End()
		switch res {
		case done:
			return false
		case aborted:
			return true
		case moved:
			continue
		case migrate:
			if !s.move(c, fail) {
				return false
			}
			continue
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
			s.giveUp(c, err, last)
			return false
		}
		s.metrics.retries.Inc()
	}
	s.giveUp(c, routing.ErrRetriesExhausted, last)
	return false
}

// giveUp answers a request no retry is left for (err says why, last is the last dispatch's
// failure): with the last worker's own error answer when it gave one (its status and body,
// so that the client sees the engine's reason), else with a 502 naming the last failure when
// every worker tried failed, else with err's answer.
func (s *Server) giveUp(c *call, err error, last failure) {
	if c.r.Context().Err() != nil {
		s.fail(c.w, c.r, nil)
		return
	}
	if c.mig.moving() {
		// The stream's head is out: it ends with an error event.
		s.metrics.migrations.WithLabelValues(migrationNoWorker).Inc()
		s.failStream(c, retryError(err, last))
		return
	}
	if a := last.answer; a != nil {
		s.log.Info("no worker left to retry on; the client gets the last worker's answer",
			"worker", a.worker.Target.Worker.String(), "status", a.resp.StatusCode)
		if a.resp.StatusCode == http.StatusServiceUnavailable {
			// A 503 from the router means nothing was asked of any worker (HeaderRefused):
			// the worker's own 503 goes out as a 502, its body unchanged.
			a.resp.StatusCode = http.StatusBadGateway
		}
		s.writeHeaders(c, a.resp, a.worker, routing.Binding{}, len(a.body))
		_, _ = c.w.Write(a.body)
		return
	}
	s.fail(c.w, c.r, retryError(err, last))
}

// retryError is the answer when no retry is left, naming the last upstream failure: a 502
// when workers were tried and failed (none left, or the retry bound reached).
func retryError(err error, last failure) *Error {
	apiErr := routeError(err)
	if apiErr == nil || last.err == nil {
		return apiErr
	}
	if errors.Is(err, routing.ErrNoWorker) {
		return &Error{Status: http.StatusBadGateway, Message: "no worker left to try; last upstream error: " + last.err.Error(),
			Type: TypeServer, Code: "upstream_failed", Cause: "retries_exhausted"}
	}
	if errors.Is(err, routing.ErrRetriesExhausted) {
		apiErr.Message = fmt.Sprintf("%s; last upstream error: %v", apiErr.Message, last.err)
	}
	return afterWorker(apiErr)
}

// dispatch sends the request to the current decision's worker once.
func (s *Server) dispatch(c *call) (outcome, failure) {
	ctx := c.r.Context()
	d := c.att.Decision()
	c.firstAt, c.boundAt, c.ended, c.generated, c.watch = time.Time{}, time.Time{}, false, 0, nil
	if d.Target.Spec == nil {
		return retry, failure{cause: "internal", err: errors.New("routing chose a target without a spec")}
	}
	by := "choice"
	if d.Bound {
		by = "binding"
	}
	c.prefill = ""
	sent, err := sentBody(c.p, d.Model)
	if err == nil && c.mig != nil {
		c.mig.start()
		if c.mig.moving() {
			sent, err = c.mig.continuation(sent)
		}
	}
	if err != nil {
		return retry, failure{cause: "internal", err: err}
	}
	c.body = sent
	// A new session's binding is proposed now, so that Raft commits it while the worker
	// prefills (and while a prefill worker does, when disaggregated); the first byte waits
	// for what is left of it (bind). A replica out of contact with its quorum commits it
	// first, and one that cannot refuses the request before any worker sees it (unbound).
	if err := c.att.Propose(ctx); err != nil {
		return s.unbound(c, err)
	}
	c.asked = true
	if res, fail, ok := s.disaggregate(c); !ok {
		return res, fail
	}
	s.metrics.dispatchesBy.with(d.Target.Worker.String(), by).Inc()
	now := time.Now()
	firstBy := now.Add(s.cfg.FirstByteTimeout)
	out := s.upstreamRequest(c.r, c.body, d.Target)
	out.at, out.answer = now, c.w.scratch.answerMemory()
	resp, ub, err := s.upstream.roundTrip(ctx, d.Target.Spec.URL, out, firstBy)
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
	rd := newUpstreamReader(ub, firstBy, s.cfg.IdleTimeout)

	if resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, keepFailedAnswer))
		return retry, failure{cause: "upstream_status",
			err:    fmt.Errorf("worker %s answered %s", d.Target.Worker, resp.Status),
			answer: &failedAnswer{worker: d, resp: ownHead(resp), body: body}}
	}

	if c.mig.moving() && (resp.StatusCode < 200 || resp.StatusCode >= 300 || !isEventStream(resp.Header)) {
		// The client has the stream's head already: a refused continuation ends it.
		c.att.Refused(ctx)
		s.metrics.migrations.WithLabelValues(migrationNoWorker).Inc()
		s.failStream(c, &Error{Status: http.StatusBadGateway, Type: TypeServer, Code: "migration_failed", Cause: "migration_failed",
			Message: fmt.Sprintf("the answer is incomplete: worker %s refused its continuation (%s)", d.Target.Worker, resp.Status)})
		return done, failure{}
	}

	if resp.StatusCode < 200 || resp.StatusCode >= 300 {
		// The worker refused the request itself: the client's fault, so it is theirs to see.
		// A new session's binding, proposed at dispatch and seen by no other request yet,
		// is dropped: a refused first request leaves no session.
		c.att.Refused(ctx)
		s.writeHeaders(c, resp, d, routing.Binding{}, -1)
		return s.relay(c, &rd, d, false, nil)
	}

	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(attrStatus.Int(resp.StatusCode))
	}

	if c.p.Stream || isEventStream(resp.Header) {
		if s.bindsResponse(c.p) {
			c.watch = &responseWatch{}
		}
		res, fail := s.relay(c, &rd, d, isEventStream(resp.Header), func() (outcome, failure, bool) {
			binding, res, fail, ok := s.bind(c)
			if !ok || c.mig.moving() {
				// A continuation's head went out with the first worker's answer.
				return res, fail, ok
			}
			c.observeTTFT(s)
			s.observeDecodeLeg(c, resp.Header)
			s.writeHeaders(c, resp, d, binding, -1)
			return done, failure{}, true
		})
		if c.ended {
			c.att.Complete(c.generated)
		}
		return res, fail
	}

	// The answer's buffer is reused: nothing holds it once it is written to the client.
	ap, _ := s.answers.Get().(*[]byte)
	if ap == nil {
		ap = new([]byte)
	}
	body, err := s.readAllInto(*ap, &rd, resp.ContentLength, c.firstBytes)
	if err == nil {
		defer func() {
			if cap(body) <= maxPooledAnswer {
				*ap = body[:0]
				s.answers.Put(ap)
			}
		}()
	}
	switch {
	case err != nil && ctx.Err() != nil:
		s.fail(c.w, c.r, nil)
		return done, failure{}
	case err != nil && rd.cause() != nil:
		return retry, s.badResponse(d, "upstream_timeout", err)
	case err != nil:
		return retry, s.badResponse(d, "upstream_garbage", err)
	case resp.Header.Get("Content-Encoding") == "" && !validJSON(body):
		return retry, s.badResponse(d, "upstream_garbage", errors.New("a 2xx answer that is not JSON"))
	}
	binding, res, fail, ok := s.bind(c)
	if !ok {
		return res, fail
	}
	u := scanUsage(body)
	var tally Tally
	tally.observe(body, &u)
	c.att.Complete(tally.Generated())
	c.observeTTFT(s)
	s.observeDecodeLeg(c, resp.Header)
	for _, key := range [...]int{usageCached, usageCacheRead} {
		if u.ok[key] {
			s.observePrediction(d, u.n[key])
			break
		}
	}
	if s.bindsResponse(c.p) {
		if o, ok := scanResponse(body); ok {
			s.keepResponse(ctx, c, d.Target.Worker, o)
		}
	}
	s.writeHeaders(c, resp, d, binding, len(body))
	if _, err := c.w.Write(body); err != nil {
		s.log.Debug("client write failed", "error", err)
		return done, failure{}
	}
	// The answer is whole (its length is set), so it goes out now, in one write, rather
	// than after the handler's cleanup.
	if err := http.NewResponseController(c.w).Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		s.log.Debug("client flush failed", "error", err)
	}
	return done, failure{}
}

// unbound answers a new session whose binding, committed before dispatch, failed
// (Attempt.Propose): bound elsewhere or its worker draining, as a failed Commit after a
// dispatch is (the request moves, or goes to its next choice); any other failure is
// routing's error, a refusal (503, X-Kvrouter-Refused) when no worker has been asked for
// the request yet, which the load balancer retries on another replica.
func (s *Server) unbound(c *call, err error) (outcome, failure) {
	if errors.Is(err, routing.ErrBoundElsewhere) || errors.Is(err, routing.ErrWorkerDraining) {
		_, res, fail, _ := s.bind(c)
		return res, fail
	}
	apiErr := routeError(err)
	if c.asked {
		apiErr = afterWorker(apiErr)
	}
	if c.mig.moving() {
		s.failStream(c, apiErr)
	} else {
		s.fail(c.w, c.r, apiErr)
	}
	return done, failure{}
}

// bind waits for the current decision's binding (for a new session: the Bind proposed at
// dispatch) before the first byte of the worker's answer goes to the client, since no byte
// may leave from a worker the session is not bound to. ok false: the answer must not go
// out, and the outcome says what the dispatch loop does instead.
func (s *Server) bind(c *call) (binding routing.Binding, res outcome, fail failure, ok bool) {
	// The attributes are set once the span records: a variadic argument is an allocation.
	bctx, bspan := s.tr.start(c.r.Context(), "bind", trace.SpanKindInternal)
	if bspan.IsRecording() {
		bspan.SetAttributes(attrSession.Bool(c.session != ""))
	}
	wasBound := c.att.Decision().Bound
	binding, err := c.att.Commit(bctx)
	if c.session != "" {
		// Only a session's binding can keep the first byte waiting: without a session Commit
		// waits for nothing, and the first byte's one condition is the worker's (firstAt).
		c.boundAt = time.Now()
	}
	if err == nil && c.session != "" {
		s.madeSession(c.client, wasBound, binding)
	}
	if bspan.IsRecording() {
		bspan.SetAttributes(attrRevision.Int64(int64(binding.Revision)), attrWorker.String(c.att.Decision().Target.Worker.ID))
	}
	if err != nil {
		failSpan(bspan, "commit", err)
	}
	bspan.End()
	switch {
	case err == nil:
		return binding, done, failure{}, true
	case errors.Is(err, routing.ErrBoundElsewhere):
		// Nothing has reached the client: drop this worker's answer (closing the body
		// cancels it) and go where the session is bound.
		s.log.Debug("session bound elsewhere by a concurrent request; moving", "session", c.att.Decision().Binding.Session,
			"worker", c.att.Decision().Target.Worker.String())
		return binding, moved, failure{}, false
	case errors.Is(err, routing.ErrWorkerDraining):
		// Nothing has reached the client: drop this worker's answer and try the next choice,
		// as for a worker that failed (a draining worker takes no new session).
		return binding, retry, failure{cause: "draining", err: err}, false
	}
	// Closing the body unread drops the connection, which cancels the worker's request.
	if c.mig.moving() {
		s.failStream(c, commitError(err))
	} else {
		s.fail(c.w, c.r, commitError(err))
	}
	return binding, done, failure{}, false
}

// commitError maps a failed Commit: the worker accepted, but the binding could not be made.
func commitError(err error) *Error {
	switch {
	case errors.Is(err, context.Canceled):
		return nil
	case errors.Is(err, routing.ErrTooManySessions):
		return routeError(err)
	}
	return afterWorker(&Error{Status: http.StatusServiceUnavailable, Message: "could not bind the session: " + err.Error(),
		Type: TypeUnavailable, Code: "binding_failed", RetryAfter: "1", Cause: "commit"})
}

// afterWorker is e for a request a worker was already asked to run: a 503 becomes a 502
// without the refusal marker, since only a request no worker saw may be answered 503
// (HeaderRefused), the status a load balancer retries on another replica.
func afterWorker(e *Error) *Error {
	if e != nil && e.Status == http.StatusServiceUnavailable {
		e.Status, e.Type, e.Refused = http.StatusBadGateway, TypeServer, ""
	}
	return e
}

// badResponse takes a worker that answered garbage out of rotation until the health checker
// sees it well again.
func (s *Server) badResponse(d routing.Decision, cause string, err error) failure {
	id := d.Target.Worker.ID
	reason := "bad response: " + err.Error()
	if s.cfg.MarkUnhealthy != nil {
		s.cfg.MarkUnhealthy(id, reason)
	} else if s.workers.SetHealthy(id, false, reason) {
		s.log.Warn("worker marked unhealthy", "worker", id, "reason", reason)
	}
	return failure{cause: cause, err: fmt.Errorf("worker %s: %s", d.Target.Worker, reason)}
}

// upstreamRequest describes the worker's copy of the client request: the client's method,
// path, query and end-to-end headers, with body.
func (s *Server) upstreamRequest(r *http.Request, body []byte, t routing.Target) outbound {
	target := r.URL.EscapedPath()
	if r.URL.RawQuery != "" {
		target += "?" + r.URL.RawQuery
	}
	return outbound{method: r.Method, target: target, body: body, forwarding: forwarding{from: r, to: t, tr: s.tr}}
}

// forwarding is what a worker's copy of a client request carries of it besides the body: the
// headers appendForwardHeaders forwards from the client request from to the worker to, and
// tr's trace context. Plain fields rather than a closure, so that building a request for a
// worker allocates nothing.
type forwarding struct {
	from *http.Request // nil: nothing is forwarded
	to   routing.Target
	tr   *tracing
}

// appendTo appends the forwarded header lines.
func (f *forwarding) appendTo(b []byte) []byte {
	if f.from == nil {
		return b
	}
	b = appendForwardHeaders(b, f.from, f.to, f.tr != nil)
	if f.tr != nil {
		b = f.tr.traceHeaders(f.from.Context(), b)
	}
	return b
}

// appendForwardHeaders appends the client's headers a worker should see, without hop-by-hop
// headers (including those the Connection header names), plus the proxy's own; traced, the
// client's trace context is left out (the dispatch's own goes instead).
func appendForwardHeaders(b []byte, r *http.Request, t routing.Target, traced bool) []byte {
	named := connectionNamed(r.Header)
	for k, vs := range r.Header {
		if !forwardable(k) || containsFold(named, k) || traced && (k == "Traceparent" || k == "Tracestate") {
			continue
		}
		for _, v := range vs {
			b = appendHeaderLine(b, k, v)
		}
	}
	if max(t.Spec.DPSize, 1) > 1 {
		// A rank the client named means nothing to a worker without data parallelism, so
		// the header goes only to workers with ranks.
		b = append(b, headerDPRank+": "...)
		b = strconv.AppendUint(b, uint64(t.Worker.DPRank), 10)
		b = append(b, "\r\n"...)
	}
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		b = append(b, "X-Forwarded-For: "...)
		for _, prior := range r.Header.Values("X-Forwarded-For") {
			b = appendHeaderValue(b, prior)
			b = append(b, ", "...)
		}
		b = appendHeaderValue(b, host)
		b = append(b, "\r\n"...)
	}
	return b
}

// forwardable reports whether a client header goes on to the worker as it is. Identity
// encoding lets the proxy check a buffered answer and pass SSE as it comes; the proxy sets
// framing, rank and forwarding headers itself.
func forwardable(k string) bool {
	switch textproto.CanonicalMIMEHeaderKey(k) {
	case "Accept-Encoding", "Expect", "Content-Length", "Host", headerDPRank, "X-Forwarded-For":
		return false
	}
	return !isHop(k)
}

// appendHeaderLine appends "k: v\r\n". Header names and values that reached the handler
// were already checked by net/http; appendHeaderValue still keeps line breaks out.
func appendHeaderLine(b []byte, k, v string) []byte {
	b = append(b, k...)
	b = append(b, ": "...)
	b = appendHeaderValue(b, v)
	return append(b, "\r\n"...)
}

func appendHeaderValue(b []byte, v string) []byte {
	if !strings.ContainsAny(v, "\r\n") {
		return append(b, v...)
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c == '\r' || c == '\n' {
			b = append(b, ' ')
		} else {
			b = append(b, c)
		}
	}
	return b
}

// connectionNamed lists the headers the Connection header marks as hop-by-hop.
func connectionNamed(h http.Header) []string {
	var named []string
	for _, v := range h["Connection"] {
		for tok := range strings.SplitSeq(v, ",") {
			if tok = strings.TrimSpace(tok); tok != "" {
				named = append(named, tok)
			}
		}
	}
	return named
}

// copyHeaders copies the worker's answer headers src (owned by this request) into dst
// without hop-by-hop headers, including those the Connection header names.
func copyHeaders(dst, src http.Header) {
	named := connectionNamed(src)
	for k, vs := range src {
		if isHop(k) || containsFold(named, k) {
			continue
		}
		dst[k] = vs
	}
}

// lengthValue is the Content-Length value for a body of n bytes: the worker's own string
// when it says exactly that (the common answer, relayed as it came), else a new one.
func lengthValue(src http.Header, n int) string {
	var buf [20]byte
	if vs := src["Content-Length"]; len(vs) == 1 && vs[0] == string(strconv.AppendInt(buf[:0], int64(n), 10)) {
		return vs[0]
	}
	return strconv.Itoa(n)
}

// isHop reports whether k names a hop-by-hop header (RFC 9110 section 7.6.1), which a proxy
// must not forward, or one that describes this hop's framing.
func isHop(k string) bool {
	// Canonical names (net/http makes them so) pass through without a copy.
	switch textproto.CanonicalMIMEHeaderKey(k) {
	case "Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
		"Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return false
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
	const sse = "text/event-stream"
	ct := h.Get("Content-Type")
	return len(ct) >= len(sse) && strings.EqualFold(ct[:len(sse)], sse)
}

// writeHeaders sends the worker's status and headers plus the router's own. bodyLen < 0
// streams.
func (s *Server) writeHeaders(c *call, resp *http.Response, d routing.Decision, b routing.Binding, bodyLen int) {
	h := c.w.Header()
	copyHeaders(h, resp.Header)
	// The names are canonical already, so the map is written directly; the values share
	// one backing array.
	vals := c.w.scratch.headerValues(7)
	set := func(k, v string) {
		vals[0] = v
		h[k] = vals[:1:1]
		vals = vals[1:]
	}
	delete(h, "Content-Length")
	if bodyLen >= 0 {
		set("Content-Length", lengthValue(resp.Header, bodyLen))
	}
	set(HeaderWorker, d.Target.Worker.String())
	if s.cfg.ReplicaID != "" {
		set(HeaderReplica, s.cfg.ReplicaID)
	}
	rev := b.Revision
	if rev == 0 {
		rev = d.Binding.Revision
	}
	// A session that is not bound yet (a refused first request) has no revision to tell.
	if c.session != "" && rev != 0 {
		set(HeaderRevision, strconv.FormatUint(rev, 10))
	}
	set(HeaderOverlap, strconv.Itoa(d.Overlap))
	if d.Model != c.p.Model {
		set(HeaderModel, d.Model)
	}
	if c.prefill != "" {
		set(HeaderPrefillWorker, c.prefill)
	}
	c.w.WriteHeader(resp.StatusCode)
}

// relay streams the worker's body to the client read by read, flushing each. hdr, when set,
// writes the headers at the first body bytes, so that a stream that fails before them can
// still be retried; without it the headers are already out. sse says the body is a stream of
// server-sent events: one that breaks off after it started, between two events, ends with an
// error event in the API's shape (Error.streamEvent) so that SDKs raise a typed error; any
// other body that breaks off after it started is aborted. hdr reporting false sends nothing:
// relay ends with the outcome it gives.
func (s *Server) relay(c *call, rd *upstreamReader, d routing.Decision, sse bool, hdr func() (outcome, failure, bool)) (outcome, failure) {
	ctx := c.r.Context()
	rc := http.NewResponseController(c.w)
	bp := s.getCopyBuffer()
	defer s.copyBuffers.Put(bp)
	buf := *bp
	started := hdr == nil
	cached, sawUsage := 0, false
	var tally Tally
	var tail eventEnd
	// Each pass reads at least one byte or ends; the idle timeout bounds how long a pass waits.
	for {
		n, err := rd.read(buf)
		if n > 0 {
			u := scanUsage(buf[:n])
			if u.ok[usageCached] {
				cached, sawUsage = u.n[usageCached], true
			}
			tally.observe(buf[:n], &u)
			c.firstBytes()
			if !started {
				if res, fail, ok := hdr(); !ok {
					return res, fail
				}
				started = true
			}
			if c.watch != nil {
				// The end of a stored answer waits for its binding, so that the client
				// cannot continue it before it is bound.
				if o, ok := c.watch.feed(buf[:n]); ok {
					s.keepResponse(ctx, c, d.Target.Worker, o)
				}
			}
			if hdr != nil && endsStream(buf[:n]) {
				// The worker's answer is whole: its load ends before the client reads the
				// end, so the client's next turn finds the worker free (Attempt.Complete).
				c.ended, c.generated = true, tally.Generated()
				c.att.Complete(c.generated)
			}
			out := buf[:n]
			if c.mig != nil && hdr != nil {
				out = c.mig.relay(out)
			}
			if _, werr := c.w.Write(out); werr != nil {
				s.log.Debug("client write failed", "error", werr)
				c.w.clientGone()
				s.metrics.errors.WithLabelValues("client_cancel").Inc()
				return done, failure{}
			}
			tail.add(out)
			// Bytes that came with the end of the stream go out with the end of the response,
			// in one write, when the handler returns; all others at once.
			if !errors.Is(err, io.EOF) {
				if ferr := rc.Flush(); ferr != nil && !errors.Is(ferr, http.ErrNotSupported) {
					c.w.clientGone()
					s.metrics.errors.WithLabelValues("client_cancel").Inc()
					return done, failure{}
				}
			}
		}
		switch {
		case err == nil:
			continue
		case errors.Is(err, io.EOF) && started:
			c.ended, c.generated = true, tally.Generated()
			if sawUsage {
				s.observePrediction(d, cached)
			}
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
		s.log.Warn("worker stream broke off mid-response", "worker", d.Target.Worker.String(), "error", why,
			"error_event", sse && tail.at())
		if !sse || !tail.at() {
			// Half an event, or a body that is not events: nothing can be added that a client
			// would read as an error, so the connection is cut.
			return aborted, fail
		}
		msg := "the answer is incomplete: " + fail.err.Error()
		if hdr != nil {
			outcome, move := c.mig.canMove()
			if move {
				return migrate, fail
			}
			s.metrics.migrations.WithLabelValues(outcome).Inc()
			switch outcome {
			case migrationFinished:
				// Every token came; only the end was lost.
				if _, err := io.WriteString(c.w, streamEnd+"\n\n"); err != nil {
					c.w.clientGone()
				}
				return done, fail
			case migrationExhausted:
				msg += fmt.Sprintf(" (the stream moved %d times already)", c.mig.moves)
			}
		}
		s.writeStreamEvent(c, &Error{Status: http.StatusBadGateway, Type: TypeServer, Code: cause, Cause: cause, Message: msg}, tally.events)
		return done, fail
	}
}

// eventEnd follows a stream of server-sent events as it is relayed: whether the bytes so far
// end with a whole event (a blank line, in any of the three line endings).
type eventEnd struct{ last [4]byte }

// add notes bytes relayed after the ones before.
func (t *eventEnd) add(b []byte) {
	if len(b) >= len(t.last) {
		copy(t.last[:], b[len(b)-len(t.last):])
		return
	}
	copy(t.last[:], t.last[len(b):])
	copy(t.last[len(t.last)-len(b):], b)
}

// at reports whether the bytes so far end with a whole event.
func (t *eventEnd) at() bool {
	l := t.last[:]
	return bytes.HasSuffix(l, []byte("\n\n")) || bytes.HasSuffix(l, []byte("\r\r")) || bytes.HasSuffix(l, []byte("\n\r\n"))
}

// streamEnd is how an OpenAI stream (chat, completions) ends.
const streamEnd = "data: [DONE]"

// endsStream reports whether chunk ends with the OpenAI stream's last event. Other APIs'
// streams end at the worker's EOF, a read later.
func endsStream(chunk []byte) bool {
	return bytes.HasSuffix(bytes.TrimRight(chunk, "\r\n"), []byte(streamEnd))
}

// getCopyBuffer returns a relay buffer of copyBuffer bytes; put it back in s.copyBuffers.
func (s *Server) getCopyBuffer() *[]byte {
	if bp, ok := s.copyBuffers.Get().(*[]byte); ok {
		return bp
	}
	b := make([]byte, copyBuffer)
	return &b
}

// readAll reads a whole non-streamed answer within maxBufferedResponse; size is the
// announced length, or -1.
func (s *Server) readAll(rd *upstreamReader, size int64, first func()) ([]byte, error) {
	return s.readAllInto(nil, rd, size, first)
}

// readAllInto is readAll into buf's array when it is large enough to start with.
func (s *Server) readAllInto(buf []byte, rd *upstreamReader, size int64, first func()) ([]byte, error) {
	// The buffer starts at the announced size (a worker's claim, so within reason) and one
	// spare byte, so that the read that finds the end does not grow it.
	if size < 0 {
		size = 512
	}
	out := buf[:0]
	if want := min(size, 1<<20) + 1; int64(cap(buf)) < want {
		out = make([]byte, 0, want)
	}
	// Each pass reads at least one byte or ends; the size cap and the idle timeout bound it.
	for {
		if len(out) == cap(out) {
			out = append(out, 0)[:len(out)]
		}
		n, err := rd.read(out[len(out):cap(out)])
		if n > 0 {
			first()
			if len(out)+n > maxBufferedResponse {
				return nil, fmt.Errorf("answer exceeds %d bytes", maxBufferedResponse)
			}
			out = out[:len(out)+n]
		}
		switch {
		case errors.Is(err, io.EOF):
			return out, nil
		case err != nil && rd.cause() != nil:
			return nil, rd.cause()
		case err != nil:
			return nil, err
		}
	}
}

// upstreamReader reads a worker's answer body under the first-byte deadline (for a stream,
// until its first bytes), then the idle timeout between reads.
type upstreamReader struct {
	body    *upBody
	firstBy time.Time
	idle    time.Duration
	// deadline is the read deadline this reader set last; roundTrip leaves one at firstBy
	// or a little later (exchangeDeadline), which serves as firstBy.
	deadline time.Time
	idling   bool // deadline is an idle one
	gotBytes bool
	empty    int // reads in a row that returned nothing
	timedOut error
}

func newUpstreamReader(body *upBody, firstBy time.Time, idle time.Duration) upstreamReader {
	return upstreamReader{body: body, firstBy: firstBy, idle: idle, deadline: firstBy}
}

// read reads once within the current deadline.
func (u *upstreamReader) read(buf []byte) (int, error) {
	if u.timedOut != nil {
		return 0, u.timedOut
	}
	why := errFirstByte
	switch {
	case !u.gotBytes:
		if !u.deadline.Equal(u.firstBy) {
			u.setDeadline(u.firstBy)
		}
	default:
		why = errIdle
		// Moving a deadline costs a timer update; reads of a fast stream come much closer
		// together than that is worth. So the idle deadline is set a 64th of the timeout
		// further out than needed, and moved only once it is no longer far enough: the gap
		// allowed between two reads is then between IdleTimeout and 1/64 more.
		if want := time.Now().Add(u.idle); !u.idling || want.After(u.deadline) {
			u.idling = true
			u.setDeadline(want.Add(u.idle / 64))
		}
	}
	n, err := u.body.Read(buf)
	if n > 0 {
		u.gotBytes = true
	}
	// A reader that keeps returning nothing would spin its caller: call it stuck.
	if n > 0 || err != nil {
		u.empty = 0
	} else if u.empty++; u.empty >= maxEmptyReads {
		return 0, io.ErrNoProgress
	}
	// A deadline in the past is also how a cancelled request ends; that is not a timeout.
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) && !u.body.conn.isCancelled() {
		u.timedOut = why
	}
	return n, err
}

func (u *upstreamReader) setDeadline(t time.Time) {
	u.deadline = t
	u.body.setReadDeadline(t)
}

// cause reports the timeout that cut the upstream request, if one did.
func (u *upstreamReader) cause() error { return u.timedOut }

// How a worker's usage reports its prefix-cache hit and the tokens it generated.
const (
	cachedTokensKey     = `"cached_tokens"`
	completionTokensKey = `"completion_tokens"`
	// Responses and Messages name the generated tokens output_tokens, and Messages the
	// cached prompt cache_read_input_tokens.
	outputTokensKey    = `"output_tokens"`
	cacheReadTokensKey = `"cache_read_input_tokens"`
)

// observePrediction records how far the predicted cache hit was from the worker's report.
func (s *Server) observePrediction(d routing.Decision, cached int) {
	predicted := d.Overlap * s.router.BlockSize()
	diff := predicted - cached
	if diff < 0 {
		diff = -diff
	}
	s.metrics.predError.Observe(float64(diff))
}

// sentBody is the body a worker receives for request p sent as model: p's own, but for an
// alias (model differs from the one p names), whose "model" is the target, the name the
// worker serves it under.
func sentBody(p *Request, model string) ([]byte, error) {
	if model == p.Model {
		return p.Body, nil
	}
	name, err := json.Marshal(model)
	if err == nil {
		var body []byte
		if body, err = setField(p.Body, "model", name); err == nil {
			return body, nil
		}
	}
	return nil, fmt.Errorf("send as model %s: %w", model, err)
}
