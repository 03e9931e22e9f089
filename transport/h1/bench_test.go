package h1

import (
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loadgen"
)

// BenchmarkServer is each server's own cost per request: a handler that reads the body
// and answers a small JSON (as the client port's do, without the routing and the worker),
// driven by 32 keep-alive connections of the raw load client in the same process. cpu-ns/op
// is the process's CPU per request (the client's is the same for both): the ratio of the
// two servers' is what --http-server fast saves per request.
func BenchmarkServer(b *testing.B) {
	answer := []byte(`{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" Paris."}]}`)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(answer)
	})
	for _, kind := range servers {
		b.Run(kind, func(b *testing.B) {
			addr := startBench(b, kind, h)
			req := loadgen.Request("m", false)
			const conns = 32
			load(b, addr, req, conns, 4*conns)
			b.ReportAllocs()
			before := cpuTime(b)
			b.ResetTimer()
			load(b, addr, req, conns, int64(b.N))
			b.StopTimer()
			b.ReportMetric(float64(cpuTime(b)-before)/float64(b.N), "cpu-ns/op")
		})
	}
}

func startBench(b *testing.B, kind string, h http.Handler) string {
	ln, err := listenLoopback()
	if err != nil {
		b.Fatal(err)
	}
	switch kind {
	case "net":
		hs := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = hs.Serve(ln) }()
		b.Cleanup(func() { _ = hs.Close() })
	default:
		s, err := New(Config{Handler: h})
		if err != nil {
			b.Fatal(err)
		}
		go func() { _ = s.Serve(ln) }()
		b.Cleanup(func() { _ = s.Close() })
	}
	return ln.Addr().String()
}

// load sends req over conns keep-alive connections until total answers are in.
func load(b *testing.B, addr string, req []byte, conns int, total int64) {
	if err := loadgen.Drive(addr, req, conns, total); err != nil {
		b.Error(err)
	}
}

// cpuTime is the CPU time this process has used.
func cpuTime(tb testing.TB) time.Duration {
	d, err := loadgen.ProcessCPU()
	if err != nil {
		tb.Fatal(err)
	}
	return d
}
