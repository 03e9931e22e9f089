package sim

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"time"
)

// The APIs beside chat and completions that today's clients use, as vLLM serves them:
// OpenAI's Responses (POST /v1/responses) and Embeddings (POST /v1/embeddings), Anthropic's
// Messages (POST /v1/messages, and /v1/messages/count_tokens). Generation runs through the
// same engine, cache and KV events as chat; the answers, whole and streamed, are in each
// API's own shape, errors included.

// api is one of the generating APIs: how its requests decode and its answers render.
type api struct {
	name string
	// decode reads a request into the engine's terms, or an error in the API's shape.
	decode func(body []byte, maxModelLen int) (*genRequest, *apiError)
	// whole renders the whole answer; events renders the stream (start, per token, end).
	whole  func(a *apiAnswer) any
	events apiEvents
	// writeErr sends an error in the API's shape.
	writeErr func(rw http.ResponseWriter, e *apiError)
}

// apiEvents are a streamed answer's server-sent events, each an event name and its data.
type apiEvents struct {
	start func(a *apiAnswer) []apiEvent
	token func(a *apiAnswer, i int) []apiEvent
	end   func(a *apiAnswer) []apiEvent
}

type apiEvent struct {
	name string
	data any
}

// apiAnswer is one request's answer as it is being made.
type apiAnswer struct {
	id, itemID string
	created    int64
	model      string
	req        *genRequest
	out        output
	res        runResult
	seq        int // events sent, for Responses' sequence_number
}

func (a *apiAnswer) text() string { return strings.Join(a.out.pieces, "") }

// handleAPI serves one generating API on the engine.
func (w *Worker) handleAPI(x api) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		start := time.Now()
		body, aerr := w.readBody(rw, r)
		var req *genRequest
		if aerr == nil {
			req, aerr = x.decode(body, w.cfg.MaxModelLen)
		}
		if aerr == nil {
			aerr = w.checkModel(req.model)
		}
		if aerr == nil && req.turn != nil {
			req, aerr = w.responses.resume(req, w.cfg.MaxModelLen)
		}
		if aerr != nil {
			w.metrics.outcome("rejected")
			x.writeErr(rw, aerr)
			return
		}
		if kind, _ := w.drawFault(); kind == faultError {
			w.failed.Add(1)
			w.metrics.outcome("fault_error")
			x.writeErr(rw, &apiError{status: http.StatusInternalServerError, typ: "server_error", message: "simulated worker failure"})
			return
		}
		n := w.nextID.Add(1)
		a := &apiAnswer{id: fmt.Sprintf("%s-%s-%d", x.name, w.cfg.ID, n), itemID: fmt.Sprintf("msg-%s-%d", w.cfg.ID, n),
			created: start.Unix(), model: w.cfg.Model, req: req, out: newOutput(req.prompt, req.maxTokens, true)}
		emit := func(i int) error {
			if i == 0 {
				w.metrics.ttft.Observe(time.Since(start).Seconds())
			}
			if !req.stream {
				return nil
			}
			var evs []apiEvent
			if i == 0 {
				rw.Header().Set("Content-Type", "text/event-stream")
				rw.Header().Set("Cache-Control", "no-cache")
				rw.WriteHeader(http.StatusOK)
				evs = x.events.start(a)
			}
			return writeEvents(rw, append(evs, x.events.token(a, i)...))
		}
		if err := w.run(r.Context(), req, a.out, emit, &a.res); err != nil {
			if aerr := (*apiError)(nil); errors.As(err, &aerr) {
				x.writeErr(rw, aerr)
				return
			}
			w.aborted.Add(1)
			w.metrics.outcome("aborted")
			return
		}
		w.served.Add(1)
		w.metrics.outcome("ok")
		w.metrics.finished.WithLabelValues("length").Inc()
		w.metrics.e2e.Observe(time.Since(start).Seconds())
		if req.turn != nil && req.turn.store {
			// Stored before the answer ends, as vLLM does: a follow-up sent the moment the
			// client has it finds it.
			w.responses.keep(a.id, req.turn.msgs, a.text())
		}
		if req.stream {
			_ = writeEvents(rw, x.events.end(a))
			return
		}
		writeJSON(rw, http.StatusOK, x.whole(a))
	}
}

