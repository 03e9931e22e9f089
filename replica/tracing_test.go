package replica

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"

	"github.com/kvrouter-ha/kvrouter-ha/internal/telemetry"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// otlpReceiver is an OTLP trace collector on loopback: it keeps every span exported to it.
type otlpReceiver struct {
	coltracepb.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []*tracepb.Span
}

func (o *otlpReceiver) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, ss := range rs.GetScopeSpans() {
			o.spans = append(o.spans, ss.GetSpans()...)
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func startOTLPReceiver(t *testing.T) (*otlpReceiver, string) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &otlpReceiver{}
	s := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(s, o)
	go s.Serve(ln)
	t.Cleanup(s.Stop)
	return o, ln.Addr().String()
}

// flakyWorkers are two workers of which the very first request fails with a 500 (whichever
// gets it) and every other streams an answer; each request's traceparent is kept.
type flakyWorkers struct {
	served      atomic.Int64
	mu          sync.Mutex
	traceparent []string // of each completion request, in order
	fleet       testFleet
}

func startFlakyWorkers(t *testing.T) *flakyWorkers {
	fw := &flakyWorkers{}
	for i := range 2 {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost || !strings.HasPrefix(r.URL.Path, "/v1/") {
				return // health probes, and the model learner's GET /v1/models
			}
			_, _ = io.Copy(io.Discard, r.Body)
			fw.mu.Lock()
			fw.traceparent = append(fw.traceparent, r.Header.Get("Traceparent"))
			fw.mu.Unlock()
			if fw.served.Add(1) == 1 {
				http.Error(w, `{"error":{"message":"first request fails"}}`, http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", "text/event-stream")
			for _, tok := range []string{"a", "b", "c"} {
				fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":%q}}]}\n\n", tok)
				http.NewResponseController(w).Flush()
			}
			fmt.Fprint(w, "data: [DONE]\n\n")
		}))
		t.Cleanup(srv.Close)
		fw.fleet = append(fw.fleet, &testWorker{spec: routing.WorkerSpec{ID: fmt.Sprintf("w%d", i), URL: srv.URL}})
	}
	return fw
}

