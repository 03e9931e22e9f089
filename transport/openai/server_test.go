package openai

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

func roundRobin(c *routing.Config) { c.Policy = "round-robin" }

func TestCompletionIsProxiedWithBodyUntouchedAndHopHeadersDropped(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		body := `{"model":"m", "prompt":"hi",  "unknown_field":{"nested":[1,2,3]},"temperature":0.5}`
		resp, got := rg.post("/v1/completions?trace=1", body, map[string]string{
			"Connection": "X-Hop", "X-Hop": "1", "X-Custom": "kept", "Authorization": "Bearer k",
			"X-Forwarded-For": "10.0.0.1", "Accept-Encoding": "gzip", "Te": "trailers",
		})
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
		if !strings.Contains(got, `"text":"ok"`) {
			t.Fatalf("client got %q, not the worker's answer", got)
		}
		sent, hdr, path := w0.last()
		if sent != body {
			t.Fatalf("worker got body %q, want the client's bytes %q", sent, body)
		}
		if path != "/v1/completions" {
			t.Fatalf("worker got path %q", path)
		}
		if hdr.Get("X-Custom") != "kept" || hdr.Get("Authorization") != "Bearer k" {
			t.Fatalf("end-to-end headers lost: %v", hdr)
		}
		if hdr.Get("X-Hop") != "" || hdr.Get("Connection") != "" {
			t.Fatalf("hop-by-hop headers forwarded: %v", hdr)
		}
		if hdr.Get("Te") != "" || hdr.Get("Accept-Encoding") != "" {
			t.Fatalf("hop-by-hop or encoding headers forwarded: %v", hdr)
		}
		if got := hdr.Values("X-Forwarded-For"); len(got) != 1 || got[0] != "10.0.0.1, 127.0.0.1" {
			t.Fatalf("X-Forwarded-For %q, want the client's chain and its address", got)
		}
		if got := hdr.Get("Content-Length"); got != strconv.Itoa(len(body)) {
			t.Fatalf("worker got Content-Length %q for a body of %d bytes", got, len(body))
		}
	})
}

func TestLargeBodiesAreProxiedIntact(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		body := `{"model":"m","prompt":"` + strings.Repeat("a long prompt ", 30000) + `"}`
		for _, chunked := range []bool{false, true} {
			var src io.Reader = strings.NewReader(body)
			if chunked {
				src = io.MultiReader(src)
			}
			req, err := http.NewRequest(http.MethodPost, rg.front.URL+"/v1/completions", src)
			if err != nil {
				t.Fatal(err)
			}
			if chunked {
				req.ContentLength = -1
			}
			resp, err := rg.front.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("chunked=%v: status %d", chunked, resp.StatusCode)
			}
			if sent, _, _ := w0.last(); sent != body {
				t.Fatalf("chunked=%v: worker got %d bytes, want the client's %d", chunked, len(sent), len(body))
			}
		}
	})
}

func TestHTTPSWorkerIsReachedWithWorkerTLS(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		tw := httptest.NewTLSServer(http.HandlerFunc(okJSON))
		t.Cleanup(tw.Close)
		roots := tw.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
		rg := newRig(t, []routing.WorkerSpec{spec("w0", tw.URL)},
			rigOptions{server: server, front: func(c *Config) { c.WorkerTLS = &tls.Config{RootCAs: roots} }})
		resp, body := rg.post("/v1/completions", completionBody, nil)
		if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderWorker) != "w0" || !strings.Contains(body, `"ok"`) {
			t.Fatalf("status %d from %q: %s", resp.StatusCode, resp.Header.Get(HeaderWorker), body)
		}
	})
}

func TestResponseHeadersTellWhatHappened(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Worker-Own", "yes")
			okJSON(w, r)
		})
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		ids := make([]string, 64)
		for i := range ids {
			ids[i] = strconv.Itoa(i + 100)
		}
		body := `{"model":"m","prompt":[` + strings.Join(ids, ",") + `]}`
		hdr := map[string]string{"X-Session-ID": "sess-1"}

		resp, _ := rg.post("/v1/completions", body, hdr)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if got := resp.Header.Get(HeaderWorker); got != "w0" {
			t.Fatalf("%s = %q, want w0", HeaderWorker, got)
		}
		if got := resp.Header.Get(HeaderReplica); got != "replica-1" {
			t.Fatalf("%s = %q", HeaderReplica, got)
		}
		rev, err := strconv.ParseUint(resp.Header.Get(HeaderRevision), 10, 64)
		if err != nil || rev == 0 {
			t.Fatalf("%s = %q, want a revision", HeaderRevision, resp.Header.Get(HeaderRevision))
		}
		if got := resp.Header.Get(HeaderOverlap); got != "0" {
			t.Fatalf("first request overlap = %q, want 0", got)
		}
		if resp.Header.Get("X-Worker-Own") != "yes" {
			t.Fatal("worker's own header not passed on")
		}

		// The first request's blocks were recorded: the same 64-token prompt now holds 4 blocks,
		// of which the engine hits 3 (it computes the last prompt token anyway), and the bound
		// session keeps its revision.
		resp, _ = rg.post("/v1/completions", body, hdr)
		if got := resp.Header.Get(HeaderOverlap); got != "3" {
			t.Fatalf("second request overlap = %q, want 3", got)
		}
		if got := resp.Header.Get(HeaderRevision); got != strconv.FormatUint(rev, 10) {
			t.Fatalf("bound session revision %q, want %d", got, rev)
		}

		resp, _ = rg.post("/v1/completions", completionBody, nil)
		if resp.Header.Get(HeaderRevision) != "" {
			t.Fatal("revision header set without a session")
		}

		// An operator sees how much of a worker's traffic its bindings send it.
		for by, want := range map[string]float64{"choice": 2, "binding": 1} {
			if got := rg.metric("kvrouter_worker_dispatches_total", map[string]string{"worker": "w0", "by": by}); got != want {
				t.Errorf("dispatches to w0 by %s = %v, want %v", by, got, want)
			}
		}
	})
}

