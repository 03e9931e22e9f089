package openai

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

func TestWorkerTokenizerAsksAWorkerAndCaches(t *testing.T) {
	var calls atomic.Int64
	fw := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/tokenize" {
			http.NotFound(w, r)
			return
		}
		calls.Add(1)
		_, _ = w.Write([]byte(`{"count":3,"max_model_len":100,"tokens":[5,6,7]}`))
	})
	reg, err := routing.NewRegistry([]routing.WorkerSpec{spec("w0", fw.URL)})
	if err != nil {
		t.Fatal(err)
	}
	tok := NewWorkerTokenizer(reg, TokenizerConfig{CacheEntries: 1})
	chat, err := Parse(KindChat, []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		got, err := tok.Tokenize(context.Background(), chat)
		if err != nil || len(got) != 3 || got[0] != 5 {
			t.Fatalf("tokens %v, %v", got, err)
		}
	}
	if calls.Load() != 1 {
		t.Fatalf("worker asked %d times for one prompt, want 1 (cache)", calls.Load())
	}
	lastBody := func() map[string]json.RawMessage {
		raw, _, _ := fw.last()
		var body map[string]json.RawMessage
		_ = json.Unmarshal([]byte(raw), &body)
		return body
	}
	body := lastBody()
	if _, ok := body["messages"]; !ok || string(body["model"]) != `"m"` {
		t.Fatalf("chat tokenize body %v: want model and messages", body)
	}
	// A second prompt evicts the first (one entry): asking for the first again calls out.
	text, _ := Parse(KindCompletion, []byte(`{"model":"m","prompt":"hello"}`))
	if _, err := tok.Tokenize(context.Background(), text); err != nil {
		t.Fatal(err)
	}
	if _, ok := lastBody()["prompt"]; !ok {
		t.Fatal("completion tokenize body has no prompt")
	}
	tok.Tokenize(context.Background(), chat)
	if calls.Load() != 3 {
		t.Fatalf("calls = %d, want 3 after eviction", calls.Load())
	}
}

type failingTokenizer struct{ calls atomic.Int64 }

func (f *failingTokenizer) Tokenize(context.Context, *Request) ([]uint32, error) {
	f.calls.Add(1)
	return nil, errors.New("tokenizer down")
}

func TestTokenizeFailureStillRoutes(t *testing.T) {
	fw := newFakeWorker(t, okJSON)
	ft := &failingTokenizer{}
	rg := newRig(t, []routing.WorkerSpec{spec("w0", fw.URL)}, rigOptions{front: func(c *Config) { c.Tokenizer = ft }})
	resp, body := rg.post("/v1/completions", `{"model":"m","prompt":"some text"}`, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if ft.calls.Load() != 1 {
		t.Fatalf("tokenizer called %d times, want 1", ft.calls.Load())
	}
	if n := rg.metric("kvrouter_errors_total", map[string]string{"cause": "tokenize"}); n != 1 {
		t.Fatalf("tokenize failures counted %v, want 1", n)
	}
}
