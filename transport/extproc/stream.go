package extproc

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// stream is one gateway stream: the request's headers, body chunks (and trailers), then the
// response's, in that order. The picker answers each message as the body modes require; in
// FULL_DUPLEX_STREAMED request mode (the protocol's, and the default when the gateway does
// not say) the headers' answer waits for the whole body, since it carries the endpoint, and
// the body goes back with it.
type stream struct {
	p       *Picker
	srv     extprocv3.ExternalProcessor_ProcessServer
	started time.Time

	// The body modes, from the first message's protocol_config when the gateway sends one.
	reqBuffered, respStreamed bool

	headers    http.Header // the request's, pseudo-headers aside
	path       string
	subset     map[string]bool // nil: no subset hint
	answered   bool            // the request headers have had their answer
	body       []byte
	sawBody    bool // a body message came
	passed     int  // body chunks answered unchanged before the pick (STREAMED mode)
	picked     bool
	endpoint   string
	pickedAt   time.Time
	held       *openai.Held
	status     int
	served     string
	firstByte  bool
	tally      openai.Tally
	responseIn bool // the response has begun
	ended      bool // the response has ended: the gateway owes the stream's close
}

// errAnswered ends a stream after an immediate response: the gateway answers the client
// itself and sends nothing more.
var errAnswered = errors.New("immediate response sent")

// received is one Recv's result.
type received struct {
	req *extprocv3.ProcessingRequest
	err error
}

// run reads the stream to its end, releasing a held decision on every path.
//
// Only a stream that owes the picker its next message runs the idle clock: one whose request
// is incomplete, or whose response has ended. gRPC has no read deadline for a stream, and a
// handler ends its stream only by returning, so while the clock runs a reader goroutine
// receives and run waits on it or the clock. A stream waiting for the upstream's answer (a
// long generation) is the gateway's to keep: the reader goes once the request is complete,
// and run receives itself, so a stream in flight costs one goroutine, not two.
func (st *stream) run() error {
	st.p.metrics.open.Inc()
	defer st.p.metrics.open.Dec()
	defer st.finish()
	d := st.p.cfg.IdleTimeout
	var idle *time.Timer
	if d > 0 {
		idle = time.NewTimer(d)
		defer idle.Stop()
	}
	var rd *reader
	defer func() {
		if rd != nil {
			close(rd.quit)
		}
	}()
	first := true
	for {
		var m received
		switch {
		case idle != nil && (!st.picked || st.ended):
			if rd == nil {
				rd = st.startReader()
			}
			idle.Reset(d)
			select {
			case m = <-rd.msgs:
			case <-idle.C:
				return st.idled()
			}
		case rd != nil:
			// The clock stopped: the reader hands over the message it waits for and goes,
			// before run receives itself (one Recv at a time).
			rd.stop.Store(true)
			select {
			case m = <-rd.msgs:
			case <-rd.done:
			}
			<-rd.done
			rd = nil
			if m.req == nil && m.err == nil {
				continue
			}
		default:
			m.req, m.err = st.srv.Recv()
		}
		if m.err != nil {
			// io.EOF: the gateway closed its side; anything else: the stream broke or the
			// picker is closing. Either way the request is over for the picker.
			if !errors.Is(m.err, io.EOF) {
				st.p.log.Debug("ext_proc stream ended", "error", m.err)
			}
			return nil
		}
		if first {
			st.readConfig(m.req.GetProtocolConfig())
			first = false
		}
		if err := st.handle(m.req); err != nil {
			if errors.Is(err, errAnswered) {
				return nil
			}
			return err
		}
	}
}

// reader receives a stream's messages on its own goroutine while run watches the clock.
type reader struct {
	msgs chan received
	stop atomic.Bool   // return after the next message handed over
	quit chan struct{} // run returned: hand nothing more over
	done chan struct{} // closed as the goroutine returns
}

// startReader starts receiving st's messages into the reader's msgs, until an error, stop
// or quit.
func (st *stream) startReader() *reader {
	rd := &reader{msgs: make(chan received), quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(rd.done)
		for {
			req, err := st.srv.Recv()
			select {
			case rd.msgs <- received{req, err}:
			case <-rd.quit:
				return
			}
			if err != nil || rd.stop.Load() {
				return
			}
		}
	}()
	return rd
}

// idled ends a stream that owed the picker a message for IdleTimeout: the client hears 408
// through the gateway (while its request is incomplete), the stream ends DEADLINE_EXCEEDED.
func (st *stream) idled() error {
	d := st.p.cfg.IdleTimeout
	if !st.picked {
		st.answer(&openai.Error{Status: http.StatusRequestTimeout, Type: openai.TypeInvalidRequest, Code: "request_timeout",
			Message: "ext_proc: the request was not complete after " + d.String() + " without a message"})
	}
	st.p.metrics.ended.WithLabelValues("idle").Inc()
	return status.Errorf(codes.DeadlineExceeded, "ext_proc: no message for %s while the picker waited for one", d)
}

