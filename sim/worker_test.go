package sim

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// completeOnce sends one generation request and returns its text and usage, decoding a
// stream or a whole answer as the request asks.
func completeOnce(t *testing.T, url string, client *http.Client, chat, stream bool, body map[string]any) (text string, cached, promptTokens int) {
	t.Helper()
	path := "/v1/completions"
	if chat {
		path = "/v1/chat/completions"
	}
	body["stream"] = stream
	if stream {
		body["stream_options"] = map[string]any{"include_usage": true}
	}
	status, hdr, data := post(t, context.Background(), client, url+path, body)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, data)
	}
	if hdr.Get("X-Worker-ID") == "" {
		t.Fatal("no X-Worker-ID header")
	}
	if !stream {
		var r testResponse
		if err := json.Unmarshal(data, &r); err != nil {
			t.Fatalf("decode %s: %v", data, err)
		}
		if len(r.Choices) != 1 || r.Usage == nil || r.Choices[0].FinishReason == nil {
			t.Fatalf("malformed response %s", data)
		}
		if chat {
			if r.Object != "chat.completion" || r.Choices[0].Message == nil || r.Choices[0].Message.Role != "assistant" {
				t.Fatalf("malformed chat response %s", data)
			}
			text = r.Choices[0].Message.Content
		} else {
			if r.Object != "text_completion" {
				t.Fatalf("object %q", r.Object)
			}
			text = r.Choices[0].Text
		}
		if r.Usage.CompletionTokens != len(Tokenize(text, false)) || r.Usage.TotalTokens != r.Usage.PromptTokens+r.Usage.CompletionTokens {
			t.Fatalf("usage %+v does not add up for text %q", *r.Usage, text)
		}
		return text, r.Usage.PromptTokensDetails.CachedTokens, r.Usage.PromptTokens
	}
	if ct := hdr.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("content type %q", ct)
	}
	chunks, done := parseSSE(t, data)
	if !done {
		t.Fatal("stream did not end with [DONE]")
	}
	last := chunks[len(chunks)-1]
	if last.Usage == nil || len(last.Choices) != 0 {
		t.Fatalf("last chunk %+v is not a usage chunk", last)
	}
	finished := 0
	for i, c := range chunks[:len(chunks)-1] {
		if len(c.Choices) != 1 {
			t.Fatalf("chunk %d has %d choices", i, len(c.Choices))
		}
		ch := c.Choices[0]
		if ch.FinishReason != nil {
			finished++
			if *ch.FinishReason != "length" || i != len(chunks)-2 {
				t.Fatalf("chunk %d finish reason %q", i, *ch.FinishReason)
			}
		}
		if chat {
			if c.Object != "chat.completion.chunk" || ch.Delta == nil {
				t.Fatalf("chunk %d malformed: %+v", i, c)
			}
			if i == 0 && ch.Delta.Role != "assistant" {
				t.Fatalf("first chat chunk has role %q", ch.Delta.Role)
			}
			text += ch.Delta.Content
		} else {
			text += ch.Text
		}
	}
	if finished != 1 {
		t.Fatalf("%d chunks carry a finish reason, want 1", finished)
	}
	if last.Usage.CompletionTokens != len(Tokenize(text, false)) {
		t.Fatalf("usage %d completion tokens, text %q", last.Usage.CompletionTokens, text)
	}
	return text, last.Usage.PromptTokensDetails.CachedTokens, last.Usage.PromptTokens
}

func TestSecondRequestReportsSharedPrefixAsCached(t *testing.T) {
	for _, chat := range []bool{false, true} {
		for _, stream := range []bool{false, true} {
			name := map[bool]string{false: "completions", true: "chat"}[chat] + map[bool]string{false: "", true: "/stream"}[stream]
			t.Run(name, func(t *testing.T) {
				w, srv := newTestWorker(t, Config{})
				if chat {
					testChatCaching(t, w, srv.URL, srv.Client(), stream)
				} else {
					testCompletionCaching(t, w, srv.URL, srv.Client(), stream)
				}
			})
		}
	}
}

