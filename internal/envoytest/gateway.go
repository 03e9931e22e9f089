// Package envoytest is a gateway for tests of the endpoint picker: it speaks ext_proc to the
// picker as Envoy does in the Gateway API Inference Extension's configuration (request and
// response bodies FULL_DUPLEX_STREAMED, the subset hint and the served endpoint in metadata,
// messages in Envoy's order, over a real gRPC connection) and carries the bytes itself to the
// endpoint the picker names, over real HTTP.
package envoytest

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/structpb"
)

// Gateway is one gateway's connection to one picker.
type Gateway struct {
	conn   *grpc.ClientConn
	client extprocv3.ExternalProcessorClient
	health healthpb.HealthClient
	// HTTP carries the requests to the endpoints.
	HTTP *http.Client
}

// Dial connects to the picker at addr.
func Dial(addr string) (*Gateway, error) {
	return dial(addr, insecure.NewCredentials())
}

// DialTLS connects to the picker at addr over TLS with cfg (its certificates, the CA it
// trusts).
func DialTLS(addr string, cfg *tls.Config) (*Gateway, error) {
	return dial(addr, credentials.NewTLS(cfg))
}

func dial(addr string, creds credentials.TransportCredentials) (*Gateway, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, fmt.Errorf("envoytest: dial %s: %w", addr, err)
	}
	return &Gateway{conn: conn, client: extprocv3.NewExternalProcessorClient(conn), health: healthpb.NewHealthClient(conn),
		HTTP: &http.Client{}}, nil
}

// Close closes the connection.
func (g *Gateway) Close() error { return g.conn.Close() }

// Health is the picker's status for a health service ("" for the server's).
func (g *Gateway) Health(ctx context.Context, service string) (healthpb.HealthCheckResponse_ServingStatus, error) {
	r, err := g.health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		return 0, err
	}
	return r.GetStatus(), nil
}

// Request is one client request through the gateway.
type Request struct {
	Method, Path string
	Header       http.Header
	Body         []byte
	// ChunkSize splits the body into messages of this many bytes (0: one message).
	ChunkSize int
	// Subset, when not nil, is the subset hint (an empty, non-nil list is an empty hint).
	Subset []string
	// Served overrides the endpoint the gateway reports as having served ("": the picked).
	Served string
	// Upstream, when set, is where the gateway sends the request instead of the picked
	// endpoint (a gateway whose own fallback moved it).
	Upstream string
}

// Result is what the gateway did with a request.
type Result struct {
	// Endpoint and Metadata are the picked endpoint, from the header and from envoy.lb.
	Endpoint, Metadata string
	// Headers are the headers the picker set on the request, and Removed those it removed.
	Headers map[string]string
	Removed []string
	// Immediate is set when the picker answered the client itself.
	Immediate *extprocv3.ImmediateResponse
	// Status and Body are the client's answer (the worker's, or the immediate one).
	Status int
	Body   []byte
	// Sent is the body the picker sent on to the worker.
	Sent []byte
}

// Do runs req through the picker and, when it names an endpoint, through the endpoint.
func (g *Gateway) Do(ctx context.Context, req Request) (*Result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := g.client.Process(ctx)
	if err != nil {
		return nil, fmt.Errorf("envoytest: open stream: %w", err)
	}
	defer st.CloseSend()
	res := &Result{Headers: map[string]string{}}
	if err := g.sendRequest(st, req); err != nil {
		return nil, err
	}
	done, err := g.readPick(st, req, res)
	if err != nil || done {
		return res, err
	}
	return res, g.carry(ctx, st, req, res)
}

// Open starts req through the picker and returns once the picker has named its endpoint,
// leaving the response to the caller (Stream). It lets a test hold a request open.
func (g *Gateway) Open(ctx context.Context, req Request) (*Stream, *Result, error) {
	st, err := g.client.Process(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("envoytest: open stream: %w", err)
	}
	res := &Result{Headers: map[string]string{}}
	if err := g.sendRequest(st, req); err != nil {
		return nil, nil, err
	}
	done, err := g.readPick(st, req, res)
	if err != nil || done {
		return nil, res, err
	}
	return &Stream{st: st}, res, nil
}

// Stream is an open request whose response the caller sends.
type Stream struct {
	st extprocv3.ExternalProcessor_ProcessClient
}