func TestBodyOverLimitIs413(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server, front: func(c *Config) { c.MaxBodyBytes = 100 }})
		big := `{"model":"m","prompt":"` + strings.Repeat("x", 200) + `"}`
		resp, body := rg.post("/v1/completions", big, nil)
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("status %d, want 413", resp.StatusCode)
		}
		if e := errorOf(t, body); e.Type != TypeInvalidRequest {
			t.Fatalf("error type %q", e.Type)
		}

		// Without a Content-Length the limit still holds while reading.
		req, _ := http.NewRequest(http.MethodPost, rg.front.URL+"/v1/completions", io.MultiReader(strings.NewReader(big)))
		req.ContentLength = -1
		r2, err := rg.front.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		r2.Body.Close()
		if r2.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("chunked body: status %d, want 413", r2.StatusCode)
		}
		if w0.requests() != 0 {
			t.Fatal("an oversized request reached the worker")
		}
	})
}

func TestBadRequestsGet400InOpenAIShape(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		tests := []struct {
			path, body, param string
		}{
			{"/v1/chat/completions", `not json`, ""},
			{"/v1/chat/completions", `{"model":"m","messages":[]}`, "messages"},
			{"/v1/completions", `{"prompt":"x"}`, "model"},
			{"/v1/completions", `{"model":"m","prompt":{}}`, "prompt"},
			// A client naming where a decode worker pulls KV from (an SSRF through the worker).
			{"/v1/completions", `{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"169.254.169.254","remote_port":80,"remote_engine_id":"e","remote_block_ids":[1]}}`, "kv_transfer_params"},
			{"/v1/route", `{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_decode":true}}`, "kv_transfer_params"},
		}
		for _, tt := range tests {
			resp, body := rg.post(tt.path, tt.body, nil)
			if resp.StatusCode != http.StatusBadRequest {
				t.Fatalf("%s %s: status %d", tt.path, tt.body, resp.StatusCode)
			}
			if e := errorOf(t, body); e.Param != tt.param || e.Type != TypeInvalidRequest || e.Message == "" {
				t.Fatalf("%s %s: error %+v, want param %q", tt.path, tt.body, e, tt.param)
			}
		}
		if w0.requests() != 0 {
			t.Fatal("a bad request reached the worker")
		}
		if got := rg.metric("kvrouter_errors_total", map[string]string{"cause": "parse"}); got != float64(len(tests)) {
			t.Fatalf("parse errors counted %v, want %d", got, len(tests))
		}
	})
}

func TestSessionKeyRules(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		tests := []struct {
			name, key string
			ok        bool
		}{
			{"printable ascii", "user-42:conv!~", true},
			{"exactly 256 bytes", strings.Repeat("k", 256), true},
			{"257 bytes", strings.Repeat("k", 257), false},
			{"space", "has space", false},
			{"tab", "has\ttab", false},
			{"non ascii", "caf\u00e9", false},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				resp, body := rg.post("/v1/completions", completionBody, map[string]string{"X-Session-ID": tt.key})
				if tt.ok {
					if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderRevision) == "" {
						t.Fatalf("status %d revision %q: %s", resp.StatusCode, resp.Header.Get(HeaderRevision), body)
					}
					if _, ok, _ := rg.affinity.Peek(context.Background(), tt.key); !ok {
						t.Fatal("session not bound")
					}
					return
				}
				if resp.StatusCode != http.StatusBadRequest {
					t.Fatalf("status %d, want 400", resp.StatusCode)
				}
				if e := errorOf(t, body); e.Param != "X-Session-ID" {
					t.Fatalf("param %q, want X-Session-ID", e.Param)
				}
			})
		}
	})
}

// TestSessionHeadersPeersUse: a session key comes from the first configured header present:
// by default X-Session-ID, then Dynamo's X-Dynamo-Session-ID (any case); a configured list
// replaces them.
func TestSessionHeadersPeersUse(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		tests := []struct {
			name    string
			headers []string
			sent    map[string]string
			want    string
		}{
			{"ours", nil, map[string]string{"x-session-id": "a"}, "a"},
			{"dynamo's", nil, map[string]string{"X-Dynamo-Session-ID": "b"}, "b"},
			{"ours first", nil, map[string]string{"X-Session-ID": "c", "X-Dynamo-Session-ID": "d"}, "c"},
			{"configured", []string{"X-Conversation"}, map[string]string{"X-Conversation": "e", "X-Session-ID": "f"}, "e"},
			{"configured, absent", []string{"X-Conversation"}, map[string]string{"X-Session-ID": "g"}, ""},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server, front: func(c *Config) { c.SessionHeaders = tt.headers }})
				resp, body := rg.post("/v1/completions", completionBody, tt.sent)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d: %s", resp.StatusCode, body)
				}
				for _, k := range []string{"a", "b", "c", "d", "e", "f", "g"} {
					_, bound, _ := rg.affinity.Peek(context.Background(), k)
					if bound != (k == tt.want) {
						t.Fatalf("session %q bound %v; want only %q bound", k, bound, tt.want)
					}
				}
			})
		}
	})
}

