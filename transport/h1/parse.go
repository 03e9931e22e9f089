package h1

import (
	"bufio"
	"bytes"
	"errors"
	"net/http"
	"net/textproto"
	"net/url"
	"strconv"

	"golang.org/x/net/http/httpguts"
)

// head is a parsed request head: what the server needs to build an *http.Request and to
// frame the body. It is the parser's whole output, so that the differential fuzz target can
// compare it with net/http's reading of the same bytes.
type head struct {
	method, target string
	// minor is the HTTP/1.x minor version (0 or 1).
	minor int
	// url is the target's URL: the head's own (last's, once parsed), which the request
	// copies, as a handler may change it.
	url    *url.URL
	header http.Header
	host   string
	// length is the body's Content-Length; -1 with chunked.
	length  int64
	chunked bool
	// close: the client asked for the connection to end after this answer (or is HTTP/1.0).
	close bool
	// expect100: the client waits for 100 Continue before it sends the body.
	expect100 bool
	// last is the last target this head parsed and its URL (kept across reads of a
	// connection's head: a client mostly sends one path again and again).
	last struct {
		target string
		url    url.URL
	}
	// spare is the header map the next read fills (a connection's head lends it to one
	// request at a time: serveOne gives it back once the answer is finished).
	spare spareHeader
}

// badRequest is a request the server refuses before any handler sees it: the status it is
// answered with and why (the text goes to the client, so it names no internals).
type badRequest struct {
	status int
	why    string
}

func (e *badRequest) Error() string { return strconv.Itoa(e.status) + " " + e.why }

func bad(status int, why string) *badRequest { return &badRequest{status: status, why: why} }

// errHeadTooLarge is a request head past the server's MaxHeaderBytes.
var errHeadTooLarge = bad(http.StatusRequestHeaderFieldsTooLarge, "request header fields too large")

// lineReader reads the lines of one request head within a byte budget.
type lineReader struct {
	br *bufio.Reader
	// left is what the head may still take, in bytes.
	left int
	// long holds a line longer than br's buffer.
	long []byte
}

// line returns the next line without its CRLF. A line must end in CRLF: a bare LF or a CR
// anywhere else is refused (a parser that accepts what another rejects is how requests are
// smuggled). The slice is valid until the next call.
func (l *lineReader) line() ([]byte, error) {
	b, err := l.br.ReadSlice('\n')
	if errors.Is(err, bufio.ErrBufferFull) {
		l.long = append(l.long[:0], b...)
		for errors.Is(err, bufio.ErrBufferFull) {
			if len(l.long) > l.left {
				return nil, errHeadTooLarge
			}
			b, err = l.br.ReadSlice('\n')
			l.long = append(l.long, b...)
		}
		b = l.long
	}
	if err != nil {
		return nil, err
	}
	if len(b) > l.left {
		return nil, errHeadTooLarge
	}
	l.left -= len(b)
	if len(b) < 2 || b[len(b)-2] != '\r' {
		return nil, bad(http.StatusBadRequest, "a line of the request head does not end in CRLF")
	}
	b = b[:len(b)-2]
	if bytes.IndexByte(b, '\r') >= 0 {
		return nil, bad(http.StatusBadRequest, "a bare CR in the request head")
	}
	return b, nil
}

// canonical maps the header names clients send most, as they send them, to their canonical
// form, so that reading them costs no allocation.
var canonical = func() map[string]string {
	m := map[string]string{}
	for _, k := range []string{"Host", "User-Agent", "Accept", "Accept-Encoding", "Content-Type", "Content-Length",
		"Connection", "Authorization", "Transfer-Encoding", "Expect", "X-Session-Id", "X-Target-Worker",
		"X-Forwarded-For", "X-Request-Id", "Traceparent", "Tracestate", "Openai-Organization", "Openai-Project",
		"X-Data-Parallel-Rank", "X-Dynamo-Session-Id", "Anthropic-Version", "X-Api-Key", "Cookie", "Keep-Alive"} {
		c := textproto.CanonicalMIMEHeaderKey(k)
		m[c] = c
		m[bytesToLower(k)] = c
	}
	m["X-Session-ID"] = "X-Session-Id"
	m["X-Dynamo-Session-ID"] = "X-Dynamo-Session-Id"
	return m
}()

func bytesToLower(s string) string { return string(bytes.ToLower([]byte(s))) }

// readHead reads and checks one request head from br, taking at most maxBytes. It refuses
// what net/http refuses and, where net/http is lenient in ways a proxy in front could read
// differently, refuses more: obs-fold, a bare LF, Transfer-Encoding with Content-Length,
// Transfer-Encoding on HTTP/1.0, any transfer coding but chunked, a version but 1.0 and 1.1.
// A read error (the client went away, a deadline) comes back as it is; a refusal is a
// *badRequest.
func readHead(br *bufio.Reader, maxBytes int) (*head, error) {
	h := &head{}
	if err := h.read(br, maxBytes); err != nil {
		return nil, err
	}
	return h, nil
}

