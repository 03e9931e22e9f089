package replay_test

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// received is what the fake server saw of one request.
type received struct {
	Method, Path, Session, ContentType string
	Model                              string
	Prompt                             []uint32
	MaxTokens                          int
	Stream                             bool
	IncludeUsage                       bool
	At                                 time.Time
}

// fakeServer is a tiny OpenAI completions server with a prefix cache of
// 16-token blocks, so cached_tokens is what a real worker would report.
type fakeServer struct {
	*httptest.Server
	// workerID, when set, goes out as X-Worker-ID.
	workerID string
	// header, when set, adds router-style headers to every response.
	header func(h http.Header, prompt []uint32)
	// behave, when set, may take over the response; true means it did.
	behave func(w http.ResponseWriter, r *http.Request, got received) bool
	// gate, when set, runs with the in-flight count before replying.
	gate func(r *http.Request)

	mu          sync.Mutex
	got         []received
	cache       map[uint64]bool
	inflight    int
	maxInflight int
	done        int
}

func newFake(t *testing.T, configure func(*fakeServer)) *fakeServer {
	t.Helper()
	f := &fakeServer{cache: make(map[uint64]bool)}
	if configure != nil {
		configure(f)
	}
	f.Server = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeServer) requests() []received {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]received(nil), f.got...)
}

func (f *fakeServer) peakInflight() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.maxInflight
}

// state returns the in-flight and completed counts.
func (f *fakeServer) state() (inflight, done int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.inflight, f.done
}

// lookup returns how many leading tokens of prompt are cached, in whole
// 16-token blocks, and caches the prompt's blocks.
func (f *fakeServer) lookup(prompt []uint32) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	var h uint64
	cached, matching := 0, true
	buf := make([]byte, 8+16*4)
	for i := 0; i+16 <= len(prompt); i += 16 {
		binary.LittleEndian.PutUint64(buf, h)
		for j, tok := range prompt[i : i+16] {
			binary.LittleEndian.PutUint32(buf[8+4*j:], tok)
		}
		hf := fnv.New64a()
		hf.Write(buf)
		h = hf.Sum64()
		if matching && f.cache[h] {
			cached += 16
		} else {
			matching = false
		}
		f.cache[h] = true
	}
	return cached
}

func (f *fakeServer) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.inflight++
	f.maxInflight = max(f.maxInflight, f.inflight)
	f.mu.Unlock()
	// A request stops counting as in flight before any byte of the answer
	// goes out: the client can only free its slot after reading the answer,
	// so counting until the handler returns would overlap the next request.
	answered := false
	answer := func() {
		if answered {
			return
		}
		answered = true
		f.mu.Lock()
		f.inflight--
		f.done++
		f.mu.Unlock()
	}
	defer answer()

	var body struct {
		Model         string   `json:"model"`
		Prompt        []uint32 `json:"prompt"`
		MaxTokens     int      `json:"max_tokens"`
		Stream        bool     `json:"stream"`
		StreamOptions *struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, `{"error":{"message":"bad json"}}`, http.StatusBadRequest)
		return
	}
	got := received{
		Method: r.Method, Path: r.URL.Path, Session: r.Header.Get("X-Session-ID"),
		ContentType: r.Header.Get("Content-Type"), Model: body.Model, Prompt: body.Prompt,
		MaxTokens: body.MaxTokens, Stream: body.Stream,
		IncludeUsage: body.StreamOptions != nil && body.StreamOptions.IncludeUsage, At: time.Now(),
	}
	f.mu.Lock()
	f.got = append(f.got, got)
	f.mu.Unlock()

	if f.gate != nil {
		f.gate(r)
	}
	answer()
	if f.workerID != "" {
		w.Header().Set("X-Worker-ID", f.workerID)
	}
	if f.header != nil {
		f.header(w.Header(), body.Prompt)
	}
	if f.behave != nil && f.behave(w, r, got) {
		return
	}
	cached := f.lookup(body.Prompt)
	usage := fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":1,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}`,
		len(body.Prompt), len(body.Prompt)+1, cached)
	if !body.Stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":%s}`, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	writeEvent(w, `{"id":"c","choices":[{"index":0,"text":"x","finish_reason":null}],"usage":null}`)
	writeEvent(w, `{"id":"c","choices":[],"usage":`+usage+`}`)
	writeEvent(w, `[DONE]`)
}

func writeEvent(w http.ResponseWriter, data string) {
	fmt.Fprintf(w, "data: %s\n\n", data)
	if fl, ok := w.(http.Flusher); ok {
		fl.Flush()
	}
}