func TestExplicitTarget(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		w1 := newFakeWorker(t, okJSON)
		dp := spec("dp", w1.URL)
		dp.DPSize = 2
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL), dp}, rigOptions{server: server})
		tests := []struct {
			target     string
			wantStatus int
			wantWorker string
		}{
			{"w0", http.StatusOK, "w0"},
			{"dp/1", http.StatusOK, "dp/1"},
			{"dp/0", http.StatusOK, "dp"},
			{"nope", http.StatusNotFound, ""},
			{"dp/2", http.StatusNotFound, ""},
			{"w0/x", http.StatusNotFound, ""},
			{"/1", http.StatusNotFound, ""},
		}
		for _, tt := range tests {
			t.Run(tt.target, func(t *testing.T) {
				resp, body := rg.post("/v1/completions", completionBody, map[string]string{"X-Target-Worker": tt.target})
				if resp.StatusCode != tt.wantStatus {
					t.Fatalf("status %d, want %d: %s", resp.StatusCode, tt.wantStatus, body)
				}
				if tt.wantStatus == http.StatusNotFound {
					if e := errorOf(t, body); e.Param != "X-Target-Worker" || e.Type != TypeNotFound {
						t.Fatalf("error %+v", e)
					}
					return
				}
				if got := resp.Header.Get(HeaderWorker); got != tt.wantWorker {
					t.Fatalf("served by %q, want %q", got, tt.wantWorker)
				}
			})
		}
		// The data-parallel worker learns its rank from the header.
		rg.post("/v1/completions", completionBody, map[string]string{"X-Target-Worker": "dp/1", "X-Data-Parallel-Rank": "1"})
		if _, hdr, _ := w1.last(); hdr.Get("X-Data-Parallel-Rank") != "1" {
			t.Fatalf("worker got rank header %q, want 1", hdr.Get("X-Data-Parallel-Rank"))
		}
		// A worker without data parallelism does not see a client's rank header.
		rg.post("/v1/completions", completionBody, map[string]string{"X-Target-Worker": "w0", "X-Data-Parallel-Rank": "0"})
		if _, hdr, _ := w0.last(); hdr.Get("X-Data-Parallel-Rank") != "" {
			t.Fatalf("single-rank worker got rank header %q", hdr.Get("X-Data-Parallel-Rank"))
		}
		// A rank that is no integer, or that no worker has (the largest dp_size is 2), is the
		// client's mistake: 400 naming the header, not 503.
		for _, rank := range []string{"-1", "2", "99999"} {
			resp, body := rg.post("/v1/completions", completionBody, map[string]string{"X-Data-Parallel-Rank": rank})
			if resp.StatusCode != http.StatusBadRequest || errorOf(t, body).Param != "X-Data-Parallel-Rank" {
				t.Fatalf("rank header %s: status %d %s", rank, resp.StatusCode, body)
			}
		}
	})
}

func TestStreamPassesChunksThroughOneByOne(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		proceed := make(chan struct{})
		w0 := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			rc := http.NewResponseController(w)
			_, _ = io.WriteString(w, "data: {\"n\":1}\n\n")
			_ = rc.Flush()
			select {
			case <-proceed:
			case <-r.Context().Done():
				return
			}
			_, _ = io.WriteString(w, "data: {\"n\":2}\n\ndata: [DONE]\n\n")
		})
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		var release sync.Once
		// On failure, let the worker finish so that cleanup does not wait out the idle timeout.
		t.Cleanup(func() { release.Do(func() { close(proceed) }) })

		req, _ := http.NewRequest(http.MethodPost, rg.front.URL+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
		resp, err := rg.front.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderWorker) != "w0" {
			t.Fatalf("status %d worker %q", resp.StatusCode, resp.Header.Get(HeaderWorker))
		}
		lines := make(chan string)
		go func() {
			defer close(lines)
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				if sc.Text() != "" {
					lines <- sc.Text()
				}
			}
		}()
		next := func() string {
			select {
			case l := <-lines:
				return l
			case <-time.After(10 * time.Second):
				t.Fatal("no chunk reached the client: the stream is buffered")
				return ""
			}
		}
		// The worker holds chunk 2 back until the client has seen chunk 1.
		if got := next(); got != `data: {"n":1}` {
			t.Fatalf("first chunk %q", got)
		}
		release.Do(func() { close(proceed) })
		if got := next(); got != `data: {"n":2}` {
			t.Fatalf("second chunk %q", got)
		}
		if got := next(); got != "data: [DONE]" {
			t.Fatalf("last chunk %q", got)
		}
		poll.Holds(t, 10*time.Second, "load to be released", rg.idle)
		if got := rg.metric("kvrouter_ttft_seconds", nil); got != 1 {
			t.Fatalf("ttft observations %v, want 1", got)
		}
	})
}

