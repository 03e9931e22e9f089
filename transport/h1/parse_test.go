package h1

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"maps"
	"net/http"
	"net/textproto"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/net/http/httpguts"
)

// netReads is net/http's server reading of one request: http.ReadRequest and the checks
// its server adds (Host, header names and values, Expect), as net/http's server.go makes
// them; the header map as a handler sees it (no Host, no Expect: 100-continue).
func netReads(data []byte) (*http.Request, *bufio.Reader, error) {
	br := bufio.NewReader(bytes.NewReader(data))
	req, err := http.ReadRequest(br)
	if err != nil {
		return nil, nil, err
	}
	if req.ProtoMajor != 1 {
		return nil, nil, errors.New("unsupported protocol version")
	}
	// http.ReadRequest moves Host out of the header map; the server reads it there.
	tp := textproto.NewReader(bufio.NewReader(bytes.NewReader(data)))
	_, _ = tp.ReadLine()
	raw, err := tp.ReadMIMEHeader()
	if err != nil {
		return nil, nil, err
	}
	hosts, haveHost := raw["Host"]
	if req.ProtoAtLeast(1, 1) && (!haveHost || len(hosts) == 0) && req.Method != http.MethodConnect {
		return nil, nil, errors.New("missing required Host header")
	}
	if len(hosts) == 1 && !httpguts.ValidHostHeader(hosts[0]) {
		return nil, nil, errors.New("malformed Host header")
	}
	for k, vv := range req.Header {
		if !httpguts.ValidHeaderFieldName(k) {
			return nil, nil, errors.New("invalid header name")
		}
		for _, v := range vv {
			if !httpguts.ValidHeaderFieldValue(v) {
				return nil, nil, errors.New("invalid header value")
			}
		}
	}
	delete(req.Header, "Host")
	if httpguts.HeaderValuesContainsToken([]string{req.Header.Get("Expect")}, "100-continue") {
		req.Header.Del("Expect")
	} else if req.Header.Get("Expect") != "" {
		return nil, nil, errors.New("expectation failed")
	}
	return req, br, nil
}

// FuzzReadHead reads the same bytes with this package's parser and with net/http's: what
// the parser accepts, net/http accepts and reads the same (method, target, version, host,
// headers, framing, connection close, body); the parser may refuse more (DESIGN.md says
// what), never less, and never panics.
func FuzzReadHead(f *testing.F) {
	for _, seed := range []string{
		"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST /v1/completions HTTP/1.1\r\nHost: a:8000\r\nContent-Type: application/json\r\nContent-Length: 2\r\nX-Session-ID: s\r\n\r\n{}",
		"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nT: v\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
		"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n",
		"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
		"GET http://h:1/p?q=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx",
		"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
		"GET / HTTP/1.1\nHost: a\n\n",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		br := bufio.NewReaderSize(bytes.NewReader(data), 4096)
		ours, err := readHead(br, 64<<10)
		if err != nil {
			return
		}
		theirs, tbr, terr := netReads(data)
		if terr != nil {
			t.Fatalf("accepted what net/http refuses (%v): %q", terr, data)
		}
		switch {
		case ours.method != theirs.Method:
			t.Fatalf("method %q; net/http %q", ours.method, theirs.Method)
		case ours.target != theirs.RequestURI:
			t.Fatalf("target %q; net/http %q", ours.target, theirs.RequestURI)
		case ours.url.String() != theirs.URL.String():
			t.Fatalf("URL %q; net/http %q", ours.url, theirs.URL)
		case ours.minor != theirs.ProtoMinor:
			t.Fatalf("HTTP/1.%d; net/http HTTP/1.%d", ours.minor, theirs.ProtoMinor)
		case ours.host != theirs.Host:
			t.Fatalf("host %q; net/http %q", ours.host, theirs.Host)
		case ours.length != theirs.ContentLength:
			t.Fatalf("length %d; net/http %d", ours.length, theirs.ContentLength)
		case ours.chunked != slices.Equal(theirs.TransferEncoding, []string{"chunked"}):
			t.Fatalf("chunked %v; net/http %q", ours.chunked, theirs.TransferEncoding)
		case ours.minor == 1 && ours.close != theirs.Close:
			t.Fatalf("close %v; net/http %v", ours.close, theirs.Close)
		}
		oh := maps.Clone(ours.header)
		oh.Del("Expect")
		if !maps.EqualFunc(oh, theirs.Header, slices.Equal) {
			t.Fatalf("headers %q; net/http %q", oh, theirs.Header)
		}
		if !ours.chunked && ours.length == 0 {
			return
		}
		body, err := io.ReadAll(newBodyReader(br, ours, 64<<10))
		if err != nil {
			return
		}
		tbody, terr := io.ReadAll(theirs.Body)
		if terr != nil {
			t.Fatalf("read a body net/http refuses (%v): %q", terr, data)
		}
		if !bytes.Equal(body, tbody) {
			t.Fatalf("body %q; net/http %q", body, tbody)
		}
		// Both end the message at the same byte: what follows is the next request's.
		rest, _ := io.ReadAll(br)
		trest, _ := io.ReadAll(tbr)
		if !bytes.Equal(rest, trest) {
			t.Fatalf("after the body %q; net/http %q", rest, trest)
		}
	})
}