func testCompletionCaching(t *testing.T, w *Worker, url string, client *http.Client, stream bool) {
	first := seqTokens(2000, 40) // two full blocks and a partial one
	_, cached, prompt := completeOnce(t, url, client, false, stream, map[string]any{"prompt": first, "max_tokens": 8})
	if cached != 0 || prompt != 40 {
		t.Fatalf("first request: cached %d prompt %d, want 0 40", cached, prompt)
	}
	second := append(slices.Clone(first), seqTokens(9000, 10)...)
	second[35] = 1 // diverge inside the third block
	_, cached, _ = completeOnce(t, url, client, false, stream, map[string]any{"prompt": second, "max_tokens": 8})
	if cached != 32 {
		t.Fatalf("second request: cached %d, want 32 (2 shared blocks x 16)", cached)
	}
	if st := w.Stats(); st.CachedTokens != 32 || st.PromptTokens != 90 || st.Served != 2 {
		t.Fatalf("stats %+v", st)
	}
	// A text prompt in the array form is tokenized like a plain string.
	_, _, prompt = completeOnce(t, url, client, false, stream, map[string]any{"prompt": []string{"one two three"}})
	if prompt != 4 {
		t.Fatalf("[\"one two three\"] counted %d prompt tokens, want 4 (BOS + 3)", prompt)
	}
}

func testChatCaching(t *testing.T, w *Worker, url string, client *http.Client, stream bool) {
	system := strings.Repeat("You answer questions about rivers and lakes. ", 8)
	turn1 := []map[string]any{{"role": "system", "content": system}, {"role": "user", "content": "Name a river."}}
	reply, cached, prompt1 := completeOnce(t, url, client, true, stream, map[string]any{"messages": turn1, "max_completion_tokens": 40})
	if cached != 0 {
		t.Fatalf("first turn cached %d, want 0", cached)
	}
	turn2 := append(slices.Clone(turn1),
		map[string]any{"role": "assistant", "content": reply},
		map[string]any{"role": "user", "content": []map[string]any{{"type": "text", "text": "And a lake?"}}})
	_, cached, prompt2 := completeOnce(t, url, client, true, stream, map[string]any{"messages": turn2, "max_tokens": 4})

	msgs1 := []ChatMessage{{"system", system}, {"user", "Name a river."}}
	msgs2 := append(slices.Clone(msgs1), ChatMessage{"assistant", reply}, ChatMessage{"user", "And a lake?"})
	p1, p2 := Tokenize(RenderChat(msgs1, true), true), Tokenize(RenderChat(msgs2, true), true)
	if prompt1 != len(p1) || prompt2 != len(p2) {
		t.Fatalf("prompt tokens %d %d, want %d %d", prompt1, prompt2, len(p1), len(p2))
	}
	// The worker cached the first prompt and its own reply: the second turn hits both.
	generated := append(slices.Clone(p1), Tokenize(reply, false)...)
	want := min(commonPrefix(generated, p2), len(p2)-1) / 16 * 16
	if cached != want {
		t.Fatalf("second turn cached %d, want %d", cached, want)
	}
	if want <= len(p1)/16*16 {
		t.Fatalf("test is too weak: expected hit %d does not reach into the reply (prompt %d)", want, len(p1))
	}
	if w.Cache().Hits != uint64(want) {
		t.Fatalf("cache hits %d, want %d", w.Cache().Hits, want)
	}
}

