package sim

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
)

func TestTokenizeSplitsWordsAndPunctuation(t *testing.T) {
	tests := []struct {
		name    string
		text    string
		special bool
		want    []uint32
	}{
		{"empty without BOS", "", false, []uint32{}},
		{"empty with BOS", "", true, []uint32{BOSToken}},
		{"words and punctuation", "Hello, world!!", true,
			[]uint32{BOSToken, pieceToken("Hello"), pieceToken(","), pieceToken("world"), pieceToken("!!")}},
		{"white space only separates", "  a\t\nb  ", false, []uint32{pieceToken("a"), pieceToken("b")}},
		{"long runs split every 8 runes", "abcdefghijk", false, []uint32{pieceToken("abcdefgh"), pieceToken("ijk")}},
		{"unicode letters form words", "héllo wörld", false, []uint32{pieceToken("héllo"), pieceToken("wörld")}},
		{"template markers", "<|user|>\nhi\n", false,
			[]uint32{pieceToken("<|"), pieceToken("user"), pieceToken("|>"), pieceToken("hi")}},
		{"invalid utf-8 still tokenizes", "a\xffb", false, []uint32{pieceToken("a"), pieceToken("\xff"), pieceToken("b")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Tokenize(tt.text, tt.special)
			if !slices.Equal(got, tt.want) {
				t.Fatalf("Tokenize(%q) = %v, want %v", tt.text, got, tt.want)
			}
			if again := Tokenize(tt.text, tt.special); !slices.Equal(got, again) {
				t.Fatalf("Tokenize is not deterministic: %v then %v", got, again)
			}
		})
	}
}

func TestPieceTokensStayInRange(t *testing.T) {
	for _, p := range []string{"a", "zz", "<|", "0123", "日本", "\x00"} {
		id := pieceToken(p)
		if id < FirstPieceToken || id >= FirstPieceToken+PieceTokens {
			t.Errorf("pieceToken(%q) = %d, outside [%d, %d)", p, id, FirstPieceToken, FirstPieceToken+PieceTokens)
		}
	}
}

func TestChatsSharingLeadingMessagesShareTokenPrefix(t *testing.T) {
	base := []ChatMessage{{"system", "You are terse."}, {"user", "Name three rivers."}}
	longer := append(slices.Clone(base), ChatMessage{"assistant", "Nile Amazon Yangtze"}, ChatMessage{"user", "And lakes?"})
	a := Tokenize(RenderChat(base, false), true)
	b := Tokenize(RenderChat(longer, true), true)
	if !slices.Equal(a, b[:len(a)]) {
		t.Fatalf("token prefix not shared:\n%v\n%v", a, b)
	}
	if got := RenderChat(base[:1], true); got != "<|system|>\nYou are terse.\n<|assistant|>\n" {
		t.Fatalf("template = %q", got)
	}
}

func TestFillerWordsAreSingleTokens(t *testing.T) {
	for _, w := range fillerWords {
		if got := Tokenize(w, false); len(got) != 1 || got[0] != pieceToken(w) {
			t.Errorf("filler word %q tokenizes to %v, want one token", w, got)
		}
	}
	out := newOutput(seqTokens(5, 40), 50, true)
	text := ""
	for _, p := range out.pieces {
		text += p
	}
	if got := Tokenize(text, false); !slices.Equal(got, out.tokens) {
		t.Fatalf("generated text re-tokenizes to %v, want %v", got, out.tokens)
	}
}

func TestTokenizeEndpointMatchesTokenizer(t *testing.T) {
	_, srv := newTestWorker(t, Config{MaxModelLen: 4096})
	msgs := []map[string]any{
		{"role": "system", "content": "Be brief."},
		{"role": "user", "content": []map[string]any{{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}}},
	}
	chat := []ChatMessage{{"system", "Be brief."}, {"user", "part one\npart two"}}
	tests := []struct {
		name string
		body map[string]any
		want []uint32
	}{
		{"prompt", map[string]any{"model": "sim-model", "prompt": "Hello there, friend."}, Tokenize("Hello there, friend.", true)},
		{"prompt without special tokens", map[string]any{"prompt": "Hello", "add_special_tokens": false}, Tokenize("Hello", false)},
		{"messages", map[string]any{"messages": msgs}, Tokenize(RenderChat(chat, true), true)},
		{"messages without generation prompt", map[string]any{"messages": msgs, "add_generation_prompt": false},
			Tokenize(RenderChat(chat, false), true)},
	}
	// A model the worker does not serve is refused, as vLLM refuses it.
	if status, _, body := post(t, context.Background(), srv.Client(), srv.URL+"/tokenize",
		map[string]any{"model": "other-model", "prompt": "Hello"}); status != http.StatusNotFound || !strings.Contains(string(body), "model_not_found") {
		t.Fatalf("tokenize for a model not served: %d %s, want 404 model_not_found", status, body)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, _, body := post(t, context.Background(), srv.Client(), srv.URL+"/tokenize", tt.body)
			if status != http.StatusOK {
				t.Fatalf("status %d: %s", status, body)
			}
			var got struct {
				Count       *int     `json:"count"`
				MaxModelLen *int     `json:"max_model_len"`
				Tokens      []uint32 `json:"tokens"`
			}
			if err := json.Unmarshal(body, &got); err != nil {
				t.Fatalf("decode %s: %v", body, err)
			}
			if got.Count == nil || got.MaxModelLen == nil {
				t.Fatalf("missing count or max_model_len: %s", body)
			}
			if *got.Count != len(tt.want) || !slices.Equal(got.Tokens, tt.want) || *got.MaxModelLen != 4096 {
				t.Fatalf("got count %d tokens %v max %d, want %d %v 4096", *got.Count, got.Tokens, *got.MaxModelLen, len(tt.want), tt.want)
			}
		})
	}
}
