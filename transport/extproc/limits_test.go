package extproc

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// liveStream is a stream whose gateway sends when the test says: Recv waits for the next
// message, for close (io.EOF), or for the stream's end (the handler returned).
type liveStream struct {
	grpc.ServerStream
	ctx  context.Context
	in   chan *extprocv3.ProcessingRequest
	mu   sync.Mutex
	out  []*extprocv3.ProcessingResponse
	done chan struct{}
	// inRecv counts the Recv calls under way, and overlapped is set when two overlap: the
	// picker must never receive on one stream from two goroutines at once.
	inRecv     atomic.Int32
	overlapped atomic.Bool
}

func newLiveStream() *liveStream {
	return &liveStream{ctx: context.Background(), in: make(chan *extprocv3.ProcessingRequest), done: make(chan struct{})}
}

func (s *liveStream) Context() context.Context { return s.ctx }
func (s *liveStream) Recv() (*extprocv3.ProcessingRequest, error) {
	if s.inRecv.Add(1) > 1 {
		s.overlapped.Store(true)
	}
	defer s.inRecv.Add(-1)
	select {
	case m, ok := <-s.in:
		if !ok {
			return nil, io.EOF
		}
		return m, nil
	case <-s.done:
		return nil, context.Canceled
	}
}
func (s *liveStream) Send(m *extprocv3.ProcessingResponse) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.out = append(s.out, m)
	return nil
}
func (s *liveStream) sent() []*extprocv3.ProcessingResponse {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*extprocv3.ProcessingResponse(nil), s.out...)
}

// serve runs p.Process on s in the background; the result arrives on the channel, and the
// stream's Recv ends as gRPC ends it once the handler returns.
func serve(p *Picker, s *liveStream) <-chan error {
	res := make(chan error, 1)
	go func() {
		err := p.Process(s)
		close(s.done)
		res <- err
	}()
	return res
}

func respHeadersMsg(code int) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(code))}}}}}}
}

func respBodyMsg(b string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
		Body: []byte(b), EndOfStream: eos}}}
}

func wait(t *testing.T, res <-chan error, within time.Duration) error {
	t.Helper()
	select {
	case err := <-res:
		return err
	case <-time.After(within):
		t.Fatalf("the stream did not end within %s", within)
		return nil
	}
}

// TestStreamsOwingAMessageEndAfterTheIdleTimeout: a stream that sends nothing, headers
// without their body, or nothing after its response ended is ended DEADLINE_EXCEEDED (with
// a 408 for the client while the request was incomplete); one waiting for the upstream's
// answer, however long, is not idle.
func TestStreamsOwingAMessageEndAfterTheIdleTimeout(t *testing.T) {
	const idle = 50 * time.Millisecond
	mode := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	for _, tc := range []struct {
		name    string
		send    []*extprocv3.ProcessingRequest
		want408 bool
	}{
		{"nothing at all", nil, true},
		{"headers without a body", []*extprocv3.ProcessingRequest{headersMsg("/v1/completions", false, mode)}, true},
		{"half a body", []*extprocv3.ProcessingRequest{headersMsg("/v1/completions", false, mode), bodyMsg(`{"model":"m",`, false)}, true},
		{"a response that ended, and no close", []*extprocv3.ProcessingRequest{headersMsg("/v1/completions", false, mode),
			bodyMsg(`{"model":"m","prompt":"hi"}`, true), respHeadersMsg(200), respBodyMsg("done", true)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newTestPicker(t, Config{IdleTimeout: idle}, &fakeFront{spec: routing.WorkerSpec{ID: "w", URL: "http://10.1.2.3:8000", DPSize: 2}})
			s := newLiveStream()
			res := serve(p, s)
			for _, m := range tc.send {
				s.in <- m
			}
			err := wait(t, res, 10*time.Second)
			if status.Code(err) != codes.DeadlineExceeded {
				t.Fatalf("stream ended with %v, want DEADLINE_EXCEEDED", err)
			}
			if s.overlapped.Load() {
				t.Fatal("two Recv calls on the stream at once")
			}
			out := s.sent()
			last := out[len(out)-1].GetImmediateResponse()
			if got := last.GetStatus().GetCode(); tc.want408 != (int(got) == http.StatusRequestTimeout) {
				t.Fatalf("last answer %v, want a 408: %v", out[len(out)-1], tc.want408)
			}
		})
	}

	t.Run("waiting for the upstream", func(t *testing.T) {
		p := newTestPicker(t, Config{IdleTimeout: idle}, &fakeFront{spec: routing.WorkerSpec{ID: "w", URL: "http://10.1.2.3:8000", DPSize: 2}})
		s := newLiveStream()
		res := serve(p, s)
		s.in <- headersMsg("/v1/completions", false, mode)
		s.in <- bodyMsg(`{"model":"m","prompt":"hi"}`, true)
		// Twenty idle timeouts with the upstream's answer pending: the stream stays.
		select {
		case err := <-res:
			t.Fatalf("a stream waiting for its upstream ended: %v", err)
		case <-time.After(20 * idle):
		}
		s.in <- respHeadersMsg(200)
		s.in <- respBodyMsg("tokens", true)
		close(s.in)
		if err := wait(t, res, 10*time.Second); err != nil {
			t.Fatalf("stream ended with %v", err)
		}
		if s.overlapped.Load() {
			t.Fatal("two Recv calls on the stream at once")
		}
	})
}

