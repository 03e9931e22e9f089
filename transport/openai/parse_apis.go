package openai

import (
	"encoding/json"
	"strconv"
	"strings"

	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
)

// The APIs beyond chat and completions: OpenAI's Responses and Embeddings, Anthropic's
// Messages (and its count_tokens). They are parsed for routing only (model, stream, the
// prompt as text) with encoding/json, and forwarded unchanged; a worker that serves the API
// answers it. Their text is rendered as chat's is ("role\ncontent\n" per message, the system
// or instructions first), so that turns of one conversation share a prefix.

// parseAPI parses a request of one of the kinds above into req.
func parseAPI(k Kind, body []byte, req *Request) error {
	switch k {
	case KindResponses:
		return parseResponses(body, req)
	case KindMessages, KindCountTokens:
		return parseMessages(body, req, k == KindMessages)
	case KindEmbeddings:
		return parseEmbeddings(body, req)
	}
	return invalid("", "unknown request kind "+strconv.Itoa(int(k)))
}

// decodeObject decodes body, a JSON object (Parse checked), into v; a member of the wrong
// type is a 400 naming it in JSON's terms, as jsonerr words it, never a Go type.
func decodeObject(body []byte, v any) error {
	if err := json.Unmarshal(body, v); err != nil {
		return invalid(jsonerr.Describe(err))
	}
	return nil
}

// modelAndStream checks the fields every API shares.
func modelAndStream(model *string, stream *bool, req *Request) error {
	if model == nil {
		return invalid("model", "missing required field: model")
	}
	if *model == "" {
		return invalid("model", "model must be a non-empty string")
	}
	req.Model = *model
	if stream != nil {
		req.Stream = *stream
	}
	return nil
}

// textParts renders content that is a string or an array of parts, keeping the parts of the
// text types; others (images, tool calls) are the worker's business.
func textParts(raw json.RawMessage, param string, textTypes ...string) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", invalid(param, param+" must be a string or an array of content parts")
	}
	var b strings.Builder
	for i, p := range parts {
		for _, t := range textTypes {
			if p.Type != t {
				continue
			}
			if p.Text == nil {
				pp := param + "[" + strconv.Itoa(i) + "].text"
				return "", invalid(pp, "missing required field: "+pp)
			}
			b.WriteString(*p.Text)
		}
	}
	return b.String(), nil
}

