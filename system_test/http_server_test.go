package system_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// TestSmuggledRequestsNeverReachAWorkerThroughTheFastFront sends the real binary, on each
// --http-server, a completion framed both by Content-Length and by chunks, whose
// Content-Length covers a second completion a proxy in front would take for its body. net
// (Go's net/http) reads the chunks and serves the smuggled completion: a worker answers it.
// fast refuses the request with 400 in the API's error shape, naming the ambiguity, and
// closes the connection: no worker sees the smuggled request. Then a normal chat is served
// on both.
func TestSmuggledRequestsNeverReachAWorkerThroughTheFastFront(t *testing.T) {
	fl := startFleet(t, 1)
	smuggled := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		len(`{"model":"`+sim.DefaultModel+`","prompt":"smuggled","max_tokens":2}`), `{"model":"`+sim.DefaultModel+`","prompt":"smuggled","max_tokens":2}`)
	body := "0\r\n\r\n" + smuggled
	req := "POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) +
		"\r\nTransfer-Encoding: chunked\r\n\r\n" + body
	for _, tc := range []struct {
		server string
		// statuses are the answers the connection gets, in order, before it ends; served
		// the completions the worker ran for them.
		statuses []int
		served   uint64
	}{
		{"net", []int{http.StatusBadRequest, http.StatusOK}, 1},
		{"fast", []int{http.StatusBadRequest}, 0},
	} {
		t.Run(tc.server, func(t *testing.T) {
			c := startCluster(t, 1, fl, "--http-server", tc.server)
			r := c.replicas[0]
			conn, err := net.Dial("tcp", r.Client)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			before := fl.sims[0].Stats().Served
			_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
			if _, err := io.WriteString(conn, req); err != nil {
				t.Fatal(err)
			}
			br := bufio.NewReader(conn)
			var got []int
			var bodies []string
			// Each pass reads one answer or ends with the connection (3 at most).
			for range 3 {
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					break
				}
				b, _ := io.ReadAll(resp.Body)
				got = append(got, resp.StatusCode)
				bodies = append(bodies, string(b))
			}
			t.Logf("answers %v: %q", got, bodies)
			if fmt.Sprint(got) != fmt.Sprint(tc.statuses) {
				t.Fatalf("answers %v; want %v", got, tc.statuses)
			}
			if served := fl.sims[0].Stats().Served - before; served != tc.served {
				t.Errorf("the worker ran %d completions for the connection; want %d", served, tc.served)
			}
			if tc.server == "fast" && (!strings.Contains(bodies[0], "both Transfer-Encoding and Content-Length") ||
				!strings.Contains(bodies[0], `"type":"invalid_request_error"`)) {
				t.Errorf("the refusal is not the API's error naming the ambiguity: %q", bodies[0])
			}
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			if a, err := chat(ctx, r, "after-smuggling", "hello"); err != nil || a.status != http.StatusOK {
				t.Fatalf("a normal chat after: %v %+v", err, a)
			}
		})
	}
}
