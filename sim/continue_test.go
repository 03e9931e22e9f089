package sim

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestContinuationGeneratesTheRestOfTheUninterruptedAnswer: a request that continues an
// answer cut after k words (completions: the prompt followed by those words; chat: the
// messages and a final assistant message holding them, continue_final_message) generates
// exactly the words after k of the uninterrupted answer, so a router that moves a stream to
// another worker can be checked for duplicated or missing tokens.
func TestContinuationGeneratesTheRestOfTheUninterruptedAnswer(t *testing.T) {
	_, srv := newTestWorker(t, Config{MaxModelLen: 4096})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	const n = 24
	user := map[string]any{"role": "user", "content": "Tell me about prefix caches."}
	tests := []struct {
		name string
		path string
		// whole is the uninterrupted request; cont the continuation after partial.
		whole func() map[string]any
		cont  func(partial string, left int) map[string]any
	}{
		{"completions", "/v1/completions",
			func() map[string]any { return map[string]any{"prompt": "Once upon a time", "max_tokens": n} },
			func(partial string, left int) map[string]any {
				return map[string]any{"prompt": "Once upon a time" + partial, "max_tokens": left}
			}},
		{"chat", "/v1/chat/completions",
			func() map[string]any { return map[string]any{"messages": []any{user}, "max_tokens": n} },
			func(partial string, left int) map[string]any {
				return map[string]any{"messages": []any{user, map[string]any{"role": "assistant", "content": partial}},
					"continue_final_message": true, "add_generation_prompt": false, "max_tokens": left}
			}},
	}
	text := func(t *testing.T, body []byte) string {
		t.Helper()
		var r testResponse
		if err := json.Unmarshal(body, &r); err != nil || len(r.Choices) != 1 {
			t.Fatalf("answer %q: %v", body, err)
		}
		if m := r.Choices[0].Message; m != nil {
			return m.Content
		}
		return r.Choices[0].Text
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, _, body := post(t, ctx, srv.Client(), srv.URL+tt.path, tt.whole())
			if status != http.StatusOK {
				t.Fatalf("whole answer: %d %s", status, body)
			}
			whole := text(t, body)
			words := strings.SplitAfter(whole, " ")
			for _, k := range []int{1, 7, n - 1} {
				// The pieces sent before the cut: each word with the space before it.
				pieces := strings.Fields(whole)
				partial := strings.Join(pieces[:k], " ")
				if tt.name == "completions" {
					partial = " " + partial
				}
				status, _, body := post(t, ctx, srv.Client(), srv.URL+tt.path, tt.cont(partial, n-k))
				if status != http.StatusOK {
					t.Fatalf("continuation after %d words: %d %s", k, status, body)
				}
				if got := partial + text(t, body); got != whole {
					t.Errorf("after %d of %d words the continuation makes %q, want %q", k, len(words), got, whole)
				}
			}
		})
	}
}

// TestContinueFinalMessageIsCheckedAsVLLMChecksIt: continue_final_message with a generation
// prompt, or after a message that is not the assistant's, is a 400 naming the field.
func TestContinueFinalMessageIsCheckedAsVLLMChecksIt(t *testing.T) {
	_, srv := newTestWorker(t, Config{MaxModelLen: 4096})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	user := map[string]any{"role": "user", "content": "hi"}
	tests := []struct {
		name string
		body map[string]any
	}{
		{"with a generation prompt", map[string]any{"messages": []any{user, map[string]any{"role": "assistant", "content": "x"}},
			"continue_final_message": true}},
		{"after a user message", map[string]any{"messages": []any{user}, "continue_final_message": true, "add_generation_prompt": false}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, _, body := post(t, ctx, srv.Client(), srv.URL+"/v1/chat/completions", tt.body)
			if status != http.StatusBadRequest || !strings.Contains(string(body), `"param":"continue_final_message"`) {
				t.Fatalf("got %d %s, want 400 naming continue_final_message", status, body)
			}
		})
	}
}