// writeEvents sends server-sent events with their names, and flushes them.
func writeEvents(rw http.ResponseWriter, evs []apiEvent) error {
	for _, ev := range evs {
		data, err := json.Marshal(ev.data)
		if err != nil {
			return fmt.Errorf("encode event: %w", err)
		}
		if _, err := fmt.Fprintf(rw, "event: %s\ndata: %s\n\n", ev.name, data); err != nil {
			return fmt.Errorf("stream write: %w", err)
		}
	}
	if err := http.NewResponseController(rw).Flush(); err != nil {
		return fmt.Errorf("stream flush: %w", err)
	}
	return nil
}

// genFrom is the engine request of a rendered conversation.
func genFrom(model string, msgs []ChatMessage, maxTokens *int64, stream *bool, param string, maxModelLen int) (*genRequest, *apiError) {
	req := &genRequest{chat: true, model: model, maxTokens: defaultMaxTokens, prompt: Tokenize(RenderChat(msgs, true), true)}
	if maxTokens != nil {
		if *maxTokens < 1 {
			return nil, badRequest(param, "%s must be at least 1, got %d", param, *maxTokens)
		}
		req.maxTokens = int(min(*maxTokens, maxMaxTokens))
	}
	req.stream = stream != nil && *stream
	if total := len(req.prompt) + req.maxTokens; total > maxModelLen {
		return nil, badRequest("", "This model's maximum context length is %d tokens. However, you requested %d tokens.", maxModelLen, total)
	}
	return req, nil
}

// --- OpenAI Responses ---

var responsesAPI = api{
	name: "resp",
	decode: func(body []byte, maxModelLen int) (*genRequest, *apiError) {
		var r struct {
			Model              string          `json:"model"`
			Input              json.RawMessage `json:"input"`
			Instructions       *string         `json:"instructions"`
			MaxOutputTokens    *int64          `json:"max_output_tokens"`
			Stream             *bool           `json:"stream"`
			Store              *bool           `json:"store"`
			PreviousResponseID *string         `json:"previous_response_id"`
		}
		if err := json.Unmarshal(body, &r); err != nil {
			return nil, decodeError(err)
		}
		turn := &responseTurn{store: r.Store == nil || *r.Store}
		if r.PreviousResponseID != nil {
			turn.previous = *r.PreviousResponseID
		}
		var msgs []ChatMessage
		if r.Instructions != nil && *r.Instructions != "" {
			msgs = append(msgs, ChatMessage{Role: "system", Content: *r.Instructions})
			turn.instructions = 1
		}
		var s string
		if json.Unmarshal(r.Input, &s) == nil {
			msgs = append(msgs, ChatMessage{Role: "user", Content: s})
		} else {
			var items []struct {
				Type    string          `json:"type"`
				Role    string          `json:"role"`
				Content json.RawMessage `json:"content"`
			}
			if err := json.Unmarshal(r.Input, &items); err != nil || len(items) == 0 {
				return nil, badRequest("input", "input must be a string or a non-empty array of input items")
			}
			for i, it := range items {
				if it.Role == "" || (it.Type != "" && it.Type != "message") {
					continue
				}
				text, aerr := responseContent(it.Content, fmt.Sprintf("input[%d].content", i))
				if aerr != nil {
					return nil, aerr
				}
				msgs = append(msgs, ChatMessage{Role: it.Role, Content: text})
			}
		}
		turn.msgs, turn.maxTokens, turn.stream = msgs, r.MaxOutputTokens, r.Stream
		req, aerr := genFrom(r.Model, msgs, r.MaxOutputTokens, r.Stream, "max_output_tokens", maxModelLen)
		if req != nil {
			req.turn = turn
		}
		return req, aerr
	},
	whole: func(a *apiAnswer) any { return responseObject(a, "completed", true) },
	events: apiEvents{
		start: func(a *apiAnswer) []apiEvent {
			return []apiEvent{
				a.responseEvent("response.created", map[string]any{"response": responseObject(a, "in_progress", false)}),
				a.responseEvent("response.in_progress", map[string]any{"response": responseObject(a, "in_progress", false)}),
				a.responseEvent("response.output_item.added", map[string]any{"output_index": 0, "item": outputItem(a, "in_progress", "")}),
				a.responseEvent("response.content_part.added", map[string]any{"item_id": a.itemID, "output_index": 0, "content_index": 0,
					"part": map[string]any{"type": "output_text", "text": "", "annotations": []any{}}}),
			}
		},
		token: func(a *apiAnswer, i int) []apiEvent {
			return []apiEvent{a.responseEvent("response.output_text.delta", map[string]any{"item_id": a.itemID, "output_index": 0,
				"content_index": 0, "delta": a.out.pieces[i], "logprobs": []any{}})}
		},
		end: func(a *apiAnswer) []apiEvent {
			text := a.text()
			return []apiEvent{
				a.responseEvent("response.output_text.done", map[string]any{"item_id": a.itemID, "output_index": 0, "content_index": 0, "text": text, "logprobs": []any{}}),
				a.responseEvent("response.content_part.done", map[string]any{"item_id": a.itemID, "output_index": 0, "content_index": 0,
					"part": map[string]any{"type": "output_text", "text": text, "annotations": []any{}}}),
				a.responseEvent("response.output_item.done", map[string]any{"output_index": 0, "item": outputItem(a, "completed", text)}),
				a.responseEvent("response.completed", map[string]any{"response": responseObject(a, "completed", true)}),
			}
		},
	},
	writeErr: writeError,
}

