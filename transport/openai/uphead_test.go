package openai

import (
	"bufio"
	"bytes"
	"io"
	"math/rand/v2"
	"net/http"
	"reflect"
	"testing"
)

// commonHeadCases are answer heads (and bodies) readCommonHead must read as ReadResponse
// does, or leave to it.
var commonHeadCases = []string{
	"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
	"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\nserver: uvicorn\r\n\r\n{}",
	"HTTP/1.1 200\r\nContent-Length: 5\r\n\r\nhello",
	"HTTP/1.1 200 \r\nContent-Length: 5\r\n\r\nhello",
	"HTTP/1.1 201 Created and more words\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nX-Dup: a\r\nx-dup: b\r\nX-DUP:  c \t\r\nContent-Length: 3\r\n\r\nabc",
	"HTTP/1.1 200 OK\r\nX-Empty:\r\nX-Spaces:    \r\nContent-Length: 1\r\n\r\nx",
	"HTTP/1.1 200 OK\r\nX-Tab:\tv\t\r\nX-High: caf\xc3\xa9\r\nContent-Length: 1\r\n\r\nx",
	"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 4\r\n\r\nbusy",
	"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 4\r\n\r\nslow",
	"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}trailing",
	"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 14\r\n\r\ndata: [DONE]\n\n",
	"HTTP/1.1 200 OK\r\nContent-Length: 007\r\n\r\n1234567",
	"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
	// Left to ReadResponse:
	"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nPragma: no-cache\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nTrailer: X-T\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nContent-Length:\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\n\r\nunbounded",
	"HTTP/1.1 204 No Content\r\nContent-Length: 2\r\n\r\n",
	"HTTP/1.1 304 Not Modified\r\nContent-Length: 2\r\n\r\n",
	"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1  200 OK\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 20x OK\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\n\r\nhi",
	"HTTP/1.1 200 OK\r\nX-Folded: a\r\n b\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\n X-Lead: a\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nX Bad: a\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nX-Bad : a\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\n: a\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nNoColon\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nX-Ctl: a\x01b\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nX-Cr: a\rb\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 O\rK\r\nContent-Length: 2\r\n\r\nhi",
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n",
	"HTTP/1.1 200 OK\r\nContent-Len",
	"",
}

// TestReadCommonHeadMatchesReadResponse checks readCommonHead against http.ReadResponse on
// the cases above and on random mutations of them: where it reads a head, every field of
// the answer, its body (bytes and error) and what is left in the buffer match; where it
// does not, it has consumed nothing.
func TestReadCommonHeadMatchesReadResponse(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const alphabet = "\r\n :\t-aZ0\x7f\x80,H/1.2"
	inputs := append([]string(nil), commonHeadCases...)
	for range 30000 {
		b := []byte(commonHeadCases[rng.IntN(len(commonHeadCases))])
		for range 1 + rng.IntN(3) {
			if len(b) == 0 {
				break
			}
			i := rng.IntN(len(b))
			switch rng.IntN(3) {
			case 0:
				b[i] = alphabet[rng.IntN(len(alphabet))]
			case 1:
				b = append(b[:i], b[i+1:]...)
			default:
				b = append(b[:i], append([]byte{alphabet[rng.IntN(len(alphabet))]}, b[i:]...)...)
			}
		}
		inputs = append(inputs, string(b))
	}
	fast := 0
	for _, in := range inputs {
		for _, method := range []string{http.MethodPost, http.MethodGet, http.MethodHead} {
			if checkCommonHead(t, in, method) {
				fast++
			}
		}
	}
	if fast < len(commonHeadCases) {
		t.Fatalf("only %d of %d inputs took the common path", fast, len(inputs))
	}
}

// FuzzReadCommonHead compares readCommonHead with http.ReadResponse on any bytes a worker
// may send, for each method: same answer, body and leftovers where it reads the head, nothing
// consumed where it leaves it.
func FuzzReadCommonHead(f *testing.F) {
	for _, in := range commonHeadCases {
		f.Add([]byte(in))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		for _, method := range []string{http.MethodPost, http.MethodGet, http.MethodHead} {
			checkCommonHead(t, string(in), method)
		}
	})
}

// checkCommonHead compares the two readers on in, and reports whether the common path read it.
func checkCommonHead(t *testing.T, in, method string) bool {
	t.Helper()
	probe := &http.Request{Method: method}
	c := &upConn{br: bufio.NewReaderSize(bytes.NewReader([]byte(in)), readBufferSize)}
	a, ok, gerr := c.readCommonHead(probe, nil)
	wr := bufio.NewReaderSize(bytes.NewReader([]byte(in)), readBufferSize)
	want, werr := http.ReadResponse(wr, probe)
	if gerr != nil {
		if werr == nil || gerr.Error() != werr.Error() {
			t.Fatalf("%q: error %v, ReadResponse's %v", in, gerr, werr)
		}
		return false
	}
	if !ok {
		if c.br.Buffered() != len(in) && len(in) <= readBufferSize {
			t.Fatalf("%q: left to ReadResponse with %d of %d bytes consumed", in, len(in)-c.br.Buffered(), len(in))
		}
		return false
	}
	got := &a.resp
	if werr != nil {
		t.Fatalf("%q: read as %d, but ReadResponse fails: %v", in, got.StatusCode, werr)
	}
	if got.Status != want.Status || got.StatusCode != want.StatusCode || got.Proto != want.Proto ||
		got.ProtoMajor != want.ProtoMajor || got.ProtoMinor != want.ProtoMinor || got.ContentLength != want.ContentLength ||
		got.Close != want.Close || got.Request != want.Request || !reflect.DeepEqual(got.Header, want.Header) ||
		!reflect.DeepEqual(got.Trailer, want.Trailer) || !reflect.DeepEqual(got.TransferEncoding, want.TransferEncoding) {
		t.Fatalf("%q:\n got %+v\nwant %+v", in, got, want)
	}
	gb, gerr := readInSmallPieces(got.Body)
	wb, werr := readInSmallPieces(want.Body)
	if !bytes.Equal(gb, wb) || (gerr == nil) != (werr == nil) || gerr != nil && gerr.Error() != werr.Error() {
		t.Fatalf("%q: body %q (%v), ReadResponse's %q (%v)", in, gb, gerr, wb, werr)
	}
	grest, _ := io.ReadAll(c.br)
	wrest, _ := io.ReadAll(wr)
	if !bytes.Equal(grest, wrest) {
		t.Fatalf("%q: %q left after the answer, ReadResponse leaves %q", in, grest, wrest)
	}
	return true
}

// readInSmallPieces reads r to its end in reads of 3 bytes, noting whether the last bytes
// came with io.EOF, as net/http's bodies send it.
func readInSmallPieces(r io.Reader) ([]byte, error) {
	var out []byte
	buf := make([]byte, 3)
	for range 1 << 16 {
		n, err := r.Read(buf)
		out = append(out, buf[:n]...)
		if err == io.EOF && n > 0 {
			out = append(out, "<eof with data>"...)
		}
		if err != nil {
			if err == io.EOF {
				return out, nil
			}
			return out, err
		}
	}
	return out, io.ErrNoProgress
}