func TestClientCancelCancelsUpstreamAndFreesLoad(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		for _, afterFirstChunk := range []bool{false, true} {
			t.Run(fmt.Sprintf("after_first_chunk=%v", afterFirstChunk), func(t *testing.T) {
				upstreamDone := make(chan struct{})
				started := make(chan struct{})
				w0 := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
					if afterFirstChunk {
						w.Header().Set("Content-Type", "text/event-stream")
						_, _ = io.WriteString(w, "data: 1\n\n")
						_ = http.NewResponseController(w).Flush()
					}
					close(started)
					<-r.Context().Done()
					close(upstreamDone)
				})
				rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, rg.front.URL+"/v1/completions",
					strings.NewReader(`{"model":"m","stream":true,"prompt":"`+strings.Repeat("p", 400)+`"}`))
				errc := make(chan error, 1)
				go func() {
					resp, err := rg.front.Client().Do(req)
					if err == nil {
						_, err = io.ReadAll(resp.Body)
						resp.Body.Close()
					}
					errc <- err
				}()
				select {
				case <-started:
				case <-time.After(10 * time.Second):
					t.Fatal("request never reached the worker")
				}
				poll.Holds(t, 10*time.Second, "load to be counted", func() bool { return !rg.idle() })
				cancel()
				select {
				case <-upstreamDone:
				case <-time.After(10 * time.Second):
					t.Fatal("the worker's request was not cancelled")
				}
				if err := <-errc; err == nil {
					t.Fatal("client finished without error after cancelling")
				}
				poll.Holds(t, 10*time.Second, "load to return to zero", rg.idle)
				poll.Holds(t, 10*time.Second, "the cancel to be counted", func() bool {
					return rg.metric("kvrouter_errors_total", map[string]string{"cause": "client_cancel"}) >= 1
				})
				if !rg.healthy("w0") {
					t.Fatal("a client cancel marked the worker unhealthy")
				}
				// Gone before or during its answer, the request counts as 499, never as a 200.
				poll.Holds(t, 10*time.Second, "the request to be counted", func() bool {
					return rg.metric("kvrouter_requests_total", map[string]string{"endpoint": "completions", "code": "499"}) == 1
				})
				if got := rg.metric("kvrouter_requests_total", map[string]string{"endpoint": "completions", "code": "200"}); got != 0 {
					t.Fatalf("requests_total{code=200} %v for a request its client abandoned", got)
				}
			})
		}
	})
}

func TestRetryLandsOnAnotherWorker(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		tests := []struct {
			name  string
			bad   func(t *testing.T) (url string, tried func() int)
			cause string
		}{
			{"refused connection", func(t *testing.T) (string, func() int) {
				return refusedURL(t), nil
			}, "upstream_connect"},
			{"500", func(t *testing.T) (string, func() int) {
				fw := newFakeWorker(t, func(w http.ResponseWriter, _ *http.Request) {
					http.Error(w, "boom", http.StatusInternalServerError)
				})
				return fw.URL, fw.requests
			}, "upstream_status"},
			{"429", func(t *testing.T) (string, func() int) {
				fw := newFakeWorker(t, func(w http.ResponseWriter, _ *http.Request) {
					http.Error(w, "slow down", http.StatusTooManyRequests)
				})
				return fw.URL, fw.requests
			}, "upstream_status"},
			{"garbage 200", func(t *testing.T) (string, func() int) {
				fw := newFakeWorker(t, func(w http.ResponseWriter, _ *http.Request) {
					_, _ = io.WriteString(w, "<html>not json</html>")
				})
				return fw.URL, fw.requests
			}, "upstream_garbage"},
			{"stream broken before first byte", func(t *testing.T) (string, func() int) {
				fw := newFakeWorker(t, brokenStream("text/event-stream", ""))
				return fw.URL, fw.requests
			}, "upstream_broken"},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				good := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
					w.Header().Set("Content-Type", "text/event-stream")
					_, _ = io.WriteString(w, "data: {\"ok\":true}\n\n")
				})
				badURL, tried := tt.bad(t)
				rg := newRig(t, []routing.WorkerSpec{spec("bad", badURL), spec("good", good.URL)},
					rigOptions{server: server, router: roundRobin})
				// Round-robin puts the bad worker first for some of these requests.
				for i := range 4 {
					body := completionBody
					if i%2 == 1 {
						body = `{"model":"m","stream":true,"prompt":"x"}`
					}
					resp, got := rg.post("/v1/completions", body, map[string]string{"X-Session-ID": "s" + strconv.Itoa(i)})
					if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderWorker) != "good" {
						t.Fatalf("request %d: status %d from %q: %s", i, resp.StatusCode, resp.Header.Get(HeaderWorker), got)
					}
					b, ok, _ := rg.affinity.Peek(context.Background(), "s"+strconv.Itoa(i))
					if !ok || b.Worker.ID != "good" {
						t.Fatalf("request %d: session bound to %+v (%v), want good", i, b, ok)
					}
				}
				if got := rg.metric("kvrouter_retries_total", nil); got < 1 {
					t.Fatal("no retry counted")
				}
				if got := rg.metric("kvrouter_errors_total", map[string]string{"cause": tt.cause}); got < 1 {
					t.Fatalf("no %s error counted", tt.cause)
				}
				if tried != nil && tried() == 0 {
					t.Fatal("the bad worker was never tried")
				}
				poll.Holds(t, 10*time.Second, "load to be released", rg.idle)
			})
		}
	})
}

// brokenStream answers 200 with contentType, sends sent, and then breaks the chunked framing.
func brokenStream(contentType, sent string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", contentType)
		w.WriteHeader(http.StatusOK)
		_, _ = io.WriteString(w, sent)
		rc := http.NewResponseController(w)
		_ = rc.Flush()
		conn, buf, err := rc.Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		_, _ = buf.WriteString("zz\r\nnot a chunk\r\n")
		_ = buf.Flush()
	}
}

