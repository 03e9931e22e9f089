package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Kind is the OpenAI endpoint a request body belongs to.
type Kind int

// The request kinds the router understands.
const (
	KindChat       Kind = iota + 1 // /v1/chat/completions
	KindCompletion                 // /v1/completions
)

// String names the kind after its endpoint.
func (k Kind) String() string {
	switch k {
	case KindChat:
		return "chat"
	case KindCompletion:
		return "completion"
	default:
		return "unknown"
	}
}

// maxTokenID bounds a token id: engines use signed 32-bit ids.
const maxTokenID = 1<<31 - 1

// Request is what the router needs of an OpenAI request. The body itself is forwarded to
// the worker untouched, so only the fields routing reads are decoded.
type Request struct {
	Kind   Kind
	Model  string
	Stream bool
	// Tokens is the prompt as token ids, when the client sent ids (completions only).
	Tokens []uint32
	// Text is the prompt as text: the completion prompt, or the chat messages rendered as
	// "role\ncontent\n" in order. Empty when Tokens is set.
	Text string
	// HasTokens tells a token prompt (possibly of length zero) from a text one.
	HasTokens bool
	// Messages is a chat request's messages as sent, for a worker's /tokenize.
	Messages json.RawMessage
	// Body is the request exactly as the client sent it.
	Body []byte
}

// PromptTokens is the prompt length in tokens: exact for token prompts, len(text)/4 otherwise.
func (r *Request) PromptTokens() int {
	if r.HasTokens {
		return len(r.Tokens)
	}
	return len(r.Text) / 4
}

// Parse decodes body as a request of kind k and checks the fields routing needs. Its errors
// are *Error values with status 400 naming the offending field.
func Parse(k Kind, body []byte) (*Request, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			return nil, invalid("", "request body must be a JSON object")
		}
		return nil, invalid("", "request body is not valid JSON: "+err.Error())
	}
	if fields == nil {
		return nil, invalid("", "request body must be a JSON object")
	}
	req := &Request{Kind: k, Body: body}

	model, ok := present(fields, "model")
	if !ok {
		return nil, invalid("model", "missing required field: model")
	}
	if req.Model, ok = jsonString(model); !ok {
		return nil, invalid("model", "model must be a string")
	}
	if req.Model == "" {
		return nil, invalid("model", "model must be a non-empty string")
	}

	if raw, ok := present(fields, "stream"); ok {
		if err := json.Unmarshal(raw, &req.Stream); err != nil {
			return nil, invalid("stream", "stream must be a boolean")
		}
	}

	switch k {
	case KindChat:
		raw, ok := present(fields, "messages")
		if !ok {
			return nil, invalid("messages", "missing required field: messages")
		}
		text, err := renderMessages(raw)
		if err != nil {
			return nil, err
		}
		req.Text = text
		req.Messages = raw
	case KindCompletion:
		raw, ok := present(fields, "prompt")
		if !ok {
			return nil, invalid("prompt", "missing required field: prompt")
		}
		if err := parsePrompt(raw, req); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("parse: unknown request kind %d", k)
	}
	return req, nil
}

// DetectKind guesses a body's kind for /v1/route, which takes either: a body with
// "messages" is a chat request, anything else a completion.
func DetectKind(body []byte) Kind {
	var probe struct {
		Messages json.RawMessage `json:"messages"`
	}
	// Case-insensitive key matching is harmless here: Parse checks the exact key.
	if json.Unmarshal(body, &probe) == nil && len(probe.Messages) > 0 {
		return KindChat
	}
	return KindCompletion
}

// present returns a field's raw value, treating an explicit null like an absent field.
func present(fields map[string]json.RawMessage, key string) (json.RawMessage, bool) {
	raw, ok := fields[key]
	if !ok {
		return nil, false
	}
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return nil, false
	}
	return raw, true
}

func renderMessages(raw json.RawMessage) (string, error) {
	const notArray = "messages must be a non-empty array"
	if raw[0] != '[' {
		return "", invalid("messages", notArray)
	}
	// Keys are matched exactly: encoding/json's struct decoding would match "Role" too,
	// which a worker would not.
	msgs, bad := objects(raw)
	if bad >= 0 {
		param := "messages[" + strconv.Itoa(bad) + "]"
		return "", invalid(param, param+" must be an object")
	}
	if len(msgs) == 0 {
		return "", invalid("messages", notArray)
	}
	var b strings.Builder
	for i, fields := range msgs {
		param := "messages[" + strconv.Itoa(i) + "]"
		role, ok := jsonString(fields["role"])
		if !ok {
			return "", invalid(param+".role", param+".role must be a string")
		}
		content, err := renderContent(fields["content"], role, param+".content")
		if err != nil {
			return "", err
		}
		b.WriteString(role)
		b.WriteByte('\n')
		b.WriteString(content)
		b.WriteByte('\n')
	}
	return b.String(), nil
}

