// Package openai is the router's client-facing HTTP front: it parses OpenAI chat and
// completion requests, asks routing for a worker, proxies the request to it (streaming,
// with retries on another worker before the first byte), and reports what happened in
// response headers and Prometheus metrics. It also probes workers' health.
package openai

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/textproto"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/ratelog"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Request headers the front reads.
const (
	headerSession = "X-Session-ID"
	headerTarget  = "X-Target-Worker"
	headerDPRank  = "X-Data-Parallel-Rank"
)

// Response headers that tell the client what the router did.
const (
	HeaderWorker   = "X-Kvrouter-Worker"
	HeaderReplica  = "X-Kvrouter-Replica"
	HeaderRevision = "X-Kvrouter-Binding-Revision"
	HeaderOverlap  = "X-Kvrouter-Overlap-Blocks"
	// HeaderModel names the model an alias request was sent as (its target); absent when
	// the request named a model, not an alias.
	HeaderModel = "X-Kvrouter-Model"
	// HeaderPrefillWorker names the prefill worker of a disaggregated request.
	HeaderPrefillWorker = "X-Kvrouter-Prefill-Worker"
)

// maxSessionKey is DESIGN's bound on a session key, in bytes.
const maxSessionKey = 256

// maxEmptyReads is how many reads in a row may return nothing before a reader is deemed
// stuck.
const maxEmptyReads = 100

// Config tunes the front. Zero values take the documented defaults.
type Config struct {
	// ReplicaID names this replica in X-Kvrouter-Replica (default: the host name).
	ReplicaID string
	// Aliases resolves a request's model that is an alias (nil: none are).
	Aliases Aliases
	// MaxBodyBytes caps a request body (8 MiB); larger bodies get 413.
	MaxBodyBytes int64
	// ConnectTimeout bounds dialling a worker (2s).
	ConnectTimeout time.Duration
	// FirstByteTimeout bounds the wait from dispatch until the worker's response headers, and
	// for a stream until its first body bytes (5m: prefill of long prompts is slow).
	FirstByteTimeout time.Duration
	// IdleTimeout is the longest gap allowed between two reads of a worker's body (2m; the
	// cut may come up to a 64th of it later).
	IdleTimeout time.Duration
	// Models is served at /v1/models; empty asks a routable worker and caches its answer.
	Models []string
	// Logger receives the front's logs (nil: discarded).
	Logger *slog.Logger
	// Registerer receives the metrics (nil: not registered).
	Registerer prometheus.Registerer
	// WorkerTLS configures connections to https workers (nil: the system's roots). Workers
	// are spoken to in HTTP/1.1 whatever its NextProtos say.
	WorkerTLS *tls.Config
	// Tokenizer, when set, turns text prompts into the worker's token ids before hashing
	// (--tokenizer=worker); nil hashes text in byte chunks (approximate).
	Tokenizer Tokenizer
	// MarkUnhealthy, when set, is told of a worker that answered garbage instead of the
	// registry being flipped directly (the cluster's health view decides; nil: the registry).
	MarkUnhealthy func(worker, reason string)
	// ReservationTTL ends a reservation (POST /v1/reserve) that is not released (10m), and
	// MaxReservations bounds those open at once (65,536; more get 429).
	ReservationTTL  time.Duration
	MaxReservations int
	// SessionHeaders are the headers a session key is read from, the first present winning
	// (default X-Session-ID, then Dynamo's X-Dynamo-Session-ID).
	SessionHeaders []string
	// Tracer, when set, traces each request (see trace.go); nil: no spans, and a client's
	// traceparent goes to the worker as it came.
	Tracer trace.TracerProvider
	// ClientLimits are the limits per client (limits.go); zero: none.
	ClientLimits ClientLimits
	// NoResponsesAffinity turns off the binding of stored Responses answers to their worker
	// (responses.go): for workers that keep no Responses state, where each binding would be
	// a Raft write for nothing. previous_response_id is then routed as any request.
	NoResponsesAffinity bool
	// MigrationLimit is how many times a streamed chat or completion whose worker fails
	// after the first byte may move to another worker, continued from the text already sent
	// (migrate.go); 0, the default, ends such a stream with an error event.
	MigrationLimit int
}