// TestTraceOfAForwardedRetriedStreamedRequestReadsAsAStory: a streamed chat request with a
// new session, sent to a follower with the client's traceparent, whose first dispatch fails
// (a 500) and whose second streams, exports over OTLP (a real exporter, configured by the
// OTEL_* variables, to an in-process receiver) one tree: the request's span under the
// client's, with the selection, two dispatch attempts (the first failed, naming its cause),
// in each the forward of its session's Bind to the leader (proposed as the dispatch starts,
// beside the worker's prefill: the first binds the failed worker, the second replaces that
// binding), and the bind (the wait for the commit before the first byte) inside the second;
// and each worker request carries the traceparent of its own dispatch span.
func TestTraceOfAForwardedRetriedStreamedRequestReadsAsAStory(t *testing.T) {
	recv, addr := startOTLPReceiver(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+addr)
	t.Setenv("OTEL_TRACES_EXPORTER", "")
	tracing, err := telemetry.FromEnv(t.Context(), "traced")
	if err != nil || !tracing.Enabled() {
		t.Fatalf("tracing from the environment: %v (enabled %v)", err, tracing != nil && tracing.Enabled())
	}
	fw := startFlakyWorkers(t)
	gc := startGossipCluster(t, fw.fleet, 3, func(_ int, c *Config) { c.Proxy.Tracer = tracing.Provider })
	var follower *Replica
	eventually(t, "a leader and a follower", func() (bool, string) {
		leaders := 0
		for i := range 3 {
			if gc.rep(i).node.IsLeader() {
				leaders++
			} else {
				follower = gc.rep(i)
			}
		}
		return leaders == 1 && follower != nil, fmt.Sprintf("%d leaders", leaders)
	})

	const clientTrace, clientSpan = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"tell me a story"}]}`
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+follower.Addr()+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", "traced-session")
	req.Header.Set("Traceparent", "00-"+clientTrace+"-"+clientSpan+"-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	events := 0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "data:") {
			events++
		}
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || events != 4 {
		t.Fatalf("status %d, %d events: want a streamed answer after one retry", resp.StatusCode, events)
	}
	waitRouterIdle(t, follower)
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tracing.Shutdown(sctx); err != nil {
		t.Fatal(err)
	}

	recv.mu.Lock()
	spans := recv.spans
	recv.mu.Unlock()
	hexID := func(b []byte) string { return fmt.Sprintf("%x", b) }
	byName := map[string][]*tracepb.Span{}
	for _, s := range spans {
		if hexID(s.GetTraceId()) != clientTrace {
			t.Fatalf("span %q in trace %x, want the client's %s", s.GetName(), s.GetTraceId(), clientTrace)
		}
		byName[s.GetName()] = append(byName[s.GetName()], s)
	}
	one := func(name string) *tracepb.Span {
		t.Helper()
		if len(byName[name]) != 1 {
			t.Fatalf("%d spans named %q, want 1 (spans: %v)", len(byName[name]), name, names(spans))
		}
		return byName[name][0]
	}
	root := one("POST /v1/chat/completions")
	if hexID(root.GetParentSpanId()) != clientSpan || root.GetKind() != tracepb.Span_SPAN_KIND_SERVER {
		t.Fatalf("request span's parent %x kind %v, want the client's span %s, server", root.GetParentSpanId(), root.GetKind(), clientSpan)
	}
	childOf := func(s, parent *tracepb.Span) {
		t.Helper()
		if string(s.GetParentSpanId()) != string(parent.GetSpanId()) {
			t.Fatalf("span %q's parent is %x, want %q (%x)", s.GetName(), s.GetParentSpanId(), parent.GetName(), parent.GetSpanId())
		}
	}
	sel := one("select")
	childOf(sel, root)
	dispatches := byName["dispatch"]
	if len(dispatches) != 2 {
		t.Fatalf("%d dispatch spans, want 2 (one failed, one retried): %v", len(dispatches), names(spans))
	}
	if attr(dispatches[0], "kvrouter.attempt") == "2" {
		dispatches[0], dispatches[1] = dispatches[1], dispatches[0]
	}
	first, second := dispatches[0], dispatches[1]
	childOf(first, root)
	childOf(second, root)
	if first.GetStatus().GetCode() != tracepb.Status_STATUS_CODE_ERROR || attr(first, "kvrouter.failure.cause") != "upstream_status" {
		t.Fatalf("first dispatch: status %v cause %q, want an error naming upstream_status", first.GetStatus(), attr(first, "kvrouter.failure.cause"))
	}
	if attr(first, "kvrouter.worker") == attr(second, "kvrouter.worker") || attr(second, "http.response.status_code") != "200" {
		t.Fatalf("dispatches to %q then %q (status %q): want the retry on the other worker, 200",
			attr(first, "kvrouter.worker"), attr(second, "kvrouter.worker"), attr(second, "http.response.status_code"))
	}
	bind := one("bind")
	childOf(bind, second)
	if attr(bind, "kvrouter.binding.revision") == "0" {
		t.Fatal("bind span has no revision")
	}
	forwards := byName["forward to the leader"]
	if len(forwards) != 2 {
		t.Fatalf("%d spans named \"forward to the leader\", want one in each dispatch: %v", len(forwards), names(spans))
	}
	if string(forwards[0].GetParentSpanId()) == string(first.GetSpanId()) {
		forwards[0], forwards[1] = forwards[1], forwards[0]
	}
	childOf(forwards[0], second)
	childOf(forwards[1], first)
	if attr(root, "http.response.status_code") != "200" {
		t.Fatalf("request span status %q", attr(root, "http.response.status_code"))
	}
	fw.mu.Lock()
	tps := fw.traceparent
	fw.mu.Unlock()
	if len(tps) != 2 {
		t.Fatalf("workers saw %d requests, want 2", len(tps))
	}
	for i, d := range []*tracepb.Span{first, second} {
		if want := "00-" + clientTrace + "-" + hexID(d.GetSpanId()) + "-01"; tps[i] != want {
			t.Fatalf("worker request %d: traceparent %q, want its dispatch's %q", i, tps[i], want)
		}
	}
}

func names(spans []*tracepb.Span) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.GetName())
	}
	return out
}

// attr is a span attribute's value as text, "" when absent.
func attr(s *tracepb.Span, key string) string {
	for _, kv := range s.GetAttributes() {
		if kv.GetKey() != key {
			continue
		}
		switch v := kv.GetValue(); {
		case v.GetStringValue() != "":
			return v.GetStringValue()
		default:
			return fmt.Sprint(v.GetIntValue())
		}
	}
	return ""
}
