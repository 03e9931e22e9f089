package openai

import (
	"bytes"
	"io"
	"net/http"
)

// maxCommonHeadLines bounds the header lines readCommonHead takes; a longer head goes to
// http.ReadResponse.
const maxCommonHeadLines = 64

// readCommonHead reads the common answer head, as http.ReadResponse would and with the same
// result, in a third of its allocations: HTTP/1.1, a final status that has a body (200 or
// more, not 204 or 304), to a request other than HEAD, every line ending in CRLF, no folded
// line, header names that are tokens, exactly one Content-Length (digits), and none of the
// headers that change the framing or the header set (Transfer-Encoding, Connection, Pragma,
// Trailer), all of it already in the read buffer. For anything else it consumes nothing and
// reports !ok, and ReadResponse reads the head instead. An error is one reading the first
// byte, as ReadResponse reports it. The answer is into when that is not nil.
func (c *upConn) readCommonHead(probe *http.Request, into *answer) (*answer, bool, error) {
	if _, err := c.br.Peek(1); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, false, err
	}
	if probe.Method == http.MethodHead {
		return nil, false, nil
	}
	buf, _ := c.br.Peek(c.br.Buffered())
	end := bytes.Index(buf, []byte("\r\n\r\n"))
	if end < 0 {
		return nil, false, nil
	}
	raw := buf[:end+2] // the status line and the header lines, each with its CRLF
	// The status line: "HTTP/1.1 NNN", then nothing or a space and the reason.
	eol := bytes.IndexByte(raw, '\n')
	if eol < 1 || raw[eol-1] != '\r' {
		return nil, false, nil
	}
	status := raw[:eol-1]
	if len(status) < 12 || string(status[:9]) != "HTTP/1.1 " || (len(status) > 12 && status[12] != ' ') {
		return nil, false, nil
	}
	code := 0
	for _, d := range status[9:12] {
		if d < '0' || d > '9' {
			return nil, false, nil
		}
		code = code*10 + int(d-'0')
	}
	if code < 200 || code == http.StatusNoContent || code == http.StatusNotModified || bytes.IndexByte(status, '\r') >= 0 {
		return nil, false, nil
	}
	// The header lines, canonicalised in a copy: each one's name and value as offsets in it.
	var fields [maxCommonHeadLines]headerSpan
	n := 0
	cp := append(c.head[:0], raw...)
	c.head = cp[:0]
	length, lengths := int64(0), 0
	for i := eol + 1; i < len(cp); {
		j := i + bytes.IndexByte(cp[i:], '\n')
		if cp[j-1] != '\r' || n == maxCommonHeadLines {
			return nil, false, nil
		}
		line := cp[i : j-1]
		f, ok := commonHeaderLine(line, i)
		if !ok {
			return nil, false, nil
		}
		switch name := string(cp[f.k0:f.k1]); name {
		case "Transfer-Encoding", "Connection", "Pragma", "Trailer":
			return nil, false, nil
		case "Content-Length":
			v := cp[f.v0:f.v1]
			if lengths++; lengths > 1 || len(v) == 0 || len(v) > 18 {
				return nil, false, nil
			}
			for _, d := range v {
				if d < '0' || d > '9' {
					return nil, false, nil
				}
				length = length*10 + int64(d-'0')
			}
		}
		fields[n] = f
		n++
		i = j + 1
	}
	if lengths != 1 {
		return nil, false, nil
	}
	// One string holds every name and value; the values' slices share one array, as
	// ReadMIMEHeader's do, inside the answer when they fit.
	s := string(cp)
	h := c.header
	if h == nil {
		h = make(http.Header, n)
		c.header = h
	} else {
		clear(h)
	}
	a := newAnswer(into)
	vals := a.vals[:]
	if n > len(vals) {
		vals = make([]string, n)
	}
	for _, f := range fields[:n] {
		k, v := s[f.k0:f.k1], s[f.v0:f.v1]
		if vv, dup := h[k]; dup {
			h[k] = append(vv, v)
			continue
		}
		vals[0] = v
		h[k] = vals[:1:1]
		vals = vals[1:]
	}
	a.resp = http.Response{
		Status: s[9 : eol-1], StatusCode: code, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: h, ContentLength: length, Request: probe, Body: http.NoBody,
	}
	if length > 0 {
		c.body = fixedBody{r: c.br, n: length}
		a.resp.Body = &c.body
	}
	_, _ = c.br.Discard(end + 4)
	return a, true, nil
}