func (c *Config) setDefaults() error {
	if c.MaxBodyBytes < 0 || c.ConnectTimeout < 0 || c.FirstByteTimeout < 0 || c.IdleTimeout < 0 || c.ReservationTTL < 0 || c.MaxReservations < 0 || c.MigrationLimit < 0 {
		return errors.New("openai: negative limit or timeout in config")
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = 8 << 20
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 2 * time.Second
	}
	if c.FirstByteTimeout == 0 {
		c.FirstByteTimeout = 5 * time.Minute
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = 2 * time.Minute
	}
	if c.ReservationTTL == 0 {
		c.ReservationTTL = 10 * time.Minute
	}
	if c.MaxReservations == 0 {
		c.MaxReservations = 1 << 16
	}
	if len(c.SessionHeaders) == 0 {
		c.SessionHeaders = []string{headerSession, "X-Dynamo-Session-ID"}
	}
	if err := c.ClientLimits.check(); err != nil {
		return err
	}
	for i, h := range c.SessionHeaders {
		if h = strings.TrimSpace(h); h == "" || strings.ContainsAny(h, " \t:") {
			return fmt.Errorf("openai: session header %q is not a header name", c.SessionHeaders[i])
		}
	}
	if c.ReplicaID == "" {
		if host, err := os.Hostname(); err == nil {
			c.ReplicaID = host
		}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	for i, m := range c.Models {
		if m == "" {
			return fmt.Errorf("openai: Models[%d] is empty", i)
		}
	}
	return nil
}

// Server is the OpenAI-compatible front of one replica.
type Server struct {
	cfg       Config
	log       *slog.Logger
	router    *routing.Router
	workers   *routing.Registry
	tracker   *routing.Tracker
	transport *http.Transport // off the hot path: the model list
	upstream  *upstream       // the proxied requests
	// copyBuffers holds relay buffers (*[]byte of copyBuffer bytes), answers the buffers of
	// non-streamed answers (*[]byte, empty).
	copyBuffers sync.Pool
	answers     sync.Pool
	metrics     *metrics
	// modelNames interns the model names requests give.
	modelNames *names
	ready      atomic.Pointer[func() error]
	models     *modelCache
	handler    http.Handler
	res        reservations
	clients    *clients
	made       made
	// tokenizeWarn spaces the warnings of a failing tokenizer.
	tokenizeWarn *ratelog.Limiter
	// respWarn spaces the warnings of stored responses that could not be bound.
	respWarn *ratelog.Limiter
	// tr traces requests; nil without Config.Tracer.
	tr *tracing
	// sessionKeys are Config.SessionHeaders in canonical form, the keys they have in a
	// request's header map (h.Values would canonicalise each, which costs an allocation
	// for a name that is not canonical already, as X-Session-ID is not).
	sessionKeys []string
}

// NewServer builds the front over a router, the worker registry and this replica's tracker.
func NewServer(cfg Config, router *routing.Router, workers *routing.Registry, tracker *routing.Tracker) (*Server, error) {
	if router == nil || workers == nil || tracker == nil {
		return nil, errors.New("openai: router, workers and tracker are required")
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	s := &Server{
		tokenizeWarn: ratelog.New(tokenizeWarnEvery, 1),
		respWarn:     ratelog.New(respWarnEvery, 1),
		cfg:          cfg,
		log:          cfg.Logger,
		router:       router,
		workers:      workers,
		tracker:      tracker,
		transport:    newTransport(cfg),
		upstream:     newUpstream(cfg.ConnectTimeout, cfg.WorkerTLS),
		metrics:      newMetrics(),
		modelNames:   newNames(),
	}
	s.clients = newClients(s.cfg.ClientLimits, time.Now)
	s.models = newModelCache(s)
	for _, h := range s.cfg.SessionHeaders {
		s.sessionKeys = append(s.sessionKeys, textproto.CanonicalMIMEHeaderKey(h))
	}
	s.tr = newTracing(cfg.Tracer)
	if cfg.Registerer != nil {
		if err := s.metrics.register(cfg.Registerer, newFleetCollector(tracker, workers)); err != nil {
			return nil, err
		}
	}
	mux := http.NewServeMux()
	rt := &routes{mux: mux}
	rt.handle("/v1/chat/completions", s.endpoint("chat", http.MethodPost, func(w *recorder, r *http.Request) {
		s.serveCompletion(w, r, KindChat)
	}))
	rt.handle("/v1/completions", s.endpoint("completions", http.MethodPost, func(w *recorder, r *http.Request) {
		s.serveCompletion(w, r, KindCompletion)
	}))
	for _, api := range []struct {
		path, name string
		kind       Kind
		anthropic  bool
	}{
		{"/v1/responses", "responses", KindResponses, false},
		{"/v1/embeddings", "embeddings", KindEmbeddings, false},
		{"/v1/messages", "messages", KindMessages, true},
		{"/v1/messages/count_tokens", "count_tokens", KindCountTokens, true},
	} {
		rt.handle(api.path, s.endpoint(api.name, http.MethodPost, func(w *recorder, r *http.Request) {
			w.anthropic = api.anthropic
			s.serveCompletion(w, r, api.kind)
		}))
	}
	mux.Handle("/v1/models", s.endpoint("models", http.MethodGet, s.serveModels))
	mux.Handle("/v1/models/{id...}", s.endpoint("model", http.MethodGet, s.serveModel))
	mux.Handle("/v1/route", s.endpoint("route", http.MethodPost, s.serveRoute))
	mux.Handle("/v1/reserve", s.endpoint("reserve", http.MethodPost, s.serveReserve))
	mux.Handle("/v1/reservations/{id}", s.endpoint("release", http.MethodDelete, s.serveRelease))
	mux.Handle("/healthz", s.endpoint("healthz", http.MethodGet, s.serveHealthz))
	mux.Handle("/readyz", s.endpoint("readyz", http.MethodGet, s.serveReadyz))
	mux.Handle("/", s.endpoint("other", "", func(w *recorder, r *http.Request) {
		(&Error{Status: http.StatusNotFound, Message: "unknown path: " + r.URL.Path, Type: TypeNotFound,
			Code: "unknown_path"}).write(w)
	}))
	s.handler = rt
	return s, nil
}

// routes is the client-facing handler: the completion endpoints (POSTs to a fixed path) by
// an exact match, the rest by the mux. The mux would find the same handler, but looking it
// up (cleaning the path, walking its tree) is a share of a busy router's CPU; a request the
// match does not take (another method, a path to clean or redirect, an escaped path such as
// "/v1%2Fcompletions", which the mux reads as one segment) gets the mux's answer as before.
// No handler reads r.Pattern, which only the mux sets.
type routes struct {
	exact []exactRoute
	mux   *http.ServeMux
}

// exactRoute is a path the routes match exactly, and its handler.
type exactRoute struct {
	path string
	h    http.Handler
}

// handle registers h for POSTs to path, with the mux too (for its method answer and the
// requests the exact match leaves to it).
func (rt *routes) handle(path string, h http.Handler) {
	rt.exact = append(rt.exact, exactRoute{path: path, h: h})
	rt.mux.Handle(path, h)
}

// ServeHTTP implements http.Handler.
func (rt *routes) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodPost && r.URL.RawPath == "" {
		for _, e := range rt.exact {
			if r.URL.Path == e.path {
				e.h.ServeHTTP(w, r)
				return
			}
		}
	}
	rt.mux.ServeHTTP(w, r)
}

// Handler returns the client-facing HTTP handler.
func (s *Server) Handler() http.Handler { return s.handler }

// SetReady installs the readiness hook /readyz consults; nil means ready.
func (s *Server) SetReady(fn func() error) {
	if fn == nil {
		s.ready.Store(nil)
		return
	}
	s.ready.Store(&fn)
}

// Close ends the open reservations and drops the idle connections to workers.
func (s *Server) Close() {
	s.closeReservations()
	s.upstream.close()
	s.transport.CloseIdleConnections()
}

// recorder remembers the status a handler answered with, for the request metrics.
type recorder struct {
	http.ResponseWriter
	status int
	// gone: the client went away, before or during the answer (counted as 499).
	gone bool
	// anthropic: errors go out in Anthropic's shape (the Messages API).
	anthropic bool
	// scratch is the memory a completion takes on its way, allocated with the recorder.
	scratch scratch
}

// scratch is what a completion request needs for its whole life, in one allocation with its
// recorder rather than one for each: the parsed request, routing's input and attempt, the
// prompt's block keys (routing.Scratch.Keys, with room for a short answer's blocks after
// them), the router's answer headers and the worker's answer. Nothing in it is reused by
// another request.
type scratch struct {
	parsed Request
	routed routing.Scratch
	// vals are writeHeaders' values; valsUsed once they are taken.
	vals     [7]string
	valsUsed bool
	// answer is the first worker answer's memory (outbound.answer); answerUsed once taken.
	answer     answer
	answerUsed bool
}

// answerMemory returns the scratch's answer the first time, nil after: an answer in use is
// never overwritten by a later exchange's (a retry on another worker allocates its own).
func (sc *scratch) answerMemory() *answer {
	if sc.answerUsed {
		return nil
	}
	sc.answerUsed = true
	return &sc.answer
}

// headerValues returns n strings for the answer's headers: the scratch's the first time.
func (sc *scratch) headerValues(n int) []string {
	if sc.valsUsed || n > len(sc.vals) {
		return make([]string, n)
	}
	sc.valsUsed = true
	return sc.vals[:n]
}

// WriteHeader implements http.ResponseWriter.
func (r *recorder) WriteHeader(code int) {
	if r.status == 0 && code >= 200 {
		r.status = code
	}
	r.ResponseWriter.WriteHeader(code)
}

// Write implements http.ResponseWriter.
func (r *recorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection for Flush.
func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

// written reports whether the response has started.
func (r *recorder) written() bool { return r.status != 0 && r.status != StatusClientClosed }

// clientGone marks the request as abandoned by its client, before its answer started or
// during it.
func (r *recorder) clientGone() {
	r.gone = true
	if r.status == 0 {
		r.status = StatusClientClosed
	}
}

// endpoint wraps a handler with the method check, panic recovery and request metrics.
func (s *Server) endpoint(name, method string, h func(*recorder, *http.Request)) http.Handler {
	// The common answer's counter is looked up once, not per request.
	ok := s.metrics.requests.WithLabelValues(name, strconv.Itoa(http.StatusOK))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &recorder{ResponseWriter: w}
		defer func() {
			v := recover()
			if v != nil && v != http.ErrAbortHandler {
				s.log.Error("handler panic", "endpoint", name, "panic", v, "stack", string(debug.Stack()))
				s.metrics.errors.WithLabelValues("panic").Inc()
				if !rec.written() {
					(&Error{Status: http.StatusInternalServerError, Message: "internal error",
						Type: TypeServer}).write(rec)
				}
			}
			code := rec.status
			if rec.gone {
				code = StatusClientClosed
			}
			if code == 0 || code == http.StatusOK {
				ok.Inc()
			} else {
				s.metrics.requests.WithLabelValues(name, strconv.Itoa(code)).Inc()
			}
			if v == http.ErrAbortHandler {
				panic(v)
			}
		}()
		if method != "" && r.Method != method {
			rec.Header().Set("Allow", method)
			(&Error{Status: http.StatusMethodNotAllowed, Message: "method " + r.Method + " not allowed; use " + method,
				Type: TypeInvalidRequest, Code: "method_not_allowed"}).write(rec)
			return
		}
		h(rec, r)
	})
}

