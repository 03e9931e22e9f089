package sim

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
)

// benchServer runs a worker whose simulated latencies are negligible, so the figures are
// the simulator's own overhead.
func benchServer(b *testing.B) (*Worker, string, *http.Client) {
	b.Helper()
	w, err := New(testConfig(Config{Speedup: 1e9, MaxRunning: 1024}))
	if err != nil {
		b.Fatal(err)
	}
	srv := httptestServer(b, w)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	return w, srv, client
}

func httptestServer(b *testing.B, w *Worker) string {
	b.Helper()
	srv := newLoopbackServer(w.Handler())
	b.Cleanup(srv.Close)
	return srv.URL
}

func benchPost(b *testing.B, client *http.Client, url string, body []byte) {
	resp, err := client.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		b.Error(err)
		return
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b.Errorf("status %d", resp.StatusCode)
	}
}

// BenchmarkCompletionLoopback measures whole requests over loopback HTTP: 16 sessions
// whose 1024-token prompts share a 512-token system prefix.
func BenchmarkCompletionLoopback(b *testing.B) {
	w, url, client := benchServer(b)
	bodies := make([][]byte, 16)
	for i := range bodies {
		prompt := append(seqTokens(1000, 512), seqTokens(100000+i*1000, 512)...)
		bodies[i], _ = json.Marshal(map[string]any{"prompt": prompt, "max_tokens": 16})
	}
	var n atomic.Uint64
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			benchPost(b, client, url+"/v1/completions", bodies[n.Add(1)%uint64(len(bodies))])
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
	st := w.Stats()
	b.ReportMetric(float64(st.CachedTokens)/float64(max(st.PromptTokens, 1)), "hit-rate")
}

// BenchmarkStreamLoopback measures streamed chat answers of 64 tokens.
func BenchmarkStreamLoopback(b *testing.B) {
	w, url, client := benchServer(b)
	body, _ := json.Marshal(map[string]any{
		"messages":   []map[string]string{{"role": "user", "content": strings.Repeat("tell me more ", 50)}},
		"max_tokens": 64, "stream": true,
	})
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			benchPost(b, client, url+"/v1/chat/completions", body)
		}
	})
	b.ReportMetric(float64(w.Stats().GeneratedTokens)/b.Elapsed().Seconds(), "tokens/s")
}

// BenchmarkCacheRequest measures one request's cache work (look up, store prompt and
// output, release) for 2048-token prompts over a cache that holds about half of them.
func BenchmarkCacheRequest(b *testing.B) {
	c := newCache(16, 64*128/2, nil)
	prompts := make([][]uint32, 64)
	for i := range prompts {
		prompts[i] = append(seqTokens(1, 1024), seqTokens(10000+i*4096, 1024)...)
	}
	i := 0
	for b.Loop() {
		p := prompts[(i*7)%len(prompts)]
		i++
		s := c.acquire(p)
		c.store(s, p)
		c.release(s)
	}
	st := c.snapshot()
	b.ReportMetric(float64(st.Hits)/float64(max(st.Queries, 1)), "hit-rate")
	b.ReportMetric(2048, "tokens/op")
}

// BenchmarkTokenize measures the tokenizer on English-like text.
func BenchmarkTokenize(b *testing.B) {
	text := strings.Repeat("The quick brown fox, jumping over 13 lazy dogs; again! ", 200)
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		_ = Tokenize(text, true)
	}
}
