package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// Request migration: a streamed chat or completion whose worker fails after the first byte
// goes on at another worker (Config.MigrationLimit times at most), as Dynamo's
// --migration-limit does. The proxy follows the stream as it relays it (the text sent, the
// events that carried it, the stream's id, created and model); when the worker breaks off
// between two events, the request goes to another worker as a continuation the engine can
// prefill: for a completion the prompt followed by the text sent, for a chat the messages
// followed by an assistant message holding the text sent, with continue_final_message true
// and add_generation_prompt false (vLLM's way to continue a message). max_tokens and
// max_completion_tokens shrink by the events sent. The new worker's events reach the client
// as the stream's own: the first worker's id, created and model, a chat's opening role event
// dropped, the usage counting the tokens sent as generated, not as prompt.
//
// A stream that cannot be continued so ends with an error event in the API's shape, as one
// with migration off does: a token prompt (the text sent cannot be appended to it), n above
// 1, echo, a chat that continues its final message already, tool calls or reasoning in the
// answer (their deltas are not content), an event the router cannot read.

// Outcomes of a worker failure after the first byte, the values of
// kvrouter_migrations_total{outcome}.
const (
	migrationMoved       = "moved"       // the stream went on at another worker
	migrationDisabled    = "disabled"    // --migration-limit 0: the stream ended with an error event
	migrationExhausted   = "exhausted"   // the stream had moved --migration-limit times already
	migrationUnsupported = "unsupported" // the request or its answer cannot be continued
	migrationNoWorker    = "no_worker"   // no other worker could take it
	migrationFinished    = "finished"    // the answer was whole but for its end, which the router sent
)

// migrationOutcomes lists every outcome, so that each is exported from the start.
func migrationOutcomes() []string {
	return []string{migrationMoved, migrationDisabled, migrationExhausted, migrationUnsupported, migrationNoWorker, migrationFinished}
}

// maxMigrationText bounds the text a stream keeps for its continuation; past it the stream
// can no longer move (it would be a prompt no worker takes anyway).
const maxMigrationText = 4 << 20

// migration follows one stream as it is relayed, for its continuation elsewhere.
type migration struct {
	kind Kind
	// left is how many more times the stream may move.
	left int
	// blocked says why the stream cannot move ("" while it can).
	blocked string
	// moves counts the times it moved; from the first, dispatches send the continuation and
	// their events are rewritten.
	moves int
	// id, created and model are the stream's first event's, which every later event keeps.
	id, created, model json.RawMessage
	// text is the content relayed so far; tokens counts the events that carried some.
	text   strings.Builder
	tokens int
	// moved is tokens when the stream last moved: what the continuation's usage counts as
	// prompt but the client as generated.
	moved int
	// finished: an event with a finish_reason went out; the answer lacks only its end.
	finished bool
	// opened: the current continuation has relayed an event (a chat's first, the role
	// alone, is dropped).
	opened bool
	// partial holds the bytes of an event not whole yet.
	partial []byte
	// out is the rewritten events of one read.
	out []byte
}

// newMigration follows p's stream for up to limit moves; nil when limit is 0. A request that
// cannot be continued gets one that is blocked, so that its failure is counted as such.
func newMigration(p *Request, limit int) *migration {
	if limit <= 0 {
		return nil
	}
	m := &migration{kind: p.Kind, left: limit}
	switch {
	case !p.Stream:
		m.blocked = "not streamed"
	case p.Kind != KindChat && p.Kind != KindCompletion:
		m.blocked = "only chat completions and completions are continued"
	case p.HasTokens:
		m.blocked = "a token prompt"
	default:
		m.blocked = continuable(p.Body)
	}
	return m
}

// continuable says why a request body cannot be continued, "" when it can.
func continuable(body []byte) string {
	var f struct {
		N        *int            `json:"n"`
		Echo     *bool           `json:"echo"`
		Continue *bool           `json:"continue_final_message"`
		Prompt   json.RawMessage `json:"prompt"`
	}
	if err := json.Unmarshal(body, &f); err != nil {
		return "an unreadable body"
	}
	switch {
	case f.N != nil && *f.N > 1:
		return "n above 1"
	case f.Echo != nil && *f.Echo:
		return "echo"
	case f.Continue != nil && *f.Continue:
		return "continue_final_message already"
	}
	if !isNull(f.Prompt) {
		if _, err := promptText(f.Prompt); err != nil {
			return err.Error()
		}
	}
	return ""
}