// fail answers err (nil: the client is gone) and counts it.
func (s *Server) fail(w *recorder, r *http.Request, apiErr *Error) {
	if apiErr == nil {
		w.clientGone()
		s.metrics.errors.WithLabelValues("client_cancel").Inc()
		s.log.Debug("client went away", "path", r.URL.Path)
		return
	}
	s.countError(apiErr)
	if apiErr.Status >= 500 {
		s.log.Warn("request failed", "path", r.URL.Path, "status", apiErr.Status, "error", apiErr.Message)
	} else {
		s.log.Debug("request rejected", "path", r.URL.Path, "status", apiErr.Status, "error", apiErr.Message)
	}
	if !w.written() {
		if w.anthropic {
			apiErr.writeAnthropic(w)
		} else {
			apiErr.write(w)
		}
	}
}

// readBody reads the request body within MaxBodyBytes.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, *Error) {
	if r.ContentLength > s.cfg.MaxBodyBytes {
		return nil, s.bodyTooLarge()
	}
	var body []byte
	var err error
	if r.ContentLength >= 0 {
		// net/http ends the body at its Content-Length, so a buffer of that size and a byte
		// (for the read that finds the end) holds it; but no larger than 64 KiB to start
		// with, so that a client announcing a large body and sending little gets the router
		// to hold little.
		body, err = readToEOF(r.Body, make([]byte, 0, min(r.ContentLength, 64<<10)+1))
	} else {
		body, err = readToEOF(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes), make([]byte, 0, 4<<10))
	}
	if err == nil {
		// Read to its end, the body is closed here rather than by net/http once the answer's
		// headers go out, where it would first try to discard what is left of it (nothing,
		// at the cost of a copy loop and its allocations).
		_ = r.Body.Close()
	}
	if err != nil {
		var maxErr *http.MaxBytesError
		if errors.As(err, &maxErr) {
			return nil, s.bodyTooLarge()
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			// The client port's body deadline: a body sent too slowly, or not at all. (The
			// failed read cancelled the request's context too: this goes first.)
			return nil, &Error{Status: http.StatusRequestTimeout, Type: TypeInvalidRequest, Code: "request_timeout",
				Message: "the request body was not complete within the server's body timeout", Cause: "body_timeout"}
		}
		if r.Context().Err() != nil {
			return nil, nil
		}
		return nil, &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest,
			Message: "could not read request body: " + err.Error(), Cause: "parse"}
	}
	return body, nil
}

