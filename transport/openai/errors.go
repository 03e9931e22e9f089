package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Error types as the OpenAI API names them.
const (
	TypeInvalidRequest = "invalid_request_error"
	TypeNotFound       = "not_found_error"
	TypeConflict       = "conflict_error"
	TypeRateLimit      = "rate_limit_error"
	TypeServer         = "server_error"
	TypeUnavailable    = "service_unavailable_error"
)

// StatusClientClosed is the status recorded (never sent) for a request whose client went away,
// after nginx's 499.
const StatusClientClosed = 499

// Error is an answer in the OpenAI error shape.
type Error struct {
	Status  int    `json:"-"`
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   string `json:"param,omitempty"`
	Code    string `json:"code,omitempty"`
	// RetryAfter, when set, becomes the Retry-After header (seconds).
	RetryAfter string `json:"-"`
	// Refused, when set, becomes the X-Kvrouter-Refused header: the replica refused the
	// request before asking any worker, for this reason (a routing.Refusal's, no_worker,
	// busy). Every 503 carries it (afterWorker).
	Refused string `json:"-"`
	// Cause is the metrics label for this error.
	Cause string `json:"-"`
}

// Error implements error.
func (e *Error) Error() string {
	if e.Param != "" {
		return e.Message + " (param " + e.Param + ")"
	}
	return e.Message
}

// errorBody is the wire shape: {"error": {...}}.
type errorBody struct {
	Error *Error `json:"error"`
}

// Body is e in the wire shape, {"error": {...}}, as a whole response body.
func (e *Error) Body() []byte {
	body, err := json.Marshal(errorBody{Error: e})
	if err != nil {
		// Marshalling plain strings cannot fail; keep a valid answer regardless.
		body = []byte(`{"error":{"message":"internal error","type":"server_error"}}`)
	}
	return append(body, '\n')
}

// RefusalBody is the answer to a request the HTTP server refused before any handler saw it
// (a malformed or ambiguous head: transport/h1's Config.Refusal), in the API's error shape.
func RefusalBody(status int, why string) []byte {
	return (&Error{Status: status, Message: "malformed request: " + why, Type: TypeInvalidRequest,
		Code: "malformed_request"}).Body()
}

// anthropicBody is e in Anthropic's error shape, {"type": "error", "error": {"type",
// "message"}}, its type named as Anthropic names it.
func (e *Error) anthropicBody() []byte {
	typ := "api_error"
	switch {
	case e.Status == http.StatusRequestEntityTooLarge:
		typ = "request_too_large"
	case e.Status == http.StatusNotFound:
		typ = "not_found_error"
	case e.Status == http.StatusTooManyRequests:
		typ = "rate_limit_error"
	case e.Status == http.StatusServiceUnavailable:
		typ = "overloaded_error"
	case e.Status >= 400 && e.Status < 500:
		typ = "invalid_request_error"
	}
	msg := e.Message
	if e.Param != "" {
		msg += " (" + e.Param + ")"
	}
	body, err := json.Marshal(map[string]any{"type": "error", "error": map[string]string{"type": typ, "message": msg}})
	if err != nil {
		body = []byte(`{"type":"error","error":{"type":"api_error","message":"internal error"}}`)
	}
	return body
}

// writeAnthropic sends e as the whole response in Anthropic's error shape.
func (e *Error) writeAnthropic(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	e.setRetryHeaders(h)
	w.WriteHeader(e.Status)
	_, _ = w.Write(append(e.anthropicBody(), '\n'))
}

// responsesErrorEvent is a Responses stream's error event: the fields flat, as the API
// reference documents them, and nested under "error", as the live API sends them (the
// openai SDKs raise an APIError on an event whose data has "error").
type responsesErrorEvent struct {
	Type     string  `json:"type"`
	Sequence int     `json:"sequence_number"`
	Code     *string `json:"code"`
	Message  string  `json:"message"`
	Param    *string `json:"param"`
	Error    *Error  `json:"error"`
}

// streamEvent is e as the last server-sent event of a stream of kind k that broke off after
// it started, in the API's own shape, so that the official SDKs raise a typed error:
// Anthropic's `event: error` with its error body (anthropic set); Responses' `event: error`
// (responsesErrorEvent; seq is the events sent so far); chat's and completions'
// `data: {"error": {...}}`, as vLLM sends.
func (e *Error) streamEvent(k Kind, anthropic bool, seq int) []byte {
	var data []byte
	var err error
	switch {
	case anthropic:
		return append(append([]byte("event: error\ndata: "), e.anthropicBody()...), "\n\n"...)
	case k == KindResponses:
		ev := responsesErrorEvent{Type: "error", Sequence: seq, Message: e.Message, Error: e}
		if e.Code != "" {
			ev.Code = &e.Code
		}
		if e.Param != "" {
			ev.Param = &e.Param
		}
		if data, err = json.Marshal(ev); err == nil {
			return append(append([]byte("event: error\ndata: "), data...), "\n\n"...)
		}
	default:
		if data, err = json.Marshal(errorBody{Error: e}); err == nil {
			return append(append([]byte("data: "), data...), "\n\n"...)
		}
	}
	// Marshalling plain strings cannot fail; keep a valid event regardless.
	return []byte(`data: {"error":{"message":"internal error","type":"server_error"}}` + "\n\n")
}

