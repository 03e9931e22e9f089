package openai

import (
	"bytes"
	"container/list"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Tokenizer turns a text prompt into the token ids the worker will see, so that a text request
// hashes into the same blocks as the engine's own KV events (precise mode).
type Tokenizer interface {
	Tokenize(ctx context.Context, p *Request) ([]uint32, error)
}

// TokenizerConfig tunes a WorkerTokenizer.
type TokenizerConfig struct {
	Timeout      time.Duration // one /tokenize call (2s)
	CacheEntries int           // prompts remembered (4096)
	CacheTokens  int           // tokens remembered in all (8M)
}

// WorkerTokenizer asks the POST /tokenize of a routable worker that serves the request's model
// (vLLM's endpoint: {"model", "prompt"} or {"model", "messages"} -> {"tokens": [...]}) and
// remembers the answers in a bounded LRU, since multi-turn chats resend the same prompts.
type WorkerTokenizer struct {
	workers *routing.Registry
	cfg     TokenizerConfig
	client  *http.Client
	next    atomic.Uint64

	mu      sync.Mutex
	order   *list.List // of *tokenEntry, most recent first
	byKey   map[uint64]*list.Element
	cached  int // tokens held
	hits    atomic.Uint64
	lookups atomic.Uint64
}

type tokenEntry struct {
	key    uint64
	tokens []uint32
}

// maxTokenizeResponse bounds a /tokenize answer (a 256k-token prompt is about 2 MiB of JSON).
const maxTokenizeResponse = 8 << 20

// NewWorkerTokenizer returns a tokenizer over the registry's routable workers.
func NewWorkerTokenizer(workers *routing.Registry, cfg TokenizerConfig) *WorkerTokenizer {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Second
	}
	if cfg.CacheEntries <= 0 {
		cfg.CacheEntries = 4096
	}
	if cfg.CacheTokens <= 0 {
		cfg.CacheTokens = 8 << 20
	}
	return &WorkerTokenizer{
		workers: workers, cfg: cfg,
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16, DisableCompression: true}},
		order:  list.New(), byKey: make(map[uint64]*list.Element),
	}
}

// tokenizeBody is the /tokenize request for p.
func tokenizeBody(p *Request) ([]byte, error) {
	body := struct {
		Model    string          `json:"model"`
		Prompt   *string         `json:"prompt,omitempty"`
		Messages json.RawMessage `json:"messages,omitempty"`
	}{Model: p.Model}
	if p.Kind == KindChat {
		body.Messages = p.Messages
	} else {
		body.Prompt = &p.Text
	}
	return json.Marshal(body)
}

// Tokenize implements Tokenizer.
func (t *WorkerTokenizer) Tokenize(ctx context.Context, p *Request) ([]uint32, error) {
	if p.HasTokens {
		return p.Tokens, nil
	}
	body, err := tokenizeBody(p)
	if err != nil {
		return nil, fmt.Errorf("tokenize request: %w", err)
	}
	key := xxhash.Sum64(body)
	t.lookups.Add(1)
	if tokens, ok := t.get(key); ok {
		t.hits.Add(1)
		return tokens, nil
	}
	// A worker that serves the model: another would refuse it (vLLM answers 404), and a
	// model's tokenizer is its own.
	var targets []routing.Target
	for _, tg := range t.workers.Routable() {
		if tg.ServesModel(p.Model) {
			targets = append(targets, tg)
		}
	}
	if len(targets) == 0 {
		return nil, fmt.Errorf("tokenize %s: %w", p.Model, routing.ErrNoWorker)
	}
	target := targets[int(t.next.Add(1)%uint64(len(targets)))]
	ctx, cancel := context.WithTimeout(ctx, t.cfg.Timeout)
	defer cancel()
	url := strings.TrimSuffix(target.Spec.URL, "/") + "/tokenize"
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("tokenize via %s: %w", target.Worker, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := t.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("tokenize via %s: %w", target.Worker, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		return nil, fmt.Errorf("tokenize via %s: %s", target.Worker, resp.Status)
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	dec := json.NewDecoder(io.LimitReader(resp.Body, maxTokenizeResponse))
	if err := dec.Decode(&out); err != nil {
		return nil, fmt.Errorf("tokenize via %s: bad answer: %w", target.Worker, err)
	}
	if len(out.Tokens) == 0 {
		return nil, errors.New("tokenize via " + target.Worker.String() + ": no tokens in the answer")
	}
	t.put(key, out.Tokens)
	return out.Tokens, nil
}

// HitRate is the share of lookups answered from the cache.
func (t *WorkerTokenizer) HitRate() float64 {
	n := t.lookups.Load()
	if n == 0 {
		return 0
	}
	return float64(t.hits.Load()) / float64(n)
}

func (t *WorkerTokenizer) get(key uint64) ([]uint32, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.byKey[key]
	if !ok {
		return nil, false
	}
	t.order.MoveToFront(e)
	return e.Value.(*tokenEntry).tokens, true
}

func (t *WorkerTokenizer) put(key uint64, tokens []uint32) {
	if len(tokens) > t.cfg.CacheTokens {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.byKey[key]; ok {
		return
	}
	t.byKey[key] = t.order.PushFront(&tokenEntry{key: key, tokens: tokens})
	t.cached += len(tokens)
	for t.order.Len() > t.cfg.CacheEntries || t.cached > t.cfg.CacheTokens {
		old := t.order.Back()
		ent := old.Value.(*tokenEntry)
		t.order.Remove(old)
		delete(t.byKey, ent.key)
		t.cached -= len(ent.tokens)
	}
}