// promptText is a completion prompt's text: a string, or an array of one string.
func promptText(raw json.RawMessage) (string, error) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var one []string
	if json.Unmarshal(raw, &one) == nil && len(one) == 1 {
		return one[0], nil
	}
	return "", errors.New("a prompt that is not one string")
}

// moving reports whether the current dispatch continues a stream that moved.
func (m *migration) moving() bool { return m != nil && m.moves > 0 }

// start readies the follower for a dispatch: an event half read from a failed worker is
// dropped (the client never saw it).
func (m *migration) start() {
	m.partial = m.partial[:0]
	m.opened = false
}

// relay follows the bytes of one read and returns what goes to the client: the bytes as
// they came, or for a continuation its whole events, rewritten as the stream's own.
func (m *migration) relay(b []byte) []byte {
	if m.blocked != "" && !m.moving() {
		return b
	}
	m.partial = append(m.partial, b...)
	m.out = m.out[:0]
	for {
		ev, rest, ok := nextEvent(m.partial)
		if !ok {
			break
		}
		if m.moving() {
			m.out = append(m.out, m.rewrite(ev)...)
		} else {
			m.observe(ev)
		}
		m.partial = append(m.partial[:0], rest...)
	}
	if len(m.partial) > maxMigrationText {
		m.block("an event too large to follow")
		m.partial = m.partial[:0]
	}
	if !m.moving() {
		return b
	}
	return m.out
}

// block stops the stream from moving, saying why (the first reason stays).
func (m *migration) block(why string) {
	if m.blocked == "" {
		m.blocked = why
	}
}

// nextEvent cuts the first whole server-sent event (ended by a blank line, in any of the
// three line endings) from b, returning it with its end and the rest.
func nextEvent(b []byte) (ev, rest []byte, ok bool) {
	for i := 0; i < len(b); i++ {
		if b[i] != '\n' && b[i] != '\r' {
			continue
		}
		// A line ends at i; a blank line follows when the next line ending comes at once.
		j := i + 1
		if b[i] == '\r' && j < len(b) && b[j] == '\n' {
			j++
		}
		if j < len(b) && (b[j] == '\n' || b[j] == '\r') {
			k := j + 1
			if b[j] == '\r' {
				if k == len(b) {
					// "\r" might be the start of "\r\n": wait for the next byte.
					return nil, b, false
				}
				if b[k] == '\n' {
					k++
				}
			}
			return b[:k], b[k:], true
		}
		i = j - 1
	}
	return nil, b, false
}

// eventData is an event's data: its data lines joined by "\n" (one optional space after
// the colon dropped), ok false when it has none.
func eventData(ev []byte) (data []byte, ok bool) {
	for line := range bytes.Lines(ev) {
		line = bytes.TrimRight(line, "\r\n")
		v, found := bytes.CutPrefix(line, []byte("data:"))
		if !found {
			continue
		}
		v, _ = bytes.CutPrefix(v, []byte(" "))
		if ok {
			data = append(data, '\n')
		}
		data, ok = append(data, v...), true
	}
	return data, ok
}

// streamChunk is what the migration reads of a chat or completion stream's event.
type streamChunk struct {
	Error   nonNull `json:"error"`
	Choices []struct {
		Index int     `json:"index"`
		Text  *string `json:"text"`
		Delta *struct {
			Role         nonNull `json:"role"`
			Content      *string `json:"content"`
			ToolCalls    nonNull `json:"tool_calls"`
			FunctionCall nonNull `json:"function_call"`
			Reasoning    nonNull `json:"reasoning_content"`
			Reasoning2   nonNull `json:"reasoning"`
		} `json:"delta"`
		FinishReason nonNull `json:"finish_reason"`
	} `json:"choices"`
}

