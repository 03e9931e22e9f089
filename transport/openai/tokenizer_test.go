package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
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

type failingTokenizer struct {
	calls atomic.Int64
	err   error // nil: "tokenizer down"
}

func (f *failingTokenizer) Tokenize(context.Context, *Request) ([]uint32, error) {
	f.calls.Add(1)
	if f.err != nil {
		return nil, f.err
	}
	return nil, errors.New("tokenizer down")
}

// warnCounter counts the warnings logged through it.
type warnCounter struct{ n atomic.Int64 }

func (w *warnCounter) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }
func (w *warnCounter) Handle(context.Context, slog.Record) error    { w.n.Add(1); return nil }
func (w *warnCounter) WithAttrs([]slog.Attr) slog.Handler           { return w }
func (w *warnCounter) WithGroup(string) slog.Handler                { return w }

// TestTokenizeFailureStillRoutes: a prompt whose /tokenize fails routes on text chunks; the
// fallback is counted by reason (a timeout told from other errors) and said as a warning,
// once for a run of failures, not once per request.
func TestTokenizeFailureStillRoutes(t *testing.T) {
	for _, tc := range []struct {
		reason string
		err    error
	}{
		{"error", nil},
		{"timeout", fmt.Errorf("tokenize: %w", context.DeadlineExceeded)},
	} {
		t.Run(tc.reason, func(t *testing.T) {
			fw := newFakeWorker(t, okJSON)
			ft := &failingTokenizer{err: tc.err}
			warns := &warnCounter{}
			rg := newRig(t, []routing.WorkerSpec{spec("w0", fw.URL)}, rigOptions{front: func(c *Config) {
				c.Tokenizer = ft
				c.Logger = slog.New(warns)
			}})
			for range 3 {
				resp, body := rg.post("/v1/completions", `{"model":"m","prompt":"some text"}`, nil)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d: %s", resp.StatusCode, body)
				}
			}
			if ft.calls.Load() != 3 {
				t.Fatalf("tokenizer called %d times, want 3", ft.calls.Load())
			}
			if n := rg.metric("kvrouter_errors_total", map[string]string{"cause": "tokenize"}); n != 3 {
				t.Fatalf("tokenize failures counted %v, want 3", n)
			}
			if n := rg.metric("kvrouter_tokenize_fallbacks_total", map[string]string{"reason": tc.reason}); n != 3 {
				t.Fatalf("fallbacks{reason=%s} %v, want 3", tc.reason, n)
			}
			if n := warns.n.Load(); n != 1 {
				t.Fatalf("%d warnings for three failures in a row, want 1", n)
			}
		})
	}
}

// fixedAliases is an alias table that does not change.
type fixedAliases map[string]routing.Alias

func (f fixedAliases) Alias(name string) (routing.Alias, bool) { a, ok := f[name]; return a, ok }
func (f fixedAliases) List() []routing.Alias {
	var out []routing.Alias
	for _, a := range f {
		out = append(out, a)
	}
	return out
}

// TestAnAliasIsTokenizedAsItsTarget: with llama -> llama-v2 / llama-v3 and two workers, one
// serving each, a request for llama is tokenized as the target it is sent as, by a worker that
// serves that target (each worker refuses any other model, 404, as vLLM does): no prompt
// falls back to text keys, and every request reaches a worker as the model it serves.
func TestAnAliasIsTokenizedAsItsTarget(t *testing.T) {
	models := []string{"llama-v2", "llama-v3"}
	var refused atomic.Int64
	var tokenized [2]atomic.Int64 // by target
	// The requests come one at a time, each prompt new: a request's prompt was tokenized
	// last, as the model it is then sent as.
	var lastTokenized atomic.Value
	var mismatched atomic.Int64
	var specs []routing.WorkerSpec
	for i, m := range models {
		var fw *fakeWorker
		fw = newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
			// The requests come one at a time: the last body is this one's.
			raw, _, _ := fw.last()
			var req struct {
				Model string `json:"model"`
			}
			_ = json.Unmarshal([]byte(raw), &req)
			if req.Model != m {
				refused.Add(1)
				http.Error(w, `{"error":{"message":"The model does not exist.","code":"model_not_found"}}`, http.StatusNotFound)
				return
			}
			if r.URL.Path == "/tokenize" {
				tokenized[i].Add(1)
				lastTokenized.Store(m)
				_, _ = w.Write([]byte(`{"count":3,"max_model_len":100,"tokens":[5,6,7]}`))
				return
			}
			if lastTokenized.Load() != m {
				mismatched.Add(1)
			}
			okJSON(w, r)
		})
		sp := spec(fmt.Sprintf("w%d", i), fw.URL)
		sp.Models = []string{m}
		specs = append(specs, sp)
	}
	tokReg, err := routing.NewRegistry(specs)
	if err != nil {
		t.Fatal(err)
	}
	rg := newRig(t, specs, rigOptions{front: func(c *Config) {
		c.Tokenizer = NewWorkerTokenizer(tokReg, TokenizerConfig{})
		c.Aliases = fixedAliases{"llama": {Name: "llama", Targets: []routing.AliasTarget{{Model: models[0], Weight: 1}, {Model: models[1], Weight: 1}}}}
	}})
	for s := range 10 {
		for turn := range 2 {
			resp, body := rg.post("/v1/chat/completions",
				fmt.Sprintf(`{"model":"llama","messages":[{"role":"user","content":"turn %d of session %d"}]}`, turn, s),
				map[string]string{"X-Session-Id": fmt.Sprintf("s%d", s)})
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("session %d turn %d: %d %s", s, turn, resp.StatusCode, body)
			}
		}
	}
	if n := refused.Load(); n != 0 {
		t.Fatalf("workers were asked %d times for a model they do not serve", n)
	}
	if n := mismatched.Load(); n != 0 {
		t.Fatalf("%d requests were sent as another model than their prompt was tokenized as", n)
	}
	if n := rg.metric("kvrouter_tokenize_fallbacks_total", map[string]string{"reason": "error"}); n != 0 {
		t.Fatalf("%v prompts fell back to text keys", n)
	}
	if tokenized[0].Load() == 0 || tokenized[1].Load() == 0 {
		t.Fatalf("prompts tokenized as %s: %d, as %s: %d; want both targets drawn", models[0], tokenized[0].Load(), models[1], tokenized[1].Load())
	}
}
