package openai

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"strconv"
	"sync"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// A held decision is the proxy's routing for a request whose bytes something else carries:
// a reservation of the decision service (POST /v1/reserve), or a gateway's ext_proc stream
// (transport/extproc). Hold parses the body, reads the same headers and takes the same steps
// as a proxied request up to its dispatch (the session bound, the load counted, the decision
// recorded and gossiped, a prefill worker planned); the carrier then reports the first byte
// and the end, as the proxy would have seen them.

// HoldOptions shape a held decision.
type HoldOptions struct {
	// Path is the request's path; /v1/chat/completions and /v1/completions fix the body's
	// kind, any other path takes it from the body (a "messages" member is a chat).
	Path string
	// Subset, when set, admits only the targets it accepts (a gateway's subset hint).
	Subset func(routing.Target) bool
	// Disaggregate plans a prefill worker as the proxy does, by the router's --disagg mode;
	// the prefill leg is the carrier's to run (llm-d's decode sidecar does), and its load
	// counts until FirstToken.
	Disaggregate bool
	// Peer is the carrier's peer address (host:port): the client, for the limits per
	// client, unless a trusted key header names one (Config.ClientLimits).
	Peer string
}

// Held is one held decision. Its methods are safe for concurrent use; End ends it once.
type Held struct {
	// Decision is where the request goes (the decode worker, when disaggregated).
	Decision routing.Decision
	// Session is the request's session key, "" for none.
	Session string
	// Plan says whether the request is disaggregated (routing.OutcomeDisaggregated) or why
	// not; Prefill is the prefill worker when it is.
	Plan    routing.PrefillPlan
	Prefill routing.Decision
	// Body is the body the worker must receive: the client's, but for a request naming an
	// alias, whose "model" is the target it was sent as (Decision.Model), as the proxy sends it.
	Body []byte

	mu  sync.Mutex
	att *routing.Attempt
	leg *routing.Attempt // the prefill leg until the first byte; nil when aggregated
}

// KindOfPath is the request kind a path fixes, false for a path that fixes none.
func KindOfPath(path string) (Kind, bool) {
	switch path {
	case "/v1/chat/completions":
		return KindChat, true
	case "/v1/completions":
		return KindCompletion, true
	case "/v1/responses":
		return KindResponses, true
	case "/v1/messages":
		return KindMessages, true
	case "/v1/messages/count_tokens":
		return KindCountTokens, true
	case "/v1/embeddings":
		return KindEmbeddings, true
	}
	return 0, false
}

// Hold routes the request with headers h and body and holds the decision until End. Its
// errors are in the OpenAI shape (with the status the client gets) and counted as the
// proxy's are; a nil *Error with a nil *Held means ctx ended first.
func (s *Server) Hold(ctx context.Context, h http.Header, body []byte, opts HoldOptions) (*Held, *Error) {
	held, apiErr := s.hold(ctx, h, body, opts)
	if apiErr != nil {
		s.countError(apiErr)
	}
	return held, apiErr
}

func (s *Server) hold(ctx context.Context, h http.Header, body []byte, opts HoldOptions) (*Held, *Error) {
	if int64(len(body)) > s.cfg.MaxBodyBytes {
		return nil, s.bodyTooLarge()
	}
	kind, ok := KindOfPath(opts.Path)
	if !ok {
		kind = DetectKind(body)
	}
	p, err := Parse(kind, body)
	if err != nil {
		return nil, routeError(err)
	}
	req, apiErr := s.routingRequest(ctx, h, p, false, nil, nil)
	if apiErr != nil {
		return nil, apiErr
	}
	req.Subset = opts.Subset
	client := ""
	if req.Session != "" {
		client = s.clientKey(h, opts.Peer)
		req.AdmitNew = s.admitNew(client)
	}
	att, err := s.router.Route(ctx, req)
	if err != nil {
		return nil, routeError(err)
	}
	// The session binds now, to the worker the carrier will send the request to; a binding
	// a concurrent request made first wins, and the decision moves to its worker.
	wasBound := att.Decision().Bound
	b, err := att.Commit(ctx)
	for errors.Is(err, routing.ErrWorkerDraining) {
		// The worker began draining after it was chosen: the next choice (Retry's bound
		// ends the loop).
		if rerr := att.Retry(ctx, err); rerr != nil {
			return nil, routeError(rerr)
		}
		wasBound = att.Decision().Bound
		b, err = att.Commit(ctx)
	}
	if err != nil && !errors.Is(err, routing.ErrBoundElsewhere) {
		att.Finish()
		return nil, commitError(err)
	}
	if err == nil && req.Session != "" {
		s.madeSession(client, wasBound, b)
	}
	held := &Held{Session: req.Session, att: att, Plan: routing.PrefillPlan{Outcome: routing.OutcomeNever}}
	held.Decision = att.Decision()
	held.Decision.Binding = b
	if held.Body, err = sentBody(p, held.Decision.Model); err != nil {
		held.End(false, 0)
		return nil, &Error{Status: http.StatusInternalServerError, Type: TypeServer, Message: err.Error(), Cause: "internal"}
	}
	s.metrics.selection.Observe(held.Decision.Took.Seconds())
	if d := held.Decision; d.PromptBlocks > 0 {
		s.metrics.kvHit.Observe(float64(d.Overlap) / float64(d.PromptBlocks))
	}
	if opts.Disaggregate && (kind == KindChat || kind == KindCompletion) {
		leg, plan, err := att.PlanPrefill(ctx)
		switch {
		case err != nil && ctx.Err() != nil:
			held.End(false, 0)
			return nil, nil
		case err != nil:
			plan.Outcome = routing.OutcomePrefillBusy
		case leg != nil:
			held.leg, held.Prefill = leg, leg.Decision()
			s.metrics.prefillSelection.Observe(held.Prefill.Took.Seconds())
		}
		held.Plan = plan
		s.metrics.disagg.WithLabelValues(plan.Outcome).Inc()
	}
	return held, nil
}