// TestParserRefusals names what the parser refuses beyond the smuggling cases, with the
// status each gets.
func TestParserRefusals(t *testing.T) {
	for _, tc := range []struct {
		name, head string
		status     int
	}{
		{"HTTP/2 request line", "GET / HTTP/2.0\r\nHost: a\r\n\r\n", http.StatusHTTPVersionNotSupported},
		{"HTTP/1.2", "GET / HTTP/1.2\r\nHost: a\r\n\r\n", http.StatusHTTPVersionNotSupported},
		{"no version", "GET /\r\nHost: a\r\n\r\n", http.StatusBadRequest},
		{"space in the target", "GET /a b HTTP/1.1\r\nHost: a\r\n\r\n", http.StatusBadRequest},
		{"relative target", "GET a HTTP/1.1\r\nHost: a\r\n\r\n", http.StatusBadRequest},
		{"CONNECT", "CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n", http.StatusMethodNotAllowed},
		{"method not a token", "G(T / HTTP/1.1\r\nHost: a\r\n\r\n", http.StatusBadRequest},
		{"bad host", "GET / HTTP/1.1\r\nHost: a b\r\n\r\n", http.StatusBadRequest},
		{"expect something else", "POST / HTTP/1.1\r\nHost: a\r\nExpect: 200-ok\r\n\r\n", http.StatusExpectationFailed},
		{"huge content-length", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n", http.StatusBadRequest},
		{"head past the limit", "GET / HTTP/1.1\r\nHost: a\r\nX: " + strings.Repeat("a", 200) + "\r\n\r\n", http.StatusRequestHeaderFieldsTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := readHead(bufio.NewReaderSize(strings.NewReader(tc.head), 64), 128)
			var br *badRequest
			if !errors.As(err, &br) || br.status != tc.status {
				t.Fatalf("%v; want a refusal with %d", err, tc.status)
			}
		})
	}
}

// TestLargeHeadsValuesAreStringsOfTheirOwn: a head's values share one string up to
// maxSharedValues bytes (each starts where the one before ends), and past it each is its
// own, so that a value kept long holds no more of its head alive.
func TestLargeHeadsValuesAreStringsOfTheirOwn(t *testing.T) {
	for _, tc := range []struct {
		size   int
		shared bool
	}{{100, true}, {maxSharedValues/2 - 100, true}, {maxSharedValues / 2, false}} {
		a, b := strings.Repeat("a", tc.size), strings.Repeat("b", tc.size+50)
		head := "GET / HTTP/1.1\r\nHost: h\r\nX-A: " + a + "\r\nX-B: " + b + "\r\n\r\n"
		h, err := readHead(bufio.NewReaderSize(strings.NewReader(head), 4096), 64<<10)
		if err != nil {
			t.Fatal(err)
		}
		va, vb := h.header.Get("X-A"), h.header.Get("X-B")
		if va != a || vb != b {
			t.Fatalf("values %q and %q", va, vb)
		}
		// Separate strings cannot be adjacent: the first's size class rounds it up.
		adjacent := uintptr(unsafe.Pointer(unsafe.StringData(vb))) == uintptr(unsafe.Pointer(unsafe.StringData(va)))+uintptr(len(va))
		if adjacent != tc.shared {
			t.Errorf("values of %d and %d bytes: one string %v, want %v", len(va), len(vb), adjacent, tc.shared)
		}
	}
}