// read is readHead into h (a connection's own, reused by its requests: the request takes
// copies of its fields, never h).
func (h *head) read(br *bufio.Reader, maxBytes int) error {
	last, spare := h.last, h.spare
	*h = head{}
	h.last, h.spare = last, spare
	lr := lineReader{br: br, left: maxBytes}
	line, err := lr.line()
	if err != nil {
		return err
	}
	if err := h.requestLine(line); err != nil {
		return err
	}
	// The values are gathered in one buffer and made one string, which the header's
	// values slice: two allocations for all of them (as net/textproto does), when they
	// are at most maxSharedValues bytes (values).
	var (
		fields                    [32]headField
		list                      = fields[:0]
		values                    = make([]byte, 0, 512)
		lengths, encodings, hosts int
	)
	for {
		line, err := lr.line()
		if err != nil {
			return err
		}
		if len(line) == 0 {
			break
		}
		key, value, err := field(line)
		if err != nil {
			return err
		}
		switch key {
		case "Content-Length":
			lengths++
			n, ok := parseLength(value)
			if !ok {
				return bad(http.StatusBadRequest, "invalid Content-Length")
			}
			if lengths > 1 && n != h.length {
				return bad(http.StatusBadRequest, "Content-Length headers that disagree")
			}
			h.length = n
		case "Transfer-Encoding":
			encodings++
		case "Host":
			hosts++
		}
		list = append(list, headField{key: key, start: len(values), end: len(values) + len(value)})
		values = append(values, value...)
	}
	all, shared := "", len(values) <= maxSharedValues
	if shared {
		all = string(values)
	}
	vals := make([]string, len(list))
	h.header = h.spare.take(len(list))
	for i, f := range list {
		if shared {
			vals[i] = all[f.start:f.end]
		} else {
			vals[i] = string(values[f.start:f.end])
		}
		if prev, ok := h.header[f.key]; ok {
			h.header[f.key] = append(prev, vals[i])
		} else {
			h.header[f.key] = vals[i : i+1 : i+1]
		}
	}
	return h.check(lengths, encodings, hosts)
}

// maxSharedValues bounds the bytes of a head's values that share one string. A value a
// handler keeps long holds its whole string alive (transport/openai's session key is kept
// in the binding tables for the binding's life): past this bound each value is a string
// of its own, so that a kept value holds at most this much of its request, not a head of
// up to MaxHeaderBytes.
const maxSharedValues = 1024

// headField is one header line's canonical name and where its value lies in the head's
// values.
type headField struct {
	key        string
	start, end int
}

// field splits a header (or trailer) line into its canonical name and its value, refusing
// obs-fold, a name that is not a token (whitespace before the colon included) and a value
// with a control character.
func field(line []byte) (key string, value []byte, err error) {
	if line[0] == ' ' || line[0] == '\t' {
		return "", nil, bad(http.StatusBadRequest, "obs-fold (a header line continued on the next) is not accepted")
	}
	colon := bytes.IndexByte(line, ':')
	if colon <= 0 {
		return "", nil, bad(http.StatusBadRequest, "a header line without a name and a colon")
	}
	name, value := line[:colon], trimOWS(line[colon+1:])
	key, ok := canonical[string(name)]
	if !ok {
		if !httpguts.ValidHeaderFieldName(string(name)) {
			return "", nil, bad(http.StatusBadRequest, "invalid header name")
		}
		key = textproto.CanonicalMIMEHeaderKey(string(name))
	}
	if !validValue(value) {
		return "", nil, bad(http.StatusBadRequest, "invalid header value")
	}
	return key, value, nil
}

