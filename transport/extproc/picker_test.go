package extproc

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// fakeFront holds every request on one worker, or refuses it with err; with sendAs, the
// held body is sendAs (an alias's request sent as its target).
type fakeFront struct {
	spec   routing.WorkerSpec
	err    *openai.Error
	sendAs []byte
	holds  int
	last   []byte
}

func (f *fakeFront) Hold(_ context.Context, _ http.Header, body []byte, opts openai.HoldOptions) (*openai.Held, *openai.Error) {
	if f.err != nil {
		return nil, f.err
	}
	f.holds++
	f.last = body
	t := routing.Target{Worker: indexer.Worker{ID: f.spec.ID, DPRank: 1}, Spec: &f.spec}
	if opts.Subset != nil && !opts.Subset(t) {
		return nil, &openai.Error{Status: http.StatusServiceUnavailable, Message: "none", Type: openai.TypeUnavailable}
	}
	sent := body
	if f.sendAs != nil {
		sent = f.sendAs
	}
	return &openai.Held{Decision: routing.Decision{Target: t}, Body: sent}, nil
}
func (f *fakeFront) MaxBodyBytes() int64 { return 1 << 10 }
func (f *fakeFront) Readiness() error    { return nil }

// fakeStream replays messages to the picker and keeps its answers.
type fakeStream struct {
	grpc.ServerStream
	in  []*extprocv3.ProcessingRequest
	out []*extprocv3.ProcessingResponse
}

func (s *fakeStream) Context() context.Context { return context.Background() }
func (s *fakeStream) Recv() (*extprocv3.ProcessingRequest, error) {
	if len(s.in) == 0 {
		return nil, io.EOF
	}
	m := s.in[0]
	s.in = s.in[1:]
	return m, nil
}
func (s *fakeStream) Send(m *extprocv3.ProcessingResponse) error {
	s.out = append(s.out, m)
	return nil
}

func newTestPicker(t testing.TB, cfg Config, front Front) *Picker {
	t.Helper()
	p, err := New(cfg, front)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func headersMsg(path string, eos bool, mode filterv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
	m := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":path", RawValue: []byte(path)}}}, EndOfStream: eos}}}
	m.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode}
	return m
}

func bodyMsg(b string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(b), EndOfStream: eos}}}
}

func destinationOf(r *extprocv3.ProcessingResponse) string {
	v, _ := headerSet(r, HeaderDestination)
	return v
}

// TestBodyModesAnswerAsEnvoyExpects: in FULL_DUPLEX_STREAMED mode the headers' answer waits
// for the body and names the endpoint, the body following it back; in BUFFERED and STREAMED
// modes the headers are answered at once and the last body chunk's answer names it. Target
// ports map a rank to its port; without them the rank goes in a header.
func TestBodyModesAnswerAsEnvoyExpects(t *testing.T) {
	spec := routing.WorkerSpec{ID: "w", URL: "http://10.1.2.3:8000", DPSize: 2}
	tests := []struct {
		name     string
		mode     filterv3.ProcessingMode_BodySendMode
		ports    []int
		wantKind []string
		wantAt   int // which answer names the endpoint
		want     string
	}{
		{"full duplex", filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, nil, []string{"headers", "body"}, 0, "10.1.2.3:8000"},
		{"full duplex, target ports", filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, []int{8000, 8001}, []string{"headers", "body"}, 0, "10.1.2.3:8001"},
		{"buffered", filterv3.ProcessingMode_BUFFERED, nil, []string{"headers", "body", "body"}, 2, "10.1.2.3:8000"},
		{"streamed", filterv3.ProcessingMode_STREAMED, nil, []string{"headers", "body", "body"}, 2, "10.1.2.3:8000"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			front := &fakeFront{spec: spec}
			p := newTestPicker(t, Config{TargetPorts: tt.ports}, front)
			fs := &fakeStream{in: []*extprocv3.ProcessingRequest{headersMsg("/v1/completions", false, tt.mode), bodyMsg(`{"a":`, false), bodyMsg(`1}`, true)}}
			if err := p.Process(fs); err != nil {
				t.Fatal(err)
			}
			if len(fs.out) != len(tt.wantKind) {
				t.Fatalf("%d answers, want %v: %v", len(fs.out), tt.wantKind, fs.out)
			}
			for i, k := range tt.wantKind {
				_, isHeaders := fs.out[i].GetResponse().(*extprocv3.ProcessingResponse_RequestHeaders)
				_, isBody := fs.out[i].GetResponse().(*extprocv3.ProcessingResponse_RequestBody)
				if (k == "headers" && !isHeaders) || (k == "body" && !isBody) {
					t.Fatalf("answer %d is %T, want %s", i, fs.out[i].GetResponse(), k)
				}
			}
			if got := destinationOf(fs.out[tt.wantAt]); got != tt.want {
				t.Fatalf("answer %d names %q, want %q", tt.wantAt, got, tt.want)
			}
			if string(front.last) != `{"a":1}` {
				t.Fatalf("front got body %q", front.last)
			}
			if tt.mode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
				sr := fs.out[1].GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
				if string(sr.GetBody()) != `{"a":1}` || !sr.GetEndOfStream() {
					t.Fatalf("body sent back %q (end %v)", sr.GetBody(), sr.GetEndOfStream())
				}
			}
		})
	}
}

