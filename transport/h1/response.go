package h1

import (
	"bufio"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"golang.org/x/net/http/httpguts"
)

// holdBytes is how much of an answer's body is held before its head goes out: an answer
// that ends within it gets a Content-Length, a longer one or one flushed early is chunked.
const holdBytes = 4096

// response is the http.ResponseWriter of one request. It is not reused: a handler's stray
// goroutine that writes after its handler returned gets an error, not the next answer.
type response struct {
	c      *conn
	req    *http.Request
	header http.Header
	status int
	// wroteHeader: the status is set; sent: the head is on its way to the client.
	wroteHeader, sent bool
	chunked           bool
	// length is the declared Content-Length (-1: none), written the body bytes so far.
	length, written int64
	hold            []byte
	// noBody: HEAD, 204 or 304; closeAfter: the connection ends after this answer.
	noBody, closeAfter bool
	minor              int
	// done: the handler returned.
	done bool
	// reqBody is the request's body (nil: none); one left unread ends the connection.
	reqBody *body
}

// newResponse is the writer of req's answer (req and h nil: a refusal's).
func (c *conn) newResponse(req *http.Request, h *head) *response {
	w := new(response)
	c.initResponse(w, req, h)
	return w
}

// initResponse makes w the writer of req's answer (newResponse's, in memory of the caller's).
func (c *conn) initResponse(w *response, req *http.Request, h *head) {
	*w = response{c: c, req: req, header: c.answerHeader.take(8), length: -1, hold: c.hold[:0], minor: 1}
	if h != nil {
		w.minor = h.minor
		w.noBody = h.method == http.MethodHead
	}
}

// Header implements http.ResponseWriter. Once the handler returned, the map is the
// connection's next answer's (spareHeader): a stray late caller gets a map of its own, which
// no answer reads.
func (w *response) Header() http.Header {
	if w.done {
		return http.Header{}
	}
	return w.header
}

// WriteHeader implements http.ResponseWriter. A 1xx status goes out at once (and may be
// followed by the real one); a second final status is ignored.
func (w *response) WriteHeader(code int) {
	if w.wroteHeader {
		return
	}
	if code < 100 || code > 999 {
		panic("h1: invalid WriteHeader code " + strconv.Itoa(code))
	}
	if code < 200 && code != http.StatusSwitchingProtocols {
		w.informational(code)
		return
	}
	w.wroteHeader, w.status = true, code
	if code == http.StatusNoContent || code == http.StatusNotModified || code < 200 {
		w.noBody = true
	}
	if cl := w.header.Get("Content-Length"); cl != "" {
		if n, ok := parseLength(cl); ok {
			w.length = n
		} else {
			w.header.Del("Content-Length")
		}
	}
}

func (w *response) informational(code int) {
	bw := w.c.bw
	writeStatus(bw, w.minor, code)
	writeHeader(bw, w.header)
	_, _ = bw.WriteString("\r\n")
	if err := bw.Flush(); err != nil {
		w.c.fail()
	}
}

// Write implements http.ResponseWriter.
func (w *response) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if w.done {
		return 0, errHandlerDone
	}
	if w.c.broken {
		return 0, errClientGone
	}
	if w.noBody {
		if w.req != nil && w.req.Method == http.MethodHead {
			return len(p), nil
		}
		return 0, http.ErrBodyNotAllowed
	}
	if w.length >= 0 && w.written+int64(len(p)) > w.length {
		return 0, http.ErrContentLength
	}
	if !w.sent {
		if len(w.hold)+len(p) <= holdBytes {
			w.hold = append(w.hold, p...)
			w.written += int64(len(p))
			return len(p), nil
		}
		w.sendHead(false)
	}
	w.written += int64(len(p))
	w.body(p)
	if w.c.broken {
		return 0, errClientGone
	}
	return len(p), nil
}

// Errors of a write that cannot go out.
var (
	errClientGone  = errors.New("h1: the client connection is gone")
	errHandlerDone = errors.New("h1: a write after the handler returned")
)

// body writes p in the answer's framing.
func (w *response) body(p []byte) {
	if len(p) == 0 {
		return
	}
	bw := w.c.bw
	if w.chunked {
		_, _ = bw.Write(strconv.AppendInt(bw.AvailableBuffer(), int64(len(p)), 16))
		_, _ = bw.WriteString("\r\n")
		_, _ = bw.Write(p)
		_, _ = bw.WriteString("\r\n")
	} else {
		_, _ = bw.Write(p)
	}
}

// sendHead puts the head in the connection's buffer, framing the body: the declared length,
// else the held bytes' length when the handler is done, else chunks (HTTP/1.1) or the
// connection's end (HTTP/1.0), then the held bytes.
func (w *response) sendHead(final bool) {
	w.sent = true
	h := w.header
	setLength := false
	switch {
	case w.noBody:
		if w.status == http.StatusNoContent || w.status == http.StatusNotModified || w.status < 200 {
			h.Del("Content-Length")
			h.Del("Transfer-Encoding")
		}
	case w.length >= 0:
		h.Del("Transfer-Encoding")
	case final:
		// The length is written with the head below, not put in the handler's header.
		w.length = int64(len(w.hold))
		setLength = true
		h.Del("Content-Length")
	case w.minor == 1:
		w.chunked = true
		h.Del("Content-Length")
		h["Transfer-Encoding"] = []string{"chunked"}
	default:
		w.closeAfter = true
	}
	if _, ok := h["Content-Type"]; !ok && len(w.hold) > 0 && !w.noBody {
		h["Content-Type"] = []string{http.DetectContentType(w.hold)}
	}
	_, hasDate := h["Date"]
	if httpguts.HeaderValuesContainsToken(h["Connection"], "close") {
		w.closeAfter = true
	}
	if w.c.srv.shutting.Load() || (w.req != nil && w.req.Close) || (w.reqBody != nil && !w.reqBody.done) {
		w.closeAfter = true
	}
	if w.closeAfter {
		if w.minor == 1 {
			h["Connection"] = []string{"close"}
		} else {
			h.Del("Connection")
		}
	}
	bw := w.c.bw
	writeStatus(bw, w.minor, w.status)
	writeHeader(bw, h)
	if setLength {
		_, _ = bw.WriteString("Content-Length: ")
		_, _ = bw.Write(strconv.AppendInt(bw.AvailableBuffer(), w.length, 10))
		_, _ = bw.WriteString("\r\n")
	}
	if !hasDate {
		_, _ = bw.WriteString("Date: ")
		_, _ = bw.WriteString(w.c.srv.date())
		_, _ = bw.WriteString("\r\n")
	}
	_, _ = bw.WriteString("\r\n")
	hold := w.hold
	w.hold = w.hold[:0]
	w.body(hold)
}

