package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
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
		{"client kv_transfer_params", KindChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.1","remote_port":5600}}`, "kv_transfer_params", "a client may not send it"},
		{"cache_salt not a string", KindCompletion, `{"model":"m","prompt":"x","cache_salt":5}`, "cache_salt", "non-empty string"},
		{"cache_salt empty", KindChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"cache_salt":""}`, "cache_salt", "non-empty string"},
		{"client kv_transfer_params on a completion", KindCompletion, `{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_decode":true}}`, "kv_transfer_params", "a client may not send it"},
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
		// The model names the server interns read as Parse reads them, twice over.
		// So do the prompts that share the body's memory.
		models := newNames()
		for _, shared := range []bool{false, true} {
			var in Request
			if ierr := parseInto(kind, body, &in, models, shared); (ierr == nil) != (err == nil) ||
				err == nil && (in.Model != req.Model || in.Text != req.Text) {
				t.Fatalf("with interned names (shared body %v): model %q, text %q, error %v; Parse's %v", shared, in.Model, in.Text, ierr, err)
			}
		}
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

// sameAsReference fails t unless Parse and the encoding/json parser it replaced agree on
// body: the same fields, or the same error naming the same field.
func sameAsReference(t *testing.T, kind Kind, body []byte) {
	t.Helper()
	got, gotErr := Parse(kind, body)
	want, wantErr := refParse(kind, body)
	if (gotErr == nil) != (wantErr == nil) {
		t.Fatalf("Parse(%q): error %v, the encoding/json parser's %v", body, gotErr, wantErr)
	}
	if gotErr != nil {
		var g, w *Error
		if !errors.As(gotErr, &g) || !errors.As(wantErr, &w) || *g != *w {
			t.Fatalf("Parse(%q): error %#v, the encoding/json parser's %#v", body, gotErr, wantErr)
		}
		return
	}
	if got.Kind != want.Kind || got.Model != want.Model || got.Stream != want.Stream || got.Text != want.Text || got.CacheSalt != want.CacheSalt ||
		got.HasTokens != want.HasTokens || !slices.Equal(got.Tokens, want.Tokens) ||
		!bytes.Equal(got.Messages, want.Messages) || !bytes.Equal(got.Body, want.Body) {
		t.Fatalf("Parse(%q) = %+v, the encoding/json parser's %+v", body, got, want)
	}
}

func TestParseReadsWhatEncodingJSONReads(t *testing.T) {
	deep := func(n int) string { return strings.Repeat("[", n) + strings.Repeat("]", n) }
	tests := []struct {
		name string
		body string
	}{
		{"escaped key", `{"mod\u0065l":"m","prompt":"p"}`},
		{"escaped key that is not ours", `{"model":"m","prompt":"p","pr\u006fmpt2":1}`},
		{"repeated key takes the last", `{"model":"a","model":"b","prompt":5,"prompt":"p"}`},
		{"escapes in text", `{"model":"m","prompt":"a\"b\\c\/d\b\f\n\r\t\u00e9\u4e2d"}`},
		{"surrogate pair", `{"model":"m","prompt":"\ud83d\ude00"}`},
		{"lone high surrogate", `{"model":"m","prompt":"x\ud83dy"}`},
		{"lone low surrogate", `{"model":"m","prompt":"\ude00"}`},
		{"high surrogate then escape", `{"model":"m","prompt":"\ud83d\u0041"}`},
		{"high surrogate twice", `{"model":"m","prompt":"\ud83d\ud83d\ude00"}`},
		{"invalid utf-8", "{\"model\":\"m\xff\",\"prompt\":\"a\xc3\x28b\xed\xa0\x80\"}"},
		{"utf-8 text", `{"model":"m","prompt":"héllo wörld ✓ 😀"}`},
		{"escaped assistant role", `{"model":"m","messages":[{"role":"assist\u0061nt","content":null}]}`},
		{"whitespace everywhere", " \t\r\n{ \"model\" : \"m\" , \"stream\" : true , \"prompt\" : [ 1 , 2 ] } \n"},
		{"numbers", `{"model":"m","prompt":"p","x":[0,-0,1.5,-2e10,3E+2,4e-2,0.0e0]}`},
		{"bad number leading zero", `{"model":"m","prompt":"p","x":01}`},
		{"bad number dot", `{"model":"m","prompt":"p","x":1.}`},
		{"bad number exponent", `{"model":"m","prompt":"p","x":1e}`},
		{"bad number minus", `{"model":"m","prompt":"p","x":-}`},
		{"bad literal", `{"model":"m","prompt":"p","x":tru}`},
		{"bad escape", `{"model":"m","prompt":"a\x"}`},
		{"bad unicode escape", `{"model":"m","prompt":"\u12g4"}`},
		{"control character in string", "{\"model\":\"m\",\"prompt\":\"a\x01\"}"},
		{"trailing comma", `{"model":"m","prompt":"p",}`},
		{"trailing garbage", `{"model":"m","prompt":"p"} x`},
		{"two values", `{"model":"m","prompt":"p"}{}`},
		{"byte order mark", "\xef\xbb\xbf{\"model\":\"m\",\"prompt\":\"p\"}"},
		{"nested 9999 deep", `{"model":"m","prompt":"p","x":` + deep(9999) + `}`},
		{"nested 10000 deep", `{"model":"m","prompt":"p","x":` + deep(10000) + `}`},
		{"top level array too deep", deep(10001)},
		{"top level array deep", deep(10000)},
		{"prompt strings with null", `{"model":"m","prompt":["a",null]}`},
		{"prompt strings with number", `{"model":"m","prompt":["a",1]}`},
		{"prompt token batch with string", `{"model":"m","prompt":[[1],"a"]}`},
		{"prompt token batch of null", `{"model":"m","prompt":[[1],null]}`},
		{"prompt escaped string batch", `{"model":"m","prompt":["\u0041"]}`},
		{"content part type escaped", `{"model":"m","messages":[{"role":"user","content":[{"type":"t\u0065xt","text":"a\nb"}]}]}`},
		{"content part type not text", `{"model":"m","messages":[{"role":"user","content":[{"type":"image","text":5}]}]}`},
		{"message null", `{"model":"m","messages":[{"role":"user","content":"a"},null]}`},
		{"second message not object before first role error", `{"model":"m","messages":[{"content":"a"},"x"]}`},
		{"part null", `{"model":"m","messages":[{"role":"user","content":[null]}]}`},
		{"empty content parts", `{"model":"m","messages":[{"role":"user","content":[]}]}`},
		{"content object", `{"model":"m","messages":[{"role":"user","content":{}}]}`},
		{"content true", `{"model":"m","messages":[{"role":"user","content":true}]}`},
		{"role null", `{"model":"m","messages":[{"role":null,"content":"a"}]}`},
		{"stream number", `{"model":"m","stream":1,"prompt":"p"}`},
		{"stream string", `{"model":"m","stream":"true","prompt":"p"}`},
		{"model empty after escape", `{"model":"\u0000","prompt":"p"}`},
		{"model array", `{"model":["m"],"prompt":"p"}`},
		{"long plain strings", `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("abcdefgh", 300) + `\n` + strings.Repeat("z", 77) + `"}]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sameAsReference(t, KindChat, []byte(tt.body))
			sameAsReference(t, KindCompletion, []byte(tt.body))
		})
	}
}

func TestValidJSONAgreesWithEncodingJSON(t *testing.T) {
	for _, s := range []string{
		``, ` `, `1`, `-1.5e3`, `"a"`, `"\u00"`, `true`, `nul`, `[1,]`, `[,1]`, `{"a":1,}`, `{"a"}`, `{1:2}`,
		`[1 2]`, `{"a":1 "b":2}`, `[[[]]]`, `[{}]`, `{"a":[{"b":null}]}`, "\"\x7f\x80\"", `"\/"`, `"\'"`,
		`01`, `1.`, `.5`, `+1`, `1e+`, `[1]]`, `{}}`, `"abc`, `"abcdefghijklmnop`, `"abcdefgh\"ijklmnop"`,
	} {
		if got, want := validJSON([]byte(s)), json.Valid([]byte(s)); got != want {
			t.Errorf("validJSON(%q) = %v, json.Valid says %v", s, got, want)
		}
	}
}

func FuzzParseMatchesEncodingJSON(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"h\u00e9 \ud83d\ude00"}]}`,
		`{"model":"m","prompt":"a\nb","stream":false}`,
		`{"model":"m","prompt":[[1,2]],"x":[1.5e3,{"y":null}]}`,
		`{"mod\u0065l":"m","prompt":["x",null]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url"}]}]}`,
		"{\"model\":\"m\xff\",\"prompt\":\"\xc3\"}",
	} {
		f.Add(true, []byte(s))
		f.Add(false, []byte(s))
	}
	f.Fuzz(func(t *testing.T, chat bool, body []byte) {
		kind := KindCompletion
		if chat {
			kind = KindChat
		}
		sameAsReference(t, kind, body)
		if got, want := validJSON(body), json.Valid(body); got != want {
			t.Fatalf("validJSON(%q) = %v, json.Valid says %v", body, got, want)
		}
		// Every JSON string decodes as encoding/json decodes it.
		if len(body) > 0 && body[0] == '"' && json.Valid(body) {
			var want string
			if err := json.Unmarshal(body, &want); err != nil {
				t.Fatal(err)
			}
			// Parse hands it values without the spaces around them.
			if got, ok := jsonString(bytes.TrimRight(body, " \t\r\n")); !ok || got != want {
				t.Fatalf("jsonString(%q) = %q, %v; encoding/json reads %q", body, got, ok, want)
			}
		}
	})
}

