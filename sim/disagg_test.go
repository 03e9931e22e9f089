package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// testKVParams is a prefill answer's kv_transfer_params as the tests read them.
type testKVParams = kvTransferOut

// remoteDecodeParams are what a router sends with a prefill leg.
func remoteDecodeParams() map[string]any {
	return map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
}

func genPath(chat bool) string {
	if chat {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

// prefillLeg sends body as a router's prefill leg (one token, not streamed) and returns the answer's
// kv_transfer_params, raw and read.
func prefillLeg(t *testing.T, srv *httptest.Server, chat bool, body map[string]any) (json.RawMessage, testKVParams) {
	t.Helper()
	leg := maps.Clone(body)
	leg["kv_transfer_params"] = remoteDecodeParams()
	leg["stream"] = false
	leg["max_tokens"] = 1
	if _, ok := leg["max_completion_tokens"]; ok {
		leg["max_completion_tokens"] = 1
	}
	status, _, data := post(t, context.Background(), srv.Client(), srv.URL+genPath(chat), leg)
	if status != http.StatusOK {
		t.Fatalf("prefill leg: status %d: %s", status, data)
	}
	var a struct {
		testResponse
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(data, &a); err != nil {
		t.Fatalf("prefill answer %s: %v", data, err)
	}
	if len(a.Choices) != 1 || a.Usage == nil || a.Usage.CompletionTokens != 1 {
		t.Fatalf("prefill answer is not a one-token completion: %s", data)
	}
	var p testKVParams
	if err := json.Unmarshal(a.Params, &p); err != nil {
		t.Fatalf("kv_transfer_params %s: %v", a.Params, err)
	}
	return a.Params, p
}

// decodeLeg sends body with params as a router's decode leg.
func decodeLeg(t *testing.T, srv *httptest.Server, chat, stream bool, body map[string]any, params json.RawMessage) (int, http.Header, []byte) {
	t.Helper()
	leg := maps.Clone(body)
	leg["kv_transfer_params"] = params
	leg["stream"] = stream
	if stream {
		leg["stream_options"] = map[string]any{"include_usage": true}
	}
	return post(t, context.Background(), srv.Client(), srv.URL+genPath(chat), leg)
}

// answerUsage reads the completion tokens and cached tokens of a whole or streamed answer.
func answerUsage(t *testing.T, data []byte, stream bool) (completion, cached int) {
	t.Helper()
	if stream {
		chunks, done := parseSSE(t, data)
		if !done || len(chunks) == 0 || chunks[len(chunks)-1].Usage == nil {
			t.Fatalf("stream without a usage chunk and [DONE]: %s", data)
		}
		u := chunks[len(chunks)-1].Usage
		return u.CompletionTokens, u.PromptTokensDetails.CachedTokens
	}
	var r testResponse
	if err := json.Unmarshal(data, &r); err != nil || r.Usage == nil {
		t.Fatalf("answer %s: %v", data, err)
	}
	return r.Usage.CompletionTokens, r.Usage.PromptTokensDetails.CachedTokens
}

// errorOf reads the OpenAI error of a 4xx answer.
func errorOf(t *testing.T, data []byte) (message, param, code string) {
	t.Helper()
	assertErrorShape(t, data, "invalid_request_error")
	var e struct {
		Error struct {
			Message string  `json:"message"`
			Param   *string `json:"param"`
			Code    *string `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(data, &e); err != nil {
		t.Fatal(err)
	}
	if e.Error.Param != nil {
		param = *e.Error.Param
	}
	if e.Error.Code != nil {
		code = *e.Error.Code
	}
	return e.Error.Message, param, code
}

// eventLog records a worker's cache events.
type eventLog struct {
	mu     sync.Mutex
	events []CacheEvent
}

func (l *eventLog) hook(e CacheEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, e)
}

// since returns the events from index n on.
func (l *eventLog) since(n int) []CacheEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.events[n:])
}

func (l *eventLog) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.events)
}

// promptHashes are the chained hashes of prompt's full blocks.
func promptHashes(prompt []uint32, bs int) []uint64 {
	var out []uint64
	var parent uint64
	for i := 0; (i+1)*bs <= len(prompt); i++ {
		parent = BlockHash(parent, prompt[i*bs:(i+1)*bs])
		out = append(out, parent)
	}
	return out
}

func serverPort(t *testing.T, srv *httptest.Server) int {
	t.Helper()
	_, port, err := net.SplitHostPort(srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.Atoi(port)
	return n
}

func TestPrefillAnswerCarriesTransferParamsAndPinsBlocksUntilPulled(t *testing.T) {
	chatMsgs := []map[string]any{{"role": "system", "content": strings.Repeat("Rivers run to the sea. ", 12)}, {"role": "user", "content": "Why?"}}
	chatPrompt := Tokenize(RenderChat([]ChatMessage{{"system", strings.Repeat("Rivers run to the sea. ", 12)}, {"user", "Why?"}}, true), true)
	tests := []struct {
		name   string
		chat   bool
		body   map[string]any
		prompt []uint32
	}{
		{"completion", false, map[string]any{"prompt": seqTokens(3000, 50)}, seqTokens(3000, 50)},
		{"completion of whole blocks", false, map[string]any{"prompt": seqTokens(3000, 48)}, seqTokens(3000, 48)},
		{"chat", true, map[string]any{"messages": chatMsgs, "max_completion_tokens": 9}, chatPrompt},
		{"shorter than a block", false, map[string]any{"prompt": seqTokens(3000, 10)}, seqTokens(3000, 10)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, srv := newTestWorker(t, Config{ID: "p0", Role: RolePrefill})
			raw, params := prefillLeg(t, srv, tt.chat, tt.body)
			var keys map[string]json.RawMessage
			_ = json.Unmarshal(raw, &keys)
			wantKeys := []string{"do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "tp_size"}
			if got := slices.Sorted(maps.Keys(keys)); !slices.Equal(got, wantKeys) {
				t.Fatalf("kv_transfer_params keys %v, want %v", got, wantKeys)
			}
			nBlocks := len(tt.prompt) / DefaultBlockSize
			if !params.DoRemotePrefill || params.DoRemoteDecode || params.TPSize != 1 ||
				params.RemoteEngineID != p.EngineID() || !strings.HasPrefix(params.RemoteEngineID, "p0-") ||
				params.RemoteHost != "127.0.0.1" || params.RemotePort != serverPort(t, srv) ||
				params.RemoteBlockIDs == nil || len(params.RemoteBlockIDs) != nBlocks {
				t.Fatalf("kv_transfer_params %s: want a decode leg's params for %d blocks of engine %s at %s", raw, nBlocks, p.EngineID(), srv.URL)
			}
			if cs, st := p.Cache(), p.Stats(); cs.Pinned != nBlocks || st.KVTransfersHeld != min(nBlocks, 1) || st.Running != 0 {
				t.Fatalf("after the prefill leg: %d blocks pinned, %d transfers held, %d running; want %d, %d, 0",
					cs.Pinned, st.KVTransfersHeld, st.Running, nBlocks, min(nBlocks, 1))
			}
			if nBlocks == 0 {
				return
			}
			pull := pullRequest{EngineID: params.RemoteEngineID, BlockIDs: params.RemoteBlockIDs}
			status, _, data := post(t, context.Background(), srv.Client(), srv.URL+KVPullPath, pull)
			if status != http.StatusOK {
				t.Fatalf("pull: %d %s", status, data)
			}
			var pr pullResponse
			if err := json.Unmarshal(data, &pr); err != nil {
				t.Fatal(err)
			}
			hashes := promptHashes(tt.prompt, DefaultBlockSize)
			for i, b := range pr.Blocks {
				if b.ID != params.RemoteBlockIDs[i] || b.Hash != hashes[i] || !slices.Equal(b.Tokens, tt.prompt[i*16:(i+1)*16]) {
					t.Fatalf("pulled block %d %+v is not the prompt's", i, b)
				}
			}
			if len(pr.Blocks) != nBlocks || pr.EngineID != p.EngineID() || pr.BlockSize != DefaultBlockSize {
				t.Fatalf("pull answer %s", data)
			}
			if cs, st := p.Cache(), p.Stats(); cs.Pinned != 0 || st.KVTransfersHeld != 0 || cs.Blocks < nBlocks {
				t.Fatalf("after the pull: %d pinned, %d held, %d cached; want 0, 0 and the blocks still cached (in the LRU)", cs.Pinned, st.KVTransfersHeld, cs.Blocks)
			}
			// A transfer is pulled once.
			if status, _, data := post(t, context.Background(), srv.Client(), srv.URL+KVPullPath, pull); status != http.StatusNotFound {
				t.Fatalf("second pull: %d %s, want 404", status, data)
			}
		})
	}
}

func TestDecodeLegPullsStoresTheBlocksAndAnswers(t *testing.T) {
	prompt := seqTokens(5000, 50) // 3 full blocks and 2 tokens
	sys := strings.Repeat("Lakes are still. ", 20)
	chatBody := map[string]any{"messages": []map[string]any{{"role": "system", "content": sys}, {"role": "user", "content": "And rivers?"}}}
	chatPrompt := Tokenize(RenderChat([]ChatMessage{{"system", sys}, {"user", "And rivers?"}}, true), true)
	tests := []struct {
		name   string
		chat   bool
		stream bool
		// warm, when set, is sent to the decode worker first: it shares the prompt's first block.
		warm    []uint32
		chunked int
		body    map[string]any
		prompt  []uint32
	}{
		{"completion", false, false, nil, 0, map[string]any{"prompt": prompt}, prompt},
		{"completion stream, one block local", false, true, append(slices.Clone(prompt[:16]), seqTokens(90000, 20)...), 0, map[string]any{"prompt": prompt}, prompt},
		{"completion, one block local, chunked prefill", false, false, append(slices.Clone(prompt[:16]), seqTokens(90000, 20)...), 8, map[string]any{"prompt": prompt}, prompt},
		{"chat stream", true, true, nil, 0, chatBody, chatPrompt},
		{"chat", true, false, nil, 16, chatBody, chatPrompt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, psrv := newTestWorker(t, Config{ID: "p0", Role: RolePrefill})
			var events eventLog
			d, dsrv := newTestWorker(t, Config{ID: "d0", Role: RoleDecode, OnEvent: events.hook, ChunkedPrefillTokens: tt.chunked})
			local := 0
			if tt.warm != nil {
				completeOnce(t, dsrv.URL, dsrv.Client(), false, false, map[string]any{"prompt": tt.warm, "max_tokens": 1})
				local = commonPrefix(tt.warm, tt.prompt) / 16 * 16
			}
			mark := events.len()
			raw, params := prefillLeg(t, psrv, tt.chat, tt.body)

			body := maps.Clone(tt.body)
			body["max_tokens"] = 5
			status, hdr, data := decodeLeg(t, dsrv, tt.chat, tt.stream, body, raw)
			if status != http.StatusOK {
				t.Fatalf("decode leg: %d %s", status, data)
			}
			completion, cached := answerUsage(t, data, tt.stream)
			if completion != 5 || cached != local {
				t.Fatalf("decode answer: %d completion tokens, %d cached; want 5 and the local hit %d", completion, cached, local)
			}
			nBlocks := len(tt.prompt) / 16
			missing := nBlocks - local/16
			if got, want := hdr.Get(KVTransferHeader), transferMs(time.Duration(missing)*DefaultTransferPerBlock); got != want {
				t.Fatalf("%s %q, want %q (%d blocks transferred)", KVTransferHeader, got, want, missing)
			}
			// The transfer stored the blocks the decode worker lacked, in one Stored event,
			// as it would have stored blocks it computed.
			evs := events.since(mark)
			if len(evs) == 0 || evs[0].Kind != Stored {
				t.Fatalf("events after the decode leg %+v, want a Stored first", evs)
			}
			hashes := promptHashes(tt.prompt, 16)
			var got []uint64
			for _, b := range evs[0].Blocks {
				got = append(got, b.Hash)
			}
			if !slices.Equal(got, hashes[local/16:]) {
				t.Fatalf("transfer stored %x, want the prompt's blocks %d.. %x", got, local/16, hashes[local/16:])
			}
			if st := d.Stats(); st.KVTransfers != 1 || st.KVTransferBlocks != uint64(missing) || st.Served != uint64(1+boolInt(tt.warm != nil)) {
				t.Fatalf("decode stats %+v", st)
			}
			if cs, st := p.Cache(), p.Stats(); cs.Pinned != 0 || st.KVTransfersHeld != 0 {
				t.Fatalf("prefill worker still holds %d pins, %d transfers after the pull", cs.Pinned, st.KVTransfersHeld)
			}
			metrics := scrape(t, dsrv.URL)
			for _, want := range []string{
				`sim_kv_transfers_total{model_name="sim-model",outcome="ok"} 1`,
				fmt.Sprintf(`sim_kv_transfer_blocks_total{model_name="sim-model"} %d`, missing),
			} {
				if !strings.Contains(metrics, want) {
					t.Errorf("decode worker's metrics lack %q", want)
				}
			}
			if !strings.Contains(scrape(t, psrv.URL), `sim_kv_transfers_released_total{model_name="sim-model",reason="pulled"} 1`) {
				t.Error("prefill worker's metrics do not count the pull")
			}
			// The same params again: the transfer is gone.
			status, _, data = decodeLeg(t, dsrv, tt.chat, tt.stream, body, raw)
			if status != http.StatusBadRequest {
				t.Fatalf("second decode leg with the same params: %d %s, want 400", status, data)
			}
			if msg, _, code := errorOf(t, data); code != "kv_transfer_failed" || !strings.Contains(msg, "already pulled") {
				t.Fatalf("second decode leg: code %q message %q", code, msg)
			}
			if params.RemoteEngineID != p.EngineID() {
				t.Fatalf("params name engine %q, not the prefill worker's %q", params.RemoteEngineID, p.EngineID())
			}
		})
	}
}

func TestDecodeLegWithAFailedTransferAnswers400(t *testing.T) {
	prompt := seqTokens(7000, 40)
	other := seqTokens(8000, 40)
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedPort := closed.Addr().(*net.TCPAddr).Port
	closed.Close()

	edit := func(raw json.RawMessage, f func(m map[string]any)) json.RawMessage {
		var m map[string]any
		_ = json.Unmarshal(raw, &m)
		f(m)
		out, _ := json.Marshal(m)
		return out
	}
	tests := []struct {
		name string
		// prepare runs after the prefill leg and returns the decode leg's params and prompt.
		prepare  func(t *testing.T, p *Worker, psrv *httptest.Server, raw json.RawMessage) (json.RawMessage, []uint32)
		wantCode string
		wantMsg  string
	}{
		{"expired", func(t *testing.T, p *Worker, _ *httptest.Server, raw json.RawMessage) (json.RawMessage, []uint32) {
			poll.Holds(t, 10*time.Second, "transfer expired and unpinned", func() bool {
				return p.Stats().KVTransfersHeld == 0 && p.Cache().Pinned == 0
			})
			return raw, prompt
		}, "kv_transfer_failed", "expired"},
		{"pulled already", func(t *testing.T, _ *Worker, psrv *httptest.Server, raw json.RawMessage) (json.RawMessage, []uint32) {
			var kp testKVParams
			_ = json.Unmarshal(raw, &kp)
			if status, _, data := post(t, context.Background(), psrv.Client(), psrv.URL+KVPullPath,
				pullRequest{EngineID: kp.RemoteEngineID, BlockIDs: kp.RemoteBlockIDs}); status != http.StatusOK {
				t.Fatalf("first pull: %d %s", status, data)
			}
			return raw, prompt
		}, "kv_transfer_failed", "already pulled"},
		{"another prompt's blocks", func(*testing.T, *Worker, *httptest.Server, json.RawMessage) (json.RawMessage, []uint32) {
			return nil, other // raw is used as it came
		}, "kv_transfer_mismatch", "another prompt"},
		{"another engine", func(_ *testing.T, _ *Worker, _ *httptest.Server, raw json.RawMessage) (json.RawMessage, []uint32) {
			return edit(raw, func(m map[string]any) { m["remote_engine_id"] = "p0-0000000000000000" }), prompt
		}, "kv_transfer_failed", "not this worker's engine"},
		{"unknown block ids", func(_ *testing.T, _ *Worker, _ *httptest.Server, raw json.RawMessage) (json.RawMessage, []uint32) {
			return edit(raw, func(m map[string]any) { m["remote_block_ids"] = []int{1000, 1001} }), prompt
		}, "kv_transfer_failed", "block 1000"},
		{"unreachable prefill worker", func(_ *testing.T, _ *Worker, _ *httptest.Server, raw json.RawMessage) (json.RawMessage, []uint32) {
			return edit(raw, func(m map[string]any) { m["remote_port"] = closedPort }), prompt
		}, "kv_transfer_failed", "pull from"},
		{"prefix cache reset on the prefill worker", func(t *testing.T, p *Worker, psrv *httptest.Server, raw json.RawMessage) (json.RawMessage, []uint32) {
			if status, _, _ := post(t, context.Background(), psrv.Client(), psrv.URL+"/reset_prefix_cache", ""); status != http.StatusOK {
				t.Fatal("reset failed")
			}
			if p.Stats().KVTransfersHeld != 0 {
				t.Fatal("a reset kept the held transfer")
			}
			return raw, prompt
		}, "kv_transfer_failed", "unknown"},
	}
	for _, tt := range tests {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", tt.name, stream), func(t *testing.T) {
				timeout := time.Duration(0)
				if tt.name == "expired" {
					timeout = 30 * time.Millisecond
				}
				p, psrv := newTestWorker(t, Config{ID: "p0", KVTransferTimeout: timeout})
				d, dsrv := newTestWorker(t, Config{ID: "d0"})
				raw, _ := prefillLeg(t, psrv, false, map[string]any{"prompt": prompt})
				params, decodePrompt := tt.prepare(t, p, psrv, raw)
				if params == nil {
					params = raw
				}
				status, hdr, data := decodeLeg(t, dsrv, false, stream, map[string]any{"prompt": decodePrompt}, params)
				if status != http.StatusBadRequest || !strings.HasPrefix(hdr.Get("Content-Type"), "application/json") {
					t.Fatalf("decode leg: %d %s, want a 400 JSON error", status, data)
				}
				msg, param, code := errorOf(t, data)
				if code != tt.wantCode || param != "kv_transfer_params" || !strings.Contains(msg, tt.wantMsg) {
					t.Fatalf("error code %q param %q message %q, want code %q and a message with %q", code, param, msg, tt.wantCode, tt.wantMsg)
				}
				if st := d.Stats(); st.Served != 0 || st.KVTransfers != 0 || st.Running != 0 || d.Cache().Pinned != 0 {
					t.Fatalf("decode worker after a failed transfer: %+v, %d pinned", st, d.Cache().Pinned)
				}
				if !strings.Contains(scrape(t, dsrv.URL), `sim_kv_transfers_total{model_name="sim-model",outcome="failed"} 1`) {
					t.Error("the failed transfer is not counted")
				}
			})
		}
	}
}

func TestLegsOfTheWrongRoleAnswer400(t *testing.T) {
	prompt := seqTokens(100, 20)
	decodeParams := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "x-1",
		"remote_block_ids": []int{}, "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}
	tests := []struct {
		role      string
		params    map[string]any
		wantParam string // "" means served
	}{
		{RolePrefill, decodeParams, "kv_transfer_params.do_remote_prefill"},
		{RoleDecode, remoteDecodeParams(), "kv_transfer_params.do_remote_decode"},
		{RolePrefill, remoteDecodeParams(), ""},
		{RoleDecode, decodeParams, ""}, // no blocks to pull: nothing to fetch
		{RoleBoth, remoteDecodeParams(), ""},
		{RoleBoth, decodeParams, ""},
		{RolePrefill, nil, ""},
		{RoleDecode, nil, ""},
		{"", nil, ""},
	}
	for _, tt := range tests {
		leg := "plain"
		if tt.params != nil {
			leg = map[bool]string{true: "decode leg", false: "prefill leg"}[tt.params["do_remote_prefill"] == true]
		}
		t.Run(fmt.Sprintf("%q/%s", tt.role, leg), func(t *testing.T) {
			w, srv := newTestWorker(t, Config{Role: tt.role})
			body := map[string]any{"prompt": prompt, "max_tokens": 1}
			if tt.params != nil {
				body["kv_transfer_params"] = tt.params
			}
			status, hdr, data := post(t, context.Background(), srv.Client(), srv.URL+"/v1/completions", body)
			if tt.wantParam == "" {
				if status != http.StatusOK {
					t.Fatalf("status %d %s, want 200", status, data)
				}
				if got := hdr.Get(KVTransferHeader); (leg == "decode leg") != (got == "0") {
					t.Fatalf("%s %q on a %s", KVTransferHeader, got, leg)
				}
				return
			}
			if status != http.StatusBadRequest {
				t.Fatalf("status %d %s, want 400", status, data)
			}
			if _, param, code := errorOf(t, data); param != tt.wantParam || code != "wrong_role" {
				t.Fatalf("param %q code %q, want %q and wrong_role", param, code, tt.wantParam)
			}
			if w.Stats().PromptTokens != 0 {
				t.Fatal("a refused leg reached the engine")
			}
		})
	}
	w, srv := newTestWorker(t, Config{Role: RoleDecode})
	var stats struct {
		Role     string `json:"role"`
		EngineID string `json:"engine_id"`
	}
	resp, err := srv.Client().Get(srv.URL + "/sim/stats")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&stats); err != nil || stats.Role != RoleDecode || stats.EngineID != w.EngineID() {
		t.Fatalf("/sim/stats role %q engine %q (%v), want %q and %q", stats.Role, stats.EngineID, err, RoleDecode, w.EngineID())
	}
}

func TestMalformedKVTransferParamsAnswer400NamingTheField(t *testing.T) {
	valid := func(edit func(m map[string]any)) map[string]any {
		m := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p0-1",
			"remote_block_ids": []int{0, 1}, "remote_host": "127.0.0.1", "remote_port": 9, "tp_size": 1}
		edit(m)
		return m
	}
	set := func(k string, v any) func(map[string]any) { return func(m map[string]any) { m[k] = v } }
	del := func(k string) func(map[string]any) { return func(m map[string]any) { delete(m, k) } }
	tests := []struct {
		name   string
		params any
		stream bool
		param  string
	}{
		{"not an object", 5, false, "kv_transfer_params"},
		{"an array", []int{1}, false, "kv_transfer_params"},
		{"do_remote_decode not a boolean", map[string]any{"do_remote_decode": "yes"}, false, "kv_transfer_params.do_remote_decode"},
		{"do_remote_prefill not a boolean", map[string]any{"do_remote_prefill": 1}, false, "kv_transfer_params.do_remote_prefill"},
		{"both legs at once", map[string]any{"do_remote_prefill": true, "do_remote_decode": true}, false, "kv_transfer_params"},
		{"prefill leg streamed", remoteDecodeParams(), true, "stream"},
		{"no engine id", valid(del("remote_engine_id")), false, "kv_transfer_params.remote_engine_id"},
		{"null engine id", valid(set("remote_engine_id", nil)), false, "kv_transfer_params.remote_engine_id"},
		{"empty engine id", valid(set("remote_engine_id", "")), false, "kv_transfer_params.remote_engine_id"},
		{"numeric engine id", valid(set("remote_engine_id", 7)), false, "kv_transfer_params.remote_engine_id"},
		{"no host", valid(del("remote_host")), false, "kv_transfer_params.remote_host"},
		{"numeric host", valid(set("remote_host", 127)), false, "kv_transfer_params.remote_host"},
		{"host not loopback", valid(set("remote_host", "10.1.2.3")), false, "kv_transfer_params.remote_host"},
		{"host with a space", valid(set("remote_host", "a b")), false, "kv_transfer_params.remote_host"},
		{"host with a port", valid(set("remote_host", "127.0.0.1:80")), false, "kv_transfer_params.remote_host"},
		{"host a url", valid(set("remote_host", "http://x")), false, "kv_transfer_params.remote_host"},
		{"no port", valid(del("remote_port")), false, "kv_transfer_params.remote_port"},
		{"port zero", valid(set("remote_port", 0)), false, "kv_transfer_params.remote_port"},
		{"port too large", valid(set("remote_port", 65536)), false, "kv_transfer_params.remote_port"},
		{"port a string", valid(set("remote_port", "8001")), false, "kv_transfer_params.remote_port"},
		{"port fractional", valid(set("remote_port", 80.5)), false, "kv_transfer_params.remote_port"},
		{"no block ids", valid(del("remote_block_ids")), false, "kv_transfer_params.remote_block_ids"},
		{"block ids a string", valid(set("remote_block_ids", "0,1")), false, "kv_transfer_params.remote_block_ids"},
		{"negative block id", valid(set("remote_block_ids", []int{0, -1})), false, "kv_transfer_params.remote_block_ids"},
		{"fractional block id", valid(set("remote_block_ids", []float64{0.5})), false, "kv_transfer_params.remote_block_ids"},
		{"null block id", valid(set("remote_block_ids", []any{nil})), false, "kv_transfer_params.remote_block_ids"},
		{"repeated block id", valid(set("remote_block_ids", []int{3, 3})), false, "kv_transfer_params.remote_block_ids"},
		{"tp size 2", valid(set("tp_size", 2)), false, "kv_transfer_params.tp_size"},
	}
	w, srv := newTestWorker(t, Config{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			body := map[string]any{"prompt": "hello there", "kv_transfer_params": tt.params, "stream": tt.stream}
			status, _, data := post(t, context.Background(), srv.Client(), srv.URL+"/v1/completions", body)
			if status != http.StatusBadRequest {
				t.Fatalf("status %d %s, want 400", status, data)
			}
			msg, param, _ := errorOf(t, data)
			if param != tt.param || (strings.HasPrefix(param, "kv_transfer_params.") && !strings.Contains(msg, param)) {
				t.Fatalf("param %q message %q, want param %q named in the message", param, msg, tt.param)
			}
		})
	}
	if st := w.Stats(); st.PromptTokens != 0 || st.KVTransfers != 0 {
		t.Fatalf("malformed params reached the engine: %+v", st)
	}
	// Accepted forms: null params, both false, bracketed IPv6 loopback, a host name.
	for _, params := range []any{nil, map[string]any{}, map[string]any{"do_remote_prefill": false, "do_remote_decode": false},
		valid(set("remote_block_ids", []int{})), valid(func(m map[string]any) { m["remote_host"], m["remote_block_ids"] = "[::1]", []int{} }),
		valid(func(m map[string]any) { m["remote_host"], m["remote_block_ids"] = "localhost", []int{} }),
		valid(func(m map[string]any) { delete(m, "tp_size"); m["remote_block_ids"] = []int{} })} {
		body := map[string]any{"prompt": "hello there", "kv_transfer_params": params}
		if status, _, data := post(t, context.Background(), srv.Client(), srv.URL+"/v1/completions", body); status != http.StatusOK {
			t.Fatalf("params %v: %d %s, want 200", params, status, data)
		}
	}
}

func TestKVPullEndpointRejectsBadPulls(t *testing.T) {
	p, srv := newTestWorker(t, Config{ID: "p0"})
	_, a := prefillLeg(t, srv, false, map[string]any{"prompt": seqTokens(100, 40)})
	_, b := prefillLeg(t, srv, false, map[string]any{"prompt": seqTokens(900, 40)})
	tests := []struct {
		name   string
		body   string
		status int
		code   string
	}{
		{"empty body", ``, http.StatusBadRequest, ""},
		{"not json", `{"engine_id":`, http.StatusBadRequest, ""},
		{"array", `[1]`, http.StatusBadRequest, ""},
		{"no engine id", `{"block_ids":[0]}`, http.StatusBadRequest, ""},
		{"numeric engine id", `{"engine_id":3,"block_ids":[0]}`, http.StatusBadRequest, ""},
		{"no block ids", fmt.Sprintf(`{"engine_id":%q}`, p.EngineID()), http.StatusBadRequest, ""},
		{"empty block ids", fmt.Sprintf(`{"engine_id":%q,"block_ids":[]}`, p.EngineID()), http.StatusBadRequest, ""},
		{"negative block id", fmt.Sprintf(`{"engine_id":%q,"block_ids":[-1]}`, p.EngineID()), http.StatusBadRequest, ""},
		{"another engine", fmt.Sprintf(`{"engine_id":"p0-x","block_ids":[%d]}`, a.RemoteBlockIDs[0]), http.StatusNotFound, "unknown_engine"},
		{"unknown block", fmt.Sprintf(`{"engine_id":%q,"block_ids":[12345]}`, p.EngineID()), http.StatusNotFound, "unknown_kv_transfer"},
		{"blocks of two transfers", fmt.Sprintf(`{"engine_id":%q,"block_ids":[%d,%d]}`, p.EngineID(), a.RemoteBlockIDs[0], b.RemoteBlockIDs[0]), http.StatusBadRequest, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, _, data := post(t, context.Background(), srv.Client(), srv.URL+KVPullPath, tt.body)
			if status != tt.status {
				t.Fatalf("status %d %s, want %d", status, data, tt.status)
			}
			if _, _, code := errorOf(t, data); code != tt.code {
				t.Fatalf("code %q, want %q", code, tt.code)
			}
		})
	}
	// None of that released anything.
	if st, cs := p.Stats(), p.Cache(); st.KVTransfersHeld != 2 || cs.Pinned != 4 {
		t.Fatalf("after bad pulls: %d transfers held, %d pinned; want 2 and 4", st.KVTransfersHeld, cs.Pinned)
	}
	// A subset of one transfer's blocks is a valid pull, and releases the whole transfer.
	status, _, data := post(t, context.Background(), srv.Client(), srv.URL+KVPullPath, pullRequest{EngineID: p.EngineID(), BlockIDs: a.RemoteBlockIDs[1:]})
	if status != http.StatusOK {
		t.Fatalf("pull of one block: %d %s", status, data)
	}
	if st, cs := p.Stats(), p.Cache(); st.KVTransfersHeld != 1 || cs.Pinned != 2 {
		t.Fatalf("after a pull: %d transfers held, %d pinned; want 1 and 2", st.KVTransfersHeld, cs.Pinned)
	}
}

func TestDataParallelFrontRoutesPullsByEngineID(t *testing.T) {
	d, front := newTestDP(t, 2, Config{ID: "p0", Role: RolePrefill})
	prompt := seqTokens(4000, 40)
	// The prefill leg on rank 1.
	a := dpDo(t, front, http.MethodPost, "/v1/completions", fmt.Sprintf(
		`{"prompt":%s,"max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true}}`, mustJSON(t, prompt)), "1")
	if a.status != http.StatusOK {
		t.Fatalf("prefill leg on rank 1: %d %s", a.status, a.body)
	}
	var ans struct {
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(a.body, &ans); err != nil {
		t.Fatal(err)
	}
	var kp testKVParams
	_ = json.Unmarshal(ans.Params, &kp)
	if kp.RemoteEngineID != d.Rank(1).EngineID() || kp.RemotePort != serverPort(t, front) || d.Rank(1).Cache().Pinned != 2 {
		t.Fatalf("rank 1's params %s (rank 1's engine %s)", ans.Params, d.Rank(1).EngineID())
	}
	_, dsrv := newTestWorker(t, Config{ID: "d0", Role: RoleDecode})
	status, _, data := decodeLeg(t, dsrv, false, false, map[string]any{"prompt": prompt}, ans.Params)
	if status != http.StatusOK {
		t.Fatalf("decode leg pulling through the front: %d %s", status, data)
	}
	if d.Rank(1).Cache().Pinned != 0 || d.Rank(1).Stats().KVTransfersHeld != 0 {
		t.Fatal("rank 1 still holds the transfer")
	}
	if a := dpDo(t, front, http.MethodPost, KVPullPath, `{"engine_id":"nobody","block_ids":[0]}`); a.status != http.StatusNotFound {
		t.Fatalf("pull of an engine of no rank: %d %s", a.status, a.body)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func FuzzParseKVTransferParams(f *testing.F) {
	for _, seed := range []string{
		`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`,
		`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[0,1,2],"remote_engine_id":"w0-1","remote_host":"127.0.0.1","remote_port":8001,"tp_size":1}`,
		`{"do_remote_prefill":true,"remote_block_ids":[],"remote_engine_id":"e","remote_host":"[::1]","remote_port":1}`,
		`{"do_remote_prefill":true,"remote_block_ids":[-1],"remote_engine_id":"e","remote_host":"localhost","remote_port":1}`,
		`{"do_remote_prefill":true,"remote_block_ids":[1],"remote_engine_id":"e","remote_host":"10.0.0.1","remote_port":70000}`,
		`{"do_remote_prefill":"true"}`, `{"do_remote_prefill":true,"do_remote_decode":true}`, `{}`, `null`, `[]`, `5`, `"x"`, ``, `{"a":`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		p, aerr := parseKVTransferParams(raw)
		if aerr != nil {
			if p != nil || aerr.status != http.StatusBadRequest || aerr.message == "" || !strings.HasPrefix(aerr.param, kvParam) {
				t.Fatalf("bad error %+v for %q", aerr, raw)
			}
			return
		}
		if p == nil {
			return
		}
		if p.remoteDecode && p.remotePrefill {
			t.Fatalf("both legs accepted for %q", raw)
		}
		if p.remotePrefill {
			if p.engineID == "" || p.port < 1 || p.port > 65535 || checkRemoteHost(p.host) != nil || p.blockIDs == nil {
				t.Fatalf("accepted decode leg params break the rules: %+v for %q", p, raw)
			}
			for _, id := range p.blockIDs {
				if id < 0 {
					t.Fatalf("negative block id accepted: %q", raw)
				}
			}
		}
		// What the worker accepts also goes through a whole request body.
		body := append(append([]byte(`{"prompt":"hi","kv_transfer_params":`), raw...), '}')
		if _, aerr := decodeRequest(body, false, 512); aerr != nil && aerr.status != http.StatusBadRequest {
			t.Fatalf("request error status %d", aerr.status)
		}
	})
}

func FuzzDecodePullRequest(f *testing.F) {
	for _, seed := range []string{
		`{"engine_id":"w0-1","block_ids":[0,1,2]}`, `{"engine_id":"w0-1","block_ids":[]}`, `{"engine_id":"","block_ids":[1]}`,
		`{"engine_id":"e","block_ids":[1,1]}`, `{"engine_id":"e","block_ids":[-3]}`, `{"engine_id":"e","block_ids":[1e3]}`,
		`{"engine_id":5}`, `[]`, `null`, ``, `{"engine_id":"e","block_ids":"0"}`, `{"engine_id":"e","block_ids":[null]}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, aerr := decodePullRequest(body)
		if aerr != nil {
			if req != nil || aerr.status != http.StatusBadRequest || aerr.message == "" {
				t.Fatalf("bad error %+v for %q", aerr, body)
			}
			return
		}
		if req.EngineID == "" || len(req.BlockIDs) == 0 {
			t.Fatalf("accepted pull %+v for %q", req, body)
		}
		seen := map[int64]bool{}
		for _, id := range req.BlockIDs {
			if id < 0 || seen[id] {
				t.Fatalf("accepted block ids %v for %q", req.BlockIDs, body)
			}
			seen[id] = true
		}
	})
}
