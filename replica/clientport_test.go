package replica

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// readAll reads conn until the replica closes it (EOF or a reset) or within passes, and
// reports which.
func readAll(conn net.Conn, within time.Duration) ([]byte, bool) {
	_ = conn.SetReadDeadline(time.Now().Add(within))
	b, err := io.ReadAll(conn)
	var ne net.Error
	return b, !errors.As(err, &ne) || !ne.Timeout()
}

// TestClientPortCutsSlowSendersNotLongAnswers: a chunked body that trickles past the body
// timeout is answered 408 in the API's error shape and its connection closed; a keep-alive
// connection quiet past the idle timeout is closed; an answer streaming for several times
// the body timeout streams to its end. On both HTTP servers (--http-server).
func TestClientPortCutsSlowSendersNotLongAnswers(t *testing.T) {
	for _, server := range []string{ServerNet, ServerFast} {
		t.Run(server, func(t *testing.T) { clientPortCuts(t, server) })
	}
}

func clientPortCuts(t *testing.T, server string) {
	const limit = 200 * time.Millisecond
	fleet := startWorkers(t, 1, simConfig(50*time.Millisecond))
	rep := startTestReplica(t, fleet, func(c *Config) {
		c.ClientPort = ClientPortConfig{IdleTimeout: limit, HeaderTimeout: limit, BodyTimeout: limit, Server: server}
	})
	dial := func(t *testing.T, send string) net.Conn {
		conn, err := net.Dial("tcp", rep.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		if _, err := io.WriteString(conn, send); err != nil {
			t.Fatal(err)
		}
		return conn
	}

	t.Run("a trickling body", func(t *testing.T) {
		conn := dial(t, "POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")
		got, closed := readAll(conn, 20*limit)
		if !closed || !bytes.HasPrefix(got, []byte("HTTP/1.1 408 ")) {
			t.Fatalf("closed %v, got %q; want a 408 and the connection closed", closed, got)
		}
		_, body, _ := bytes.Cut(got, []byte("\r\n\r\n"))
		var e struct {
			Error *apiError `json:"error"`
		}
		if err := json.Unmarshal(body, &e); err != nil || e.Error == nil || e.Error.Code != "request_timeout" {
			t.Fatalf("408 body %q is not the API's error with code request_timeout: %v", body, err)
		}
	})

	t.Run("a quiet keep-alive connection", func(t *testing.T) {
		conn := dial(t, "GET /healthz HTTP/1.1\r\nHost: r\r\n\r\n")
		got, closed := readAll(conn, 20*limit)
		if !closed || !bytes.HasPrefix(got, []byte("HTTP/1.1 200 ")) {
			t.Fatalf("closed %v, got %q; want a 200, then the connection closed", closed, got)
		}
	})

	t.Run("a long streamed answer", func(t *testing.T) {
		// Twenty tokens at 50ms: five times the body timeout.
		start := time.Now()
		a := newRouterClient(t, rep).post("/v1/completions", completionBody(promptTokens(7, 32), 20, true), nil).mustOK(t)
		if !strings.Contains(string(a.body), "[DONE]") {
			t.Fatalf("stream did not end: %s", a.body)
		}
		t.Logf("stream took %s with a %s body timeout", time.Since(start).Round(time.Millisecond), limit)
	})
}