// streamHead is a stream's first event's identity, which every later event keeps.
type streamHead struct {
	ID      json.RawMessage `json:"id"`
	Created json.RawMessage `json:"created"`
	Model   json.RawMessage `json:"model"`
}

// nonNull notes that a member is present and not null, without keeping it.
type nonNull bool

// UnmarshalJSON implements json.Unmarshaler.
func (n *nonNull) UnmarshalJSON(b []byte) error {
	*n = nonNull(string(b) != "null")
	return nil
}

// observe notes one event the client gets; roleOnly reports a chat event that carries the
// assistant's role and nothing else (a stream's opening event).
func (m *migration) observe(ev []byte) (roleOnly bool) {
	data, ok := eventData(ev)
	if !ok || string(data) == "[DONE]" {
		return false
	}
	var c streamChunk
	if err := json.Unmarshal(data, &c); err != nil {
		m.block("an event that is not a chunk")
		return false
	}
	if c.Error {
		m.block("an error event")
		return false
	}
	if m.id == nil {
		var h streamHead
		if json.Unmarshal(data, &h) != nil || isNull(h.ID) {
			m.block("a first event without an id")
			return false
		}
		m.id, m.created, m.model = h.ID, h.Created, h.Model
	}
	roleOnly = len(c.Choices) == 1
	for _, ch := range c.Choices {
		if ch.Index != 0 {
			m.block("a choice other than the first")
			continue
		}
		piece := ch.Text
		if d := ch.Delta; d != nil {
			piece = d.Content
			if d.ToolCalls || d.FunctionCall || d.Reasoning || d.Reasoning2 {
				m.block("tool calls or reasoning in the answer")
			}
			roleOnly = roleOnly && bool(d.Role) && (d.Content == nil || *d.Content == "")
		} else {
			roleOnly = false
		}
		if piece != nil && *piece != "" {
			if m.text.Len()+len(*piece) > maxMigrationText {
				m.block("an answer too long to continue")
			} else {
				m.text.WriteString(*piece)
			}
			m.tokens++
		}
		if ch.FinishReason {
			m.finished = true
			roleOnly = false
		}
	}
	return roleOnly
}

