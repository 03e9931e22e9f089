package sim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strings"

	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
)

// apiError is an error answered in the OpenAI error shape.
type apiError struct {
	status  int
	typ     string
	message string
	param   string
	code    string
}

func (e *apiError) Error() string { return e.message }

// decodeError is the 400 for a body json.Unmarshal refused, naming the member of the wrong
// type in JSON's terms (jsonerr), never a Go type.
func decodeError(err error) *apiError {
	field, msg := jsonerr.Describe(err)
	return badRequest(field, "%s", msg)
}

func badRequest(param, format string, args ...any) *apiError {
	return &apiError{
		status: http.StatusBadRequest, typ: "invalid_request_error",
		message: fmt.Sprintf(format, args...), param: param,
	}
}

type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func (e *apiError) body() errorBody {
	d := errorDetail{Message: e.message, Type: e.typ}
	if e.param != "" {
		d.Param = &e.param
	}
	if e.code != "" {
		d.Code = &e.code
	}
	return errorBody{Error: d}
}

// genRequest is a decoded completion or chat completion request.
type genRequest struct {
	chat         bool
	model        string
	prompt       []uint32
	maxTokens    int
	stream       bool
	includeUsage bool
	// kv is the request's kv_transfer_params; nil without them.
	kv *kvParams
	// cacheSalt is the request's cache_salt: its blocks are other blocks than the same
	// tokens' under another salt or none, as vLLM keys the salt into the first block.
	cacheSalt string
	// turn is a Responses request's place in its conversation; nil for the other APIs.
	turn *responseTurn
	// continues: a chat request with continue_final_message whose final (assistant) message
	// has content, so its first generated word follows that text after a space.
	continues bool
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type wireMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type wireRequest struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            json.RawMessage `json:"messages"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	Stream              *bool           `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	N                   *int64          `json:"n"`
	AddSpecialTokens    *bool           `json:"add_special_tokens"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	ContinueFinal       *bool           `json:"continue_final_message"`
	KVTransferParams    json.RawMessage `json:"kv_transfer_params"`
	CacheSalt           json.RawMessage `json:"cache_salt"`
}

func decodeWire(body []byte) (*wireRequest, *apiError) {
	var w wireRequest
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, badRequest("", "request body is empty: expected a JSON object")
	}
	if err := json.Unmarshal(body, &w); err != nil {
		return nil, decodeError(err)
	}
	return &w, nil
}

// decodeRequest parses a /v1/completions (chat false) or /v1/chat/completions body and
// checks it against maxModelLen. It never panics, whatever the bytes.
func decodeRequest(body []byte, chat bool, maxModelLen int) (*genRequest, *apiError) {
	w, aerr := decodeWire(body)
	if aerr != nil {
		return nil, aerr
	}
	req := &genRequest{chat: chat, model: w.Model, maxTokens: defaultMaxTokens}
	addSpecial := w.AddSpecialTokens == nil || *w.AddSpecialTokens
	if chat {
		msgs, aerr := parseMessages(w.Messages)
		if aerr != nil {
			return nil, aerr
		}
		addGen := w.AddGenerationPrompt == nil || *w.AddGenerationPrompt
		if w.ContinueFinal != nil && *w.ContinueFinal {
			// As vLLM: the final message is continued rather than closed, which a
			// generation prompt after it would contradict.
			if addGen {
				return nil, badRequest("continue_final_message", "continue_final_message and add_generation_prompt cannot both be true")
			}
			last := msgs[len(msgs)-1]
			if last.Role != "assistant" {
				return nil, badRequest("continue_final_message", "continue_final_message needs a final message of role assistant, got %q", last.Role)
			}
			req.continues = last.Content != ""
		}
		req.prompt = Tokenize(RenderChat(msgs, addGen), addSpecial)
	} else {
		if req.prompt, aerr = parsePrompt(w.Prompt, addSpecial); aerr != nil {
			return nil, aerr
		}
	}

	maxTokens, param := w.MaxTokens, "max_tokens"
	if chat && w.MaxCompletionTokens != nil {
		maxTokens, param = w.MaxCompletionTokens, "max_completion_tokens"
	}
	if maxTokens != nil {
		if *maxTokens < 1 {
			return nil, badRequest(param, "%s must be at least 1, got %d", param, *maxTokens)
		}
		req.maxTokens = int(min(*maxTokens, maxMaxTokens))
	}
	if w.N != nil && *w.N != 1 {
		return nil, badRequest("n", "n must be 1 on this worker, got %d", *w.N)
	}
	req.stream = w.Stream != nil && *w.Stream
	if w.StreamOptions != nil {
		if !req.stream {
			return nil, badRequest("stream_options", "stream_options can only be given when stream is true")
		}
		req.includeUsage = w.StreamOptions.IncludeUsage
	}
	if req.kv, aerr = parseKVTransferParams(w.KVTransferParams); aerr != nil {
		return nil, aerr
	}
	if req.cacheSalt, aerr = parseCacheSalt(w.CacheSalt); aerr != nil {
		return nil, aerr
	}
	if req.kv != nil && req.kv.remoteDecode && req.stream {
		return nil, badRequest("stream", "a prefill leg (kv_transfer_params.do_remote_decode true) cannot be streamed: its kv_transfer_params come in the whole answer")
	}
	if total := len(req.prompt) + req.maxTokens; total > maxModelLen {
		return nil, badRequest("", "This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the prompt, %d in the completion).",
			maxModelLen, total, len(req.prompt), req.maxTokens)
	}
	return req, nil
}

// parseCacheSalt reads cache_salt: absent or null for none, else a non-empty string, as vLLM
// requires it.
func parseCacheSalt(raw json.RawMessage) (string, *apiError) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil || s == "" {
		return "", badRequest("cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided.")
	}
	return s, nil
}

func isNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || bytes.Equal(t, []byte("null"))
}

// parsePrompt accepts a string, an array of token ids, or an array holding one of those.
func parsePrompt(raw json.RawMessage, addSpecial bool) ([]uint32, *apiError) {
	const shape = "prompt must be a string, an array of token ids, or an array with one string or one array of token ids"
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return nil, badRequest("prompt", "prompt is required")
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, badRequest("prompt", "%s", shape)
		}
		if strings.TrimSpace(s) == "" {
			return nil, badRequest("prompt", "prompt must not be empty")
		}
		return Tokenize(s, addSpecial), nil
	case '[':
		// Peek at the first element: a flat token array, the common and long case, is
		// decoded in one pass.
		if inner := bytes.TrimSpace(raw[1:]); len(inner) == 0 || (inner[0] != '"' && inner[0] != '[') {
			return parseTokenIDs(raw)
		}
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return nil, badRequest("prompt", "%s", shape)
		}
		if len(items) != 1 {
			return nil, badRequest("prompt", "batched prompts are not supported: send one prompt per request")
		}
		first := bytes.TrimSpace(items[0])
		if first[0] == '"' {
			return parsePrompt(first, addSpecial)
		}
		return parseTokenIDs(first)
	default:
		return nil, badRequest("prompt", "%s", shape)
	}
}

func parseTokenIDs(raw json.RawMessage) ([]uint32, *apiError) {
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err != nil {
		return nil, badRequest("prompt", "token ids must be non-negative integers")
	}
	if len(ids) == 0 {
		return nil, badRequest("prompt", "prompt must not be empty")
	}
	out := make([]uint32, len(ids))
	for i, id := range ids {
		if id < 0 || id > math.MaxUint32 {
			return nil, badRequest("prompt", "token id %d at position %d is out of range [0, %d]", id, i, uint32(math.MaxUint32))
		}
		out[i] = uint32(id)
	}
	return out, nil
}

type wirePart struct {
	Type string  `json:"type"`
	Text *string `json:"text"`
}

// parseMessages accepts messages whose content is a string, null, or an array of text parts.
func parseMessages(raw json.RawMessage) ([]ChatMessage, *apiError) {
	if isNull(raw) {
		return nil, badRequest("messages", "messages is required")
	}
	var wms []wireMessage
	if err := json.Unmarshal(raw, &wms); err != nil {
		return nil, badRequest("messages", "messages must be an array of {role, content} objects")
	}
	if len(wms) == 0 {
		return nil, badRequest("messages", "messages must not be empty")
	}
	msgs := make([]ChatMessage, len(wms))
	for i, m := range wms {
		param := fmt.Sprintf("messages[%d]", i)
		if m.Role == "" {
			return nil, badRequest(param+".role", "message %d has no role", i)
		}
		content, aerr := parseContent(m.Content, param+".content")
		if aerr != nil {
			return nil, aerr
		}
		msgs[i] = ChatMessage{Role: m.Role, Content: content}
	}
	return msgs, nil
}

func parseContent(raw json.RawMessage, param string) (string, *apiError) {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return "", nil
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", badRequest(param, "content must be a string")
		}
		return s, nil
	case '[':
		var parts []wirePart
		if err := json.Unmarshal(raw, &parts); err != nil {
			return "", badRequest(param, "content parts must be {type, text} objects")
		}
		texts := make([]string, 0, len(parts))
		for j, p := range parts {
			if p.Type != "text" || p.Text == nil {
				return "", badRequest(fmt.Sprintf("%s[%d]", param, j), "only text content parts are supported, got type %q", p.Type)
			}
			texts = append(texts, *p.Text)
		}
		// vLLM joins text parts with newlines for string-format chat templates.
		return strings.Join(texts, "\n"), nil
	default:
		return "", badRequest(param, "content must be a string or an array of text parts")
	}
}

// decodeTokenize parses a /tokenize body: the model it names ("" for none) and the tokens
// of its prompt string or chat messages.
func decodeTokenize(body []byte) (string, []uint32, *apiError) {
	w, aerr := decodeWire(body)
	if aerr != nil {
		return "", nil, aerr
	}
	addSpecial := w.AddSpecialTokens == nil || *w.AddSpecialTokens
	switch {
	case !isNull(w.Messages):
		msgs, aerr := parseMessages(w.Messages)
		if aerr != nil {
			return "", nil, aerr
		}
		addGen := w.AddGenerationPrompt == nil || *w.AddGenerationPrompt
		return w.Model, Tokenize(RenderChat(msgs, addGen), addSpecial), nil
	case !isNull(w.Prompt):
		var s string
		if err := json.Unmarshal(w.Prompt, &s); err != nil {
			return "", nil, badRequest("prompt", "prompt must be a string")
		}
		return w.Model, Tokenize(s, addSpecial), nil
	default:
		return "", nil, badRequest("", "give either prompt or messages")
	}
}

// Response shapes.

type usage struct {
	PromptTokens        int           `json:"prompt_tokens"`
	CompletionTokens    int           `json:"completion_tokens"`
	TotalTokens         int           `json:"total_tokens"`
	PromptTokensDetails *tokenDetails `json:"prompt_tokens_details"`
}

type tokenDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func newUsage(prompt, completion, cached int) *usage {
	return &usage{
		PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion,
		PromptTokensDetails: &tokenDetails{CachedTokens: cached},
	}
}

type chatMessageOut struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content"`
}

type choice struct {
	Index        int             `json:"index"`
	Text         *string         `json:"text,omitempty"`
	Message      *chatMessageOut `json:"message,omitempty"`
	Delta        *chatMessageOut `json:"delta,omitempty"`
	Logprobs     *struct{}       `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
}

// response is a whole response or one stream chunk; Usage is a pointer so that stream
// chunks carry "usage": null until the last one, as OpenAI's do.
type response struct {
	ID      string   `json:"id"`
	Object  string   `json:"object"`
	Created int64    `json:"created"`
	Model   string   `json:"model"`
	Choices []choice `json:"choices"`
	Usage   *usage   `json:"usage,omitempty"`
	// KVTransferParams is a prefill leg's answer to the decode leg (see kvTransferOut).
	KVTransferParams *kvTransferOut `json:"kv_transfer_params,omitempty"`
}

type modelCard struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
	Root    string `json:"root"`
	// Parent is an adapter's base model (null for the base model), as vLLM lists it.
	Parent      *string `json:"parent"`
	MaxModelLen int     `json:"max_model_len"`
}

type modelList struct {
	Object string      `json:"object"`
	Data   []modelCard `json:"data"`
}

type tokenizeResponse struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []uint32 `json:"tokens"`
}