// Flush implements http.Flusher.
func (w *response) Flush() { _ = w.FlushError() }

// FlushError sends what is written so far (http.ResponseController's Flush).
func (w *response) FlushError() error {
	if w.done {
		return errHandlerDone
	}
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.sent {
		w.sendHead(false)
	}
	if err := w.c.bw.Flush(); err != nil {
		w.c.fail()
		return err
	}
	return nil
}

// SetReadDeadline sets the request's body's deadline (http.ResponseController's), kept by
// the server's clock (within two ticks after t; zero: none). Once the body is read to its
// end it applies to nothing: the wait for a next request is the idle timeout's.
func (w *response) SetReadDeadline(t time.Time) error {
	c := w.c
	at := int64(0)
	if !t.IsZero() {
		at = max(t.UnixMilli()+c.srv.cfg.Tick.Milliseconds(), 1)
	}
	// Only the clock's expiry moves a body's phase meanwhile: a failed move is a body
	// whose time already ran out, or one read to its end.
	c.move(phases(phaseBody), phaseBody, at)
	return nil
}

// SetWriteDeadline sets the connection's write deadline (http.ResponseController's).
func (w *response) SetWriteDeadline(t time.Time) error { return w.c.rwc.SetWriteDeadline(t) }

// finish ends the answer once the handler returned: the head if it is still held, the last
// chunk, and the whole to the client.
func (w *response) finish() {
	w.done = true
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.sent {
		w.sendHead(true)
	}
	if w.chunked {
		_, _ = w.c.bw.WriteString("0\r\n\r\n")
	}
	if w.length >= 0 && w.written != w.length && !w.noBody {
		// Fewer bytes than declared: the client cannot tell where the answer ends.
		w.closeAfter = true
	}
	if err := w.c.bw.Flush(); err != nil {
		w.c.fail()
	}
	w.c.hold = w.hold[:0]
}

// fail marks the connection broken after a failed write and cancels its request.
func (c *conn) fail() {
	c.broken = true
	c.req.cancel()
}

// writeStatus writes the status line.
func writeStatus(bw *bufio.Writer, minor, code int) {
	if minor == 0 {
		_, _ = bw.WriteString("HTTP/1.0 ")
	} else {
		_, _ = bw.WriteString("HTTP/1.1 ")
	}
	_, _ = bw.Write(strconv.AppendInt(bw.AvailableBuffer(), int64(code), 10))
	_ = bw.WriteByte(' ')
	_, _ = bw.WriteString(http.StatusText(code))
	_, _ = bw.WriteString("\r\n")
}

// writeHeader writes h's fields: a name that is not a token is left out and a CR or LF in
// a value becomes a space, so that no handler can split the answer.
func writeHeader(bw *bufio.Writer, h http.Header) {
	for k, vs := range h {
		if !httpguts.ValidHeaderFieldName(k) {
			continue
		}
		for _, v := range vs {
			_, _ = bw.WriteString(k)
			_, _ = bw.WriteString(": ")
			if strings.ContainsAny(v, "\r\n") {
				v = strings.NewReplacer("\r", " ", "\n", " ").Replace(v)
			}
			_, _ = bw.WriteString(strings.TrimSpace(v))
			_, _ = bw.WriteString("\r\n")
		}
	}
}

// dateCache is the Date header's value, made once a second.
type dateCache struct {
	sec int64
	val string
}

// date is the Date header value at the clock's last tick.
func (s *Server) date() string { return s.dates.Load().val }

// setClock is the clock's tick at now: its time, and the Date header's value once a second.
func (s *Server) setClock(now time.Time) {
	s.clock.Store(now.UnixMilli())
	if d := s.dates.Load(); d == nil || d.sec != now.Unix() {
		s.dates.Store(&dateCache{sec: now.Unix(), val: now.UTC().Format(http.TimeFormat)})
	}
}

// chunkedBody reads a chunked body and then its trailer section, which is read, checked as
// strictly as a head (so that the body ends where net/http would end it) and dropped (the
// handlers read no trailers), within the head's byte budget.
type chunkedBody struct {
	br  *bufio.Reader
	r   io.Reader
	max int
}

func (c *chunkedBody) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if !errors.Is(err, io.EOF) {
		return n, err
	}
	lr := lineReader{br: c.br, left: c.max}
	for {
		line, lerr := lr.line()
		if errors.Is(lerr, io.EOF) {
			return n, io.ErrUnexpectedEOF
		}
		if lerr != nil {
			return n, lerr
		}
		if len(line) == 0 {
			return n, io.EOF
		}
		if _, _, err := field(line); err != nil {
			return n, err
		}
	}
}
