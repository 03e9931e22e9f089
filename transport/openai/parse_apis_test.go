package openai

import (
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
)

// TestParseAPIs: the Responses, Messages, count_tokens and Embeddings bodies clients send
// parse into what routing needs (model, stream, the prompt as text or ids), and the ones they
// must not send are refused naming the field.
func TestParseAPIs(t *testing.T) {
	tests := []struct {
		name      string
		kind      Kind
		body      string
		wantText  string // "" with wantParam set: an error
		wantParam string
		stream    bool
		tokens    int
	}{
		{"responses, string input", KindResponses, `{"model":"m","input":"hi"}`, "user\nhi\n", "", false, 0},
		{"responses, items", KindResponses, `{"model":"m","stream":true,"instructions":"be brief","input":[{"role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_image","image_url":"x"}]},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"b"}]},{"type":"function_call_output","call_id":"c","output":"{}"}]}`,
			"system\nbe brief\nuser\na\nassistant\nb\n", "", true, 0},
		{"responses, no input", KindResponses, `{"model":"m"}`, "", "input", false, 0},
		{"responses, empty input", KindResponses, `{"model":"m","input":[]}`, "", "input", false, 0},
		{"responses, bad input", KindResponses, `{"model":"m","input":5}`, "", "input", false, 0},
		{"responses, no model", KindResponses, `{"input":"x"}`, "", "model", false, 0},
		{"messages", KindMessages, `{"model":"m","max_tokens":5,"system":[{"type":"text","text":"sys"}],"messages":[{"role":"user","content":"q"},{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"tool_use","id":"t","name":"f","input":{}}]}]}`,
			"system\nsys\nuser\nq\nassistant\na\n", "", false, 0},
		{"messages, no max_tokens", KindMessages, `{"model":"m","messages":[{"role":"user","content":"q"}]}`, "", "max_tokens", false, 0},
		{"messages, zero max_tokens", KindMessages, `{"model":"m","max_tokens":0,"messages":[{"role":"user","content":"q"}]}`, "", "max_tokens", false, 0},
		{"messages, system role in messages", KindMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"system","content":"q"}]}`, "", "messages[0].role", false, 0},
		{"messages, empty", KindMessages, `{"model":"m","max_tokens":1,"messages":[]}`, "", "messages", false, 0},
		{"messages, text part without text", KindMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text"}]}]}`, "", "messages[0].content[0].text", false, 0},
		{"count_tokens needs no max_tokens", KindCountTokens, `{"model":"m","messages":[{"role":"user","content":"q"}]}`, "user\nq\n", "", false, 0},
		{"embeddings, string", KindEmbeddings, `{"model":"m","input":"e"}`, "e", "", false, 0},
		{"embeddings, batch routes on the first", KindEmbeddings, `{"model":"m","input":["e1","e2"]}`, "e1", "", false, 0},
		{"embeddings, ids", KindEmbeddings, `{"model":"m","input":[1,2,3]}`, "", "", false, 3},
		{"embeddings, id batches", KindEmbeddings, `{"model":"m","input":[[4,5],[6]]}`, "", "", false, 2},
		{"embeddings, id too large", KindEmbeddings, `{"model":"m","input":[4294967295]}`, "", "input", false, 0},
		{"embeddings, no input", KindEmbeddings, `{"model":"m"}`, "", "input", false, 0},
		{"kv_transfer_params refused here too", KindMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"q"}],"kv_transfer_params":{}}`, "", "kv_transfer_params", false, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := Parse(tt.kind, []byte(tt.body))
			if tt.wantParam != "" {
				var apiErr *Error
				if !errors.As(err, &apiErr) || apiErr.Status != http.StatusBadRequest || apiErr.Param != tt.wantParam {
					t.Fatalf("Parse = %v, want a 400 naming %q", err, tt.wantParam)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if req.Model != "m" || req.Stream != tt.stream || req.Text != tt.wantText || len(req.Tokens) != tt.tokens {
				t.Fatalf("Parse = %+v, want text %q stream %v tokens %d", req, tt.wantText, tt.stream, tt.tokens)
			}
		})
	}
	// Turns of one conversation share their rendering's prefix, as chat's do.
	a, _ := Parse(KindMessages, []byte(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"q1"}]}`))
	b, _ := Parse(KindMessages, []byte(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},{"role":"user","content":"q2"}]}`))
	if !strings.HasPrefix(b.Text, a.Text) {
		t.Fatalf("second turn %q does not extend the first %q", b.Text, a.Text)
	}
}

// TestParseAPIsWordWrongTypesInJSONTerms: a member of the wrong type is a 400 naming it and
// what it must be, never encoding/json's Go type names ("cannot unmarshal string into Go
// struct field ... of type []struct {...}").
func TestParseAPIsWordWrongTypesInJSONTerms(t *testing.T) {
	tests := []struct {
		kind           Kind
		body           string
		param, message string
	}{
		{KindMessages, `{"model":"m","max_tokens":1,"messages":"hi"}`, "messages", "messages must be an array, not a string"},
		{KindCountTokens, `{"model":"m","messages":{"role":"user"}}`, "messages", "messages must be an array, not an object"},
		{KindMessages, `{"model":"m","max_tokens":1,"messages":[{"role":3,"content":"q"}]}`, "messages.role", "messages.role must be a string, not a number"},
		{KindMessages, `{"model":"m","max_tokens":1,"stream":"yes","messages":[{"role":"user","content":"q"}]}`, "stream", "stream must be a boolean, not a string"},
		{KindResponses, `{"model":5,"input":"x"}`, "model", "model must be a string, not a number"},
		{KindResponses, `{"model":"m","input":"x","instructions":["a"]}`, "instructions", "instructions must be a string, not an array"},
		{KindEmbeddings, `{"model":true,"input":"x"}`, "model", "model must be a string, not a boolean"},
	}
	for _, tt := range tests {
		t.Run(tt.body, func(t *testing.T) {
			_, err := Parse(tt.kind, []byte(tt.body))
			var apiErr *Error
			if !errors.As(err, &apiErr) || apiErr.Status != http.StatusBadRequest || apiErr.Param != tt.param || apiErr.Message != tt.message {
				t.Fatalf("Parse = %#v, want a 400 naming %q: %q", err, tt.param, tt.message)
			}
		})
	}
}

// FuzzParseAPIs: any body for the Responses, Messages, count_tokens and Embeddings kinds is
// accepted with what routing needs, or refused with a 400 that says why; nothing panics.
func FuzzParseAPIs(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","input":"hi"}`,
		`{"model":"m","input":"hi","previous_response_id":"resp_1","store":false}`, `{"model":"m","input":"x","previous_response_id":7,"store":"no"}`,
		`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"}]}]}`,
		`{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"q"}]}`,
		`{"model":"m","system":"s","messages":[{"role":"assistant","content":[{"type":"text","text":"a"}]}]}`,
		`{"model":"m","input":[[1,2],[3]]}`,
		`{"model":"m","input":[]}`, `null`, `{`, `{"model":1}`,
	} {
		for k := range byte(4) {
			f.Add(k, []byte(s))
		}
	}
	kinds := []Kind{KindResponses, KindMessages, KindCountTokens, KindEmbeddings}
	f.Fuzz(func(t *testing.T, k byte, body []byte) {
		kind := kinds[int(k)%len(kinds)]
		req, err := Parse(kind, body)
		if err != nil {
			var apiErr *Error
			if !errors.As(err, &apiErr) || apiErr.Status != http.StatusBadRequest || apiErr.Message == "" {
				t.Fatalf("error %v is not a 400 *Error with a message", err)
			}
			if jsonerr.ShowsGoTypes(apiErr.Message) {
				t.Fatalf("error %q shows Go types", apiErr.Message)
			}
			return
		}
		if req.Model == "" || req.Kind != kind || string(req.Body) != string(body) {
			t.Fatalf("accepted request lacks what routing needs: %+v", req)
		}
		for _, id := range req.Tokens {
			if id > maxTokenID {
				t.Fatalf("token id %d out of range", id)
			}
		}
	})
}
