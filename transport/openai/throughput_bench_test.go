package openai

import (
	"bufio"
	"bytes"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loadgen"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/h1"
)

// BenchmarkServeThroughput is the front's saturation cost per request in one process: the
// Server behind an HTTP server on loopback, as a replica serves it, over two workers that
// answer every request with a static completion from a raw socket loop, driven by 32
// keep-alive connections of a raw HTTP/1.1 client, each sending its next request when its
// answer is in. Worker and client allocate nothing per request, so allocs/op and B/op are
// the front's (its HTTP server's included); ns/op is the whole process's time per request
// on this machine's cores. system_test's BenchmarkThroughputVsHAProxy measures the release
// binary against HAProxy; this is the quick loop for the allocations and the CPU profile.
//
// Each runs on both client-port servers (--http-server): net (net/http's) and fast
// (transport/h1).
func BenchmarkServeThroughput(b *testing.B) {
	for _, kind := range []string{"net", "fast"} {
		for _, stream := range []bool{false, true} {
			name := map[bool]string{false: "json", true: "sse"}[stream]
			b.Run(kind+"/"+name, func(b *testing.B) { benchServe(b, kind, stream) })
		}
	}
}

func benchServe(b *testing.B, kind string, stream bool) {
	{
		{
			workers := []string{staticWorker(b), staticWorker(b)}
			reg, err := routing.NewRegistry([]routing.WorkerSpec{spec("w0", "http://"+workers[0]), spec("w1", "http://"+workers[1])})
			if err != nil {
				b.Fatal(err)
			}
			tracker := routing.NewTracker()
			idx := indexer.New(indexer.Options{TTL: 2 * time.Minute})
			router, err := routing.New(routing.Config{}, routing.Deps{Index: idx, Recorder: idx, Workers: reg, Tracker: tracker,
				Affinity: routing.NewMemoryAffinity(time.Hour, 0)})
			if err != nil {
				b.Fatal(err)
			}
			srv, err := NewServer(Config{ReplicaID: "r0", Registerer: prometheus.NewRegistry(),
				Logger: slog.New(slog.DiscardHandler)}, router, reg, tracker)
			if err != nil {
				b.Fatal(err)
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			stop := serveFront(b, kind, srv.Handler(), ln)
			b.Cleanup(func() {
				stop()
				srv.Close()
			})
			req := loadgen.Request("m", stream)
			const conns = 32
			// Warm every connection and the router's state.
			runLoad(b, ln.Addr().String(), req, conns, 4*conns)
			b.ReportAllocs()
			before := processCPU(b)
			b.ResetTimer()
			runLoad(b, ln.Addr().String(), req, conns, int64(b.N))
			b.StopTimer()
			// The whole process's CPU (the client's and the workers' are the same for both
			// servers), per request: the figure to compare --http-server's two with.
			b.ReportMetric(float64(processCPU(b)-before)/float64(b.N), "cpu-ns/op")
		}
	}
}

// processCPU is the CPU time this process has used.
func processCPU(tb testing.TB) time.Duration {
	d, err := loadgen.ProcessCPU()
	if err != nil {
		tb.Fatal(err)
	}
	return d
}

// serveFront serves h on ln with the client-port server named kind (net or fast) and
// returns what stops it.
func serveFront(tb testing.TB, kind string, h http.Handler, ln net.Listener) func() {
	switch kind {
	case "net":
		hs := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = hs.Serve(ln) }()
		return func() { _ = hs.Close() }
	case "fast":
		fs, err := h1.New(h1.Config{Handler: h})
		if err != nil {
			tb.Fatal(err)
		}
		go func() { _ = fs.Serve(ln) }()
		return func() { _ = fs.Close() }
	}
	tb.Fatalf("no server %q", kind)
	return nil
}

// staticWorker serves every request on a loopback port with a fixed answer (SSE for chat
// completions) from a raw loop, and returns its address.
func staticWorker(b *testing.B) string {
	const (
		jsonBody = `{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,` +
			`"text":" Paris.","finish_reason":"stop"}],"usage":{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43,` +
			`"prompt_tokens_details":{"cached_tokens":32}}}`
		sseBody = `data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Paris"}}]}` + "\n\n" +
			`data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],` +
			`"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41}}` + "\n\n" + "data: [DONE]\n\n"
	)
	answer := func(ct, body string) []byte {
		return fmt.Appendf(nil, "HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s", ct, len(body), body)
	}
	jsonAnswer, sseAnswer := answer("application/json", jsonBody), answer("text/event-stream", sseBody)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReaderSize(c, 16<<10)
				// Each pass reads one request (head, then the body its Content-Length says).
				for {
					line, err := br.ReadSlice('\n')
					if err != nil {
						return
					}
					out := jsonAnswer
					if bytes.Contains(line, []byte("/chat/")) {
						out = sseAnswer
					}
					length := 0
					for {
						h, err := br.ReadSlice('\n')
						if err != nil {
							return
						}
						if len(h) <= 2 {
							break
						}
						if v, ok := bytes.CutPrefix(h, []byte("Content-Length: ")); ok {
							length, _ = strconv.Atoi(string(bytes.TrimSpace(v)))
						}
					}
					if _, err := br.Discard(length); err != nil {
						return
					}
					if _, err := c.Write(out); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// runLoad sends req over conns keep-alive connections until total answers are in; each
// answer must be a whole 200 (Content-Length or chunked).
func runLoad(b *testing.B, addr string, req []byte, conns int, total int64) {
	if err := loadgen.Drive(addr, req, conns, total); err != nil {
		b.Error(err)
	}
}