// readToEOF appends everything src yields to buf, growing it as needed. Reading up to the
// end matters: that is when net/http starts watching the client connection for a
// disconnect, which cancels the request's context.
func readToEOF(src io.Reader, buf []byte) ([]byte, error) {
	// Each pass reads or ends (the source's own limit bounds it), or counts an empty read.
	for empty := 0; empty < maxEmptyReads; {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := src.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if n == 0 {
			empty++
		} else {
			empty = 0
		}
		if errors.Is(err, io.EOF) {
			return buf, nil
		}
		if err != nil {
			return nil, err
		}
	}
	return nil, io.ErrNoProgress
}

// routingRequest turns a parsed request and its headers into routing's input.
// It fills dst (nil: a new one) and returns it; hashes, when not nil, is memory for the
// prompt's block keys.
func (s *Server) routingRequest(ctx context.Context, h http.Header, p *Request, queryOnly bool, dst *routing.Request, hashes []uint64) (*routing.Request, *Error) {
	session, apiErr := s.sessionKey(h)
	if apiErr != nil {
		return nil, apiErr
	}
	target, apiErr := s.explicitTarget(h)
	if apiErr != nil {
		return nil, apiErr
	}
	rank, apiErr := dpRank(h)
	if apiErr != nil {
		return nil, apiErr
	}
	if apiErr := s.rankExists(rank); apiErr != nil {
		return nil, apiErr
	}
	catalog := s.workers.Catalog()
	alias, apiErr := s.alias(p.Model, catalog)
	if apiErr != nil {
		s.metrics.modelsBy.with(routing.OtherModel, "").Inc()
		return nil, apiErr
	}
	if alias != nil {
		// An alias the fleet serves a target of counts as a model the fleet serves: the
		// label's values stay bounded by the replicated aliases (at most fsm.MaxAliases).
		s.metrics.modelsBy.with(p.Model, "").Inc()
	} else {
		s.metrics.modelsBy.with(catalog.Label(p.Model), "").Inc()
		if p.Model != "" && !catalog.Known(p.Model) {
			return nil, modelNotFound(p.Model)
		}
	}
	lora := ""
	if catalog.Adapter(p.Model) {
		lora = p.Model
	}
	if dst == nil {
		dst = new(routing.Request)
	}
	req := dst
	*req = routing.Request{
		PromptTokens: p.PromptTokens(),
		Session:      session,
		Target:       target,
		LoRA:         lora,
		Model:        p.Model,
		Alias:        alias,
		Role:         routing.RoleBoth,
		DPRank:       rank,
		QueryOnly:    queryOnly,
	}
	if alias != nil && s.cfg.Tokenizer != nil && !p.HasTokens {
		// The prompt is tokenized as the target (its tokenizer, and a worker that serves
		// it), once Route has chosen the target.
		req.Keys = func(ctx context.Context, model string) ([]uint64, int) {
			q := *p
			q.Model = model
			return s.promptKeys(ctx, &q, lora, nil)
		}
	} else {
		req.Hashes, req.PromptTokens = s.promptKeys(ctx, p, lora, hashes)
	}
	return req, nil
}