// FirstToken reports the request's first byte from its worker: its prefill is over (a
// disaggregated one's prefill leg with it, recorded on the prefill worker).
func (h *Held) FirstToken() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.att == nil {
		return
	}
	h.att.FirstToken()
	h.endLeg(true)
}

// End ends the held decision: completed (the worker answered the request whole) records the
// prompt and its answer's outputTokens blocks on the worker, as the proxy does at the end of
// an answer; otherwise the load is freed and nothing more recorded. Later calls do nothing.
func (h *Held) End(completed bool, outputTokens int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.att == nil {
		return
	}
	h.endLeg(completed)
	if completed {
		h.att.Complete(outputTokens)
	}
	h.att.Finish()
	h.att = nil
}

// endLeg ends the prefill leg, recording its prompt on the prefill worker when done.
func (h *Held) endLeg(done bool) {
	if h.leg == nil {
		return
	}
	if done {
		// A prefill leg has no session: its commit records the decision, nothing more.
		if _, err := h.leg.Commit(context.Background()); err == nil {
			h.leg.Complete(1)
		}
	}
	h.leg.Finish()
	h.leg = nil
}

// countError counts a refused or failed request under its cause, as the proxy does.
func (s *Server) countError(apiErr *Error) {
	cause := apiErr.Cause
	if cause == "" {
		cause = "parse"
	}
	s.metrics.errors.WithLabelValues(cause).Inc()
}

// MaxBodyBytes is the largest request body the server takes (--max-body-bytes).
func (s *Server) MaxBodyBytes() int64 { return s.cfg.MaxBodyBytes }

// bodyTooLarge is the answer to a body over MaxBodyBytes.
func (s *Server) bodyTooLarge() *Error {
	return &Error{Status: http.StatusRequestEntityTooLarge, Type: TypeInvalidRequest, Code: "body_too_large",
		Message: "request body exceeds " + strconv.FormatInt(s.cfg.MaxBodyBytes, 10) + " bytes", Cause: "body_too_large"}
}

// Tally reads what an answer's bytes say of the tokens generated: the usage's
// completion_tokens when the answer has one (the usage chunk comes last), else about one per
// stream event (engines send a token or a few per chunk), the closing [DONE] aside. Feed it
// the answer's chunks in order.
type Tally struct {
	generated    int
	sawGenerated bool
	events       int
}

// Observe reads one chunk of the answer.
func (t *Tally) Observe(chunk []byte) {
	u := scanUsage(chunk)
	t.observe(chunk, &u)
}

// observe is Observe with the chunk's usage already read.
func (t *Tally) observe(chunk []byte, u *usage) {
	// Chat and completions say completion_tokens; Responses and Messages, output_tokens.
	for _, key := range [...]int{usageCompletion, usageOutput} {
		if u.ok[key] {
			t.generated, t.sawGenerated = u.n[key], true
		}
	}
	t.events += bytes.Count(chunk, []byte("data:"))
}

// Generated is the answer's generated tokens as far as its chunks tell.
func (t *Tally) Generated() int {
	if t.sawGenerated {
		return t.generated
	}
	return max(t.events-1, 0) // the last is [DONE]
}