// answerValues is how many header values an answer holds without a slice of their own:
// the common answer's few (type, length, and a server's date or request id).
const answerValues = 6

// answer is one exchange's answer from a worker: its head, the body the proxy reads, and
// the common head's header values, in one allocation rather than one for each.
type answer struct {
	resp http.Response
	body upBody
	vals [answerValues]string
}

// newAnswer is into, when there is one, else a new answer.
func newAnswer(into *answer) *answer {
	if into == nil {
		return new(answer)
	}
	return into
}

// headerSpan is one header line's name and value, as offsets in the head copy.
type headerSpan struct{ k0, k1, v0, v1 int }

// commonHeaderLine reads "Name: value" (line, at offset off in the head, without its CRLF),
// canonicalising the name in place as textproto does; !ok for a line ReadMIMEHeader would
// refuse or read otherwise (folded, a name that is not a token, a byte a value may not hold).
func commonHeaderLine(line []byte, off int) (headerSpan, bool) {
	colon := bytes.IndexByte(line, ':')
	if colon <= 0 || line[0] == ' ' || line[0] == '\t' {
		return headerSpan{}, false
	}
	upper := true
	for i, ch := range line[:colon] {
		if !validHeaderNameByte(ch) {
			return headerSpan{}, false
		}
		switch {
		case upper && 'a' <= ch && ch <= 'z':
			ch -= 'a' - 'A'
		case !upper && 'A' <= ch && ch <= 'Z':
			ch += 'a' - 'A'
		}
		line[i] = ch
		upper = ch == '-'
	}
	v0, v1 := colon+1, len(line)
	for _, ch := range line[v0:] {
		if (ch < ' ' && ch != '\t') || ch == 0x7f {
			return headerSpan{}, false
		}
	}
	for v0 < v1 && (line[v0] == ' ' || line[v0] == '\t') {
		v0++
	}
	for v1 > v0 && (line[v1-1] == ' ' || line[v1-1] == '\t') {
		v1--
	}
	return headerSpan{k0: off, k1: off + colon, v0: off + v0, v1: off + v1}, true
}

// validHeaderNameByte reports whether ch may be in a header name (an RFC 9110 token).
func validHeaderNameByte(ch byte) bool {
	switch {
	case 'a' <= ch && ch <= 'z', 'A' <= ch && ch <= 'Z', '0' <= ch && ch <= '9':
		return true
	}
	switch ch {
	case '!', '#', '$', '%', '&', '\'', '*', '+', '-', '.', '^', '_', '`', '|', '~':
		return true
	}
	return false
}

// fixedBody is an answer body of a known length over the connection's reader, read as
// net/http reads one: io.EOF with the last bytes, io.ErrUnexpectedEOF when the connection
// ends before them.
type fixedBody struct {
	r      io.Reader
	n      int64 // bytes left
	eof    bool
	closed bool
}

// Close implements io.Closer (upBody never calls it: it drops or pools the connection).
func (b *fixedBody) Close() error {
	b.closed = true
	return nil
}

// Read implements io.Reader.
func (b *fixedBody) Read(p []byte) (int, error) {
	if b.closed {
		return 0, http.ErrBodyReadAfterClose
	}
	if b.eof || b.n <= 0 {
		b.eof = true
		return 0, io.EOF
	}
	if int64(len(p)) > b.n {
		p = p[:b.n]
	}
	n, err := b.r.Read(p)
	b.n -= int64(n)
	switch {
	case err == io.EOF:
		b.eof = true
		if b.n > 0 {
			err = io.ErrUnexpectedEOF
		}
	case err == nil && n > 0 && b.n == 0:
		b.eof = true
		err = io.EOF
	}
	return n, err
}