// TestNamesInternTheNamesRequestsRepeat checks that a model name given again is the string
// the table holds (no new one), and that interning never changes what a JSON string reads as.
func TestNamesInternTheNamesRequestsRepeat(t *testing.T) {
	cases := []struct {
		name     string
		raw      string
		interned bool // the second read returns the first one's string
	}{
		{name: "plain", raw: `"tp-model"`, interned: true},
		{name: "a long name", raw: `"meta-llama/Llama-3.1-8B-Instruct"`, interned: true},
		{name: "escaped", raw: `"tp-\u006dodel"`},
		{name: "non-ASCII", raw: `"modèle"`},
		{name: "empty", raw: `""`},
		{name: "not a string", raw: `42`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := newNames()
			want, wantOK := jsonString([]byte(tc.raw))
			first, ok := n.jsonString([]byte(tc.raw))
			if first != want || ok != wantOK {
				t.Fatalf("read %q, %v; jsonString reads %q, %v", first, ok, want, wantOK)
			}
			second, _ := (*names)(nil).jsonString([]byte(tc.raw))
			if second != want {
				t.Fatalf("without a table: %q, want %q", second, want)
			}
			again, _ := n.jsonString([]byte(tc.raw))
			if again != want {
				t.Fatalf("read again %q, want %q", again, want)
			}
			if same := len(want) > 0 && unsafe.StringData(again) == unsafe.StringData(first); same != tc.interned {
				t.Fatalf("the second read shares the first's string: %v, want %v", same, tc.interned)
			}
		})
	}
}