// promptKeys are p's block keys and its prompt length in tokens: from its token ids, from the
// tokenizer's answer (asked as p.Model), or, without either, from its text.
// The keys go into dst's array when they fit (dst is empty; nil: a new array).
func (s *Server) promptKeys(ctx context.Context, p *Request, lora string, dst []uint64) (hashes []uint64, promptTokens int) {
	promptTokens = p.PromptTokens()
	switch {
	case p.HasTokens:
		hashes = s.router.HashTokensWithSalt(p.Tokens, lora, p.CacheSalt, dst)
	case s.cfg.Tokenizer != nil:
		tctx, span := s.tr.start(ctx, "tokenize", trace.SpanKindClient)
		tokens, err := s.cfg.Tokenizer.Tokenize(tctx, p)
		span.SetAttributes(attrTokens.Int(len(tokens)), attrFallback.Bool(err != nil))
		if err != nil {
			failSpan(span, "tokenize", err)
		}
		span.End()
		if err == nil {
			return s.router.HashTokensWithSalt(tokens, lora, p.CacheSalt, dst), len(tokens)
		}
		// The request still routes, on approximate keys; the failure is counted and said,
		// at most once per tokenizeWarnEvery so that a tokenizer down cannot flood the log.
		reason := "error"
		if errors.Is(err, context.DeadlineExceeded) {
			reason = "timeout"
		}
		s.metrics.errors.WithLabelValues("tokenize").Inc()
		s.metrics.tokenizeFallbacks.WithLabelValues(reason).Inc()
		if ok, left := s.tokenizeWarn.Allow("tokenize", time.Now()); ok {
			s.log.Warn("tokenize failed; routing on text chunks (approximate keys) until it answers again",
				"reason", reason, "error", err, "suppressed", left)
		} else {
			s.log.Debug("tokenize failed; routing on text chunks", "reason", reason, "error", err)
		}
		hashes = s.router.HashTextWithSalt(p.Text, lora, p.CacheSalt, dst)
	default:
		hashes = s.router.HashTextWithSalt(p.Text, lora, p.CacheSalt, dst)
	}
	return hashes, promptTokens
}