// overloaded refuses a stream past MaxStreams: a 503 the gateway can answer the client
// with at once (Retry-After 1), and RESOURCE_EXHAUSTED for the stream.
func (st *stream) overloaded(limit int) error {
	st.answer(&openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeServer, Code: "ext_proc_busy", RetryAfter: "1",
		Message: "ext_proc: the picker holds " + strconv.Itoa(limit) + " streams, its limit"})
	st.p.metrics.ended.WithLabelValues("overloaded").Inc()
	return status.Errorf(codes.ResourceExhausted, "ext_proc: %d streams open, the most this picker takes (--ext-proc-max-streams)", limit)
}

// readConfig takes the body modes the gateway announces. Without an announcement the modes
// are the protocol's: both bodies FULL_DUPLEX_STREAMED.
func (st *stream) readConfig(pc *extprocv3.ProtocolConfiguration) {
	if pc == nil {
		return
	}
	st.reqBuffered = pc.GetRequestBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	st.respStreamed = pc.GetResponseBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// handle answers one message.
func (st *stream) handle(req *extprocv3.ProcessingRequest) error {
	switch m := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		if st.headers != nil {
			return st.refuse("request headers arrived twice")
		}
		st.readHeaders(m.RequestHeaders.GetHeaders())
		if msg := st.readSubset(req.GetMetadataContext()); msg != "" {
			return st.refuse(msg)
		}
		if m.RequestHeaders.GetEndOfStream() {
			return st.pick(false)
		}
		if st.reqBuffered {
			st.answered = true
			return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
				RequestHeaders: &extprocv3.HeadersResponse{}}})
		}
		return nil
	case *extprocv3.ProcessingRequest_RequestBody:
		switch {
		case st.headers == nil:
			return st.refuse("request body before the request headers")
		case st.picked:
			return st.refuse("request body after the request ended")
		}
		st.sawBody = true
		st.body = append(st.body, m.RequestBody.GetBody()...)
		if int64(len(st.body)) > st.p.front.MaxBodyBytes() {
			return st.immediate(&openai.Error{Status: http.StatusRequestEntityTooLarge, Type: openai.TypeInvalidRequest,
				Code: "body_too_large", Message: "request body exceeds " + strconv.FormatInt(st.p.front.MaxBodyBytes(), 10) + " bytes"})
		}
		if m.RequestBody.GetEndOfStream() {
			return st.pick(false)
		}
		if st.reqBuffered {
			// STREAMED mode: each chunk is answered, unchanged.
			st.passed++
			return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
				RequestBody: &extprocv3.BodyResponse{}}})
		}
		return nil
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if st.headers == nil || st.picked {
			return st.refuse("request trailers out of order")
		}
		if err := st.pick(true); err != nil {
			return err
		}
		return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
			RequestTrailers: &extprocv3.TrailersResponse{}}})
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		if !st.picked || st.responseIn {
			return st.refuse("response headers out of order")
		}
		st.responseIn = true
		st.status = statusOf(m.ResponseHeaders.GetHeaders())
		st.served = servedOf(req.GetMetadataContext())
		if err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
			ResponseHeaders: &extprocv3.HeadersResponse{}}}); err != nil {
			return err
		}
		if m.ResponseHeaders.GetEndOfStream() {
			st.finish()
		}
		return nil
	case *extprocv3.ProcessingRequest_ResponseBody:
		if !st.responseIn {
			return st.refuse("response body before the response headers")
		}
		chunk := m.ResponseBody.GetBody()
		if !st.firstByte && len(chunk) > 0 {
			st.firstByte = true
			if st.held != nil {
				st.held.FirstToken()
			}
		}
		st.tally.Observe(chunk)
		eos := m.ResponseBody.GetEndOfStream()
		var br extprocv3.BodyResponse
		if !st.respStreamed {
			// FULL_DUPLEX_STREAMED: the picker sends the body on, chunk by chunk.
			br.Response = &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
				StreamedResponse: &extprocv3.StreamedBodyResponse{Body: chunk, EndOfStream: eos}}}}
		}
		if err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &br}}); err != nil {
			return err
		}
		if eos {
			st.finish()
		}
		return nil
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if !st.responseIn {
			return st.refuse("response trailers before the response headers")
		}
		if err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{}}}); err != nil {
			return err
		}
		st.finish()
		return nil
	default:
		return st.refuse("a message with no request headers, body, trailers or response")
	}
}

