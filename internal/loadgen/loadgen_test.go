package loadgen

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
)

// TestDoReadsEachAnswerWhole serves answers framed each way over one connection and checks
// that Do reads every one to its end (the next one starts where it stopped) and refuses the
// ones it must.
func TestDoReadsEachAnswerWhole(t *testing.T) {
	answers := []struct {
		raw  string
		fail bool
	}{
		{"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", false},
		{"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", false},
		{"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", false},
		{"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", true},
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		br := bufio.NewReader(c)
		for _, a := range answers {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, req.Body)
			if _, err := c.Write([]byte(a.raw)); err != nil {
				return
			}
		}
	}()
	lc, err := Dial(ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close()
	req := Request("m", false)
	if !strings.Contains(string(req), Prompt) {
		t.Fatalf("request %q", req)
	}
	for i, a := range answers {
		if err := lc.Do(req); (err != nil) != a.fail {
			t.Fatalf("answer %d: error %v, want failure %v", i, err, a.fail)
		}
	}
}