// TestPromptSharesOnlyAReadBody: a plain completion prompt shares the body's memory only
// when parseInto is told the body is the handler's own (shared); Parse's caller keeps its
// buffer, so a prompt from Parse stays as it was when that buffer is written again, and
// so do an escaped prompt and a chat rendering, which are decoded into memory of their own.
func TestPromptSharesOnlyAReadBody(t *testing.T) {
	within := func(s string, body []byte) bool {
		p := uintptr(unsafe.Pointer(unsafe.StringData(s)))
		b := uintptr(unsafe.Pointer(unsafe.SliceData(body)))
		return p >= b && p < b+uintptr(len(body))
	}
	tests := []struct {
		name  string
		kind  Kind
		body  string
		text  string
		share bool // with shared, Text is in the body
	}{
		{"plain prompt", KindCompletion, `{"model":"m","prompt":"hello there"}`, "hello there", true},
		{"escaped prompt", KindCompletion, `{"model":"m","prompt":"hello\nthere"}`, "hello\nthere", false},
		{"chat", KindChat, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, "user\nhi\n", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, shared := range []bool{false, true} {
				body := []byte(tt.body)
				var p Request
				if shared {
					if err := parseInto(tt.kind, body, &p, nil, true); err != nil {
						t.Fatal(err)
					}
				} else {
					q, err := Parse(tt.kind, body)
					if err != nil {
						t.Fatal(err)
					}
					p = *q
				}
				if p.Text != tt.text {
					t.Fatalf("shared %v: text %q, want %q", shared, p.Text, tt.text)
				}
				if in := within(p.Text, body); in != (shared && tt.share) {
					t.Fatalf("shared %v: text in the body's memory %v, want %v", shared, in, shared && tt.share)
				}
				if !shared {
					clear(body) // Parse's caller reuses its buffer
					if p.Text != tt.text {
						t.Fatalf("Parse's text %q changed with its caller's buffer, want %q", p.Text, tt.text)
					}
				}
			}
		})
	}
}