// rewrite turns one event of a continuation into the stream's own: the first worker's id,
// created and model; the usage counting the tokens sent before the move as generated; a
// chat's opening role event dropped (the client had it from the first worker).
func (m *migration) rewrite(ev []byte) []byte {
	data, ok := eventData(ev)
	if !ok || string(data) == "[DONE]" {
		return ev
	}
	roleOnly := m.observe(ev)
	first := !m.opened
	m.opened = true
	if roleOnly && first {
		return nil
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(data, &obj); err != nil {
		return ev
	}
	for k, v := range map[string]json.RawMessage{"id": m.id, "created": m.created, "model": m.model} {
		if _, has := obj[k]; has && v != nil {
			obj[k] = v
		}
	}
	if u, has := obj["usage"]; has && !isNull(u) {
		obj["usage"] = shiftUsage(u, m.moved)
	}
	out, err := json.Marshal(obj)
	if err != nil {
		return ev
	}
	return append(append([]byte("data: "), out...), "\n\n"...)
}

// shiftUsage moves sent tokens from a continuation's prompt to its completion, where the
// client counts them; a usage it cannot read stays as it is.
func shiftUsage(u json.RawMessage, sent int) json.RawMessage {
	var obj map[string]json.RawMessage
	if json.Unmarshal(u, &obj) != nil {
		return u
	}
	var prompt, completion int
	if json.Unmarshal(obj["prompt_tokens"], &prompt) != nil || json.Unmarshal(obj["completion_tokens"], &completion) != nil {
		return u
	}
	obj["prompt_tokens"], _ = json.Marshal(max(prompt-sent, 0))
	obj["completion_tokens"], _ = json.Marshal(completion + sent)
	out, err := json.Marshal(obj)
	if err != nil {
		return u
	}
	return out
}

// continuation is body (what the first worker was sent) as a continuation of the text sent
// so far.
func (m *migration) continuation(body []byte) ([]byte, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil {
		return nil, fmt.Errorf("continuation: %w", err)
	}
	text := m.text.String()
	if m.kind == KindChat {
		var msgs []json.RawMessage
		if err := json.Unmarshal(obj["messages"], &msgs); err != nil {
			return nil, fmt.Errorf("continuation: messages: %w", err)
		}
		last, err := json.Marshal(map[string]string{"role": "assistant", "content": text})
		if err != nil {
			return nil, fmt.Errorf("continuation: %w", err)
		}
		if obj["messages"], err = json.Marshal(append(msgs, last)); err != nil {
			return nil, fmt.Errorf("continuation: %w", err)
		}
		obj["continue_final_message"], obj["add_generation_prompt"] = json.RawMessage("true"), json.RawMessage("false")
	} else {
		prompt, err := promptText(obj["prompt"])
		if err != nil {
			return nil, fmt.Errorf("continuation: %w", err)
		}
		if obj["prompt"], err = json.Marshal(prompt + text); err != nil {
			return nil, fmt.Errorf("continuation: %w", err)
		}
	}
	for _, k := range [...]string{"max_tokens", "max_completion_tokens"} {
		var n int64
		if raw, has := obj[k]; has && json.Unmarshal(raw, &n) == nil {
			// The router counts events, which an engine may batch: at least one token more.
			obj[k], _ = json.Marshal(max(n-int64(m.tokens), 1))
		}
	}
	out, err := json.Marshal(obj)
	if err != nil {
		return nil, fmt.Errorf("continuation: %w", err)
	}
	return out, nil
}

// canMove decides what becomes of a stream whose worker broke off between two events after
// the client had its first: the outcome (kvrouter_migrations_total) and whether it moves.
func (m *migration) canMove() (outcome string, move bool) {
	switch {
	case m == nil:
		return migrationDisabled, false
	case m.blocked != "":
		return migrationUnsupported, false
	case m.finished:
		return migrationFinished, false
	case m.left == 0:
		return migrationExhausted, false
	}
	return migrationMoved, true
}

// move continues c's stream, whose worker failed (fail), at another worker, and reports
// whether the dispatch loop goes on; when no worker can take it, the stream ends with an
// error event.
func (s *Server) move(c *call, fail failure) bool {
	m := c.mig
	from := c.att.Decision().Target.Worker.String()
	if err := c.att.Move(c.r.Context(), fail.err); err != nil {
		s.metrics.migrations.WithLabelValues(migrationNoWorker).Inc()
		s.log.Warn("worker failed mid-stream and no other worker can continue it", "worker", from, "error", err)
		s.failStream(c, &Error{Status: http.StatusBadGateway, Type: TypeServer, Code: fail.cause, Cause: fail.cause,
			Message: fmt.Sprintf("the answer is incomplete: %v; no worker to continue it: %v", fail.err, err)})
		return false
	}
	m.moves++
	m.left--
	m.moved = m.tokens
	s.metrics.migrations.WithLabelValues(migrationMoved).Inc()
	s.log.Info("worker failed mid-stream; the stream moves to another worker", "from", from,
		"to", c.att.Decision().Target.Worker.String(), "move", m.moves, "tokens_sent", m.tokens, "cause", fail.cause, "error", fail.err)
	return true
}

// failStream ends a request whose answer may have started: a stream whose head is out ends
// with apiErr as its last event, any other request is answered apiErr (nil: the client left).
func (s *Server) failStream(c *call, apiErr *Error) {
	if apiErr == nil || !c.w.written() {
		s.fail(c.w, c.r, apiErr)
		return
	}
	s.countError(apiErr)
	s.log.Warn("stream ended with an error event", "path", c.r.URL.Path, "error", apiErr.Message)
	s.writeStreamEvent(c, apiErr, 0)
}

// writeStreamEvent writes apiErr as the stream's last event (Error.streamEvent; seq is the
// events sent so far).
func (s *Server) writeStreamEvent(c *call, apiErr *Error, seq int) {
	if _, err := c.w.Write(apiErr.streamEvent(c.p.Kind, c.w.anthropic, seq)); err != nil {
		c.w.clientGone()
	}
}
