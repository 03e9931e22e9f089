package openai

import (
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"
)

func TestParseAcceptsWhatRoutingNeeds(t *testing.T) {
	tests := []struct {
		name       string
		kind       Kind
		body       string
		wantModel  string
		wantStream bool
		wantText   string
		wantTokens []uint32
	}{
		{"chat string content", KindChat,
			`{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}`,
			"m", false, "system\nbe brief\nuser\nhi\n", nil},
		{"chat text parts", KindChat,
			`{"model":"m","stream":true,"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}`,
			"m", true, "user\nab\n", nil},
		{"chat image part is the worker's business", KindChat,
			`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"see"}]}]}`,
			"m", false, "user\nsee\n", nil},
		{"chat assistant tool call without content", KindChat,
			`{"model":"m","messages":[{"role":"user","content":"q"},{"role":"assistant","content":null,"tool_calls":[]}]}`,
			"m", false, "user\nq\nassistant\n\n", nil},
		{"unknown fields ignored", KindChat,
			`{"model":"m","temperature":0.2,"x":{"y":[1,2]},"messages":[{"role":"user","content":"hi","name":"n"}]}`,
			"m", false, "user\nhi\n", nil},
		{"completion string", KindCompletion, `{"model":"m","prompt":"hello"}`, "m", false, "hello", nil},
		{"completion empty string", KindCompletion, `{"model":"m","prompt":""}`, "m", false, "", nil},
		{"completion one string", KindCompletion, `{"model":"m","prompt":["hello"]}`, "m", false, "hello", nil},
		{"completion token ids", KindCompletion, `{"model":"m","prompt":[1, 2 ,2147483647],"stream":false}`,
			"m", false, "", []uint32{1, 2, 2147483647}},
		{"completion one token array", KindCompletion, `{"model":"m","prompt":[[0,5]]}`, "m", false, "", []uint32{0, 5}},
		{"null stream is absent", KindCompletion, `{"model":"m","prompt":"p","stream":null}`, "m", false, "p", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := Parse(tt.kind, []byte(tt.body))
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if req.Model != tt.wantModel || req.Stream != tt.wantStream || req.Text != tt.wantText {
				t.Fatalf("got model %q stream %v text %q; want %q %v %q", req.Model, req.Stream, req.Text,
					tt.wantModel, tt.wantStream, tt.wantText)
			}
			if req.HasTokens != (tt.wantTokens != nil) || !slices.Equal(req.Tokens, tt.wantTokens) {
				t.Fatalf("tokens %v (has %v), want %v", req.Tokens, req.HasTokens, tt.wantTokens)
			}
			if string(req.Body) != tt.body {
				t.Fatal("body was not kept as sent")
			}
		})
	}
}

func TestParseErrorsNameTheirField(t *testing.T) {
	tests := []struct {
		name      string
		kind      Kind
		body      string
		wantParam string
		wantMsg   string
	}{
		{"not json", KindChat, `{"model":`, "", "not valid JSON"},
		{"not an object", KindChat, `[1,2]`, "", "must be a JSON object"},
		{"null body", KindChat, `null`, "", "must be a JSON object"},
		{"missing model", KindChat, `{"messages":[{"role":"user","content":"x"}]}`, "model", "missing required field: model"},
		{"null model", KindCompletion, `{"model":null,"prompt":"x"}`, "model", "missing required field: model"},
		{"model not string", KindChat, `{"model":7,"messages":[]}`, "model", "model must be a string"},
		{"model empty", KindChat, `{"model":"","messages":[]}`, "model", "non-empty"},
		{"model key is case sensitive", KindChat, `{"Model":"m","messages":[{"role":"user","content":"x"}]}`, "model", "missing required field: model"},
		{"stream not bool", KindChat, `{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}`, "stream", "stream must be a boolean"},
		{"missing messages", KindChat, `{"model":"m"}`, "messages", "missing required field: messages"},
		{"empty messages", KindChat, `{"model":"m","messages":[]}`, "messages", "messages must be a non-empty array"},
		{"messages not array", KindChat, `{"model":"m","messages":{"role":"user"}}`, "messages", "messages must be a non-empty array"},
		{"message not object", KindChat, `{"model":"m","messages":["hi"]}`, "messages[0]", "must be an object"},
		{"role missing", KindChat, `{"model":"m","messages":[{"content":"x"}]}`, "messages[0].role", "role must be a string"},
		{"role not string", KindChat, `{"model":"m","messages":[{"role":1,"content":"x"}]}`, "messages[0].role", "role must be a string"},
		{"content missing", KindChat, `{"model":"m","messages":[{"role":"user"}]}`, "messages[0].content", "missing required field"},
		{"content number", KindChat, `{"model":"m","messages":[{"role":"user","content":"a"},{"role":"user","content":5}]}`, "messages[1].content", "string or an array of text parts"},
		{"part without type", KindChat, `{"model":"m","messages":[{"role":"user","content":[{"text":"a"}]}]}`, "messages[0].content[0].type", "type must be a string"},
		{"text part without text", KindChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":3}]}]}`, "messages[0].content[0].text", "text must be a string"},
		{"part not object", KindChat, `{"model":"m","messages":[{"role":"user","content":["a"]}]}`, "messages[0].content[0]", "must be an object"},
		{"missing prompt", KindCompletion, `{"model":"m"}`, "prompt", "missing required field: prompt"},
		{"prompt number", KindCompletion, `{"model":"m","prompt":5}`, "prompt", "prompt must be a string or an array of token ids"},
		{"prompt empty array", KindCompletion, `{"model":"m","prompt":[]}`, "prompt", "must not be an empty array"},
		{"prompt negative id", KindCompletion, `{"model":"m","prompt":[1,-2]}`, "prompt", "prompt must be a string or an array of token ids"},
		{"prompt float id", KindCompletion, `{"model":"m","prompt":[1.5]}`, "prompt", "array of token ids"},
		{"prompt exponent id", KindCompletion, `{"model":"m","prompt":[1e3]}`, "prompt", "array of token ids"},
		{"prompt id too large", KindCompletion, `{"model":"m","prompt":[2147483648]}`, "prompt", "array of token ids"},
		{"prompt mixed", KindCompletion, `{"model":"m","prompt":[1,"a"]}`, "prompt", "array of token ids"},
		{"prompt string batch", KindCompletion, `{"model":"m","prompt":["a","b"]}`, "prompt", "exactly one string"},
		{"prompt token batch", KindCompletion, `{"model":"m","prompt":[[1],[2]]}`, "prompt", "exactly one token array"},
		{"prompt empty inner", KindCompletion, `{"model":"m","prompt":[[]]}`, "prompt", "must not be an empty array"},
		{"prompt nested too deep", KindCompletion, `{"model":"m","prompt":[[[1]]]}`, "prompt", "array of token ids"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse(tt.kind, []byte(tt.body))
			var apiErr *Error
			if !errors.As(err, &apiErr) {
				t.Fatalf("Parse returned %v, want an *Error", err)
			}
			if apiErr.Status != http.StatusBadRequest || apiErr.Type != TypeInvalidRequest {
				t.Fatalf("status %d type %q, want 400 %q", apiErr.Status, apiErr.Type, TypeInvalidRequest)
			}
			if apiErr.Param != tt.wantParam {
				t.Fatalf("param %q, want %q (message %q)", apiErr.Param, tt.wantParam, apiErr.Message)
			}
			if !strings.Contains(apiErr.Message, tt.wantMsg) {
				t.Fatalf("message %q does not contain %q", apiErr.Message, tt.wantMsg)
			}
		})
	}
}

