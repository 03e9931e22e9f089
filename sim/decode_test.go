package sim

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
)

func assertErrorShape(t *testing.T, body []byte, wantType string) {
	t.Helper()
	var e struct {
		Error *struct {
			Message string          `json:"message"`
			Type    string          `json:"type"`
			Param   json.RawMessage `json:"param"`
			Code    json.RawMessage `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("error body %q: %v", body, err)
	}
	if e.Error == nil || e.Error.Message == "" || e.Error.Type != wantType || e.Error.Param == nil || e.Error.Code == nil {
		t.Fatalf("error body %s: want message, type %q, param and code keys", body, wantType)
	}
}

func TestBadRequestsAnswer400WithErrorShape(t *testing.T) {
	_, srv := newTestWorker(t, Config{MaxModelLen: 64})
	tests := []struct {
		name, path, body, param string
	}{
		{"empty body", "/v1/completions", ``, ""},
		{"not json", "/v1/completions", `{"prompt":`, ""},
		{"json array", "/v1/completions", `[1,2]`, ""},
		{"no prompt", "/v1/completions", `{"model":"sim-model"}`, "prompt"},
		{"empty prompt", "/v1/completions", `{"prompt":"  "}`, "prompt"},
		{"empty token list", "/v1/completions", `{"prompt":[]}`, "prompt"},
		{"batched prompts", "/v1/completions", `{"prompt":["a","b"]}`, "prompt"},
		{"batched token lists", "/v1/completions", `{"prompt":[[1],[2]]}`, "prompt"},
		{"negative token", "/v1/completions", `{"prompt":[1,-2]}`, "prompt"},
		{"token too large", "/v1/completions", `{"prompt":[4294967296]}`, "prompt"},
		{"fractional token", "/v1/completions", `{"prompt":[1.5]}`, "prompt"},
		{"prompt object", "/v1/completions", `{"prompt":{"a":1}}`, "prompt"},
		{"zero max_tokens", "/v1/completions", `{"prompt":"hi","max_tokens":0}`, "max_tokens"},
		{"string max_tokens", "/v1/completions", `{"prompt":"hi","max_tokens":"9"}`, "max_tokens"},
		{"n above one", "/v1/completions", `{"prompt":"hi","n":2}`, "n"},
		{"stream options without stream", "/v1/completions", `{"prompt":"hi","stream_options":{"include_usage":true}}`, "stream_options"},
		{"too long for the model", "/v1/completions", `{"prompt":"` + strings.Repeat("w ", 60) + `"}`, ""},
		{"no messages", "/v1/chat/completions", `{"prompt":"hi"}`, "messages"},
		{"empty messages", "/v1/chat/completions", `{"messages":[]}`, "messages"},
		{"message without role", "/v1/chat/completions", `{"messages":[{"content":"hi"}]}`, "messages[0].role"},
		{"image part", "/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`, "messages[0].content[0]"},
		{"numeric content", "/v1/chat/completions", `{"messages":[{"role":"user","content":5}]}`, "messages[0].content"},
		{"zero max_completion_tokens", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":0}`, "max_completion_tokens"},
		{"tokenize nothing", "/tokenize", `{"model":"sim-model"}`, ""},
		{"tokenize token ids", "/tokenize", `{"prompt":[1,2]}`, "prompt"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, _, body := post(t, context.Background(), srv.Client(), srv.URL+tt.path, tt.body)
			if status != http.StatusBadRequest {
				t.Fatalf("status %d, want 400: %s", status, body)
			}
			assertErrorShape(t, body, "invalid_request_error")
			var e struct {
				Error struct {
					Param *string `json:"param"`
				} `json:"error"`
			}
			_ = json.Unmarshal(body, &e)
			if got := ""; e.Error.Param != nil {
				got = *e.Error.Param
				if got != tt.param {
					t.Fatalf("param %q, want %q", got, tt.param)
				}
			} else if tt.param != "" {
				t.Fatalf("param null, want %q", tt.param)
			}
		})
	}
}

func TestOversizedBodyAnswers413(t *testing.T) {
	_, srv := newTestWorker(t, Config{MaxBodyBytes: 1024})
	body := `{"prompt":"` + strings.Repeat("x", 2048) + `"}`
	for _, path := range []string{"/v1/completions", "/v1/chat/completions", "/tokenize"} {
		status, _, resp := post(t, context.Background(), srv.Client(), srv.URL+path, body)
		if status != http.StatusRequestEntityTooLarge {
			t.Fatalf("%s: status %d, want 413", path, status)
		}
		assertErrorShape(t, resp, "invalid_request_error")
	}
}

func TestUnknownModelAnswers404(t *testing.T) {
	_, srv := newTestWorker(t, Config{})
	status, _, body := post(t, context.Background(), srv.Client(), srv.URL+"/v1/completions", `{"model":"other","prompt":"hi"}`)
	if status != http.StatusNotFound {
		t.Fatalf("status %d, want 404", status)
	}
	assertErrorShape(t, body, "invalid_request_error")
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{"zero config is valid", Config{}, ""},
		{"negative block size", Config{BlockSize: -1}, "block size"},
		{"negative capacity", Config{CapacityBlocks: -5}, "capacity"},
		{"negative running", Config{MaxRunning: -1}, "max running"},
		{"negative duration", Config{DecodePerToken: -time.Millisecond}, "decode per token"},
		{"negative speedup", Config{Speedup: -2}, "speedup"},
		{"error rate above one", Config{ErrorRate: 1.5}, "error rate"},
		{"negative stall", Config{Stall: -time.Millisecond}, "stall"},
		{"every role", Config{Role: RolePrefill}, ""},
		{"unknown role", Config{Role: "encode"}, "role"},
		{"negative chunked prefill", Config{ChunkedPrefillTokens: -1}, "chunked prefill tokens"},
		{"negative transfer timeout", Config{KVTransferTimeout: -time.Second}, "kv transfer timeout"},
		{"negative transfer per block", Config{TransferPerBlock: -time.Microsecond}, "kv transfer per block"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %v, want one mentioning %q", err, tt.wantErr)
			}
			if _, err := New(tt.cfg); err == nil {
				t.Fatal("New accepted an invalid config")
			}
		})
	}
}

