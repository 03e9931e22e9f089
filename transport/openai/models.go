package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
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

// modelEntry is one model in the OpenAI list shape; Parent is an adapter's base model, as
// vLLM lists it.
type modelEntry struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
	Parent  string `json:"parent,omitempty"`
}

// modelList is the OpenAI list shape.
type modelList struct {
	Object string       `json:"object"`
	Data   []modelEntry `json:"data"`
}

func newModelCache(s *Server) *modelCache {
	c := &modelCache{s: s, fetch: make(chan struct{}, 1)}
	if len(s.cfg.Models) > 0 {
		list := modelList{Object: "list"}
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

// modelList returns the model list: the configured one (--models); else the union of what
// the routable workers serve when the fleet's models are known (declared or learned); else a
// worker's own answer, reused briefly (a fleet that declares nothing).
func (s *Server) modelList(ctx context.Context) ([]byte, error) {
	if s.models.static != nil {
		return s.models.static, nil
	}
	if list, ok := catalogList(s.workers.Catalog()); ok {
		s.listAliases(&list, s.workers.Catalog())
		// A list of plain strings always encodes.
		body, _ := json.Marshal(list)
		return body, nil
	}
	return s.models.get(ctx)
}

// catalogList is the union of what cat's routable workers serve; false when no model of the
// fleet is known.
func catalogList(cat *routing.Catalog) (modelList, bool) {
	all := cat.Models()
	if len(all) == 0 {
		return modelList{}, false
	}
	list := modelList{Object: "list", Data: []modelEntry{}}
	for _, m := range all {
		if m.Routable > 0 {
			list.Data = append(list.Data, modelEntry{ID: m.ID, Object: "model", OwnedBy: "kvrouter-ha", Parent: m.Parent})
		}
	}
	return list, true
}

// listAliases adds to list every alias with a target of positive weight that a routable
// worker serves, in id order with the rest: a client can name it as a model.
func (s *Server) listAliases(list *modelList, cat *routing.Catalog) {
	if s.cfg.Aliases == nil {
		return
	}
	added := false
	for _, al := range s.cfg.Aliases.List() {
		for _, t := range al.Targets {
			if m, ok := cat.Lookup(t.Model); ok && t.Weight > 0 && m.Routable > 0 {
				list.Data = append(list.Data, modelEntry{ID: al.Name, Object: "model", OwnedBy: "kvrouter-ha"})
				added = true
				break
			}
		}
	}
	if added {
		slices.SortFunc(list.Data, func(a, b modelEntry) int { return strings.Compare(a.ID, b.ID) })
	}
}

func (s *Server) modelsFailed(w *recorder, r *http.Request, err error) {
	switch {
	case r.Context().Err() != nil:
		s.fail(w, r, nil)
	case errors.Is(err, errNoModelSource):
		s.fail(w, r, &Error{Status: http.StatusServiceUnavailable, Message: err.Error(), Type: TypeUnavailable,
			Code: "no_worker", RetryAfter: "1", Refused: "no_worker", Cause: "no_worker"})
	default:
		s.fail(w, r, &Error{Status: http.StatusBadGateway, Message: "could not list models: " + err.Error(),
			Type: TypeServer, Code: "upstream_failed", Cause: "upstream_models"})
	}
}

func (s *Server) serveModels(w *recorder, r *http.Request) {
	body, err := s.modelList(r.Context())
	if err != nil {
		s.modelsFailed(w, r, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
}

// serveModel answers GET /v1/models/{id}: the model's entry in the list, or 404
// model_not_found.
func (s *Server) serveModel(w *recorder, r *http.Request) {
	id := r.PathValue("id")
	body, err := s.modelList(r.Context())
	if err != nil {
		s.modelsFailed(w, r, err)
		return
	}
	entries, err := decodeModelList(body)
	if err != nil {
		s.modelsFailed(w, r, err)
		return
	}
	for _, e := range entries {
		if e.ID == id {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write(e.raw)
			return
		}
	}
	s.fail(w, r, modelNotFound(id))
}

// listedModel is one entry of a GET /v1/models answer: its id, its parent (an adapter's
// base model) and the entry as it came.
type listedModel struct {
	routing.Model
	raw json.RawMessage
}

// decodeModelList reads an OpenAI model list ({"data": [{"id", "parent"}, ...]}), at most
// routing.MaxModels entries, each id (and parent) a valid model name. It never panics,
// whatever the bytes.
func decodeModelList(body []byte) ([]listedModel, error) {
	var list struct {
		Data []json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		return nil, fmt.Errorf("model list: %w", err)
	}
	if len(list.Data) > routing.MaxModels {
		return nil, fmt.Errorf("model list: %d entries, more than %d", len(list.Data), routing.MaxModels)
	}
	out := make([]listedModel, 0, len(list.Data))
	for i, raw := range list.Data {
		var e struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		}
		if err := json.Unmarshal(raw, &e); err != nil {
			return nil, fmt.Errorf("model list entry %d: %w", i, err)
		}
		if err := routing.ValidateModelName(e.ID); err != nil {
			return nil, fmt.Errorf("model list entry %d: %w", i, err)
		}
		m := listedModel{Model: routing.Model{ID: e.ID}, raw: raw}
		if e.Parent != nil && *e.Parent != "" && *e.Parent != e.ID {
			if err := routing.ValidateModelName(*e.Parent); err != nil {
				return nil, fmt.Errorf("model list entry %d: parent: %w", i, err)
			}
			m.Parent = *e.Parent
		}
		out = append(out, m)
	}
	return out, nil
}

// LearnModels asks every configured worker for its GET /v1/models at once, then each again
// modelsTTL after its last answer, until ctx is done, and records what each serves in the
// registry (Registry.SetLearned): the worker's base models and its LoRA adapters with
// their parents. A worker that does not answer, or answers garbage, keeps what was learned
// of it before (its health is the health checker's business).
func (s *Server) LearnModels(ctx context.Context) {
	next := make(map[string]time.Time)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		s.learnDue(ctx, next, time.Now())
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// learnDue asks the workers whose turn has come (next: when each is due), one at a time.
func (s *Server) learnDue(ctx context.Context, next map[string]time.Time, now time.Time) {
	present := make(map[string]bool)
	for _, st := range s.workers.List() {
		id := st.Spec.ID
		present[id] = true
		if due, ok := next[id]; ok && now.Before(due) {
			continue
		}
		next[id] = now.Add(modelsTTL)
		if err := s.learnOne(ctx, id, st.Spec.URL); err != nil && ctx.Err() == nil {
			s.log.Debug("could not learn the worker's models", "worker", id, "err", err)
		}
	}
	for id := range next {
		if !present[id] {
			delete(next, id)
		}
	}
}

// learnOne asks one worker for its models and records them.
func (s *Server) learnOne(ctx context.Context, id, base string) error {
	body, err := s.models.askOne(ctx, base)
	if err != nil {
		return err
	}
	entries, err := decodeModelList(body)
	if err != nil {
		return err
	}
	models := make([]routing.Model, len(entries))
	for i, e := range entries {
		models[i] = e.Model
	}
	changed, err := s.workers.SetLearned(id, models)
	if changed {
		s.log.Info("worker models learned", "worker", id, "models", models)
	}
	return err
}
