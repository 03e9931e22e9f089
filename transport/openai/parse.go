package openai

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"net/http"
	"strconv"
	"sync/atomic"
	"unicode/utf16"
	"unicode/utf8"
	"unsafe"

	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
)

// Kind is the OpenAI endpoint a request body belongs to.
type Kind int

// The request kinds the router understands.
const (
	KindChat        Kind = iota + 1 // /v1/chat/completions
	KindCompletion                  // /v1/completions
	KindResponses                   // /v1/responses (OpenAI Responses)
	KindMessages                    // /v1/messages (Anthropic Messages)
	KindCountTokens                 // /v1/messages/count_tokens (Anthropic)
	KindEmbeddings                  // /v1/embeddings
)

// String names the kind after its endpoint.
func (k Kind) String() string {
	switch k {
	case KindChat:
		return "chat"
	case KindCompletion:
		return "completion"
	case KindResponses:
		return "responses"
	case KindMessages:
		return "messages"
	case KindCountTokens:
		return "count_tokens"
	case KindEmbeddings:
		return "embeddings"
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
	// Body is the request exactly as the client sent it. It is never written: Text may
	// share its memory (parseInto's shared).
	Body []byte
	// PreviousResponseID is a Responses request's previous_response_id ("" for none): the
	// stored answer it continues, which lives on the worker that made it.
	PreviousResponseID string
	// StoreResponse: a Responses request whose answer the worker keeps (store, true unless
	// the client says false), to be continued by a later previous_response_id.
	StoreResponse bool
	// CacheSalt is vLLM's cache_salt, "" for none: it keys the prompt's first block on the
	// engine, so it keys the router's too.
	CacheSalt string
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
//
// It reads the body in one pass that both checks the JSON (accepting exactly what
// encoding/json accepts) and notes where the few fields routing reads are; encoding/json
// runs only to word the error for a body that is not JSON. Keys match exactly, as a worker
// decoding into a map would; a key repeated takes its last value.
func Parse(k Kind, body []byte) (*Request, error) {
	req := new(Request)
	if err := parseInto(k, body, req, nil, false); err != nil {
		return nil, err
	}
	return req, nil
}

// parseInto is Parse into req, which it overwrites: so that a caller can keep the request
// in memory of its own. The model's name comes from models (nil: a new string). shared: body
// is the request's own and no one writes it again (a body the handler read itself, not a
// caller's buffer), so a completion prompt with nothing to decode is a string that shares
// body's memory instead of a copy of it.
func parseInto(k Kind, body []byte, req *Request, models *names, shared bool) error {
	var f topFields
	switch scanTop(body, &f) {
	case topNotJSON:
		var probe json.RawMessage
		return invalid(jsonerr.Describe(json.Unmarshal(body, &probe)))
	case topNotObject:
		return invalid("", "request body must be a JSON object")
	}
	*req = Request{Kind: k, Body: body}

	// kv_transfer_params tell a worker to pull a prompt's KV from another worker, or to hold
	// it for one; they are the router's to set between the legs of a disaggregated request.
	// From a client they would make a decode worker pull from any address the client names
	// and pin KV on a prefill worker, so they are refused, not forwarded.
	if _, ok := present(f.kvTransfer); ok {
		return invalid("kv_transfer_params", "kv_transfer_params is set by the router between prefill and decode workers; a client may not send it")
	}
	if raw, ok := present(f.cacheSalt); ok {
		// vLLM takes a non-empty string, and keys the prompt's first block with it.
		if req.CacheSalt, ok = jsonString(raw); !ok || req.CacheSalt == "" {
			return invalid("cache_salt", "cache_salt must be a non-empty string")
		}
	}
	if k >= KindResponses {
		if err := parseAPI(k, body, req); err != nil {
			return err
		}
		return nil
	}

	model, ok := present(f.model)
	if !ok {
		return invalid("model", "missing required field: model")
	}
	if req.Model, ok = models.jsonString(model); !ok {
		return invalid("model", "model must be a string")
	}
	if req.Model == "" {
		return invalid("model", "model must be a non-empty string")
	}

	if raw, ok := present(f.stream); ok {
		switch string(raw) {
		case "true":
			req.Stream = true
		case "false":
		default:
			return invalid("stream", "stream must be a boolean")
		}
	}

	switch k {
	case KindChat:
		raw, ok := present(f.messages)
		if !ok {
			return invalid("messages", "missing required field: messages")
		}
		text, err := renderMessages(raw)
		if err != nil {
			return err
		}
		req.Text = text
		req.Messages = raw
	case KindCompletion:
		raw, ok := present(f.prompt)
		if !ok {
			return invalid("prompt", "missing required field: prompt")
		}
		if err := parsePrompt(raw, req, shared); err != nil {
			return err
		}
	default:
		return fmt.Errorf("parse: unknown request kind %d", k)
	}
	return nil
}

// DetectKind guesses a body's kind for /v1/route, which takes either: a JSON object with a
// "messages" member is a chat request, anything else a completion.
func DetectKind(body []byte) Kind {
	var f topFields
	if scanTop(body, &f) == topObject && f.messages != nil {
		return KindChat
	}
	return KindCompletion
}

// topFields are the raw values of the top-level fields routing reads (nil: absent).
type topFields struct {
	model, stream, messages, prompt, kvTransfer, cacheSalt []byte
}

// What scanTop found.
const (
	topObject = iota
	topNotObject
	topNotJSON
)

// scanTop checks that body is one JSON value and, when it is an object, notes the raw
// values of the fields routing reads.
func scanTop(body []byte, f *topFields) int {
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		end, ok := skipValue(body, i, maxDepth)
		if !ok || skipSpace(body, end) != len(body) {
			return topNotJSON
		}
		return topNotObject
	}
	end, ok := members(body[i:], maxDepth, func(key, val []byte) {
		switch string(key) {
		case "model":
			f.model = val
		case "stream":
			f.stream = val
		case "messages":
			f.messages = val
		case "prompt":
			f.prompt = val
		case "kv_transfer_params":
			f.kvTransfer = val
		case "cache_salt":
			f.cacheSalt = val
		}
	})
	if !ok || skipSpace(body, i+end) != len(body) {
		return topNotJSON
	}
	return topObject
}

// present returns a field's raw value, treating an explicit null like an absent field.
func present(raw []byte) ([]byte, bool) {
	if isNull(raw) {
		return nil, false
	}
	return raw, true
}

func renderMessages(raw []byte) (string, error) {
	const notArray = "messages must be a non-empty array"
	if raw[0] != '[' {
		return "", invalid("messages", notArray)
	}
	var buf [16][]byte
	msgs, bad := objects(raw, buf[:0])
	if bad >= 0 {
		param := "messages[" + strconv.Itoa(bad) + "]"
		return "", invalid(param, param+" must be an object")
	}
	if len(msgs) == 0 {
		return "", invalid("messages", notArray)
	}
	// The rendering is about as long as the messages' JSON.
	out := make([]byte, 0, len(raw))
	for i, m := range msgs {
		var role, content []byte
		fieldsOf(m, func(key, val []byte) {
			switch string(key) {
			case "role":
				role = val
			case "content":
				content = val
			}
		})
		var ok bool
		mark := len(out)
		if out, ok = appendString(out, role); !ok {
			param := "messages[" + strconv.Itoa(i) + "].role"
			return "", invalid(param, param+" must be a string")
		}
		isAssistant := string(out[mark:]) == "assistant"
		out = append(out, '\n')
		var err error
		if out, err = appendContent(out, content, isAssistant, i); err != nil {
			return "", err
		}
		out = append(out, '\n')
	}
	return ownedString(out), nil
}

// objects returns the elements of the JSON array raw, appended to dst, when all are
// objects; otherwise the index of the first that is not.
func objects(raw []byte, dst [][]byte) ([][]byte, int) {
	bad := -1
	elements(raw, func(i int, v []byte) bool {
		if v[0] != '{' {
			bad = i
			return false
		}
		dst = append(dst, v)
		return true
	})
	if bad >= 0 {
		return nil, bad
	}
	return dst, -1
}

// appendContent renders a message's content: a string, an array of content parts, or (for
// an assistant message that carries tool calls instead of text) null or nothing. Non-text
// parts such as images are the worker's business and do not reach the routing text.
func appendContent(out, raw []byte, isAssistant bool, msg int) ([]byte, error) {
	const shape = " must be a string or an array of text parts"
	param := func() string { return "messages[" + strconv.Itoa(msg) + "].content" }
	if isNull(raw) {
		if isAssistant {
			return out, nil
		}
		p := param()
		return nil, invalid(p, "missing required field: "+p)
	}
	if raw[0] == '"' {
		out, _ = appendString(out, raw)
		return out, nil
	}
	if raw[0] != '[' {
		p := param()
		return nil, invalid(p, p+shape)
	}
	var buf [8][]byte
	parts, bad := objects(raw, buf[:0])
	if bad >= 0 {
		pp := param() + "[" + strconv.Itoa(bad) + "]"
		return nil, invalid(pp, pp+" must be an object with a type")
	}
	for i, part := range parts {
		var typ, text []byte
		fieldsOf(part, func(key, val []byte) {
			switch string(key) {
			case "type":
				typ = val
			case "text":
				text = val
			}
		})
		if !isString(typ) {
			pp := param() + "[" + strconv.Itoa(i) + "].type"
			return nil, invalid(pp, pp+" must be a string")
		}
		if t, _ := jsonString(typ); t != "text" {
			continue
		}
		var ok bool
		if out, ok = appendString(out, text); !ok {
			pp := param() + "[" + strconv.Itoa(i) + "].text"
			return nil, invalid(pp, pp+" must be a string")
		}
	}
	return out, nil
}

// parsePrompt reads a completion's prompt into req; shared: raw is in memory no one writes
// again, which a plain string prompt may share (parseInto).
func parsePrompt(raw []byte, req *Request, shared bool) error {
	const shape = "prompt must be a string or an array of token ids"
	if s, ok := decodeString(raw, shared); ok {
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
		// As a decoder into []string would, null elements pass and others fail.
		var text []byte
		n, ok := 0, true
		elements(raw, func(i int, v []byte) bool {
			n++
			if i == 0 {
				text, ok = appendString(nil, v)
			} else {
				ok = isString(v) || string(v) == "null"
			}
			return ok
		})
		if !ok {
			return invalid("prompt", shape)
		}
		if n != 1 {
			return invalid("prompt", "prompt must hold exactly one string; batches of prompts are not supported")
		}
		req.Text = ownedString(text)
		return nil
	case len(inner) > 0 && inner[0] == '[':
		var first []byte
		n := 0
		elements(raw, func(i int, v []byte) bool {
			if i == 0 {
				first = v
			}
			n++
			return true
		})
		if n != 1 {
			return invalid("prompt", "prompt must hold exactly one token array; batches of prompts are not supported")
		}
		raw = first
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
// up to maxTokenID. raw is part of a checked document, so a byte scan suffices; it returns
// the index of the first bad element, or -1.
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

// jsonString decodes raw when it is a JSON string.
func jsonString(raw []byte) (string, bool) { return decodeString(raw, false) }

// decodeString decodes raw when it is a JSON string. shared: raw is in memory that no one
// writes again, so a string with nothing to decode is that memory rather than a copy.
func decodeString(raw []byte, shared bool) (string, bool) {
	if !isString(raw) {
		return "", false
	}
	// Plain ASCII, the common case, is found in one pass; then other text without escapes.
	if s := raw[1 : len(raw)-1]; plainRun(s, 0, true) == len(s) || (bytes.IndexByte(s, '\\') < 0 && utf8.Valid(s)) {
		if shared {
			return ownedString(s), true
		}
		return string(s), true
	}
	b, ok := appendString(nil, raw)
	return ownedString(b), ok
}

// ownedString is b as a string without a copy, for memory that no one writes again: a
// buffer its caller made and drops (as strings.Builder does with its own), or part of a
// request body the handler read itself (Request.Body is never written).
func ownedString(b []byte) string {
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// names interns strings that requests repeat (model names), so that a common one is not a
// new string on every request: a table of the last name seen in each of a few slots, by
// hash. A name that misses replaces its slot's; any number of names stays correct, a few
// dozen in turn only allocate as before. Safe for concurrent use.
type names struct {
	seed  maphash.Seed
	slots [namesSlots]atomic.Pointer[string]
}

// namesSlots is the table's size: a fleet's models, and more.
const namesSlots = 64

func newNames() *names { return &names{seed: maphash.MakeSeed()} }

// intern returns b as a string, the table's when it holds it.
func (n *names) intern(b []byte) string {
	if n == nil {
		return string(b)
	}
	slot := &n.slots[maphash.Bytes(n.seed, b)%namesSlots]
	if p := slot.Load(); p != nil && *p == string(b) {
		return *p
	}
	s := string(b)
	slot.Store(&s)
	return s
}

// jsonString is the package's jsonString, with a plain string interned.
func (n *names) jsonString(raw []byte) (string, bool) {
	if isString(raw) {
		if s := raw[1 : len(raw)-1]; plainRun(s, 0, true) == len(s) {
			return n.intern(s), true
		}
	}
	return jsonString(raw)
}

func isString(raw []byte) bool {
	return len(raw) >= 2 && raw[0] == '"' && raw[len(raw)-1] == '"'
}

func invalid(param, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Message: msg, Type: TypeInvalidRequest, Param: param}
}

// The scanner below checks JSON as encoding/json does (the same grammar, the same nesting
// limit, strings not required to be valid UTF-8) and decodes strings as it does (invalid
// UTF-8 and lone surrogates become U+FFFD), so that what the router reads of a body is what a
// worker's JSON decoder reads. Callers that walk a value already checked (members of a
// document scanTop accepted) still get bounds-checked code: bad input gives false, never a
// panic.

// maxDepth is encoding/json's nesting limit.
const maxDepth = 10000

// stringStop marks the bytes that end a run of plain string bytes: the quote, the
// backslash and control characters.
var stringStop = func() (t [256]bool) {
	for c := range 0x20 {
		t[c] = true
	}
	t['"'], t['\\'] = true, true
	return t
}()

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipString checks the string starting at b[i] == '"' and returns the index after it, and
// whether it holds escapes.
func skipString(b []byte, i int) (end int, escaped, ok bool) {
	i++
	for {
		i = plainRun(b, i, false)
		if i >= len(b) {
			return i, escaped, false
		}
		switch b[i] {
		case '"':
			return i + 1, escaped, true
		case '\\':
			escaped = true
			if i+1 >= len(b) {
				return i, escaped, false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if hex4(b, i+2) < 0 {
					return i, escaped, false
				}
				i += 6
			default:
				return i, escaped, false
			}
		default:
			return i, escaped, false
		}
	}
}

// plainRun returns the index of the first byte at or after i that ends a run of plain
// string bytes (see stringStop; with ascii, bytes from 0x80 end it too), or len(b). It tests
// eight bytes at a time: prompts are mostly long plain runs.
func plainRun(b []byte, i int, ascii bool) int {
	const (
		ones  = 0x0101010101010101
		highs = 0x8080808080808080
	)
	var high uint64
	if ascii {
		high = highs
	}
	for ; i+8 <= len(b); i += 8 {
		x := binary.LittleEndian.Uint64(b[i:])
		// Each term has a high bit set in some byte if and only if a byte is below 0x20, a
		// quote, or a backslash (the borrow trick; it may mark bytes above the first hit,
		// which the byte loop below sorts out).
		ctl := (x - 0x20*ones) &^ x
		q := x ^ '"'*ones
		quote := (q - ones) &^ q
		bs := x ^ '\\'*ones
		slash := (bs - ones) &^ bs
		if ((ctl|quote|slash)&highs)|(x&high) != 0 {
			break
		}
	}
	for i < len(b) && !stringStop[b[i]] && (!ascii || b[i] < utf8.RuneSelf) {
		i++
	}
	return i
}

// hex4 decodes the four hex digits at b[i:], or returns -1.
func hex4(b []byte, i int) rune {
	if i+4 > len(b) {
		return -1
	}
	var r rune
	for _, c := range b[i : i+4] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			c = c - 'A' + 10
		default:
			return -1
		}
		r = r<<4 | rune(c)
	}
	return r
}

func skipNumber(b []byte, i int) (int, bool) {
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i >= len(b):
		return i, false
	case b[i] == '0':
		i++
	case b[i] >= '1' && b[i] <= '9':
		i = skipDigits(b, i+1)
	default:
		return i, false
	}
	if i < len(b) && b[i] == '.' {
		j := skipDigits(b, i+1)
		if j == i+1 {
			return j, false
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := skipDigits(b, i)
		if j == i {
			return j, false
		}
		i = j
	}
	return i, true
}

func skipDigits(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}

// skipKey checks an object key and its colon, from b[i] on (spaces first), and returns the
// index after the colon.
func skipKey(b []byte, i int) (int, bool) {
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != '"' {
		return i, false
	}
	i, _, ok := skipString(b, i)
	if !ok {
		return i, false
	}
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != ':' {
		return i, false
	}
	return i + 1, true
}

// skipValue checks the JSON value starting at b[i] (spaces first), nested at most depth
// deep, and returns the index after it. It keeps its own stack rather than recursing, so a
// deeply nested body costs a byte per level.
func skipValue(b []byte, i int, depth int) (int, bool) {
	var stackBuf [64]byte
	stack := stackBuf[:0]
	var ok bool
	for {
		// A value starts at i.
		i = skipSpace(b, i)
		if i >= len(b) {
			return i, false
		}
		switch c := b[i]; c {
		case '{', '[':
			if len(stack) >= depth {
				return i, false
			}
			end := byte('}')
			if c == '[' {
				end = ']'
			}
			j := skipSpace(b, i+1)
			if j < len(b) && b[j] == end {
				i = j + 1
				break // an empty container is a whole value
			}
			stack = append(stack, c)
			i = j
			if c == '{' {
				if i, ok = skipKey(b, i); !ok {
					return i, false
				}
			}
			continue
		case '"':
			if i, _, ok = skipString(b, i); !ok {
				return i, false
			}
		case 't':
			if i, ok = skipLiteral(b, i, "true"); !ok {
				return i, false
			}
		case 'f':
			if i, ok = skipLiteral(b, i, "false"); !ok {
				return i, false
			}
		case 'n':
			if i, ok = skipLiteral(b, i, "null"); !ok {
				return i, false
			}
		default:
			if i, ok = skipNumber(b, i); !ok {
				return i, false
			}
		}
		// A value ended at i: close containers until one has a next member.
		for next := false; !next; {
			if len(stack) == 0 {
				return i, true
			}
			i = skipSpace(b, i)
			if i >= len(b) {
				return i, false
			}
			top := stack[len(stack)-1]
			switch {
			case b[i] == ',' && top == '{':
				if i, ok = skipKey(b, i+1); !ok {
					return i, false
				}
				next = true
			case b[i] == ',':
				i++
				next = true
			case (b[i] == '}' && top == '{') || (b[i] == ']' && top == '['):
				i++
				stack = stack[:len(stack)-1]
			default:
				return i, false
			}
		}
	}
}

func skipLiteral(b []byte, i int, lit string) (int, bool) {
	if !bytes.HasPrefix(b[i:], []byte(lit)) {
		return i, false
	}
	return i + len(lit), true
}

// validJSON reports whether b is one JSON value, as json.Valid does.
func validJSON(b []byte) bool {
	end, ok := skipValue(b, 0, maxDepth)
	return ok && skipSpace(b, end) == len(b)
}

// members walks the object starting at obj[0] == '{', nested at most depth deep with
// itself counted, checking it and calling fn with each member's decoded key and raw value.
// It returns the index after the object.
func members(obj []byte, depth int, fn func(key, val []byte)) (int, bool) {
	i := skipSpace(obj, 1)
	if i < len(obj) && obj[i] == '}' {
		return i + 1, true
	}
	// Every pass consumes a member or returns.
	for {
		i = skipSpace(obj, i)
		if i >= len(obj) || obj[i] != '"' {
			return i, false
		}
		keyEnd, escaped, ok := skipString(obj, i)
		if !ok {
			return keyEnd, false
		}
		key := obj[i+1 : keyEnd-1]
		if escaped {
			key, _ = appendString(nil, obj[i:keyEnd])
		}
		i = skipSpace(obj, keyEnd)
		if i >= len(obj) || obj[i] != ':' {
			return i, false
		}
		start := skipSpace(obj, i+1)
		end, ok := skipValue(obj, start, depth-1)
		if !ok {
			return end, false
		}
		fn(key, obj[start:end])
		i = skipSpace(obj, end)
		if i >= len(obj) {
			return i, false
		}
		switch obj[i] {
		case ',':
			i++
		case '}':
			return i + 1, true
		default:
			return i, false
		}
	}
}

// fieldsOf calls fn with each member of a checked object (ignoring any fault in it).
func fieldsOf(obj []byte, fn func(key, val []byte)) {
	_, _ = members(obj, maxDepth, fn)
}

// elements calls fn with each element of a checked array until fn returns false.
func elements(arr []byte, fn func(i int, v []byte) bool) {
	if len(arr) == 0 || arr[0] != '[' {
		return
	}
	i := skipSpace(arr, 1)
	if i < len(arr) && arr[i] == ']' {
		return
	}
	// Every pass consumes an element or returns.
	for n := 0; ; n++ {
		start := skipSpace(arr, i)
		end, ok := skipValue(arr, start, maxDepth)
		if !ok || !fn(n, arr[start:end]) {
			return
		}
		i = skipSpace(arr, end)
		if i >= len(arr) || arr[i] != ',' {
			return
		}
		i++
	}
}

// appendString appends the decoded JSON string raw to dst; false if raw is not a string.
// Decoding follows encoding/json: invalid UTF-8 and unpaired surrogates become U+FFFD.
func appendString(dst, raw []byte) ([]byte, bool) {
	if !isString(raw) {
		return dst, false
	}
	s := raw[1 : len(raw)-1]
	// Every pass consumes at least one byte or returns.
	for r := 0; r < len(s); {
		c := s[r]
		switch {
		case c == '\\':
			if r+1 >= len(s) {
				return dst, false
			}
			switch s[r+1] {
			case '"', '\\', '/', '\'':
				dst = append(dst, s[r+1])
			case 'b':
				dst = append(dst, '\b')
			case 'f':
				dst = append(dst, '\f')
			case 'n':
				dst = append(dst, '\n')
			case 'r':
				dst = append(dst, '\r')
			case 't':
				dst = append(dst, '\t')
			case 'u':
				rr := hex4(s, r+2)
				if rr < 0 {
					return dst, false
				}
				r += 6
				if utf16.IsSurrogate(rr) {
					var rr1 rune = -1
					if r+1 < len(s) && s[r] == '\\' && s[r+1] == 'u' {
						rr1 = hex4(s, r+2)
					}
					if dec := utf16.DecodeRune(rr, rr1); dec != utf8.RuneError {
						dst = utf8.AppendRune(dst, dec)
						r += 6
						continue
					}
					rr = utf8.RuneError
				}
				dst = utf8.AppendRune(dst, rr)
				continue
			default:
				return dst, false
			}
			r += 2
		case c == '"' || c < ' ':
			return dst, false
		case c < utf8.RuneSelf:
			// A run of plain ASCII goes in one copy.
			j := plainRun(s, r+1, true)
			dst = append(dst, s[r:j]...)
			r = j
		default:
			rr, size := utf8.DecodeRune(s[r:])
			dst = utf8.AppendRune(dst, rr)
			r += size
		}
	}
	return dst, true
}