func FuzzDecodeRequest(f *testing.F) {
	for _, seed := range []string{
		`{"prompt":"hello world","max_tokens":4}`,
		`{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"prompt":[[1,2,3]]}`,
		`{"prompt":["text"]}`,
		`{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"add_generation_prompt":false}`,
		`{"messages":[{"role":"assistant","content":null}]}`,
		`{"prompt":[-1]}`, `{"prompt":{}}`, `{"prompt":"p","max_tokens":"5"}`, `[]`, `null`, ``, `{"prompt":"\xff\xfe"}`,
	} {
		f.Add(false, []byte(seed))
		f.Add(true, []byte(seed))
	}
	const maxModelLen = 512
	f.Fuzz(func(t *testing.T, chat bool, body []byte) {
		req, aerr := decodeRequest(body, chat, maxModelLen)
		if aerr != nil {
			if aerr.status != http.StatusBadRequest || aerr.message == "" || req != nil || jsonerr.ShowsGoTypes(aerr.message) {
				t.Fatalf("bad error %+v for %q", aerr, body)
			}
			return
		}
		if len(req.prompt) == 0 || req.maxTokens < 1 || req.maxTokens > maxMaxTokens ||
			len(req.prompt)+req.maxTokens > maxModelLen || req.chat != chat {
			t.Fatalf("accepted request breaks limits: %+v for %q", req, body)
		}
		if _, _, aerr := decodeTokenize(body); aerr != nil && aerr.status != http.StatusBadRequest {
			t.Fatalf("tokenize error status %d", aerr.status)
		}
	})
}
