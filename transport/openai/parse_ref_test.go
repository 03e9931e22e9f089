package openai

// The parser as it was before the single-pass scanner: encoding/json into maps of raw
// values. The tests hold the scanner to it, result for result and error for error.

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

// refParse is Parse as it was: errors are *Error values with status 400 naming the
// offending field.
func refParse(k Kind, body []byte) (*Request, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			return nil, refInvalid("", "request body must be a JSON object")
		}
		return nil, refInvalid("", "request body is not valid JSON: "+err.Error())
	}
	if fields == nil {
		return nil, refInvalid("", "request body must be a JSON object")
	}
	req := &Request{Kind: k, Body: body}

	if _, ok := refPresent(fields, "kv_transfer_params"); ok {
		return nil, refInvalid("kv_transfer_params", "kv_transfer_params is set by the router between prefill and decode workers; a client may not send it")
	}
	if raw, ok := refPresent(fields, "cache_salt"); ok {
		if req.CacheSalt, ok = refJsonString(raw); !ok || req.CacheSalt == "" {
			return nil, refInvalid("cache_salt", "cache_salt must be a non-empty string")
		}
	}

	model, ok := refPresent(fields, "model")
	if !ok {
		return nil, refInvalid("model", "missing required field: model")
	}
	if req.Model, ok = refJsonString(model); !ok {
		return nil, refInvalid("model", "model must be a string")
	}
	if req.Model == "" {
		return nil, refInvalid("model", "model must be a non-empty string")
	}

	if raw, ok := refPresent(fields, "stream"); ok {
		if err := json.Unmarshal(raw, &req.Stream); err != nil {
			return nil, refInvalid("stream", "stream must be a boolean")
		}
	}

	switch k {
	case KindChat:
		raw, ok := refPresent(fields, "messages")
		if !ok {
			return nil, refInvalid("messages", "missing required field: messages")
		}
		text, err := refRenderMessages(raw)
		if err != nil {
			return nil, err
		}
		req.Text = text
		req.Messages = raw
	case KindCompletion:
		raw, ok := refPresent(fields, "prompt")
		if !ok {
			return nil, refInvalid("prompt", "missing required field: prompt")
		}
		if err := refParsePrompt(raw, req); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("parse: unknown request kind %d", k)
	}
	return req, nil
}

// refPresent returns a field's raw value, treating an explicit null like an absent field.
func refPresent(fields map[string]json.RawMessage, key string) (json.RawMessage, bool) {
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

func refRenderMessages(raw json.RawMessage) (string, error) {
	const notArray = "messages must be a non-empty array"
	if raw[0] != '[' {
		return "", refInvalid("messages", notArray)
	}
	// Keys are matched exactly: encoding/json's struct decoding would match "Role" too,
	// which a worker would not.
	msgs, bad := refObjects(raw)
	if bad >= 0 {
		param := "messages[" + strconv.Itoa(bad) + "]"
		return "", refInvalid(param, param+" must be an object")
	}
	if len(msgs) == 0 {
		return "", refInvalid("messages", notArray)
	}
	var b strings.Builder
	for i, fields := range msgs {
		param := "messages[" + strconv.Itoa(i) + "]"
		role, ok := refJsonString(fields["role"])
		if !ok {
			return "", refInvalid(param+".role", param+".role must be a string")
		}
		content, err := refRenderContent(fields["content"], role, param+".content")
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

// refObjects decodes a JSON array of objects. On failure it returns the index of the first
// element that is not an object (or 0 when raw is not an array).
func refObjects(raw json.RawMessage) ([]map[string]json.RawMessage, int) {
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

// refRenderContent accepts a string, an array of content parts, or (for an assistant message
// that carries tool calls instead of text) null or nothing. Non-text parts such as images
// are the worker's business and do not reach the routing text.
func refRenderContent(raw json.RawMessage, role, param string) (string, error) {
	const shape = " must be a string or an array of text parts"
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		if role == "assistant" {
			return "", nil
		}
		return "", refInvalid(param, "missing required field: "+param)
	}
	if s, ok := refJsonString(raw); ok {
		return s, nil
	}
	if raw[0] != '[' {
		return "", refInvalid(param, param+shape)
	}
	parts, bad := refObjects(raw)
	if bad >= 0 {
		pp := param + "[" + strconv.Itoa(bad) + "]"
		return "", refInvalid(pp, pp+" must be an object with a type")
	}
	var b strings.Builder
	for i, fields := range parts {
		pp := param + "[" + strconv.Itoa(i) + "]"
		typ, ok := refJsonString(fields["type"])
		if !ok {
			return "", refInvalid(pp+".type", pp+".type must be a string")
		}
		if typ != "text" {
			continue
		}
		text, ok := refJsonString(fields["text"])
		if !ok {
			return "", refInvalid(pp+".text", pp+".text must be a string")
		}
		b.WriteString(text)
	}
	return b.String(), nil
}

func refParsePrompt(raw json.RawMessage, req *Request) error {
	const shape = "prompt must be a string or an array of token ids"
	if s, ok := refJsonString(raw); ok {
		req.Text = s
		return nil
	}
	if raw[0] != '[' {
		return refInvalid("prompt", shape)
	}
	inner := bytes.TrimSpace(raw[1:])
	switch {
	case len(inner) > 0 && inner[0] == '"':
		// A batch of several prompts could go to different workers; the router takes one.
		var batch []string
		if err := json.Unmarshal(raw, &batch); err != nil {
			return refInvalid("prompt", shape)
		}
		if len(batch) != 1 {
			return refInvalid("prompt", "prompt must hold exactly one string; batches of prompts are not supported")
		}
		req.Text = batch[0]
		return nil
	case len(inner) > 0 && inner[0] == '[':
		var batch []json.RawMessage
		if err := json.Unmarshal(raw, &batch); err != nil {
			return refInvalid("prompt", shape)
		}
		if len(batch) != 1 {
			return refInvalid("prompt", "prompt must hold exactly one token array; batches of prompts are not supported")
		}
		raw = batch[0]
	}
	tokens, bad := refTokenArray(raw)
	if bad >= 0 {
		return refInvalid("prompt", fmt.Sprintf("%s (element %d is not an integer in 0..%d)", shape, bad, maxTokenID))
	}
	if len(tokens) == 0 {
		return refInvalid("prompt", "prompt must not be an empty array")
	}
	req.Tokens = tokens
	req.HasTokens = true
	return nil
}

// refTokenArray reads an array of plain non-negative integers (no sign, fraction or exponent)
// up to maxTokenID. raw is part of a document encoding/json has already validated, so a
// byte scan suffices; it returns the index of the first bad element, or -1.
func refTokenArray(raw []byte) ([]uint32, int) {
	i := refSkipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return nil, 0
	}
	i = refSkipSpace(raw, i+1)
	// Each token takes at least two bytes ("1,"), which bounds the capacity needed.
	tokens := make([]uint32, 0, len(raw)/2+1)
	if i < len(raw) && raw[i] == ']' {
		return tokens, -1
	}
	// Every pass consumes at least one digit and one separator, or returns.
	for idx := 0; ; idx++ {
		i = refSkipSpace(raw, i)
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
		i = refSkipSpace(raw, i)
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

func refSkipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// refJsonString decodes raw when it is a JSON string. raw comes from a validated document, so
// a string without escapes is its bytes between the quotes.
func refJsonString(raw json.RawMessage) (string, bool) {
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

func refInvalid(param, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Message: msg, Type: TypeInvalidRequest, Param: param}
}
