package replica

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrouter-ha/kvrouter-ha/internal/envoytest"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// startPicker starts a replica over fleet with its endpoint picker on loopback, and a
// gateway connected to it.
func startPicker(t *testing.T, fleet testFleet, tune func(*Config)) (*Replica, *envoytest.Gateway) {
	t.Helper()
	rep := startTestReplica(t, fleet, func(c *Config) {
		c.ExtProcListen = "127.0.0.1:0"
		if tune != nil {
			tune(c)
		}
	})
	gw := dialPicker(t, rep)
	return rep, gw
}

func dialPicker(t *testing.T, rep *Replica) *envoytest.Gateway {
	t.Helper()
	gw, err := envoytest.Dial(rep.ExtProcAddr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gw.Close() })
	return gw
}

// endpointOf is the picker's name of a worker of fleet: its URL's host:port.
func endpointOf(w *testWorker) string { return strings.TrimPrefix(w.spec.URL, "http://") }

// workerAt is the worker of fleet at endpoint ep, nil for none.
func workerAt(fleet testFleet, ep string) *testWorker {
	for _, w := range fleet {
		if endpointOf(w) == ep {
			return w
		}
	}
	return nil
}

// cachedOf is a worker's answer's usage.prompt_tokens_details.cached_tokens.
func cachedOf(t *testing.T, body []byte) int {
	t.Helper()
	return answer{status: http.StatusOK, body: body}.cachedTokens(t)
}

// TestPickerRoutesChunkedBodiesKVAware: a body split in small chunks is parsed whole and
// sent on unchanged; the endpoint is named in the header and in envoy.lb alike; a prompt
// sharing a long prefix with an earlier one goes where that prefix is cached (the worker's
// own cached_tokens says so); and every decision is released when its stream ends.
func TestPickerRoutesChunkedBodiesKVAware(t *testing.T) {
	fleet := startWorkers(t, 4, simConfig(0))
	rep, gw := startPicker(t, fleet, nil)
	ctx := t.Context()
	prefix := promptTokens(7, 512)
	first := completionBody(concat(prefix, promptTokens(8, 32)), 4, false)
	r1, err := gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: first, ChunkSize: 7, Header: hdr("content-type", "application/json")})
	if err != nil {
		t.Fatal(err)
	}
	if r1.Status != http.StatusOK || r1.Immediate != nil {
		t.Fatalf("status %d, immediate %v: %s", r1.Status, r1.Immediate, r1.Body)
	}
	if r1.Endpoint == "" || r1.Endpoint != r1.Metadata || workerAt(fleet, r1.Endpoint) == nil {
		t.Fatalf("header endpoint %q, metadata %q: want one worker's endpoint in both", r1.Endpoint, r1.Metadata)
	}
	if !bytes.Equal(r1.Sent, first) {
		t.Fatalf("the picker sent on %d bytes, not the client's %d", len(r1.Sent), len(first))
	}
	waitRouterIdle(t, rep)
	// Streamed this time, with a different tail: the shared 512 tokens are cached where the
	// first went.
	second := completionBody(concat(prefix, promptTokens(9, 32)), 4, false)
	r2, err := gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: second, ChunkSize: 100})
	if err != nil {
		t.Fatal(err)
	}
	if r2.Endpoint != r1.Endpoint {
		t.Fatalf("the prompt sharing 512 tokens went to %s, the first to %s", r2.Endpoint, r1.Endpoint)
	}
	if got := cachedOf(t, r2.Body); got < 512 {
		t.Fatalf("worker found %d tokens cached, want the shared 512", got)
	}
	streamed := completionBody(promptTokens(10, 64), 8, true)
	r3, err := gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: streamed})
	if err != nil {
		t.Fatal(err)
	}
	if r3.Status != http.StatusOK || !bytes.Contains(r3.Body, []byte("data: [DONE]")) {
		t.Fatalf("stream through the picker: status %d, body %q", r3.Status, r3.Body)
	}
	waitRouterIdle(t, rep)
}

// TestPickerSessionAndSubset: a session keeps its endpoint; a subset hint narrows the choice
// (a session bound outside it moves inside it); an empty hint, or one naming no worker, is
// 503 as the protocol says.
func TestPickerSessionAndSubset(t *testing.T) {
	fleet := startWorkers(t, 4, simConfig(0))
	_, gw := startPicker(t, fleet, nil)
	ctx := t.Context()
	h := hdr("x-session-id", "conv-1")
	body := func(seed uint64) []byte { return completionBody(promptTokens(seed, 64), 2, false) }
	r, err := gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: body(1), Header: h})
	if err != nil || r.Status != http.StatusOK {
		t.Fatalf("first turn: %v %+v", err, r)
	}
	bound := r.Endpoint
	for i := range 5 {
		r, err := gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: body(uint64(100 + i)), Header: h})
		if err != nil || r.Endpoint != bound {
			t.Fatalf("turn %d: %v, endpoint %s, want the bound %s", i, err, r.Endpoint, bound)
		}
	}
	var others []string
	for _, w := range fleet {
		if endpointOf(w) != bound {
			others = append(others, endpointOf(w))
		}
	}
	subset := others[:2]
	r, err = gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: body(2), Header: h, Subset: subset})
	if err != nil || !slices.Contains(subset, r.Endpoint) {
		t.Fatalf("with the subset %v: %v, endpoint %s", subset, err, r.Endpoint)
	}
	rebound := r.Endpoint
	r, err = gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: body(3), Header: h})
	if err != nil || r.Endpoint != rebound {
		t.Fatalf("after the move: %v, endpoint %s, want %s", err, r.Endpoint, rebound)
	}
	for _, sub := range [][]string{{}, {"10.9.9.9:1"}} {
		r, err := gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: body(4), Subset: sub})
		if err != nil || r.Immediate == nil || r.Status != http.StatusServiceUnavailable {
			t.Fatalf("subset %v: %v, status %d, want an immediate 503", sub, err, r.Status)
		}
	}
}