// TestStreamsPastTheCapAreRefusedAtOnce: with MaxStreams open, the next stream is answered
// 503 and ended RESOURCE_EXHAUSTED without a message read; once one ends, a new one is taken.
func TestStreamsPastTheCapAreRefusedAtOnce(t *testing.T) {
	p := newTestPicker(t, Config{MaxStreams: 2, IdleTimeout: -1}, &fakeFront{})
	var open []*liveStream
	var results []<-chan error
	for range 2 {
		s := newLiveStream()
		open = append(open, s)
		results = append(results, serve(p, s))
	}
	poll.Holds(t, 10*time.Second, "two streams counted open", func() bool { return p.open.Load() == 2 })
	extra := newLiveStream()
	err := wait(t, serve(p, extra), 10*time.Second)
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("third stream: %v, want RESOURCE_EXHAUSTED", err)
	}
	if out := extra.sent(); len(out) != 1 || out[0].GetImmediateResponse().GetStatus().GetCode() != http.StatusServiceUnavailable {
		t.Fatalf("third stream's answers %v, want one immediate 503", out)
	}
	close(open[0].in)
	if err := wait(t, results[0], 10*time.Second); err != nil {
		t.Fatal(err)
	}
	again := newLiveStream()
	res := serve(p, again)
	close(again.in)
	if err := wait(t, res, 10*time.Second); err != nil {
		t.Fatalf("a stream after one ended: %v", err)
	}
	close(open[1].in)
	if err := wait(t, results[1], 10*time.Second); err != nil || p.open.Load() != 0 {
		t.Fatalf("last stream: %v, %d counted open", err, p.open.Load())
	}
}

// watchStream is a health Watch's stream, open until its context ends.
type watchStream struct {
	grpc.ServerStream
	ctx  context.Context
	sent chan *healthpb.HealthCheckResponse
}

func (w *watchStream) Context() context.Context { return w.ctx }
func (w *watchStream) Send(r *healthpb.HealthCheckResponse) error {
	select {
	case w.sent <- r:
	default:
	}
	return nil
}

// TestHealthWatchesCountAgainstTheCap: a Watch holds its stream as long as the caller likes,
// so it counts against MaxStreams with the ext_proc streams: past the cap a Watch is refused
// RESOURCE_EXHAUSTED, and an open Watch leaves no room for an ext_proc stream.
func TestHealthWatchesCountAgainstTheCap(t *testing.T) {
	p := newTestPicker(t, Config{MaxStreams: 1, IdleTimeout: -1}, &fakeFront{})
	h := &health{p: p}
	ctx, cancel := context.WithCancel(t.Context())
	w := &watchStream{ctx: ctx, sent: make(chan *healthpb.HealthCheckResponse, 1)}
	watched := make(chan error, 1)
	go func() { watched <- h.Watch(&healthpb.HealthCheckRequest{Service: serviceLiveness}, w) }()
	<-w.sent // the Watch is open and counted
	if err := wait(t, serve(p, newLiveStream()), 10*time.Second); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("ext_proc stream beside a Watch at the cap: %v, want RESOURCE_EXHAUSTED", err)
	}
	second := &watchStream{ctx: t.Context(), sent: make(chan *healthpb.HealthCheckResponse, 1)}
	if err := h.Watch(&healthpb.HealthCheckRequest{Service: serviceLiveness}, second); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("second Watch at the cap: %v, want RESOURCE_EXHAUSTED", err)
	}
	cancel()
	if err := wait(t, watched, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if n := p.open.Load(); n != 0 {
		t.Fatalf("%d streams counted after the Watch ended", n)
	}
}