// objects decodes a JSON array of objects. On failure it returns the index of the first
// element that is not an object (or 0 when raw is not an array).
func objects(raw json.RawMessage) ([]map[string]json.RawMessage, int) {
	var out []map[string]json.RawMessage
	if err := json.Unmarshal(raw, &out); err == nil {
		for i, m := range out {
			if m == nil {
				return nil, i
			}
		}
		return out, -1
	}
	// Only on bad input: find the element to blame.
	var elems []json.RawMessage
	if err := json.Unmarshal(raw, &elems); err != nil {
		return nil, 0
	}
	for i, e := range elems {
		var m map[string]json.RawMessage
		if json.Unmarshal(e, &m) != nil || m == nil {
			return nil, i
		}
	}
	return nil, 0
}

// renderContent accepts a string, an array of content parts, or (for an assistant message
// that carries tool calls instead of text) null or nothing. Non-text parts such as images
// are the worker's business and do not reach the routing text.
func renderContent(raw json.RawMessage, role, param string) (string, error) {
	const shape = " must be a string or an array of text parts"
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		if role == "assistant" {
			return "", nil
		}
		return "", invalid(param, "missing required field: "+param)
	}
	if s, ok := jsonString(raw); ok {
		return s, nil
	}
	if raw[0] != '[' {
		return "", invalid(param, param+shape)
	}
	parts, bad := objects(raw)
	if bad >= 0 {
		pp := param + "[" + strconv.Itoa(bad) + "]"
		return "", invalid(pp, pp+" must be an object with a type")
	}
	var b strings.Builder
	for i, fields := range parts {
		pp := param + "[" + strconv.Itoa(i) + "]"
		typ, ok := jsonString(fields["type"])
		if !ok {
			return "", invalid(pp+".type", pp+".type must be a string")
		}
		if typ != "text" {
			continue
		}
		text, ok := jsonString(fields["text"])
		if !ok {
			return "", invalid(pp+".text", pp+".text must be a string")
		}
		b.WriteString(text)
	}
	return b.String(), nil
}

func parsePrompt(raw json.RawMessage, req *Request) error {
	const shape = "prompt must be a string or an array of token ids"
	if s, ok := jsonString(raw); ok {
		req.Text = s
		return nil
	}
	if raw[0] != '[' {
		return invalid("prompt", shape)
	}
	inner := bytes.TrimSpace(raw[1:])
	switch {
	case len(inner) > 0 && inner[0] == '"':
		// A batch of several prompts could go to different workers; the router takes one.
		var batch []string
		if err := json.Unmarshal(raw, &batch); err != nil {
			return invalid("prompt", shape)
		}
		if len(batch) != 1 {
			return invalid("prompt", "prompt must hold exactly one string; batches of prompts are not supported")
		}
		req.Text = batch[0]
		return nil
	case len(inner) > 0 && inner[0] == '[':
		var batch []json.RawMessage
		if err := json.Unmarshal(raw, &batch); err != nil {
			return invalid("prompt", shape)
		}
		if len(batch) != 1 {
			return invalid("prompt", "prompt must hold exactly one token array; batches of prompts are not supported")
		}
		raw = batch[0]
	}
	tokens, bad := tokenArray(raw)
	if bad >= 0 {
		return invalid("prompt", fmt.Sprintf("%s (element %d is not an integer in 0..%d)", shape, bad, maxTokenID))
	}
	if len(tokens) == 0 {
		return invalid("prompt", "prompt must not be an empty array")
	}
	req.Tokens = tokens
	req.HasTokens = true
	return nil
}

// tokenArray reads an array of plain non-negative integers (no sign, fraction or exponent)
// up to maxTokenID. raw is part of a document encoding/json has already validated, so a
// byte scan suffices; it returns the index of the first bad element, or -1.
func tokenArray(raw []byte) ([]uint32, int) {
	i := skipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return nil, 0
	}
	i = skipSpace(raw, i+1)
	// Each token takes at least two bytes ("1,"), which bounds the capacity needed.
	tokens := make([]uint32, 0, len(raw)/2+1)
	if i < len(raw) && raw[i] == ']' {
		return tokens, -1
	}
	// Every pass consumes at least one digit and one separator, or returns.
	for idx := 0; ; idx++ {
		i = skipSpace(raw, i)
		start := i
		var v uint64
		for i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
			v = v*10 + uint64(raw[i]-'0')
			if v > maxTokenID {
				return nil, idx
			}
			i++
		}
		if i == start {
			return nil, idx
		}
		tokens = append(tokens, uint32(v))
		i = skipSpace(raw, i)
		if i >= len(raw) {
			return nil, idx
		}
		switch raw[i] {
		case ',':
			i++
		case ']':
			return tokens, -1
		default:
			return nil, idx
		}
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// jsonString decodes raw when it is a JSON string. raw comes from a validated document, so
// a string without escapes is its bytes between the quotes.
func jsonString(raw json.RawMessage) (string, bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) < 2 || raw[0] != '"' || raw[len(raw)-1] != '"' {
		return "", false
	}
	if body := raw[1 : len(raw)-1]; bytes.IndexByte(body, '\\') < 0 && utf8.Valid(body) {
		return string(body), true
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", false
	}
	return s, true
}

func invalid(param, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Message: msg, Type: TypeInvalidRequest, Param: param}
}