// TestPickerDisaggregatesAsLLMD: a long uncached prompt over prefill and decode workers goes
// to a decode endpoint with the prefill endpoint in x-prefiller-host-port (llm-d's decode
// sidecar runs the legs); a client's own x-prefiller-host-port is removed otherwise.
func TestPickerDisaggregatesAsLLMD(t *testing.T) {
	fleet := pdFleet(t)
	rep, gw := startPicker(t, fleet, nil)
	ctx := t.Context()
	r, err := gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: completionBody(promptTokens(1, 2048), 4, false)})
	if err != nil || r.Status != http.StatusOK {
		t.Fatalf("%v %+v", err, r)
	}
	dec, pre := workerAt(fleet, r.Endpoint), workerAt(fleet, r.Headers["x-prefiller-host-port"])
	if dec == nil || pre == nil || dec.spec.Role != routing.RoleDecode || pre.spec.Role != routing.RolePrefill {
		t.Fatalf("destination %s, prefiller %q: want a decode and a prefill worker", r.Endpoint, r.Headers["x-prefiller-host-port"])
	}
	waitRouterIdle(t, rep)
	// A short prompt is served aggregated: the client's prefiller header does not pass.
	r, err = gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: completionBody(promptTokens(2, 32), 2, false),
		Header: hdr("x-prefiller-host-port", "169.254.169.254:80")})
	if err != nil || r.Status != http.StatusOK {
		t.Fatalf("%v %+v", err, r)
	}
	if _, set := r.Headers["x-prefiller-host-port"]; set || !slices.Contains(r.Removed, "x-prefiller-host-port") {
		t.Fatalf("aggregated request: prefiller set %v, removed %v; want it removed", r.Headers, r.Removed)
	}
	waitRouterIdle(t, rep)
}

// TestPickerAnswers503And429: no routable worker is an immediate 503; every worker busy with
// no room to queue is shedding, an immediate 429; both in the OpenAI error shape.
func TestPickerAnswers503And429(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(2*time.Second))
	rep, gw := startPicker(t, fleet, func(c *Config) {
		c.Router.BusyPrefillTokens = 1
		c.Router.QueueSize = 1
		c.Router.QueueWait = 50 * time.Millisecond
	})
	ctx := t.Context()
	// Hold a request open on each worker: both are busy.
	var open []*envoytest.Stream
	for i := range 2 {
		st, res, err := gw.Open(ctx, envoytest.Request{Path: "/v1/completions", Body: completionBody(promptTokens(uint64(i), 64), 2, false)})
		if err != nil || res.Endpoint == "" {
			t.Fatalf("open %d: %v %+v", i, err, res)
		}
		open = append(open, st)
	}
	r, err := gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: completionBody(promptTokens(3, 64), 2, false)})
	if err != nil || r.Immediate == nil || r.Status != http.StatusTooManyRequests {
		t.Fatalf("every worker busy: %v, status %d, want an immediate 429", err, r.Status)
	}
	wantErrorBody(t, r.Body, "rate_limit_error")
	for _, st := range open {
		if err := st.Respond(http.StatusOK, "", []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
		st.Close()
	}
	waitRouterIdle(t, rep)
	for _, w := range fleet {
		rep.registry.SetHealthy(w.spec.ID, false, "test")
	}
	r, err = gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: completionBody(promptTokens(4, 64), 2, false)})
	if err != nil || r.Immediate == nil || r.Status != http.StatusServiceUnavailable {
		t.Fatalf("no worker: %v, status %d, want an immediate 503", err, r.Status)
	}
	wantErrorBody(t, r.Body, "service_unavailable_error")
	// The picker is not ready without a routable worker.
	if s, err := gw.Health(ctx, "readiness"); err != nil || s != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("readiness with no worker: %v %v", s, err)
	}
}