// requestLine reads "METHOD SP target SP HTTP/1.x".
func (h *head) requestLine(line []byte) error {
	sp1 := bytes.IndexByte(line, ' ')
	if sp1 <= 0 {
		return bad(http.StatusBadRequest, "malformed request line")
	}
	rest := line[sp1+1:]
	sp2 := bytes.IndexByte(rest, ' ')
	if sp2 <= 0 {
		return bad(http.StatusBadRequest, "malformed request line")
	}
	method, target, proto := line[:sp1], rest[:sp2], rest[sp2+1:]
	if !validMethod(method) {
		return bad(http.StatusBadRequest, "invalid method")
	}
	switch string(proto) {
	case "HTTP/1.1":
		h.minor = 1
	case "HTTP/1.0":
		h.minor = 0
	default:
		if bytes.HasPrefix(proto, []byte("HTTP/")) {
			return bad(http.StatusHTTPVersionNotSupported, "HTTP version not supported")
		}
		return bad(http.StatusBadRequest, "malformed request line")
	}
	h.method = methodString(method)
	if h.method == http.MethodConnect {
		return bad(http.StatusMethodNotAllowed, "CONNECT is not served")
	}
	if h.last.target != "" && string(target) == h.last.target {
		// The same target as the connection's last: its string and its URL.
		h.target = h.last.target
		h.url = &h.last.url
		return nil
	}
	h.target = string(target)
	if h.target == "*" && h.method == http.MethodOptions {
		h.url = &url.URL{Path: "*"}
		return nil
	}
	u, err := url.ParseRequestURI(h.target)
	if err != nil {
		return bad(http.StatusBadRequest, "invalid request target")
	}
	h.last.target, h.last.url = h.target, *u
	h.url = &h.last.url
	return nil
}

// check settles the framing and the host once every header is read.
func (h *head) check(lengths, encodings, hosts int) error {
	if hosts > 1 {
		return bad(http.StatusBadRequest, "too many Host headers")
	}
	h.host = h.header.Get("Host")
	if hosts == 0 && h.minor == 1 {
		return bad(http.StatusBadRequest, "missing required Host header")
	}
	if !httpguts.ValidHostHeader(h.host) {
		return bad(http.StatusBadRequest, "malformed Host header")
	}
	if h.url.Host != "" {
		// An absolute-form target names the host (RFC 9112, 3.2.2).
		h.host = h.url.Host
	}
	delete(h.header, "Host")
	if lengths > 1 {
		// Copies of one length are one length (as net/http reads them).
		h.header["Content-Length"] = h.header["Content-Length"][:1]
	}
	if encodings > 0 {
		switch {
		case h.minor == 0:
			return bad(http.StatusBadRequest, "Transfer-Encoding in an HTTP/1.0 request")
		case lengths > 0:
			return bad(http.StatusBadRequest, "both Transfer-Encoding and Content-Length")
		}
		te := h.header["Transfer-Encoding"]
		if len(te) != 1 || !asciiEqualFold(te[0], "chunked") {
			return bad(http.StatusNotImplemented, "unsupported transfer encoding (only chunked is)")
		}
		h.chunked, h.length = true, -1
		// As net/http: the coding is the request's TransferEncoding, not a header.
		delete(h.header, "Transfer-Encoding")
	}
	for _, c := range h.header["Connection"] {
		if httpguts.HeaderValuesContainsToken([]string{c}, "close") {
			h.close = true
		}
	}
	if h.minor == 0 {
		h.close = true
	}
	if e, ok := h.header["Expect"]; ok {
		if h.minor == 0 || len(e) != 1 || !asciiEqualFold(e[0], "100-continue") {
			return bad(http.StatusExpectationFailed, "unsupported Expect")
		}
		h.expect100 = h.chunked || h.length > 0
	}
	return nil
}

// parseLength reads a Content-Length: digits only, no sign, within int64.
func parseLength[T string | []byte](v T) (int64, bool) {
	if len(v) == 0 || len(v) > 18 {
		return 0, false
	}
	var n int64
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

func trimOWS(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	return b
}

// validValue: field-content (visible ASCII, obs-text, SP, HT), as net/http's server checks.
func validValue(b []byte) bool {
	for _, c := range b {
		if (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// validMethod: a token.
func validMethod(b []byte) bool {
	for _, c := range b {
		if !httpguts.IsTokenRune(rune(c)) {
			return false
		}
	}
	return len(b) > 0
}

// methodString returns the common methods without an allocation.
func methodString(b []byte) string {
	switch string(b) {
	case http.MethodPost:
		return http.MethodPost
	case http.MethodGet:
		return http.MethodGet
	case http.MethodDelete:
		return http.MethodDelete
	case http.MethodHead:
		return http.MethodHead
	case http.MethodPut:
		return http.MethodPut
	case http.MethodOptions:
		return http.MethodOptions
	case http.MethodConnect:
		return http.MethodConnect
	}
	return string(b)
}

// asciiEqualFold compares s and t folding ASCII letters only: strings.EqualFold folds
// Unicode too, and would read "chun\u212aed" (a Kelvin sign) as chunked.
func asciiEqualFold(s, t string) bool {
	if len(s) != len(t) {
		return false
	}
	for i := 0; i < len(s); i++ {
		a, b := s[i], t[i]
		if 'A' <= a && a <= 'Z' {
			a += 'a' - 'A'
		}
		if 'A' <= b && b <= 'Z' {
			b += 'a' - 'A'
		}
		if a != b {
			return false
		}
	}
	return true
}