func TestPromptTokensEstimatesText(t *testing.T) {
	req, err := Parse(KindCompletion, []byte(`{"model":"m","prompt":"`+strings.Repeat("x", 41)+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := req.PromptTokens(); got != 10 {
		t.Fatalf("PromptTokens = %d, want 41/4 = 10", got)
	}
	req, err = Parse(KindCompletion, []byte(`{"model":"m","prompt":[1,2,3]}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := req.PromptTokens(); got != 3 {
		t.Fatalf("PromptTokens = %d, want 3", got)
	}
}

func TestDetectKind(t *testing.T) {
	if k := DetectKind([]byte(`{"model":"m","messages":[]}`)); k != KindChat {
		t.Fatalf("messages body detected as %v", k)
	}
	if k := DetectKind([]byte(`{"model":"m","prompt":"x"}`)); k != KindCompletion {
		t.Fatalf("prompt body detected as %v", k)
	}
	if k := DetectKind([]byte(`garbage`)); k != KindCompletion {
		t.Fatalf("garbage detected as %v", k)
	}
}

func FuzzParse(f *testing.F) {
	seeds := []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","stream":true,"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`,
		`{"model":"m","messages":[{"role":"assistant","content":null}]}`,
		`{"model":"m","prompt":"hello"}`,
		`{"model":"m","prompt":[1,2,3]}`,
		`{"model":"m","prompt":[[1,2]]}`,
		`{"model":"m","prompt":["x"]}`,
		`{"model":"m","prompt":[1e3]}`,
		`{"model":"m","prompt":[-1]}`,
		`{"model":"m","prompt":[[[]]]}`,
		`{"model":7}`,
		`{"model":"m","messages":[]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}`,
		`null`, `[]`, `"x"`, `{`, ``, `{"model":"m","prompt":[2147483648]}`,
	}
	for _, s := range seeds {
		f.Add(true, []byte(s))
		f.Add(false, []byte(s))
	}
	f.Fuzz(func(t *testing.T, chat bool, body []byte) {
		kind := KindCompletion
		if chat {
			kind = KindChat
		}
		req, err := Parse(kind, body)
		if err != nil {
			var apiErr *Error
			if !errors.As(err, &apiErr) || apiErr.Status != http.StatusBadRequest || apiErr.Message == "" {
				t.Fatalf("error %v is not a 400 *Error with a message", err)
			}
			return
		}
		if req.Model == "" || req.Kind != kind || string(req.Body) != string(body) {
			t.Fatalf("accepted request lacks what routing needs: %+v", req)
		}
		if req.HasTokens && (req.Text != "" || kind != KindCompletion || len(req.Tokens) == 0) {
			t.Fatalf("token prompt inconsistent: %+v", req)
		}
		for _, id := range req.Tokens {
			if id > maxTokenID {
				t.Fatalf("token id %d out of range", id)
			}
		}
		if kind == KindChat && !strings.Contains(req.Text, "\n") {
			t.Fatalf("chat request rendered no message: %q", req.Text)
		}
	})
}