// headerSet is the value r's header mutation sets for key, and whether it sets one.
func headerSet(r *extprocv3.ProcessingResponse, key string) (string, bool) {
	var common *extprocv3.CommonResponse
	switch m := r.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		common = m.RequestHeaders.GetResponse()
	case *extprocv3.ProcessingResponse_RequestBody:
		common = m.RequestBody.GetResponse()
	}
	for _, h := range common.GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == key {
			return string(h.GetHeader().GetRawValue()), true
		}
	}
	return "", false
}

// TestAnAliasIsSentAsItsTarget: when the front sends a request as another body (an alias's
// model replaced by its target), the worker gets that body, with its content-length: in
// FULL_DUPLEX_STREAMED mode the body sent back is the new one and the headers' answer sets
// the length; in BUFFERED mode the body's answer replaces it; in STREAMED mode, where the
// first chunks went on unchanged, the request is refused rather than sent as the alias. A
// body the front leaves alone keeps its length.
func TestAnAliasIsSentAsItsTarget(t *testing.T) {
	spec := routing.WorkerSpec{ID: "w", URL: "http://10.1.2.3:8000"}
	const asked, target = `{"model":"llama","prompt":"x"}`, `{"model":"llama-v3","prompt":"x"}`
	full, buffered, streamed := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_STREAMED
	tests := []struct {
		name   string
		mode   filterv3.ProcessingMode_BodySendMode
		chunks []string
		sendAs string // "": the body as it came
		want   string // the body the worker gets; "": refused
		length string // the content-length set; "": none
	}{
		{"full duplex", full, []string{asked[:10], asked[10:]}, target, target, "33"},
		{"full duplex, no alias", full, []string{asked[:10], asked[10:]}, "", asked, ""},
		{"buffered", buffered, []string{asked}, target, target, "33"},
		{"buffered, no alias", buffered, []string{asked}, "", "", ""},
		{"streamed, one chunk", streamed, []string{asked}, target, target, "33"},
		{"streamed, chunks sent on", streamed, []string{asked[:10], asked[10:]}, target, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			front := &fakeFront{spec: spec}
			if tt.sendAs != "" {
				front.sendAs = []byte(tt.sendAs)
			}
			p := newTestPicker(t, Config{}, front)
			in := []*extprocv3.ProcessingRequest{headersMsg("/v1/completions", false, tt.mode)}
			for i, c := range tt.chunks {
				in = append(in, bodyMsg(c, i == len(tt.chunks)-1))
			}
			fs := &fakeStream{in: in}
			if err := p.Process(fs); err != nil {
				t.Fatal(err)
			}
			last := fs.out[len(fs.out)-1]
			if tt.want == "" && tt.sendAs != "" {
				ir := last.GetImmediateResponse()
				if ir == nil || ir.GetStatus().GetCode() != http.StatusInternalServerError || !strings.Contains(string(ir.GetBody()), "FULL_DUPLEX_STREAMED") {
					t.Fatalf("last answer %v, want a 500 naming the body modes", last)
				}
				return
			}
			named := fs.out[0]
			var got []byte
			switch tt.mode {
			case full:
				got = last.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody()
			default:
				named = last
				got = last.GetRequestBody().GetResponse().GetBodyMutation().GetBody()
			}
			if string(got) != tt.want {
				t.Fatalf("the worker gets %q, want %q", got, tt.want)
			}
			if l, ok := headerSet(named, "content-length"); l != tt.length || ok != (tt.length != "") {
				t.Fatalf("content-length set to %q (%v), want %q", l, ok, tt.length)
			}
		})
	}
}

// FuzzProcessStream: any sequence of messages the gateway sends (decoded from arbitrary
// bytes as protobuf) is answered or refused without a panic, and ends the stream.
func FuzzProcessStream(f *testing.F) {
	seed := func(ms ...*extprocv3.ProcessingRequest) []byte {
		var out []byte
		for _, m := range ms {
			b, err := proto.Marshal(m)
			if err != nil {
				f.Fatal(err)
			}
			out = append(out, byte(len(b)>>8), byte(len(b)))
			out = append(out, b...)
		}
		return out
	}
	full := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	f.Add(seed(headersMsg("/v1/completions", false, full), bodyMsg(`{"model":"m","prompt":"x"}`, true)))
	f.Add(seed(headersMsg("/v1/models", true, full)))
	f.Add(seed(bodyMsg("x", true), headersMsg("/", false, filterv3.ProcessingMode_BUFFERED)))
	f.Add(seed(headersMsg("/v1/chat/completions", false, filterv3.ProcessingMode_STREAMED), bodyMsg("{", false), bodyMsg("}", true),
		&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{}}},
		&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte("data: x"), EndOfStream: true}}}))
	spec := routing.WorkerSpec{ID: "w", URL: "http://127.0.0.1:9"}
	f.Fuzz(func(t *testing.T, data []byte) {
		var in []*extprocv3.ProcessingRequest
		for len(data) >= 2 {
			n := int(data[0])<<8 | int(data[1])
			data = data[2:]
			n = min(n, len(data))
			m := &extprocv3.ProcessingRequest{}
			if proto.Unmarshal(data[:n], m) == nil {
				in = append(in, m)
			}
			data = data[n:]
		}
		for _, front := range []*fakeFront{{spec: spec}, {spec: spec, err: &openai.Error{Status: 503, Type: openai.TypeUnavailable, Code: "busy"}}} {
			p := newTestPicker(t, Config{TargetPorts: []int{9}}, front)
			fs := &fakeStream{in: in}
			if err := p.Process(fs); err != nil {
				t.Fatalf("Process: %v", err)
			}
		}
	})
}