func TestMaxTokensDefaultsAndCaps(t *testing.T) {
	_, srv := newTestWorker(t, Config{Speedup: 1e6})
	tests := []struct {
		name      string
		maxTokens any
		want      int
	}{
		{"default", nil, 16},
		{"given", 3, 3},
		{"capped", 100000, 4096},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			body := map[string]any{"prompt": "count"}
			if tt.maxTokens != nil {
				body["max_tokens"] = tt.maxTokens
			}
			text, _, _ := completeOnce(t, srv.URL, srv.Client(), false, false, body)
			if got := len(Tokenize(text, false)); got != tt.want {
				t.Fatalf("generated %d tokens, want %d", got, tt.want)
			}
		})
	}
}

func TestRequestLargerThanCacheCompletes(t *testing.T) {
	w, srv := newTestWorker(t, Config{CapacityBlocks: 2})
	completeOnce(t, srv.URL, srv.Client(), false, false, map[string]any{"prompt": seqTokens(1000, 200)})
	if st := w.Cache(); st.Blocks != 2 || st.Pinned != 0 {
		t.Fatalf("cache %+v: want 2 blocks, none pinned", st)
	}
}

func TestClientDisconnectFreesSlotAndPins(t *testing.T) {
	// Real-time decode of 1 s per token: the stream outlives the test unless the abort works.
	w, srv := newTestWorker(t, Config{Speedup: 1, DecodePerToken: time.Second, Overhead: time.Microsecond,
		PrefillPerToken: time.Microsecond, MaxRunning: 1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp := openStream(t, ctx, srv, seqTokens(7, 40), 1000)
	buf := make([]byte, 1)
	if _, err := io.ReadFull(resp.Body, buf); err != nil { // the first token has been sent
		t.Fatal(err)
	}
	if st, cs := w.Stats(), w.Cache(); st.Running != 1 || cs.Pinned != 2 {
		t.Fatalf("running %d pinned %d, want 1 and 2", st.Running, cs.Pinned)
	}

	// A second request queues behind the first, then its client leaves too.
	ctx2, cancel2 := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		req2, _ := http.NewRequestWithContext(ctx2, http.MethodPost, srv.URL+"/v1/completions", strings.NewReader(`{"prompt":"queued"}`))
		resp2, err := srv.Client().Do(req2)
		if err == nil {
			resp2.Body.Close()
		}
		errc <- err
	}()
	poll.Holds(t, 10*time.Second, "second request waiting", func() bool { return w.Stats().Waiting == 1 })
	cancel2()
	if err := <-errc; err == nil {
		t.Fatal("cancelled request succeeded")
	}
	poll.Holds(t, 10*time.Second, "waiting queue empty", func() bool { return w.Stats().Waiting == 0 })

	cancel()
	poll.Holds(t, 10*time.Second, "slot and pins freed", func() bool {
		st, cs := w.Stats(), w.Cache()
		return st.Running == 0 && cs.Pinned == 0 && st.Aborted == 2
	})
	if st := w.Stats(); st.Served != 0 {
		t.Fatalf("served %d, want 0", st.Served)
	}
}

func TestErrorRateOneAnswers500(t *testing.T) {
	w, srv := newTestWorker(t, Config{ErrorRate: 1})
	status, _, body := post(t, context.Background(), srv.Client(), srv.URL+"/v1/completions", `{"prompt":"hi"}`)
	if status != http.StatusInternalServerError {
		t.Fatalf("status %d, want 500", status)
	}
	assertErrorShape(t, body, "server_error")
	// Turned off over HTTP, requests succeed again.
	status, _, body = post(t, context.Background(), srv.Client(), srv.URL+"/sim/faults", `{"error_rate": 0}`)
	if status != http.StatusOK {
		t.Fatalf("set faults: %d %s", status, body)
	}
	completeOnce(t, srv.URL, srv.Client(), false, false, map[string]any{"prompt": "hi"})
	if st := w.Stats(); st.Failed != 1 || st.Served != 1 {
		t.Fatalf("stats %+v, want 1 failed and 1 served", st)
	}
}

func TestFaultsEndpointRejectsBadValues(t *testing.T) {
	w, srv := newTestWorker(t, Config{})
	for _, body := range []string{`{"error_rate": 2}`, `{"stall": "soon"}`, `{"stall_rate": -0.1}`, `not json`, `{"refuse_for": "-1s"}`} {
		status, _, resp := post(t, context.Background(), srv.Client(), srv.URL+"/sim/faults", body)
		if status != http.StatusBadRequest {
			t.Errorf("%s: status %d, want 400", body, status)
			continue
		}
		assertErrorShape(t, resp, "invalid_request_error")
	}
	if f := w.Faults(); f != (Faults{}) {
		t.Fatalf("faults changed by bad input: %+v", f)
	}
	if err := w.SetFaults(Faults{ErrorRate: -1}); err == nil {
		t.Fatal("SetFaults accepted a negative rate")
	}
}

func TestStallHoldsFirstByteUntilClientLeaves(t *testing.T) {
	w, srv := newTestWorker(t, Config{StallRate: 1})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/completions", strings.NewReader(`{"prompt":"hi"}`))
		resp, err := srv.Client().Do(req)
		if err == nil {
			resp.Body.Close()
			err = errors.New("stalled request got an answer: " + resp.Status)
		}
		errc <- err
	}()
	poll.Holds(t, 10*time.Second, "request stalled", func() bool { return strings.Contains(scrape(t, srv.URL), `outcome="fault_stall"} 1`) })
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("stalled request ended with %v, want context.Canceled", err)
	}
	poll.Holds(t, 10*time.Second, "stalled request counted aborted", func() bool { return w.Stats().Aborted == 1 })

	// A bounded stall answers once it is over.
	if err := w.SetFaults(Faults{StallRate: 1, Stall: time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	completeOnce(t, srv.URL, srv.Client(), false, false, map[string]any{"prompt": "hi"})
}

func TestRefuseGivesConnectionErrorsThenRecovers(t *testing.T) {
	w, err := New(testConfig(Config{ID: "w1"}))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- w.Serve(ctx, ln) }()
	url := "http://" + ln.Addr().String()
	keepAlive := &http.Client{Timeout: 10 * time.Second}
	fresh := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	try := func(c *http.Client) error { return tinyCompletion(c, url) }
	if err := try(keepAlive); err != nil { // leaves an idle kept-alive connection
		t.Fatalf("before refuse: %v", err)
	}
	if err := w.SetFaults(Faults{Refuse: true}); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]*http.Client{"reused connection": keepAlive, "new connection": fresh} {
		err := try(c)
		var netErr net.Error
		var opErr *net.OpError
		if err == nil || (!errors.As(err, &opErr) && !errors.As(err, &netErr) && !errors.Is(err, io.EOF) && !strings.Contains(err.Error(), "EOF")) {
			t.Fatalf("%s while refusing: got %v, want a connection error", name, err)
		}
	}
	if err := w.SetFaults(Faults{}); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]*http.Client{"reused connection": keepAlive, "new connection": fresh} {
		if err := try(c); err != nil {
			t.Fatalf("%s after refuse: %v", name, err)
		}
	}

	// Over HTTP, a bounded refusal ends by itself.
	status, _, body := post(t, context.Background(), fresh, url+"/sim/faults", `{"refuse": true, "refuse_for": "50ms"}`)
	if status != http.StatusOK {
		t.Fatalf("set faults: %d %s", status, body)
	}
	poll.Holds(t, 10*time.Second, "refusal over", func() bool { return try(fresh) == nil })

	cancel()
	if err := <-served; err != nil {
		t.Fatalf("Serve returned %v after its context ended", err)
	}
	if _, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second); err == nil {
		t.Fatal("listener still open after Serve returned")
	}
}