// Aliases looks up model aliases (the replicated ones, in a replica).
type Aliases interface {
	// Alias returns the alias named name, if there is one.
	Alias(name string) (routing.Alias, bool)
	// List returns every alias, by name.
	List() []routing.Alias
}

// alias returns model's alias with only the targets the fleet serves, nil when model is not
// an alias; an alias none of whose targets of positive weight the fleet serves is
// model_not_found, as any model no worker serves.
func (s *Server) alias(model string, catalog *routing.Catalog) (*routing.Alias, *Error) {
	if s.cfg.Aliases == nil || model == "" {
		return nil, nil
	}
	al, ok := s.cfg.Aliases.Alias(model)
	if !ok {
		return nil, nil
	}
	served := routing.Alias{Name: al.Name, Targets: make([]routing.AliasTarget, 0, len(al.Targets))}
	positive := false
	for _, t := range al.Targets {
		if catalog.Known(t.Model) {
			served.Targets = append(served.Targets, t)
			positive = positive || t.Weight > 0
		}
	}
	if !positive {
		return nil, modelNotFound(model)
	}
	return &served, nil
}

func badHeader(name, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Message: msg, Type: TypeInvalidRequest, Param: name,
		Code: "invalid_header", Cause: "bad_header"}
}

// sessionKey reads the first of the session headers present (X-Session-ID, then
// X-Dynamo-Session-ID, by default): at most 256 bytes of printable ASCII without spaces.
func (s *Server) sessionKey(h http.Header) (string, *Error) {
	for i, name := range s.cfg.SessionHeaders {
		vals := h[s.sessionKeys[i]]
		if len(vals) == 0 {
			continue
		}
		if len(vals) > 1 {
			return "", badHeader(name, name+" must be given once")
		}
		key := vals[0]
		if key == "" {
			continue
		}
		if len(key) > maxSessionKey {
			return "", badHeader(name, fmt.Sprintf("%s must be at most %d bytes", name, maxSessionKey))
		}
		if !printable(key) {
			return "", badHeader(name, name+" must be printable ASCII without spaces")
		}
		return key, nil
	}
	return "", nil
}

// printable reports whether a session key is printable ASCII without spaces.
func printable(key string) bool {
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x21 || c > 0x7e {
			return false
		}
	}
	return true
}

// explicitTarget reads X-Target-Worker: "id" or "id/rank" of a configured worker.
func (s *Server) explicitTarget(h http.Header) (*indexer.Worker, *Error) {
	v := strings.TrimSpace(h.Get(headerTarget))
	if v == "" {
		return nil, nil
	}
	if len(v) > maxSessionKey {
		return nil, badHeader(headerTarget, fmt.Sprintf("%s must be at most %d bytes", headerTarget, maxSessionKey))
	}
	unknown := func(detail string) *Error {
		return routeError(fmt.Errorf("%w: %q%s", routing.ErrUnknownTarget, v, detail))
	}
	if _, ok := s.workers.Lookup(v); ok {
		return &indexer.Worker{ID: v}, nil
	}
	i := strings.LastIndexByte(v, '/')
	if i <= 0 {
		return nil, unknown("")
	}
	id := v[:i]
	rank, err := strconv.ParseUint(v[i+1:], 10, 32)
	if err != nil {
		return nil, unknown("")
	}
	spec, ok := s.workers.Lookup(id)
	if !ok {
		return nil, unknown("")
	}
	if size := max(spec.DPSize, 1); rank >= uint64(size) {
		return nil, unknown(fmt.Sprintf(" (worker %q has %d data-parallel ranks)", id, size))
	}
	return &indexer.Worker{ID: id, DPRank: uint32(rank)}, nil
}

