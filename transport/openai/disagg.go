package openai

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Prefill/decode disaggregation speaks vLLM's protocol as its NixlConnector proxy does: the
// prefill leg is the client's request with kv_transfer_params asking for a remote decode,
// not streamed, one token long; the prefill worker's JSON answer carries the
// kv_transfer_params that tell a decode worker where to pull the prompt's KV from; the
// decode leg is the client's request with those params, and its answer goes to the client
// unchanged. Both legs carry one X-Request-Id.

// headerRequestID is the request id both legs of a disaggregated request share.
const headerRequestID = "X-Request-Id"

// headerTransferMs is how long a decode worker says the KV transfer took, in milliseconds,
// when it says (the simulated worker does; vLLM does not).
const headerTransferMs = "X-Kv-Transfer-Ms"

// remoteDecodeParams asks a prefill worker to keep the prompt's KV for a remote decode.
var remoteDecodeParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// prefillBody is the prefill leg's body: the client's, with remoteDecodeParams, not
// streamed, one token long (max_completion_tokens too when the client set it), without
// stream_options and without a minimum length.
func prefillBody(body []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("prefill leg body: %w", err)
	}
	one := json.RawMessage("1")
	m["kv_transfer_params"] = remoteDecodeParams
	m["stream"] = json.RawMessage("false")
	m["max_tokens"] = one
	if _, ok := m["max_completion_tokens"]; ok {
		m["max_completion_tokens"] = one
	}
	for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
		delete(m, k)
	}
	return json.Marshal(m)
}

// decodeBody is the decode leg's body: the client's, with the prefill worker's params.
func decodeBody(body []byte, params json.RawMessage) ([]byte, error) {
	b, err := setField(body, "kv_transfer_params", params)
	if err != nil {
		return nil, fmt.Errorf("decode leg body: %w", err)
	}
	return b, nil
}

// setField returns body (a JSON object) with its top-level field key set to value.
func setField(body []byte, key string, value json.RawMessage) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, err
	}
	m[key] = value
	return json.Marshal(m)
}