// Send sends a message as it is, for tests of messages out of order, and reads the answer.
func (s *Stream) Send(m *extprocv3.ProcessingRequest) (*extprocv3.ProcessingResponse, error) {
	if err := s.st.Send(m); err != nil {
		return nil, err
	}
	return s.st.Recv()
}

// Respond sends response headers with status and the body in one chunk, and reads the
// answers.
func (s *Stream) Respond(status int, served string, body []byte) error {
	if _, err := s.Send(responseHeaders(status, served, false)); err != nil {
		return err
	}
	_, err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}})
	return err
}

// Recv reads the picker's next answer; the stream's end is an error (io.EOF, or the status
// the picker ended it with).
func (s *Stream) Recv() (*extprocv3.ProcessingResponse, error) { return s.st.Recv() }

// Close ends the stream from the gateway's side.
func (s *Stream) Close() error { return s.st.CloseSend() }

func (g *Gateway) sendRequest(st extprocv3.ExternalProcessor_ProcessClient, req Request) error {
	method := req.Method
	if method == "" {
		method = http.MethodPost
	}
	hm := &corev3.HeaderMap{}
	add := func(k, v string) {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
	}
	add(":method", method)
	add(":path", req.Path)
	add(":authority", "gateway.test")
	add(":scheme", "http")
	for k, vs := range req.Header {
		for _, v := range vs {
			add(k, v)
		}
	}
	if req.Body != nil && req.Header.Get("Content-Length") == "" {
		// A client's request with a body says its length, as an HTTP/1.1 client does.
		add("content-length", strconv.Itoa(len(req.Body)))
	}
	first := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: hm, EndOfStream: req.Body == nil}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
	}
	if req.Subset != nil {
		vals := make([]any, len(req.Subset))
		for i, s := range req.Subset {
			vals[i] = s
		}
		hint, err := structpb.NewStruct(map[string]any{"x-gateway-destination-endpoint-subset": vals})
		if err != nil {
			return err
		}
		first.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb.subset_hint": hint}}
	}
	if err := st.Send(first); err != nil {
		return fmt.Errorf("envoytest: send headers: %w", err)
	}
	if req.Body == nil {
		return nil
	}
	chunks := split(req.Body, req.ChunkSize)
	for i, c := range chunks {
		if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: c, EndOfStream: i == len(chunks)-1}}}); err != nil {
			return fmt.Errorf("envoytest: send body: %w", err)
		}
	}
	return nil
}

func split(b []byte, n int) [][]byte {
	if n <= 0 || len(b) <= n {
		return [][]byte{b}
	}
	var out [][]byte
	for len(b) > n {
		out = append(out, b[:n])
		b = b[n:]
	}
	return append(out, b)
}

// readPick reads the picker's answer to the request: the headers' answer and the body back,
// or an immediate response (done).
func (g *Gateway) readPick(st extprocv3.ExternalProcessor_ProcessClient, req Request, res *Result) (done bool, err error) {
	m, err := st.Recv()
	if err != nil {
		return true, fmt.Errorf("envoytest: read the headers' answer: %w", err)
	}
	if ir := m.GetImmediateResponse(); ir != nil {
		res.Immediate, res.Status, res.Body = ir, int(ir.GetStatus().GetCode()), ir.GetBody()
		return true, nil
	}
	hr := m.GetRequestHeaders()
	if hr == nil {
		return true, fmt.Errorf("envoytest: first answer is %T, want request headers", m.GetResponse())
	}
	for _, h := range hr.GetResponse().GetHeaderMutation().GetSetHeaders() {
		v := h.GetHeader().GetValue()
		if raw := h.GetHeader().GetRawValue(); len(raw) > 0 {
			v = string(raw)
		}
		res.Headers[h.GetHeader().GetKey()] = v
	}
	res.Removed = hr.GetResponse().GetHeaderMutation().GetRemoveHeaders()
	res.Endpoint = res.Headers["x-gateway-destination-endpoint"]
	res.Metadata = m.GetDynamicMetadata().GetFields()["envoy.lb"].GetStructValue().GetFields()["x-gateway-destination-endpoint"].GetStringValue()
	if req.Body == nil {
		return false, nil
	}
	for {
		m, err := st.Recv()
		if err != nil {
			return true, fmt.Errorf("envoytest: read the body back: %w", err)
		}
		if ir := m.GetImmediateResponse(); ir != nil {
			res.Immediate, res.Status, res.Body = ir, int(ir.GetStatus().GetCode()), ir.GetBody()
			return true, nil
		}
		sr := m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return true, fmt.Errorf("envoytest: body answer has no streamed body")
		}
		res.Sent = append(res.Sent, sr.GetBody()...)
		if sr.GetEndOfStream() {
			return false, nil
		}
	}
}