// responseContent is a Responses input item's text: a string or input_text/output_text parts.
func responseContent(raw json.RawMessage, param string) (string, *apiError) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []wirePart
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", badRequest(param, "content must be a string or an array of parts")
	}
	var texts []string
	for _, p := range parts {
		if (p.Type == "input_text" || p.Type == "output_text") && p.Text != nil {
			texts = append(texts, *p.Text)
		}
	}
	return strings.Join(texts, "\n"), nil
}

func (a *apiAnswer) responseEvent(typ string, fields map[string]any) apiEvent {
	fields["type"] = typ
	fields["sequence_number"] = a.seq
	a.seq++
	return apiEvent{name: typ, data: fields}
}

func outputItem(a *apiAnswer, status, text string) map[string]any {
	content := []any{}
	if status == "completed" {
		content = append(content, map[string]any{"type": "output_text", "text": text, "annotations": []any{}})
	}
	return map[string]any{"type": "message", "id": a.itemID, "status": status, "role": "assistant", "content": content}
}

func responseObject(a *apiAnswer, status string, done bool) map[string]any {
	resp := map[string]any{"id": a.id, "object": "response", "created_at": a.created, "status": status, "model": a.model,
		"output": []any{}, "parallel_tool_calls": false, "tool_choice": "auto", "tools": []any{}}
	if t := a.req.turn; t != nil {
		resp["store"] = t.store
		if t.previous != "" {
			resp["previous_response_id"] = t.previous
		}
	}
	if done {
		n := len(a.out.pieces)
		resp["output"] = []any{outputItem(a, "completed", a.text())}
		resp["usage"] = map[string]any{"input_tokens": len(a.req.prompt), "input_tokens_details": map[string]int{"cached_tokens": a.res.cached},
			"output_tokens": n, "output_tokens_details": map[string]int{"reasoning_tokens": 0}, "total_tokens": len(a.req.prompt) + n}
	}
	return resp
}

// --- Anthropic Messages ---

type anthropicRequest struct {
	Model     string          `json:"model"`
	MaxTokens *int64          `json:"max_tokens"`
	System    json.RawMessage `json:"system"`
	Messages  []wireMessage   `json:"messages"`
	Stream    *bool           `json:"stream"`
}

// decodeAnthropic reads a Messages (or count_tokens) body into a conversation.
func decodeAnthropic(body []byte, needMax bool) (*anthropicRequest, []ChatMessage, *apiError) {
	var r anthropicRequest
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, nil, decodeError(err)
	}
	if needMax && r.MaxTokens == nil {
		return nil, nil, badRequest("max_tokens", "max_tokens: Field required")
	}
	if len(r.Messages) == 0 {
		return nil, nil, badRequest("messages", "messages: at least one message is required")
	}
	var msgs []ChatMessage
	if !isNull(r.System) {
		sys, aerr := parseContent(r.System, "system")
		if aerr != nil {
			return nil, nil, aerr
		}
		msgs = append(msgs, ChatMessage{Role: "system", Content: sys})
	}
	for i, m := range r.Messages {
		content, aerr := parseContent(m.Content, fmt.Sprintf("messages.%d.content", i))
		if aerr != nil {
			return nil, nil, aerr
		}
		msgs = append(msgs, ChatMessage{Role: m.Role, Content: content})
	}
	return &r, msgs, nil
}