// readHeaders keeps the request's headers (Envoy sends them lower-cased, the value in
// raw_value or value) and its path.
func (st *stream) readHeaders(hm *corev3.HeaderMap) {
	st.headers = http.Header{}
	for _, h := range hm.GetHeaders() {
		v := headerValue(h)
		switch k := h.GetKey(); {
		case k == ":path":
			st.path, _, _ = strings.Cut(v, "?")
		case strings.HasPrefix(k, ":"):
		default:
			st.headers.Add(k, v)
		}
	}
}

func headerValue(h *corev3.HeaderValue) string {
	if raw := h.GetRawValue(); len(raw) > 0 {
		return string(raw)
	}
	return h.GetValue()
}

// readSubset takes the subset hint, when the gateway sends one; a non-empty result says
// what is wrong with it.
func (st *stream) readSubset(md *corev3.Metadata) string {
	ns, ok := md.GetFilterMetadata()[NamespaceSubset]
	if !ok {
		return ""
	}
	v, ok := ns.GetFields()[KeySubset]
	if !ok {
		return ""
	}
	list := v.GetListValue()
	if list == nil {
		return KeySubset + " must be a list of ip:port strings"
	}
	st.subset = make(map[string]bool, len(list.GetValues()))
	for _, e := range list.GetValues() {
		s, ok := e.GetKind().(*structpb.Value_StringValue)
		if !ok {
			return KeySubset + " must be a list of ip:port strings"
		}
		st.subset[s.StringValue] = true
	}
	return ""
}

// pick routes the request, whose body is complete, and answers the gateway with the
// endpoint; trailers says the body's end came with trailers, which follow on their own.
func (st *stream) pick(trailers bool) error {
	st.picked = true
	p := st.p
	ctx := st.srv.Context()
	start := time.Now()
	opts := openai.HoldOptions{Path: st.path, Disaggregate: true}
	if pr, ok := peer.FromContext(ctx); ok && pr.Addr != nil {
		// The gateway is the peer: behind one, name the client in a trusted key header.
		opts.Peer = pr.Addr.String()
	}
	if st.subset != nil {
		subset := st.subset
		opts.Subset = func(t routing.Target) bool {
			ep, err := p.endpoint(ctx, t)
			return err == nil && subset[ep]
		}
	}
	held, apiErr := p.front.Hold(ctx, st.headers, st.body, opts)
	if apiErr != nil {
		if apiErr.Code == "busy" {
			// Every candidate is busy and the queue is full or timed out: the protocol's
			// shedding answer.
			shed := *apiErr
			shed.Status, shed.Type = http.StatusTooManyRequests, openai.TypeRateLimit
			apiErr = &shed
		}
		return st.immediate(apiErr)
	}
	if held == nil {
		return ctx.Err()
	}
	st.held = held
	d := held.Decision
	// An alias is sent as its target (held.Body names it), with the body's new length.
	rewritten := !bytes.Equal(held.Body, st.body)
	if rewritten && st.passed > 0 {
		return st.immediate(&openai.Error{Status: http.StatusInternalServerError, Type: openai.TypeServer, Code: "body_mode",
			Message: "ext_proc: model " + strconv.Quote(d.Model) + " must replace the request's alias, but the gateway sent its body on in STREAMED mode; " +
				"configure the request body mode FULL_DUPLEX_STREAMED or BUFFERED"})
	}
	ep, err := p.endpoint(ctx, d.Target)
	if err != nil {
		return st.immediate(&openai.Error{Status: http.StatusInternalServerError, Type: openai.TypeServer, Code: "bad_endpoint", Message: err.Error()})
	}
	st.endpoint, st.pickedAt = ep, time.Now()
	mut := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setHeader(HeaderDestination, ep)}}
	if rewritten {
		// Envoy leaves the length of a body the processor changes to the processor.
		mut.SetHeaders = append(mut.SetHeaders, setHeader("content-length", strconv.Itoa(len(held.Body))))
	}
	if p.ranksShareAPort(d.Target) {
		mut.SetHeaders = append(mut.SetHeaders, setHeader(headerDPRank, strconv.FormatUint(uint64(d.Target.Worker.DPRank), 10)))
	} else {
		mut.RemoveHeaders = append(mut.RemoveHeaders, headerDPRank)
	}
	outcome := "picked"
	if held.Plan.Outcome == routing.OutcomeDisaggregated {
		pep, err := p.endpoint(ctx, held.Prefill.Target)
		if err != nil {
			return st.immediate(&openai.Error{Status: http.StatusInternalServerError, Type: openai.TypeServer, Code: "bad_endpoint", Message: err.Error()})
		}
		mut.SetHeaders = append(mut.SetHeaders, setHeader(HeaderPrefiller, pep))
		outcome = "disaggregated"
	} else {
		// A client's own prefill endpoint would make the decode sidecar prefill wherever it
		// names: only the picker names it.
		mut.RemoveHeaders = append(mut.RemoveHeaders, HeaderPrefiller)
	}
	common := &extprocv3.CommonResponse{HeaderMutation: mut, ClearRouteCache: true}
	meta := &structpb.Struct{Fields: map[string]*structpb.Value{
		NamespaceLB: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			HeaderDestination: structpb.NewStringValue(ep)}}),
	}}
	p.metrics.requests.WithLabelValues(outcome).Inc()
	p.metrics.pick.Observe(time.Since(start).Seconds())
	if !st.answered {
		// The headers' answer carries the endpoint; in FULL_DUPLEX_STREAMED mode the body
		// follows it back, whole.
		st.answered = true
		if err := st.send(&extprocv3.ProcessingResponse{DynamicMetadata: meta, Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: common}}}); err != nil {
			return err
		}
		if !st.sawBody && !trailers {
			// The request ended with its headers: no body to send on.
			return nil
		}
		return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
				Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{
					Body: held.Body, EndOfStream: !trailers}}}}}}})
	}
	// BUFFERED or STREAMED: the headers were answered already; the last body chunk's answer
	// carries the endpoint (and, for an alias, the body: the whole of it, since no chunk was
	// sent on before).
	if rewritten {
		common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: held.Body}}
	}
	return st.send(&extprocv3.ProcessingResponse{DynamicMetadata: meta, Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: common}}})
}

func setHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
}

// finish releases the held decision once: completed when the served endpoint answered 2xx
// and was the one picked (a gateway that sent the request elsewhere leaves nothing to
// record here).
func (st *stream) finish() {
	if st.responseIn {
		st.ended = true
	}
	if st.held == nil {
		return
	}
	held := st.held
	st.held = nil
	elsewhere := st.served != "" && !servedIncludes(st.served, st.endpoint)
	if elsewhere {
		st.p.metrics.servedElsewhere.Inc()
		st.p.log.Info("gateway served the request on another endpoint", "picked", st.endpoint, "served", st.served)
	}
	completed := st.status >= 200 && st.status < 300 && st.firstByte && !elsewhere
	held.End(completed, st.tally.Generated())
}

// servedIncludes reports whether the served value (one endpoint, or a list) names ep.
func servedIncludes(served, ep string) bool {
	for s := range strings.SplitSeq(served, ",") {
		if strings.TrimSpace(s) == ep {
			return true
		}
	}
	return false
}

// refuse answers a message the protocol does not allow where it came with a 400.
func (st *stream) refuse(msg string) error {
	return st.immediate(&openai.Error{Status: http.StatusBadRequest, Type: openai.TypeInvalidRequest,
		Code: "ext_proc_out_of_order", Message: "ext_proc: " + msg})
}

// immediate answers the client through the gateway with e, and ends the stream.
func (st *stream) immediate(e *openai.Error) error {
	if e.Status >= 500 {
		st.p.log.Warn("ext_proc request failed", "path", st.path, "status", e.Status, "error", e.Message)
	} else {
		st.p.log.Debug("ext_proc request refused", "path", st.path, "status", e.Status, "error", e.Message)
	}
	if err := st.answer(e); err != nil {
		return err
	}
	return errAnswered
}

// answer sends e as the immediate response the gateway answers the client with, counted.
func (st *stream) answer(e *openai.Error) error {
	st.p.metrics.requests.WithLabelValues(strconv.Itoa(e.Status)).Inc()
	hm := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setHeader("content-type", "application/json")}}
	if e.RetryAfter != "" {
		hm.SetHeaders = append(hm.SetHeaders, setHeader("retry-after", e.RetryAfter))
	}
	details := "kvrouter-ha"
	if e.Code != "" {
		details += ": " + e.Code
	}
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{Status: &typev3.HttpStatus{Code: typev3.StatusCode(e.Status)},
			Headers: hm, Body: e.Body(), Details: details}}})
}

func (st *stream) send(r *extprocv3.ProcessingResponse) error { return st.srv.Send(r) }

// statusOf is the :status of response headers, 0 when absent or bad.
func statusOf(hm *corev3.HeaderMap) int {
	for _, h := range hm.GetHeaders() {
		if h.GetKey() == ":status" {
			n, err := strconv.Atoi(headerValue(h))
			if err != nil {
				return 0
			}
			return n
		}
	}
	return 0
}

// servedOf is the endpoint the gateway says served the request, "" when it does not say.
func servedOf(md *corev3.Metadata) string {
	return md.GetFilterMetadata()[NamespaceLB].GetFields()[KeyServed].GetStringValue()
}