// carry sends the request to the endpoint and its response through the picker.
func (g *Gateway) carry(ctx context.Context, st extprocv3.ExternalProcessor_ProcessClient, req Request, res *Result) error {
	upstream := res.Endpoint
	if req.Upstream != "" {
		upstream = req.Upstream
	}
	if upstream == "" {
		return errors.New("envoytest: the picker named no endpoint")
	}
	method := req.Method
	if method == "" {
		method = http.MethodPost
	}
	var body io.Reader
	if req.Body != nil {
		body = bytes.NewReader(res.Sent)
		// Envoy refuses (500) a request whose content-length, as the picker left it, is
		// not the length of the body the picker sent on.
		length := strconv.Itoa(len(req.Body))
		if v, ok := res.Headers["content-length"]; ok {
			length = v
		}
		if slices.Contains(res.Removed, "content-length") {
			length = ""
		}
		if length != "" && length != strconv.Itoa(len(res.Sent)) {
			return fmt.Errorf("envoytest: content-length %s, but the picker sent on a body of %d bytes", length, len(res.Sent))
		}
	}
	hr, err := http.NewRequestWithContext(ctx, method, "http://"+upstream+req.Path, body)
	if err != nil {
		return err
	}
	for k, vs := range req.Header {
		for _, v := range vs {
			hr.Header.Add(k, v)
		}
	}
	for _, k := range res.Removed {
		hr.Header.Del(k)
	}
	for k, v := range res.Headers {
		hr.Header.Set(k, v)
	}
	resp, err := g.HTTP.Do(hr)
	if err != nil {
		return fmt.Errorf("envoytest: upstream %s: %w", upstream, err)
	}
	defer resp.Body.Close()
	served := upstream
	if req.Served != "" {
		served = req.Served
	}
	if err := st.Send(responseHeaders(resp.StatusCode, served, false)); err != nil {
		return err
	}
	if _, err := st.Recv(); err != nil {
		return fmt.Errorf("envoytest: read the response headers' answer: %w", err)
	}
	res.Status = resp.StatusCode
	buf := make([]byte, 32<<10)
	for {
		n, rerr := resp.Body.Read(buf)
		eos := rerr != nil
		if n > 0 || eos {
			if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
				ResponseBody: &extprocv3.HttpBody{Body: bytes.Clone(buf[:n]), EndOfStream: eos}}}); err != nil {
				return err
			}
			m, err := st.Recv()
			if err != nil {
				return fmt.Errorf("envoytest: read a response body answer: %w", err)
			}
			res.Body = append(res.Body, m.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody()...)
		}
		if eos {
			if !errors.Is(rerr, io.EOF) {
				return fmt.Errorf("envoytest: upstream body: %w", rerr)
			}
			return nil
		}
	}
}

// responseHeaders is the response-headers message, with the served endpoint in envoy.lb.
func responseHeaders(status int, served string, eos bool) *extprocv3.ProcessingRequest {
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: fmt.Appendf(nil, "%d", status)}}}
	m := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: hm, EndOfStream: eos}}}
	if served != "" {
		lb, _ := structpb.NewStruct(map[string]any{"x-gateway-destination-endpoint-served": served})
		m.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb": lb}}
	}
	return m
}

// Raw opens a stream on which a test sends messages of its choosing.
func (g *Gateway) Raw(ctx context.Context) (*Stream, error) {
	st, err := g.client.Process(ctx)
	if err != nil {
		return nil, fmt.Errorf("envoytest: open stream: %w", err)
	}
	return &Stream{st: st}, nil
}

// SendOnly sends a message without waiting for an answer (one the picker does not answer
// alone, such as request headers in FULL_DUPLEX_STREAMED mode).
func (s *Stream) SendOnly(m *extprocv3.ProcessingRequest) error { return s.st.Send(m) }

// RequestHeaders is a POST's request-headers message for path, first of its stream.
func RequestHeaders(path string, eos bool) *extprocv3.ProcessingRequest {
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(http.MethodPost)}, {Key: ":path", RawValue: []byte(path)}}}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: hm, EndOfStream: eos}}}
}