// writeAnthropicError sends e in Anthropic's error shape.
func writeAnthropicError(rw http.ResponseWriter, e *apiError) {
	typ := "invalid_request_error"
	switch {
	case e.status == http.StatusNotFound:
		typ = "not_found_error"
	case e.status == http.StatusRequestEntityTooLarge:
		typ = "request_too_large"
	case e.status >= 500:
		typ = "api_error"
	}
	writeJSON(rw, e.status, map[string]any{"type": "error", "error": map[string]string{"type": typ, "message": e.message}})
}

var messagesAPI = api{
	name: "msg",
	decode: func(body []byte, maxModelLen int) (*genRequest, *apiError) {
		r, msgs, aerr := decodeAnthropic(body, true)
		if aerr != nil {
			return nil, aerr
		}
		return genFrom(r.Model, msgs, r.MaxTokens, r.Stream, "max_tokens", maxModelLen)
	},
	whole: func(a *apiAnswer) any {
		m := anthropicMessage(a, []any{map[string]any{"type": "text", "text": a.text()}})
		m["stop_reason"] = "max_tokens"
		m["usage"] = anthropicUsage(a, len(a.out.pieces))
		return m
	},
	events: apiEvents{
		start: func(a *apiAnswer) []apiEvent {
			m := anthropicMessage(a, []any{})
			m["usage"] = anthropicUsage(a, 1)
			return []apiEvent{
				{"message_start", map[string]any{"type": "message_start", "message": m}},
				{"content_block_start", map[string]any{"type": "content_block_start", "index": 0, "content_block": map[string]any{"type": "text", "text": ""}}},
				{"ping", map[string]any{"type": "ping"}},
			}
		},
		token: func(a *apiAnswer, i int) []apiEvent {
			return []apiEvent{{"content_block_delta", map[string]any{"type": "content_block_delta", "index": 0,
				"delta": map[string]any{"type": "text_delta", "text": a.out.pieces[i]}}}}
		},
		end: func(a *apiAnswer) []apiEvent {
			return []apiEvent{
				{"content_block_stop", map[string]any{"type": "content_block_stop", "index": 0}},
				{"message_delta", map[string]any{"type": "message_delta", "delta": map[string]any{"stop_reason": "max_tokens", "stop_sequence": nil},
					"usage": map[string]any{"output_tokens": len(a.out.pieces)}}},
				{"message_stop", map[string]any{"type": "message_stop"}},
			}
		},
	},
	writeErr: writeAnthropicError,
}

func anthropicMessage(a *apiAnswer, content []any) map[string]any {
	return map[string]any{"id": a.id, "type": "message", "role": "assistant", "model": a.model, "content": content,
		"stop_reason": nil, "stop_sequence": nil}
}

func anthropicUsage(a *apiAnswer, output int) map[string]any {
	return map[string]any{"input_tokens": len(a.req.prompt) - a.res.cached, "cache_read_input_tokens": a.res.cached,
		"cache_creation_input_tokens": 0, "output_tokens": output}
}

// handleCountTokens answers /v1/messages/count_tokens: the conversation's prompt tokens.
func (w *Worker) handleCountTokens(rw http.ResponseWriter, r *http.Request) {
	body, aerr := w.readBody(rw, r)
	var msgs []ChatMessage
	var req *anthropicRequest
	if aerr == nil {
		req, msgs, aerr = decodeAnthropic(body, false)
	}
	if aerr == nil {
		aerr = w.checkModel(req.Model)
	}
	if aerr != nil {
		writeAnthropicError(rw, aerr)
		return
	}
	writeJSON(rw, http.StatusOK, map[string]int{"input_tokens": len(Tokenize(RenderChat(msgs, true), true))})
}