// dpRank reads X-Data-Parallel-Rank; -1 means any rank.
func dpRank(h http.Header) (int, *Error) {
	v := strings.TrimSpace(h.Get(headerDPRank))
	if v == "" {
		return -1, nil
	}
	rank, err := strconv.ParseUint(v, 10, 31)
	if err != nil {
		return 0, badHeader(headerDPRank, headerDPRank+" must be a non-negative integer")
	}
	return int(rank), nil
}

// rankExists refuses a rank beyond every worker's data-parallel size: the client's mistake
// (a 400 naming the header), where routing would find no candidate and answer 503.
func (s *Server) rankExists(rank int) *Error {
	if rank <= 0 {
		return nil
	}
	size := 1
	for _, st := range s.workers.List() {
		size = max(size, st.Spec.DPSize)
	}
	if rank < size {
		return nil
	}
	return badHeader(headerDPRank, fmt.Sprintf("%s %d: no worker has that data-parallel rank (the largest dp_size is %d)", headerDPRank, rank, size))
}

// serveCompletion handles /v1/chat/completions and /v1/completions.
func (s *Server) serveCompletion(w *recorder, r *http.Request, kind Kind) {
	arrived := time.Now()
	r, span := s.tr.startRequest(r, kind, s.cfg.ReplicaID)
	defer func() {
		code := w.status
		if w.gone {
			code = StatusClientClosed
		}
		if !span.IsRecording() {
			return
		}
		span.SetAttributes(attrStatus.Int(code))
		if code >= 500 {
			span.SetStatus(codes.Error, http.StatusText(code))
		}
		span.End()
	}()
	body, apiErr := s.readBody(w, r)
	if apiErr != nil || body == nil {
		s.fail(w, r, apiErr)
		return
	}
	p := &w.scratch.parsed
	// The body is readBody's, and no one writes it (Request.Body): the prompt may share it.
	if err := parseInto(kind, body, p, s.modelNames, true); err != nil {
		s.fail(w, r, routeError(err))
		return
	}
	req, apiErr := s.routingRequest(r.Context(), r.Header, p, false, &w.scratch.routed.Request, w.scratch.routed.Keys())
	if apiErr != nil {
		s.fail(w, r, apiErr)
		return
	}
	if key := s.resumes(p); key != "" {
		// The stored response it continues outranks a session header: only its worker
		// holds it.
		req.Session, req.Resume = key, true
	}
	client := ""
	if req.Session != "" || s.bindsResponse(p) {
		// (A stored answer's binding is a new session of the client's: keepResponse.)
		client = s.clientKey(r.Header, r.RemoteAddr)
	}
	if req.Session != "" {
		req.AdmitNew = s.admitNew(client)
	}
	sctx, sspan := s.tr.start(r.Context(), "select", trace.SpanKindInternal)
	if sspan.IsRecording() {
		sspan.SetAttributes(attrSession.Bool(req.Session != ""), attrTokens.Int(req.PromptTokens))
	}
	att, err := s.router.RouteScratch(sctx, &w.scratch.routed)
	if err != nil {
		failSpan(sspan, "select", err)
		sspan.End()
		s.fail(w, r, routeError(err))
		return
	}
	d := att.Decision()
	if sspan.IsRecording() {
		sspan.SetAttributes(decisionAttrs(d)...)
	}
	sspan.End()
	s.metrics.selection.Observe(d.Took.Seconds())
	if d.PromptBlocks > 0 {
		s.metrics.kvHit.Observe(float64(d.Overlap) / float64(d.PromptBlocks))
	}
	if s.proxy(&call{w: w, r: r, p: p, att: att, session: req.Session, client: client, arrived: arrived}) {
		// The response has started and the worker broke off: the client must see a broken
		// response, not a clean end.
		panic(http.ErrAbortHandler)
	}
}