// write sends e as the whole response.
func (e *Error) write(w http.ResponseWriter) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	e.setRetryHeaders(h)
	w.WriteHeader(e.Status)
	_, _ = w.Write(e.Body())
}

// HeaderRefused marks a refusal (Error.Refused): a 503 the replica answered before asking
// any worker, which a load balancer may send to another replica. Every 503 the router
// answers is one (a failure after a worker was asked is a 502), so a balancer that matches
// statuses only (HAProxy's retry-on) can retry 503s; one that reads headers can match this.
const HeaderRefused = "X-Kvrouter-Refused"

// setRetryHeaders sets Retry-After and the refusal marker when e has them.
func (e *Error) setRetryHeaders(h http.Header) {
	if e.RetryAfter != "" {
		h.Set("Retry-After", e.RetryAfter)
	}
	if e.Refused != "" {
		h.Set(HeaderRefused, e.Refused)
	}
}

// modelNotFound is the answer for a model no worker of the fleet serves, in OpenAI's words
// (Anthropic's not_found_error on /v1/messages).
func modelNotFound(model string) *Error {
	return &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Param: "model", Code: "model_not_found",
		Message: fmt.Sprintf("The model `%s` does not exist.", model), Cause: "model_not_found"}
}

// routeError maps a routing error to the answer a client gets. A nil result means the
// client went away and nothing should be written. It answers errors met before any worker
// was asked, so its 503s are refusals (Refused set); after one, afterWorker turns them into
// 502s.
func routeError(err error) *Error {
	var (
		apiErr  *Error
		refusal *routing.Refusal
	)
	switch {
	case errors.As(err, &apiErr):
		return apiErr
	case errors.Is(err, context.Canceled):
		return nil
	case errors.Is(err, routing.ErrNoWorker):
		return &Error{Status: http.StatusServiceUnavailable, Message: err.Error(), Type: TypeUnavailable,
			Code: "no_worker", RetryAfter: "1", Refused: "no_worker", Cause: "no_worker"}
	case errors.Is(err, routing.ErrBusy):
		return &Error{Status: http.StatusServiceUnavailable, Message: err.Error(), Type: TypeUnavailable,
			Code: "busy", RetryAfter: "1", Refused: "busy", Cause: "busy"}
	case errors.As(err, &refusal):
		return &Error{Status: http.StatusServiceUnavailable, Message: err.Error(), Type: TypeUnavailable,
			Code: "cluster_unavailable", RetryAfter: "1", Refused: refusal.Reason, Cause: "refused_" + refusal.Reason}
	case errors.Is(err, routing.ErrUnavailable):
		return &Error{Status: http.StatusServiceUnavailable, Message: err.Error(), Type: TypeUnavailable,
			Code: "cluster_unavailable", RetryAfter: "1", Refused: "cluster_unavailable", Cause: "cluster_unavailable"}
	case errors.Is(err, routing.ErrUnknownTarget):
		return &Error{Status: http.StatusNotFound, Message: err.Error(), Type: TypeNotFound,
			Param: headerTarget, Code: "unknown_target", Cause: "unknown_target"}
	case errors.Is(err, routing.ErrTargetConflict):
		return &Error{Status: http.StatusConflict, Message: err.Error(), Type: TypeConflict,
			Param: headerTarget, Code: "target_conflict", Cause: "target_conflict"}
	case errors.Is(err, routing.ErrTooManySessions):
		return &Error{Status: http.StatusTooManyRequests, Message: err.Error(), Type: TypeRateLimit,
			Param: headerSession, Code: "too_many_sessions", Cause: "too_many_sessions"}
	case errors.Is(err, routing.ErrRetriesExhausted):
		return &Error{Status: http.StatusBadGateway, Message: err.Error(), Type: TypeServer,
			Code: "upstream_failed", Cause: "retries_exhausted"}
	case errors.Is(err, context.DeadlineExceeded):
		return &Error{Status: http.StatusGatewayTimeout, Message: err.Error(), Type: TypeServer,
			Code: "timeout", Cause: "timeout"}
	default:
		return &Error{Status: http.StatusInternalServerError, Message: "internal error: " + err.Error(),
			Type: TypeServer, Cause: "internal"}
	}
}