// --- Embeddings ---

// embeddingDims is the length of a simulated embedding.
const embeddingDims = 8

// handleEmbeddings answers /v1/embeddings with a deterministic unit vector per input,
// seeded by its tokens: equal inputs get equal embeddings. encoding_format "float" (the
// default) sends each vector as numbers; "base64" sends its float32 values, little-endian,
// base64-encoded, as OpenAI and vLLM do (the official openai clients ask for it by default
// and decode it); any other format is a 400.
func (w *Worker) handleEmbeddings(rw http.ResponseWriter, r *http.Request) {
	body, aerr := w.readBody(rw, r)
	var in struct {
		Model          string          `json:"model"`
		Input          json.RawMessage `json:"input"`
		EncodingFormat json.RawMessage `json:"encoding_format"`
	}
	if aerr == nil && json.Unmarshal(body, &in) != nil {
		aerr = badRequest("", "request body must be a JSON object")
	}
	if aerr == nil {
		aerr = w.checkModel(in.Model)
	}
	var encode func([]float32) any
	if aerr == nil {
		encode, aerr = embeddingEncoder(in.EncodingFormat)
	}
	var inputs [][]uint32
	if aerr == nil {
		inputs, aerr = embeddingInputs(in.Input)
	}
	if aerr != nil {
		writeError(rw, aerr)
		return
	}
	data := make([]any, len(inputs))
	total := 0
	for i, toks := range inputs {
		total += len(toks)
		data[i] = map[string]any{"object": "embedding", "index": i, "embedding": encode(embedding(toks))}
	}
	w.served.Add(1)
	writeJSON(rw, http.StatusOK, map[string]any{"object": "list", "data": data, "model": w.cfg.Model,
		"usage": map[string]int{"prompt_tokens": total, "total_tokens": total}})
}

// embedding is the simulated embedding of tokens: a unit vector seeded by their hash.
func embedding(toks []uint32) []float32 {
	seed := BlockHash(0, toks)
	vec := make([]float64, embeddingDims)
	norm := 0.0
	for d := range vec {
		vec[d] = float64(int64(seed*uint64(2*d+1)>>40)%1000)/1000 - 0.5
		norm += vec[d] * vec[d]
	}
	out := make([]float32, embeddingDims)
	for d := range vec {
		out[d] = float32(vec[d] / math.Sqrt(norm+1e-12))
	}
	return out
}

// embeddingEncoder returns how an embedding is sent for an encoding_format: numbers when it
// is absent, null or "float"; a base64 string of little-endian float32s for "base64".
func embeddingEncoder(raw json.RawMessage) (func([]float32) any, *apiError) {
	format := "float"
	if len(raw) > 0 && string(raw) != "null" && json.Unmarshal(raw, &format) != nil {
		return nil, badRequest("encoding_format", "encoding_format must be a string, \"float\" or \"base64\"")
	}
	switch format {
	case "float":
		return func(v []float32) any { return v }, nil
	case "base64":
		return func(v []float32) any {
			buf := make([]byte, 0, 4*len(v))
			for _, x := range v {
				buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(x))
			}
			return base64.StdEncoding.EncodeToString(buf)
		}, nil
	}
	return nil, badRequest("encoding_format", "encoding_format must be \"float\" or \"base64\", not %q", format)
}

// embeddingInputs reads input: a string, strings, token ids, or arrays of token ids.
func embeddingInputs(raw json.RawMessage) ([][]uint32, *apiError) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return [][]uint32{Tokenize(s, true)}, nil
	}
	var ss []string
	if json.Unmarshal(raw, &ss) == nil && len(ss) > 0 {
		out := make([][]uint32, len(ss))
		for i, x := range ss {
			out[i] = Tokenize(x, true)
		}
		return out, nil
	}
	var ids []uint32
	if json.Unmarshal(raw, &ids) == nil && len(ids) > 0 {
		return [][]uint32{ids}, nil
	}
	var batch [][]uint32
	if json.Unmarshal(raw, &batch) == nil && len(batch) > 0 {
		return batch, nil
	}
	return nil, badRequest("input", "input must be a string, an array of strings, or token ids")
}