func TestWorkerClientErrorPassesThrough(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"max_tokens too large","type":"BadRequestError","param":"max_tokens"}}`)
		})
		w1 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL), spec("w1", w1.URL)}, rigOptions{server: server})
		resp, body := rg.post("/v1/completions", completionBody, map[string]string{"X-Target-Worker": "w0"})
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("status %d, want the worker's 400", resp.StatusCode)
		}
		if e := errorOf(t, body); e.Message != "max_tokens too large" || e.Param != "max_tokens" {
			t.Fatalf("worker's error body changed: %s", body)
		}
		if resp.Header.Get(HeaderWorker) != "w0" {
			t.Fatal("worker header missing on a passed-through error")
		}
		if w0.requests() != 1 || w1.requests() != 0 {
			t.Fatalf("a 4xx was retried: w0 %d, w1 %d", w0.requests(), w1.requests())
		}
		if !rg.healthy("w0") {
			t.Fatal("a client error marked the worker unhealthy")
		}
		poll.Holds(t, 10*time.Second, "load to be released", rg.idle)
	})
}

func TestGarbageEverywhereIs502AndMarksWorkersUnhealthy(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		garbage := func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "%%%") }
		w0 := newFakeWorker(t, garbage)
		w1 := newFakeWorker(t, garbage)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL), spec("w1", w1.URL)},
			rigOptions{server: server, router: func(c *routing.Config) { c.MaxRetries = 1 }})
		resp, body := rg.post("/v1/completions", completionBody, nil)
		if resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("status %d, want 502: %s", resp.StatusCode, body)
		}
		if e := errorOf(t, body); e.Type != TypeServer || !strings.Contains(e.Message, "bad response") {
			t.Fatalf("error %+v", e)
		}
		for _, id := range []string{"w0", "w1"} {
			if rg.healthy(id) {
				t.Fatalf("%s still healthy after a garbage answer", id)
			}
		}
		for _, st := range rg.workers.List() {
			if !strings.HasPrefix(st.Reason, "bad response:") {
				t.Fatalf("%s unhealthy for %q", st.Spec.ID, st.Reason)
			}
		}
		if got := rg.metric("kvrouter_errors_total", map[string]string{"cause": "upstream_garbage"}); got != 2 {
			t.Fatalf("garbage counted %v times, want 2", got)
		}
		poll.Holds(t, 10*time.Second, "load to be released", rg.idle)

		// With every worker out, the fleet is unavailable rather than broken.
		resp, _ = rg.post("/v1/completions", completionBody, nil)
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" {
			t.Fatalf("status %d Retry-After %q, want 503 and 1", resp.StatusCode, resp.Header.Get("Retry-After"))
		}
	})
}

// TestStreamBrokenMidwayEndsWithAnErrorEventInTheAPIsShape: a worker whose stream breaks off
// after the answer started is marked unhealthy, and the client, having had every byte before
// the break, gets one more event, an error in the API's own shape (what the official SDKs
// raise as a typed error), and a clean end. A stream broken inside an event, or a streamed
// body that is not events, cannot be ended so: its connection is cut.
func TestStreamBrokenMidwayEndsWithAnErrorEventInTheAPIsShape(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		const chunk = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
		tests := []struct {
			name, path, body string
			sent             string // what the worker sends before it breaks
			contentType      string
			event            string // the event the client gets after sent; "" when it is cut
		}{
			{"chat", "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`, chunk, "text/event-stream",
				`data: {"error":{"message":"the answer is incomplete: worker w0: bad response: stream broke off: invalid byte in chunk length","type":"server_error","code":"upstream_broken"}}`},
			{"completions, CRLF events", "/v1/completions", `{"model":"m","stream":true,"prompt":"x"}`, "data: 1\r\n\r\n", "text/event-stream",
				`data: {"error":{"message":"the answer is incomplete: worker w0: bad response: stream broke off: invalid byte in chunk length","type":"server_error","code":"upstream_broken"}}`},
			{"responses", "/v1/responses", `{"model":"m","stream":true,"input":"x"}`,
				"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0}\n\n", "text/event-stream",
				"event: error\n" + `data: {"type":"error","sequence_number":1,"code":"upstream_broken","message":"the answer is incomplete: worker w0: bad response: stream broke off: invalid byte in chunk length","param":null,"error":{"message":"the answer is incomplete: worker w0: bad response: stream broke off: invalid byte in chunk length","type":"server_error","code":"upstream_broken"}}`},
			{"messages", "/v1/messages", `{"model":"m","max_tokens":4,"stream":true,"messages":[{"role":"user","content":"x"}]}`,
				"event: message_start\ndata: {\"type\":\"message_start\"}\n\n", "text/event-stream",
				"event: error\n" + `data: {"error":{"message":"the answer is incomplete: worker w0: bad response: stream broke off: invalid byte in chunk length","type":"api_error"},"type":"error"}`},
			{"inside an event", "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`, chunk + "data: {\"cho", "text/event-stream", ""},
			{"streamed, not events", "/v1/completions", `{"model":"m","stream":true,"prompt":"x"}`, `{"choices":[`, "application/json", ""},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				w0 := newFakeWorker(t, brokenStream(tt.contentType, tt.sent))
				rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
				req, _ := http.NewRequest(http.MethodPost, rg.front.URL+tt.path, strings.NewReader(tt.body))
				resp, err := rg.front.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				got, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if !strings.HasPrefix(string(got), tt.sent) {
					t.Fatalf("the bytes before the break were lost: %q", got)
				}
				if tt.event == "" {
					if err == nil {
						t.Fatalf("client read a clean end after a stream broken where no event fits: %q", got)
					}
				} else if err != nil || string(got) != tt.sent+tt.event+"\n\n" {
					t.Fatalf("client read %q (%v), want %q then the error event %q and a clean end", got, err, tt.sent, tt.event)
				}
				if rg.healthy("w0") {
					t.Fatal("worker still healthy after breaking a stream")
				}
				if got := rg.metric("kvrouter_errors_total", map[string]string{"cause": "upstream_broken"}); got != 1 {
					t.Fatalf("upstream_broken counted %v times, want 1", got)
				}
				poll.Holds(t, 10*time.Second, "load to be released", rg.idle)
			})
		}
	})
}