// transferParams reads and checks the kv_transfer_params of a prefill worker's answer and
// returns them as they came (fields this router does not know pass through).
func transferParams(answer []byte) (json.RawMessage, error) {
	var a struct {
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(answer, &a); err != nil {
		return nil, fmt.Errorf("prefill answer is not a JSON object: %w", err)
	}
	if isNull(a.Params) {
		return nil, errors.New("prefill answer has no kv_transfer_params (is the worker's KV connector configured?)")
	}
	var p struct {
		DoRemotePrefill *bool    `json:"do_remote_prefill"`
		EngineID        *string  `json:"remote_engine_id"`
		BlockIDs        *[]int64 `json:"remote_block_ids"`
		Host            *string  `json:"remote_host"`
		Port            *int     `json:"remote_port"`
	}
	if err := json.Unmarshal(a.Params, &p); err != nil {
		return nil, fmt.Errorf("kv_transfer_params: %w", err)
	}
	switch {
	case p.DoRemotePrefill == nil || !*p.DoRemotePrefill:
		return nil, errors.New("kv_transfer_params: do_remote_prefill is not true")
	case p.EngineID == nil || *p.EngineID == "":
		return nil, errors.New("kv_transfer_params: no remote_engine_id")
	case p.BlockIDs == nil:
		return nil, errors.New("kv_transfer_params: no remote_block_ids")
	case p.Host == nil || *p.Host == "":
		return nil, errors.New("kv_transfer_params: no remote_host")
	case p.Port == nil || *p.Port < 1 || *p.Port > 65535:
		return nil, errors.New("kv_transfer_params: remote_port missing or out of range")
	}
	return a.Params, nil
}

// disaggregate decides, for the current decision, whether the request is disaggregated and
// if so runs its prefill leg; ok means go on with the decode dispatch (aggregated, or with
// the decode leg's body in c.body). A prefill leg that fails on every prefill worker it may
// try falls back to aggregated on the decode worker; bad kv_transfer_params end the request
// with 502 and take the prefill worker out of rotation.
func (s *Server) disaggregate(c *call) (res outcome, fail failure, ok bool) {
	if c.p.Kind != KindChat && c.p.Kind != KindCompletion {
		// vLLM's P/D protocol is chat's and completions'; other APIs are served aggregated.
		return 0, failure{}, true
	}
	ctx := c.r.Context()
	leg, plan, err := c.att.PlanPrefill(ctx)
	switch {
	case err != nil && ctx.Err() != nil:
		s.fail(c.w, c.r, nil)
		return done, failure{}, false
	case err != nil:
		s.log.Debug("no prefill worker for a disaggregated request; serving it aggregated", "error", err)
		s.metrics.disagg.WithLabelValues(routing.OutcomePrefillBusy).Inc()
		return 0, failure{}, true
	case leg == nil:
		s.metrics.disagg.WithLabelValues(plan.Outcome).Inc()
		return 0, failure{}, true
	}
	if c.r.Header.Get(headerRequestID) == "" {
		c.r.Header.Set(headerRequestID, rand.Text())
	}
	s.metrics.prefillSelection.Observe(leg.Decision().Took.Seconds())
	params, apiErr, gone := s.prefillLeg(c, leg)
	switch {
	case gone:
		s.fail(c.w, c.r, nil)
		return done, failure{}, false
	case apiErr != nil:
		s.fail(c.w, c.r, apiErr)
		return done, failure{}, false
	case params == nil:
		s.metrics.disagg.WithLabelValues(outcomePrefillFailed).Inc()
		return 0, failure{}, true
	}
	body, err := decodeBody(c.body, params)
	if err != nil {
		// The client's body was checked on arrival; this is the router's own fault.
		s.fail(c.w, c.r, &Error{Status: http.StatusInternalServerError, Message: err.Error(), Type: TypeServer, Cause: "internal"})
		return done, failure{}, false
	}
	c.body, c.prefill, c.decodeAt = body, leg.Decision().Target.Worker.String(), time.Now()
	s.metrics.disagg.WithLabelValues(routing.OutcomeDisaggregated).Inc()
	return 0, failure{}, true
}

// outcomePrefillFailed: the prefill leg failed on every worker it tried (metric label).
const outcomePrefillFailed = "prefill_failed"

// prefillLeg sends the prefill leg, retrying on another prefill worker (the router's retry
// bound) after a failure before its answer, and returns the decode leg's kv_transfer_params;
// nil params without an error: no prefill worker could do it. gone: the client left. It
// always finishes the leg, so its load is released on every path.
func (s *Server) prefillLeg(c *call, leg *routing.Attempt) (params json.RawMessage, apiErr *Error, gone bool) {
	defer leg.Finish()
	ctx := c.r.Context()
	body, err := prefillBody(c.body)
	if err != nil {
		return nil, nil, false
	}
	start := time.Now()
	for {
		d := leg.Decision()
		span := trace.SpanFromContext(context.Background())
		pr := c.r
		if s.tr != nil {
			var pctx context.Context
			pctx, span = s.tr.start(ctx, "prefill", trace.SpanKindClient, decisionAttrs(d)...)
			pr = c.r.WithContext(pctx)
		}
		answer, fail, refused := s.sendPrefill(pr, leg, body)
		if fail.err != nil {
			failSpan(span, fail.cause, fail.err)
		}
		span.End()
		switch {
		case refused:
			// The prefill worker refused the request itself: the decode worker serves it
			// aggregated, and its answer (the same refusal, most likely) is the client's.
			return nil, nil, false
		case fail.err == nil:
			p, perr := transferParams(answer)
			if perr != nil {
				s.badResponse(d, "prefill_params", perr)
				return nil, &Error{Status: http.StatusBadGateway, Message: fmt.Sprintf("prefill worker %s: %v", d.Target.Worker, perr),
					Type: TypeServer, Code: "bad_kv_transfer_params", Cause: "prefill_params"}, false
			}
			if _, err := leg.Commit(ctx); err != nil {
				return nil, nil, ctx.Err() != nil
			}
			leg.Complete(1)
			s.metrics.prefillLeg.Observe(time.Since(start).Seconds())
			return p, nil, false
		case ctx.Err() != nil:
			return nil, nil, true
		}
		s.metrics.errors.WithLabelValues(fail.cause).Inc()
		s.log.Info("prefill leg failed before its answer", "worker", d.Target.Worker.String(), "cause", fail.cause, "error", fail.err)
		if err := leg.Retry(ctx, fail.err); err != nil {
			if ctx.Err() != nil {
				return nil, nil, true
			}
			s.log.Info("no prefill worker left to try; serving the request aggregated", "error", err)
			return nil, nil, false
		}
	}
}

// sendPrefill sends the prefill leg once, to the leg's current worker, and reads its whole
// answer: a failure worth another prefill worker (unreachable, 5xx, 429, a broken read), or
// refused (any other non-2xx).
func (s *Server) sendPrefill(r *http.Request, leg *routing.Attempt, body []byte) (answer []byte, fail failure, refused bool) {
	d := leg.Decision()
	firstBy := time.Now().Add(s.cfg.FirstByteTimeout)
	resp, ub, err := s.upstream.roundTrip(r.Context(), d.Target.Spec.URL, s.upstreamRequest(r, body, d.Target), firstBy)
	if err != nil {
		return nil, failure{cause: "prefill_connect", err: fmt.Errorf("prefill worker %s: %w", d.Target.Worker, err)}, false
	}
	defer resp.Body.Close()
	rd := newUpstreamReader(ub, firstBy, s.cfg.IdleTimeout)
	answer, err = s.readAll(&rd, resp.ContentLength, leg.FirstToken)
	switch {
	case err != nil:
		return nil, failure{cause: "prefill_read", err: fmt.Errorf("prefill worker %s: %w", d.Target.Worker, err)}, false
	case resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests:
		return nil, failure{cause: "prefill_status", err: fmt.Errorf("prefill worker %s answered %s", d.Target.Worker, resp.Status)}, false
	case resp.StatusCode < 200 || resp.StatusCode >= 300:
		s.log.Info("prefill worker refused the request; serving it aggregated", "worker", d.Target.Worker.String(), "status", resp.Status)
		return nil, failure{}, true
	}
	return answer, failure{}, false
}

// observeDecodeLeg records a disaggregated answer's split: from the decode dispatch to its
// first byte, and the KV transfer the decode worker reports.
func (s *Server) observeDecodeLeg(c *call, h http.Header) {
	if c.prefill == "" {
		return
	}
	if !c.firstAt.IsZero() {
		s.metrics.decodeFirstToken.Observe(c.firstAt.Sub(c.decodeAt).Seconds())
	}
	if v := h.Get(headerTransferMs); v != "" {
		if ms, err := strconv.ParseFloat(v, 64); err == nil && ms >= 0 && ms < 1e9 {
			s.metrics.transfer.Observe(ms / 1000)
		}
	}
}
