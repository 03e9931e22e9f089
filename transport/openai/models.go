package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

const (
	// modelsTTL is how long a worker's /v1/models answer is reused.
	modelsTTL = 10 * time.Second
	// modelsTries is how many workers are asked before giving up.
	modelsTries = 3
	// modelsTimeout bounds one worker's answer.
	modelsTimeout = 5 * time.Second
	// maxModelsBody caps a worker's /v1/models answer.
	maxModelsBody = 1 << 20
)

// errNoModelSource: no routable worker to ask (503 rather than 502).
var errNoModelSource = errors.New("no routable worker to ask for models")

// modelCache serves /v1/models: the configured list, or a worker's answer reused briefly.
type modelCache struct {
	s      *Server
	static []byte
	// fetch admits one refresh at a time; waiters give up with their context.
	fetch chan struct{}
	mu    sync.Mutex
	body  []byte
	until time.Time
}

// modelEntry is one model in the OpenAI list shape.
type modelEntry struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

func newModelCache(s *Server) *modelCache {
	c := &modelCache{s: s, fetch: make(chan struct{}, 1)}
	if len(s.cfg.Models) > 0 {
		list := struct {
			Object string       `json:"object"`
			Data   []modelEntry `json:"data"`
		}{Object: "list"}
		for _, m := range s.cfg.Models {
			list.Data = append(list.Data, modelEntry{ID: m, Object: "model", OwnedBy: "kvrouter-ha"})
		}
		// A list of plain strings always encodes.
		c.static, _ = json.Marshal(list)
	}
	return c
}

func (c *modelCache) cached() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Now().Before(c.until) {
		return c.body
	}
	return nil
}

// get returns the model list, asking a worker when the cache is cold.
func (c *modelCache) get(ctx context.Context) ([]byte, error) {
	if c.static != nil {
		return c.static, nil
	}
	if body := c.cached(); body != nil {
		return body, nil
	}
	select {
	case c.fetch <- struct{}{}:
		defer func() { <-c.fetch }()
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	// Another request may have refreshed the cache while this one waited.
	if body := c.cached(); body != nil {
		return body, nil
	}
	body, err := c.ask(ctx)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.body, c.until = body, time.Now().Add(modelsTTL)
	c.mu.Unlock()
	return body, nil
}

// ask tries a few routable workers in turn.
func (c *modelCache) ask(ctx context.Context) ([]byte, error) {
	seen := make(map[string]bool)
	var errs []error
	for _, t := range c.s.workers.Routable() {
		if len(seen) == modelsTries {
			break
		}
		if t.Spec == nil || seen[t.Worker.ID] {
			continue
		}
		seen[t.Worker.ID] = true
		body, err := c.askOne(ctx, t.Spec.URL)
		if err == nil {
			return body, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		errs = append(errs, fmt.Errorf("worker %s: %w", t.Worker.ID, err))
	}
	if len(seen) == 0 {
		return nil, errNoModelSource
	}
	return nil, errors.Join(errs...)
}

func (c *modelCache) askOne(ctx context.Context, base string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, modelsTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(base, "/")+"/v1/models", nil)
	if err != nil {
		return nil, fmt.Errorf("build models request: %w", err)
	}
	resp, err := c.s.transport.RoundTrip(req)
	if err != nil {
		return nil, fmt.Errorf("ask models: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBody+1))
	if err != nil {
		return nil, fmt.Errorf("read models: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("models answered %s", resp.Status)
	}
	if len(body) > maxModelsBody || !json.Valid(body) {
		return nil, errors.New("models answer is not a JSON document")
	}
	return body, nil
}

func (s *Server) serveModels(w *recorder, r *http.Request) {
	body, err := s.models.get(r.Context())
	if err != nil {
		switch {
		case r.Context().Err() != nil:
			s.fail(w, r, nil)
		case errors.Is(err, errNoModelSource):
			s.fail(w, r, &Error{Status: http.StatusServiceUnavailable, Message: err.Error(), Type: TypeUnavailable,
				Code: "no_worker", RetryAfter: "1", Cause: "no_worker"})
		default:
			s.fail(w, r, &Error{Status: http.StatusBadGateway, Message: "could not list models: " + err.Error(),
				Type: TypeServer, Code: "upstream_failed", Cause: "upstream_models"})
		}
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
}