func TestIdleStreamEndsWithATimeoutEventAndFirstByteTimeoutRetries(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		stall := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: 1\n\n")
			_ = http.NewResponseController(w).Flush()
			<-r.Context().Done()
		})
		silent := newFakeWorker(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
		good := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("stall", stall.URL), spec("silent", silent.URL), spec("good", good.URL)},
			rigOptions{server: server, router: roundRobin, front: func(c *Config) {
				c.IdleTimeout = 50 * time.Millisecond
				c.FirstByteTimeout = 100 * time.Millisecond
			}})

		req, _ := http.NewRequest(http.MethodPost, rg.front.URL+"/v1/completions", strings.NewReader(`{"model":"m","stream":true,"prompt":"x"}`))
		req.Header.Set("X-Target-Worker", "stall")
		resp, err := rg.front.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || !strings.HasPrefix(string(got), "data: 1\n\n") || errorOf(t, strings.TrimPrefix(strings.TrimPrefix(string(got), "data: 1\n\n"), "data: ")).Code != "upstream_timeout" {
			t.Fatalf("an idle stream gave %q (%v), want its event then an upstream_timeout error event", got, err)
		}
		if rg.healthy("stall") {
			t.Fatal("stalled worker still healthy")
		}

		// The silent worker never sends headers: each request that tries it moves on.
		for i := range 3 {
			resp, body := rg.post("/v1/completions", completionBody, nil)
			if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderWorker) != "good" {
				t.Fatalf("request %d: status %d from %q: %s", i, resp.StatusCode, resp.Header.Get(HeaderWorker), body)
			}
		}
		if silent.requests() == 0 {
			t.Fatal("the silent worker was never tried")
		}
		if rg.metric("kvrouter_errors_total", map[string]string{"cause": "upstream_timeout"}) < 2 {
			t.Fatal("idle and header timeouts not counted")
		}
		poll.Holds(t, 10*time.Second, "load to be released", rg.idle)
	})
}

func TestRouteQueryChangesNothing(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("q", 300) + `"}]}`
		for range 2 {
			resp, got := rg.post("/v1/route", body, map[string]string{"X-Session-ID": "s1"})
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			var ans routeAnswer
			if err := json.Unmarshal([]byte(got), &ans); err != nil {
				t.Fatal(err)
			}
			if ans.Worker != "w0" || ans.URL != w0.URL || ans.Session != "s1" || ans.Bound || ans.BindingRevision != 0 {
				t.Fatalf("answer %+v", ans)
			}
			if ans.PromptBlocks == 0 || ans.OverlapBlocks != 0 {
				t.Fatalf("blocks: prompt %d overlap %d (a query must record nothing)", ans.PromptBlocks, ans.OverlapBlocks)
			}
		}
		if w0.requests() != 0 {
			t.Fatal("a query dispatched to the worker")
		}
		if _, ok, _ := rg.affinity.Peek(context.Background(), "s1"); ok {
			t.Fatal("a query bound the session")
		}
		if len(rg.tracker.Snapshot()) != 0 && !rg.idle() {
			t.Fatal("a query left load behind")
		}

		// A bound session is reported as such.
		rg.post("/v1/chat/completions", body, map[string]string{"X-Session-ID": "s1"})
		_, got := rg.post("/v1/route", body, map[string]string{"X-Session-ID": "s1"})
		var ans routeAnswer
		if err := json.Unmarshal([]byte(got), &ans); err != nil || !ans.Bound || ans.BindingRevision == 0 {
			t.Fatalf("bound session answer %s (%v)", got, err)
		}
	})
}

func TestHealthAndReadiness(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		if resp, _ := rg.do(context.Background(), http.MethodGet, "/healthz", "", nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("healthz %d", resp.StatusCode)
		}
		if resp, _ := rg.do(context.Background(), http.MethodGet, "/readyz", "", nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("readyz %d with a routable worker", resp.StatusCode)
		}
		rg.srv.SetReady(func() error { return fmt.Errorf("no raft leader") })
		resp, body := rg.do(context.Background(), http.MethodGet, "/readyz", "", nil)
		if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(body, "no raft leader") {
			t.Fatalf("readyz %d %s with a failing hook", resp.StatusCode, body)
		}
		rg.srv.SetReady(nil)
		rg.workers.SetHealthy("w0", false, "test")
		resp, body = rg.do(context.Background(), http.MethodGet, "/readyz", "", nil)
		if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(body, "no routable worker") {
			t.Fatalf("readyz %d %s without workers", resp.StatusCode, body)
		}
		if resp, _ := rg.do(context.Background(), http.MethodGet, "/healthz", "", nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("healthz %d: liveness must not depend on workers", resp.StatusCode)
		}
	})
}