func wantErrorBody(t *testing.T, body []byte, typ string) {
	t.Helper()
	var e struct {
		Error *apiError `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil || e.Error == nil || e.Error.Type != typ || e.Error.Message == "" {
		t.Fatalf("body %q: want an OpenAI error of type %s", body, typ)
	}
}

// TestPickerRefusesBadInput: a body that is not JSON, an oversized body, a client's
// kv_transfer_params and messages out of order each get a clear immediate answer; the
// picker keeps serving.
func TestPickerRefusesBadInput(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(0))
	rep, gw := startPicker(t, fleet, func(c *Config) { c.Proxy.MaxBodyBytes = 4096 })
	ctx := t.Context()
	tests := []struct {
		name   string
		req    envoytest.Request
		status int
		code   string
	}{
		{"not json", envoytest.Request{Path: "/v1/chat/completions", Body: []byte(`{"model": nope`), ChunkSize: 3}, http.StatusBadRequest, ""},
		{"no messages", envoytest.Request{Path: "/v1/chat/completions", Body: []byte(`{"model":"m"}`)}, http.StatusBadRequest, ""},
		{"oversized", envoytest.Request{Path: "/v1/completions", Body: bytes.Repeat([]byte("x"), 5000), ChunkSize: 1000}, http.StatusRequestEntityTooLarge, "body_too_large"},
		{"kv_transfer_params", envoytest.Request{Path: "/v1/completions", Body: []byte(`{"model":"m","prompt":"x","kv_transfer_params":{"remote_host":"10.0.0.1"}}`)}, http.StatusBadRequest, ""},
		{"bad session", envoytest.Request{Path: "/v1/completions", Body: completionBody(promptTokens(1, 16), 1, false), Header: hdr("x-session-id", "has space")}, http.StatusBadRequest, "invalid_header"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := gw.Do(ctx, tt.req)
			if err != nil || r.Immediate == nil || r.Status != tt.status {
				t.Fatalf("%v: status %d immediate %v, want an immediate %d", err, r.Status, r.Immediate != nil, tt.status)
			}
			wantErrorBody(t, r.Body, "invalid_request_error")
			if tt.code != "" && !strings.Contains(string(r.Body), tt.code) {
				t.Fatalf("body %s lacks code %s", r.Body, tt.code)
			}
		})
	}
	// Messages out of order, on raw streams.
	body := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte("{}"), EndOfStream: true}}}
	respHeaders := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte("200")}}}}}}
	for name, m := range map[string]*extprocv3.ProcessingRequest{
		"body first": body, "response first": respHeaders, "empty message": {},
	} {
		t.Run(name, func(t *testing.T) {
			st, err := gw.Raw(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			ans, err := st.Send(m)
			if err != nil || ans.GetImmediateResponse().GetStatus().GetCode() != http.StatusBadRequest {
				t.Fatalf("%v: answer %v, want an immediate 400", err, ans)
			}
		})
	}
	// A response before the request's body ended: the request was never picked.
	t.Run("response before the body ended", func(t *testing.T) {
		st, err := gw.Raw(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		if err := st.SendOnly(envoytest.RequestHeaders("/v1/completions", false)); err != nil {
			t.Fatal(err)
		}
		ans, err := st.Send(respHeaders)
		if err != nil || ans.GetImmediateResponse().GetStatus().GetCode() != http.StatusBadRequest {
			t.Fatalf("%v: answer %v, want an immediate 400", err, ans)
		}
	})
	// Still serving, nothing held.
	r, err := gw.Do(ctx, envoytest.Request{Path: "/v1/completions", Body: completionBody(promptTokens(2, 16), 1, false)})
	if err != nil || r.Status != http.StatusOK {
		t.Fatalf("after the bad input: %v %+v", err, r)
	}
	waitRouterIdle(t, rep)
}

// TestPickerReleasesWhenTheGatewayGoes: a stream the gateway abandons after the pick (the
// client left mid-answer) frees its load; every health service reports serving.
func TestPickerReleasesWhenTheGatewayGoes(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(0))
	rep, gw := startPicker(t, fleet, nil)
	ctx := t.Context()
	st, res, err := gw.Open(ctx, envoytest.Request{Path: "/v1/completions", Body: completionBody(promptTokens(1, 256), 2, false)})
	if err != nil || res.Endpoint == "" {
		t.Fatalf("%v %+v", err, res)
	}
	if w := workerAt(fleet, res.Endpoint); workerLoad(rep, w.spec.ID).Requests != 1 {
		t.Fatalf("load on %s while the stream is open: %+v, want 1 request", w.spec.ID, workerLoad(rep, w.spec.ID))
	}
	st.Close()
	waitRouterIdle(t, rep)
	waitPickerServing(t, gw)
}

// waitPickerServing waits until every health service of the picker reports serving.
func waitPickerServing(t *testing.T, gw *envoytest.Gateway) {
	t.Helper()
	eventually(t, "every health service serving", func() (bool, string) {
		for _, svc := range []string{"", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"} {
			if s, err := gw.Health(t.Context(), svc); err != nil || s != healthpb.HealthCheckResponse_SERVING {
				return false, fmt.Sprintf("health %q: %v %v", svc, s, err)
			}
		}
		return true, ""
	})
}