func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func TestMetricsUseVLLMNames(t *testing.T) {
	_, srv := newTestWorker(t, Config{})
	completeOnce(t, srv.URL, srv.Client(), false, false, map[string]any{"prompt": seqTokens(1, 40)})
	completeOnce(t, srv.URL, srv.Client(), false, false, map[string]any{"prompt": seqTokens(1, 40)})
	text := scrape(t, srv.URL)
	for _, want := range []string{
		`vllm:num_requests_running{model_name="sim-model"} 0`,
		`vllm:num_requests_waiting{model_name="sim-model"} 0`,
		`vllm:kv_cache_usage_perc{model_name="sim-model"} 0`,
		`vllm:prefix_cache_queries_total{model_name="sim-model"} 80`,
		`vllm:prefix_cache_hits_total{model_name="sim-model"} 32`,
		`vllm:prompt_tokens_total{model_name="sim-model"} 80`,
		`vllm:generation_tokens_total{model_name="sim-model"} 32`,
		`vllm:request_success_total{finished_reason="length",model_name="sim-model"} 2`,
		`vllm:time_to_first_token_seconds_count{model_name="sim-model"} 2`,
		`sim_requests_total{model_name="sim-model",outcome="ok"} 2`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if t.Failed() {
		t.Log(text)
	}
}

func TestModelsAndHealth(t *testing.T) {
	_, srv := newTestWorker(t, Config{Model: "m1", ID: "w7"})
	resp, err := http.Get(srv.URL + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Worker-ID") != "w7" {
		t.Fatalf("health: %d, worker %q", resp.StatusCode, resp.Header.Get("X-Worker-ID"))
	}
	resp, err = http.Get(srv.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID     string `json:"id"`
			Object string `json:"object"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	if list.Object != "list" || len(list.Data) != 1 || list.Data[0].ID != "m1" || list.Data[0].Object != "model" {
		t.Fatalf("models %+v", list)
	}
}

func TestIgnoresRoutingHeaders(t *testing.T) {
	_, srv := newTestWorker(t, Config{})
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/completions", strings.NewReader(`{"prompt":"hi"}`))
	req.Header.Set("X-Data-Parallel-Rank", "3")
	req.Header.Set("X-Session-ID", "s1")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
}

func TestClearCacheOverHTTP(t *testing.T) {
	var kinds []EventKind
	w, srv := newTestWorker(t, Config{OnEvent: func(e CacheEvent) { kinds = append(kinds, e.Kind) }})
	completeOnce(t, srv.URL, srv.Client(), false, false, map[string]any{"prompt": seqTokens(1, 40)})
	status, _, _ := post(t, context.Background(), srv.Client(), srv.URL+"/reset_prefix_cache", "")
	if status != http.StatusOK || w.Cache().Blocks != 0 {
		t.Fatalf("reset: status %d, %d blocks left", status, w.Cache().Blocks)
	}
	if !slices.Equal(kinds, []EventKind{Stored, Stored, Cleared}) {
		t.Fatalf("events %v, want prompt blocks, output blocks, clear", kinds)
	}
}

// TestLoRAModulesAreListedAndServed: adapters are listed with their parent, as vLLM lists
// them, and served; another model is refused 404 model_not_found and counted.
func TestLoRAModulesAreListedAndServed(t *testing.T) {
	w, srv := newTestWorker(t, Config{Model: "base", LoRAs: []string{"sql"}})
	resp, err := http.Get(srv.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	err = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if err != nil || len(list.Data) != 2 || list.Data[0].Parent != nil || list.Data[1].ID != "sql" || list.Data[1].Parent == nil || *list.Data[1].Parent != "base" {
		t.Fatalf("models %+v, %v", list, err)
	}
	for _, tc := range []struct {
		model string
		want  int
	}{{"base", http.StatusOK}, {"sql", http.StatusOK}, {"other", http.StatusNotFound}} {
		resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"`+tc.model+`","prompt":"hi","max_tokens":1}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Fatalf("%s: %d, want %d", tc.model, resp.StatusCode, tc.want)
		}
	}
	if n := w.Stats().WrongModel; n != 1 {
		t.Fatalf("WrongModel = %d, want 1", n)
	}
}