func TestWrongMethodAndPathGetJSONErrors(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		resp, body := rg.do(context.Background(), http.MethodGet, "/v1/completions", "", nil)
		if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != http.MethodPost {
			t.Fatalf("GET completions: %d Allow %q", resp.StatusCode, resp.Header.Get("Allow"))
		}
		errorOf(t, body)
		resp, body = rg.do(context.Background(), http.MethodGet, "/v2/nothing", "", nil)
		if resp.StatusCode != http.StatusNotFound {
			t.Fatalf("unknown path: %d", resp.StatusCode)
		}
		errorOf(t, body)
	})
}

func TestModels(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		t.Run("configured", func(t *testing.T) {
			w0 := newFakeWorker(t, okJSON)
			rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server, front: func(c *Config) { c.Models = []string{"a", "b"} }})
			resp, body := rg.do(context.Background(), http.MethodGet, "/v1/models", "", nil)
			var list struct {
				Data []modelEntry `json:"data"`
			}
			if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &list) != nil || len(list.Data) != 2 || list.Data[1].ID != "b" {
				t.Fatalf("models %d %s", resp.StatusCode, body)
			}
			if w0.requests() != 0 {
				t.Fatal("configured models asked a worker")
			}
		})
		t.Run("from a worker, cached", func(t *testing.T) {
			var asked atomic.Int32
			w0 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/v1/models" {
					http.NotFound(w, r)
					return
				}
				asked.Add(1)
				_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"llama","object":"model"}]}`)
			}))
			t.Cleanup(w0.Close)
			rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
			for range 3 {
				resp, body := rg.do(context.Background(), http.MethodGet, "/v1/models", "", nil)
				if resp.StatusCode != http.StatusOK || !strings.Contains(body, `"llama"`) {
					t.Fatalf("models %d %s", resp.StatusCode, body)
				}
			}
			if n := asked.Load(); n != 1 {
				t.Fatalf("worker asked %d times, want 1 (cached)", n)
			}
		})
		t.Run("no worker", func(t *testing.T) {
			w0 := newFakeWorker(t, okJSON)
			rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
			rg.workers.SetHealthy("w0", false, "test")
			resp, body := rg.do(context.Background(), http.MethodGet, "/v1/models", "", nil)
			if resp.StatusCode != http.StatusServiceUnavailable {
				t.Fatalf("models %d %s", resp.StatusCode, body)
			}
		})
	})
}

func TestLoRAModelRoutesToWorkersServingIt(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		base := newFakeWorker(t, okJSON)
		lora := newFakeWorker(t, okJSON)
		withLoRA := spec("lora", lora.URL)
		withLoRA.LoRAs = []string{"sql-adapter"}
		rg := newRig(t, []routing.WorkerSpec{spec("base", base.URL), withLoRA}, rigOptions{server: server, router: roundRobin})
		for i := range 4 {
			resp, _ := rg.post("/v1/completions", `{"model":"sql-adapter","prompt":"select"}`, nil)
			if got := resp.Header.Get(HeaderWorker); got != "lora" {
				t.Fatalf("request %d for the adapter served by %q", i, got)
			}
		}
	})
}

func TestMetricsAreExported(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		rg.post("/v1/completions", completionBody, nil)
		// The answer is flushed to the client before the handler's bookkeeping ends.
		poll.Holds(t, 10*time.Second, "requests_total to count the request", func() bool {
			return rg.metric("kvrouter_requests_total", map[string]string{"endpoint": "completions", "code": "200"}) == 1
		})
		if got := rg.metric("kvrouter_selection_seconds", nil); got != 1 {
			t.Fatalf("selection observations %v, want 1", got)
		}
		if got := rg.metric("kvrouter_worker_healthy", map[string]string{"worker": "w0"}); got != 1 {
			t.Fatalf("worker_healthy = %v", got)
		}
		srv := httptest.NewServer(AdminHandler(rg.reg))
		t.Cleanup(srv.Close)
		resp, err := http.Get(srv.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, name := range []string{"kvrouter_requests_total", "kvrouter_ttft_seconds", "kvrouter_worker_inflight_requests", "kvrouter_predicted_kv_hit_ratio"} {
			if !strings.Contains(string(body), name) {
				t.Fatalf("/metrics lacks %s", name)
			}
		}
	})
}

func TestNewServerRejectsBadConfig(t *testing.T) {
	workers, _ := routing.NewRegistry(nil)
	tracker := routing.NewTracker()
	router, err := routing.New(routing.Config{}, routing.Deps{Workers: workers, Tracker: tracker})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewServer(Config{IdleTimeout: -1}, router, workers, tracker); err == nil {
		t.Fatal("negative timeout accepted")
	}
	if _, err := NewServer(Config{}, nil, workers, tracker); err == nil {
		t.Fatal("nil router accepted")
	}
	if _, err := NewServer(Config{Models: []string{""}}, router, workers, tracker); err == nil {
		t.Fatal("empty model name accepted")
	}
}

// TestEveryWorkerFailingGivesTheClientTheLastWorkersAnswer: when every worker answers a
// 5xx, the client gets the last one's own answer (its status and its error body, the
// engine's reason), not a 503 "no worker" with every worker healthy; when every worker is
// unreachable, a 502 naming the last failure. Each failure is counted under its cause.
func TestEveryWorkerFailingGivesTheClientTheLastWorkersAnswer(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		engineError := `{"error":{"message":"n must be 1 on this engine","type":"BadRequestError","code":500}}`
		failing := func() *fakeWorker {
			return newFakeWorker(t, func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusInternalServerError)
				_, _ = io.WriteString(w, engineError)
			})
		}
		w0, w1 := failing(), failing()
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL), spec("w1", w1.URL)}, rigOptions{server: server, router: roundRobin})
		resp, body := rg.post("/v1/completions", completionBody, nil)
		if resp.StatusCode != http.StatusInternalServerError || body != engineError {
			t.Fatalf("status %d body %q, want the worker's 500 and its body", resp.StatusCode, body)
		}
		if w := resp.Header.Get(HeaderWorker); w != "w0" && w != "w1" {
			t.Fatalf("%s %q, want the worker that answered", HeaderWorker, w)
		}
		if w0.requests()+w1.requests() != 2 {
			t.Fatalf("workers tried %d and %d times, want each once", w0.requests(), w1.requests())
		}
		if got := rg.metric("kvrouter_errors_total", map[string]string{"cause": "upstream_status"}); got != 2 {
			t.Fatalf("upstream_status errors %v, want 2", got)
		}
		if got := rg.metric("kvrouter_requests_total", map[string]string{"endpoint": "completions", "code": "500"}); got != 1 {
			t.Fatalf("requests_total{code=500} %v, want 1", got)
		}

		down := newRig(t, []routing.WorkerSpec{spec("d0", refusedURL(t)), spec("d1", refusedURL(t))}, rigOptions{server: server, router: roundRobin})
		resp, body = down.post("/v1/completions", completionBody, nil)
		if resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("every worker unreachable: status %d, want 502: %s", resp.StatusCode, body)
		}
		if e := errorOf(t, body); e.Code != "upstream_failed" || !strings.Contains(e.Message, "d0") && !strings.Contains(e.Message, "d1") {
			t.Fatalf("error %+v, want upstream_failed naming the last worker", e)
		}
	})
}

// TestEventEndFindsAWholeEventAcrossReads: the bytes relayed end with a whole server-sent
// event however the reads split them, in each line ending, and never inside one.
func TestEventEndFindsAWholeEventAcrossReads(t *testing.T) {
	tests := []struct {
		stream string
		at     bool
	}{
		{"data: 1\n\n", true},
		{"data: 1\r\n\r\n", true},
		{"data: 1\r\r", true},
		{"data: 1\n", false},
		{"data: 1\r\n", false},
		{"data: 1\n\ndata: {\"a", false},
		{"event: error\ndata: x\n\n", true},
	}
	for _, tt := range tests {
		for split := 1; split <= len(tt.stream); split++ {
			var e eventEnd
			for b := []byte(tt.stream); len(b) > 0; {
				n := min(split, len(b))
				e.add(b[:n])
				b = b[n:]
			}
			if e.at() != tt.at {
				t.Fatalf("%q read %d bytes at a time: at %v, want %v", tt.stream, split, e.at(), tt.at)
			}
		}
	}
}

func TestCompletionPathsAreMatchedExactlyAndTheRestGetTheMuxsAnswer(t *testing.T) {
	// Each handler answers with the pattern the mux set: none when the exact match served.
	seen := func(w http.ResponseWriter, r *http.Request) { fmt.Fprintf(w, "pattern %q", r.Pattern) }
	build := func(exact bool) http.Handler {
		mux := http.NewServeMux()
		rt := &routes{mux: mux}
		for _, p := range []string{"/v1/completions", "/v1/chat/completions"} {
			if exact {
				rt.handle(p, http.HandlerFunc(seen))
			} else {
				mux.HandleFunc(p, seen)
			}
		}
		mux.HandleFunc("/v1/models/{id...}", seen)
		mux.HandleFunc("/", seen)
		return rt
	}
	tests := []struct {
		method, target string
		exact          bool // served by the exact match, with the mux's handler
	}{
		{http.MethodPost, "/v1/completions", true},
		{http.MethodPost, "/v1/chat/completions", true},
		{http.MethodPost, "/v1/completions?stream=1", true},
		{http.MethodGet, "/v1/completions", false},
		{http.MethodPut, "/v1/chat/completions", false},
		{http.MethodPost, "/v1//completions", false},       // the mux's redirect to the clean path
		{http.MethodPost, "/v1/./completions", false},      // likewise
		{http.MethodPost, "/v1/%63ompletions", false},      // escaped, the same path to the mux
		{http.MethodPost, "/v1%2Fcompletions", false},      // one segment to the mux: "/"
		{http.MethodPost, "/v1/completions/", false},       // "/"
		{http.MethodPost, "/V1/completions", false},        // "/"
		{http.MethodPost, "/v1/models/a/b", false},         // a wildcard
		{http.MethodPost, "/v1/chat/completions/x", false}, // "/"
	}
	fast, mux := build(true), build(false)
	for _, tt := range tests {
		t.Run(tt.method+" "+tt.target, func(t *testing.T) {
			want := httptest.NewRecorder()
			mux.ServeHTTP(want, httptest.NewRequest(tt.method, tt.target, nil))
			got := httptest.NewRecorder()
			fast.ServeHTTP(got, httptest.NewRequest(tt.method, tt.target, nil))
			if tt.exact {
				if got.Code != http.StatusOK || got.Body.String() != `pattern ""` {
					t.Fatalf("got %d %q, want the handler without the mux", got.Code, got.Body)
				}
				return
			}
			if got.Code != want.Code || got.Header().Get("Location") != want.Header().Get("Location") ||
				got.Body.String() != want.Body.String() {
				t.Fatalf("got %d %q Location %q, the mux answers %d %q Location %q", got.Code, got.Body,
					got.Header().Get("Location"), want.Code, want.Body, want.Header().Get("Location"))
			}
		})
	}
}