// parseResponses reads an OpenAI Responses request: input a string or an array of items
// (messages with a role and content; other items, such as function call outputs, carry no
// routing text), with optional instructions.
func parseResponses(body []byte, req *Request) error {
	var r struct {
		Model        *string         `json:"model"`
		Stream       *bool           `json:"stream"`
		Input        json.RawMessage `json:"input"`
		Instructions *string         `json:"instructions"`
		Previous     json.RawMessage `json:"previous_response_id"`
		Store        json.RawMessage `json:"store"`
	}
	if err := decodeObject(body, &r); err != nil {
		return err
	}
	if err := modelAndStream(r.Model, r.Stream, req); err != nil {
		return err
	}
	if err := responseState(r.Previous, r.Store, req); err != nil {
		return err
	}
	if isNull(r.Input) {
		return invalid("input", "missing required field: input")
	}
	var b strings.Builder
	if r.Instructions != nil && *r.Instructions != "" {
		b.WriteString("system\n" + *r.Instructions + "\n")
	}
	var s string
	if json.Unmarshal(r.Input, &s) == nil {
		b.WriteString("user\n" + s + "\n")
		req.Text = b.String()
		return nil
	}
	var items []struct {
		Type    string          `json:"type"`
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(r.Input, &items); err != nil {
		return invalid("input", "input must be a string or an array of input items")
	}
	if len(items) == 0 {
		return invalid("input", "input must not be an empty array")
	}
	for i, it := range items {
		if it.Role == "" || (it.Type != "" && it.Type != "message") {
			continue
		}
		text, err := textParts(it.Content, "input["+strconv.Itoa(i)+"].content", "input_text", "output_text", "text")
		if err != nil {
			return err
		}
		b.WriteString(it.Role + "\n" + text + "\n")
	}
	req.Text = b.String()
	return nil
}

// responseState reads what a Responses request says of the state its worker keeps: the
// response it continues (previous_response_id: a string, null or absent for none) and
// whether its own answer is kept (store: a boolean, true when null or absent, as the API
// has it).
func responseState(previous, store json.RawMessage, req *Request) error {
	if !isNull(previous) {
		id, ok := jsonString(previous)
		if !ok {
			return invalid("previous_response_id", "previous_response_id must be a string")
		}
		req.PreviousResponseID = id
	}
	switch string(store) {
	case "", "null", "true":
		req.StoreResponse = true
	case "false":
	default:
		return invalid("store", "store must be a boolean")
	}
	return nil
}

// isNull reports whether a raw member is absent or null.
func isNull(raw json.RawMessage) bool { return len(raw) == 0 || string(raw) == "null" }

// parseMessages reads an Anthropic Messages request (or count_tokens, which has no
// max_tokens): messages a non-empty array of {role, content}, system a string or text blocks.
func parseMessages(body []byte, req *Request, generates bool) error {
	var r struct {
		Model     *string         `json:"model"`
		Stream    *bool           `json:"stream"`
		MaxTokens json.RawMessage `json:"max_tokens"`
		System    json.RawMessage `json:"system"`
		Messages  *[]struct {
			Role    *string         `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	if err := decodeObject(body, &r); err != nil {
		return err
	}
	if err := modelAndStream(r.Model, r.Stream, req); err != nil {
		return err
	}
	if generates {
		var n int64
		if isNull(r.MaxTokens) {
			return invalid("max_tokens", "missing required field: max_tokens")
		}
		if json.Unmarshal(r.MaxTokens, &n) != nil || n < 1 {
			return invalid("max_tokens", "max_tokens must be a positive integer")
		}
	}
	if r.Messages == nil || len(*r.Messages) == 0 {
		return invalid("messages", "messages must be a non-empty array")
	}
	var b strings.Builder
	system, err := textParts(r.System, "system", "text")
	if err != nil {
		return err
	}
	if system != "" {
		b.WriteString("system\n" + system + "\n")
	}
	for i, m := range *r.Messages {
		param := "messages[" + strconv.Itoa(i) + "]"
		if m.Role == nil || (*m.Role != "user" && *m.Role != "assistant") {
			return invalid(param+".role", param+".role must be \"user\" or \"assistant\"")
		}
		if isNull(m.Content) {
			return invalid(param+".content", "missing required field: "+param+".content")
		}
		text, err := textParts(m.Content, param+".content", "text")
		if err != nil {
			return err
		}
		b.WriteString(*m.Role + "\n" + text + "\n")
	}
	req.Text = b.String()
	return nil
}

// parseEmbeddings reads an Embeddings request: input a string, an array of strings, an
// array of token ids or an array of those; the first input routes the request.
func parseEmbeddings(body []byte, req *Request) error {
	var r struct {
		Model *string         `json:"model"`
		Input json.RawMessage `json:"input"`
	}
	if err := decodeObject(body, &r); err != nil {
		return err
	}
	if err := modelAndStream(r.Model, nil, req); err != nil {
		return err
	}
	if isNull(r.Input) {
		return invalid("input", "missing required field: input")
	}
	// The completions prompt's shapes, with batches allowed: the first element routes.
	const shape = "input must be a string, an array of strings, or an array of token ids"
	var s string
	if json.Unmarshal(r.Input, &s) == nil {
		req.Text = s
		return nil
	}
	var list []json.RawMessage
	if json.Unmarshal(r.Input, &list) != nil || len(list) == 0 {
		return invalid("input", shape)
	}
	var ids []uint32
	if json.Unmarshal(r.Input, &ids) == nil {
		return tokenInput(ids, req)
	}
	var first []uint32
	if json.Unmarshal(list[0], &s) == nil {
		req.Text = s
		return nil
	}
	if json.Unmarshal(list[0], &first) == nil && len(first) > 0 {
		return tokenInput(first, req)
	}
	return invalid("input", shape)
}

// tokenInput takes token ids as the routing prompt, within the engines' id range.
func tokenInput(ids []uint32, req *Request) error {
	for _, id := range ids {
		if id > maxTokenID {
			return invalid("input", "input token ids must be below 2^31")
		}
	}
	req.Tokens, req.HasTokens = ids, true
	return nil
}