// routeAnswer is /v1/route's reply.
type routeAnswer struct {
	Worker          string `json:"worker"`
	DPRank          uint32 `json:"dp_rank"`
	URL             string `json:"url"`
	OverlapBlocks   int    `json:"overlap_blocks"`
	PromptBlocks    int    `json:"prompt_blocks"`
	Session         string `json:"session,omitempty"`
	BindingRevision uint64 `json:"binding_revision"`
	Bound           bool   `json:"bound"`
	// Disaggregation is "disaggregated" or why the request would be served aggregated; for a
	// disaggregated one, the worker above decodes and Prefill prefills.
	Disaggregation string        `json:"disaggregation"`
	Prefill        *prefillRoute `json:"prefill,omitempty"`
}

// prefillRoute is the prefill worker of a disaggregated routing answer.
type prefillRoute struct {
	Worker        string `json:"worker"`
	DPRank        uint32 `json:"dp_rank"`
	URL           string `json:"url"`
	OverlapBlocks int    `json:"overlap_blocks"`
}

// decisionRequest reads the chat or completion body of a decision-service call (route,
// reserve) into a routing request; nil means the answer (an error) is written already.
func (s *Server) decisionRequest(w *recorder, r *http.Request, queryOnly bool) *routing.Request {
	body, apiErr := s.readBody(w, r)
	if apiErr != nil || body == nil {
		s.fail(w, r, apiErr)
		return nil
	}
	p, err := Parse(DetectKind(body), body)
	if err != nil {
		s.fail(w, r, routeError(err))
		return nil
	}
	req, apiErr := s.routingRequest(r.Context(), r.Header, p, queryOnly, nil, nil)
	if apiErr != nil {
		s.fail(w, r, apiErr)
		return nil
	}
	return req
}

// serveRoute answers the routing decision for a chat or completion body, dispatching nothing.
func (s *Server) serveRoute(w *recorder, r *http.Request) {
	req := s.decisionRequest(w, r, true)
	if req == nil {
		return
	}
	att, err := s.router.Route(r.Context(), req)
	if err != nil {
		s.fail(w, r, routeError(err))
		return
	}
	d := att.Decision()
	att.Finish()
	pd, plan, err := att.QueryPrefill(r.Context())
	if err != nil {
		s.fail(w, r, routeError(err))
		return
	}
	writeJSON(w, http.StatusOK, routeAnswerOf(d, req.Session, plan, pd))
}

// routeAnswerOf is the decision-service answer for decision d of session, with plan's
// outcome and, for a disaggregated one, its prefill decision pd.
func routeAnswerOf(d routing.Decision, session string, plan routing.PrefillPlan, pd routing.Decision) routeAnswer {
	ans := routeAnswer{
		Disaggregation:  plan.Outcome,
		Worker:          d.Target.Worker.ID,
		DPRank:          d.Target.Worker.DPRank,
		OverlapBlocks:   d.Overlap,
		PromptBlocks:    d.PromptBlocks,
		Session:         session,
		BindingRevision: d.Binding.Revision,
		Bound:           d.Bound,
	}
	if d.Target.Spec != nil {
		ans.URL = d.Target.Spec.URL
	}
	if plan.Outcome == routing.OutcomeDisaggregated {
		ans.Prefill = &prefillRoute{Worker: pd.Target.Worker.ID, DPRank: pd.Target.Worker.DPRank, OverlapBlocks: pd.Overlap}
		if pd.Target.Spec != nil {
			ans.Prefill.URL = pd.Target.Spec.URL
		}
	}
	return ans
}

func (s *Server) serveHealthz(w *recorder, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (s *Server) serveReadyz(w *recorder, _ *http.Request) {
	if err := s.Readiness(); err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"status": "not ready", "reason": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

// Readiness is /readyz's verdict: nil when the replica serves (SetReady's check passes) and
// some worker is routable.
func (s *Server) Readiness() error {
	if fn := s.ready.Load(); fn != nil {
		if err := (*fn)(); err != nil {
			return err
		}
	}
	if len(s.workers.Routable()) == 0 {
		return errNoRoutableWorker
	}
	return nil
}

// tokenizeWarnEvery spaces the warnings of a failing tokenizer.
const tokenizeWarnEvery = 10 * time.Second

// errNoRoutableWorker: every worker is unhealthy or drained.
var errNoRoutableWorker = errors.New("no routable worker")

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		(&Error{Status: http.StatusInternalServerError, Message: "encode response: " + err.Error(), Type: TypeServer}).write(w)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}
