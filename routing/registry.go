package routing

import (
	"errors"
	"fmt"
	"net/url"
	"reflect"
	"slices"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// MaxDPSize bounds a worker's data-parallel ranks.
const MaxDPSize = 1024

// WorkerStatus is a configured worker and its state.
type WorkerStatus struct {
	Spec    WorkerSpec `json:"spec"`
	Healthy bool       `json:"healthy"`
	Drained bool       `json:"drained"`
	// NotReady: its discovery source says the worker is there but not ready. It takes no new
	// choices, and its bindings are kept (see Workers.NotReady).
	NotReady bool   `json:"not_ready"`
	Reason   string `json:"reason,omitempty"`
	// Learned are the models this replica last read from the worker's GET /v1/models
	// (SetLearned); they are this replica's own, not replicated.
	Learned []Model `json:"learned_models,omitempty"`
}

// Registry is the in-memory set of workers with their health and drain state. It implements
// Workers. Reads on the request path take no lock: the routable set is rebuilt on every change
// and published through an atomic pointer.
type Registry struct {
	mu       sync.Mutex
	workers  map[string]*WorkerStatus
	routable atomic.Pointer[[]Target]
	catalog  atomic.Pointer[Catalog]
	onChange []func(WorkerStatus, bool)
}

// NewRegistry validates specs and returns a registry where every worker starts healthy.
func NewRegistry(specs []WorkerSpec) (*Registry, error) {
	r := &Registry{workers: make(map[string]*WorkerStatus)}
	for _, s := range specs {
		if err := r.add(s); err != nil {
			return nil, err
		}
	}
	r.publish()
	return r, nil
}

// ValidateSpec checks a worker spec and fills its defaults.
func ValidateSpec(s *WorkerSpec) error {
	if s.ID == "" {
		return errors.New("worker id is empty")
	}
	if len(s.ID) > 128 {
		return fmt.Errorf("worker id %.20q...: longer than 128 bytes", s.ID)
	}
	for _, c := range []byte(s.ID) {
		if c <= 0x20 || c >= 0x7f || c == '/' {
			return fmt.Errorf("worker id %q: only printable ASCII without spaces or '/'", s.ID)
		}
	}
	u, err := url.Parse(s.URL)
	if err != nil {
		return fmt.Errorf("worker %s: url: %w", s.ID, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("worker %s: url %q must be http(s)://host[:port]", s.ID, s.URL)
	}
	switch s.Role {
	case RoleBoth, RolePrefill, RoleDecode:
	default:
		return fmt.Errorf("worker %s: role %q must be prefill, decode or empty", s.ID, s.Role)
	}
	if s.DPSize == 0 {
		s.DPSize = 1
	}
	if s.DPSize < 0 || s.DPSize > MaxDPSize {
		return fmt.Errorf("worker %s: dp_size %d out of range 1..%d", s.ID, s.DPSize, MaxDPSize)
	}
	if s.CapacityBlocks < 0 {
		return fmt.Errorf("worker %s: capacity_blocks %d is negative", s.ID, s.CapacityBlocks)
	}
	if len(s.Models) > MaxModels {
		return fmt.Errorf("worker %s: %d models, more than %d", s.ID, len(s.Models), MaxModels)
	}
	for _, m := range s.Models {
		if err := ValidateModelName(m); err != nil {
			return fmt.Errorf("worker %s: models: %w", s.ID, err)
		}
	}
	return nil
}

func (r *Registry) add(s WorkerSpec) error {
	if err := ValidateSpec(&s); err != nil {
		return err
	}
	if _, dup := r.workers[s.ID]; dup {
		return fmt.Errorf("worker %s: already registered", s.ID)
	}
	r.workers[s.ID] = &WorkerStatus{Spec: s, Healthy: true}
	return nil
}

// publish rebuilds the routable set; r.mu must be held (or r not yet shared).
func (r *Registry) publish() {
	ids := make([]string, 0, len(r.workers))
	for id := range r.workers {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var out []Target
	all := make([]WorkerStatus, 0, len(ids))
	for _, id := range ids {
		st := r.workers[id]
		all = append(all, *st)
		if !st.Healthy || st.Drained || st.NotReady {
			continue
		}
		spec := st.Spec
		serves := servingOf(st)
		for rank := 0; rank < spec.DPSize; rank++ {
			out = append(out, Target{Worker: indexer.Worker{ID: id, DPRank: uint32(rank)}, Spec: &spec, Serves: serves})
		}
	}
	r.routable.Store(&out)
	r.catalog.Store(newCatalog(all))
}

// OnChange registers fn to run after any change of a worker's state; removed is true when the
// worker was removed. It runs with no lock held.
func (r *Registry) OnChange(fn func(st WorkerStatus, removed bool)) {
	r.mu.Lock()
	r.onChange = append(r.onChange, fn)
	r.mu.Unlock()
}

func (r *Registry) changed(st WorkerStatus, removed bool) {
	r.publish()
	fns := r.onChange
	r.mu.Unlock()
	for _, fn := range fns {
		fn(st, removed)
	}
}

// SetLearned records the models this replica read from a worker's own GET /v1/models, at
// most MaxModels of them; it reports whether they changed (and a changed set is published
// to routing). An unknown worker, or a bad name, changes nothing.
func (r *Registry) SetLearned(id string, models []Model) (bool, error) {
	if len(models) > MaxModels {
		return false, fmt.Errorf("worker %s: %d models learned, more than %d", id, len(models), MaxModels)
	}
	for _, m := range models {
		if err := ValidateModelName(m.ID); err != nil {
			return false, fmt.Errorf("worker %s: learned: %w", id, err)
		}
		if m.Parent != "" {
			if err := ValidateModelName(m.Parent); err != nil {
				return false, fmt.Errorf("worker %s: learned parent: %w", id, err)
			}
		}
	}
	models = slices.Clone(models)
	sort.Slice(models, func(i, j int) bool { return models[i].ID < models[j].ID })
	r.mu.Lock()
	st, ok := r.workers[id]
	if !ok {
		r.mu.Unlock()
		return false, fmt.Errorf("worker %s: %w", id, ErrUnknownTarget)
	}
	if slices.Equal(st.Learned, models) {
		r.mu.Unlock()
		return false, nil
	}
	st.Learned = models
	r.changed(*st, false)
	return true, nil
}

// Catalog returns the fleet's models as of the last change.
func (r *Registry) Catalog() *Catalog { return r.catalog.Load() }

// Routable implements Workers.
func (r *Registry) Routable() []Target { return *r.routable.Load() }

// Lookup implements Workers.
func (r *Registry) Lookup(id string) (WorkerSpec, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	st, ok := r.workers[id]
	if !ok {
		return WorkerSpec{}, false
	}
	return st.Spec, true
}

// List returns every configured worker with its state, sorted by id.
func (r *Registry) List() []WorkerStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]WorkerStatus, 0, len(r.workers))
	for _, st := range r.workers {
		out = append(out, *st)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Spec.ID < out[j].Spec.ID })
	return out
}

// SetHealthy records a health observation; reason says why a worker is unhealthy. It
// reports whether the state changed.
func (r *Registry) SetHealthy(id string, healthy bool, reason string) bool {
	r.mu.Lock()
	st, ok := r.workers[id]
	if !ok || st.Healthy == healthy {
		r.mu.Unlock()
		return false
	}
	st.Healthy = healthy
	st.Reason = ""
	if !healthy {
		st.Reason = reason
	}
	r.changed(*st, false)
	return true
}

// Add registers a new worker.
func (r *Registry) Add(spec WorkerSpec) error {
	r.mu.Lock()
	if err := r.add(spec); err != nil {
		r.mu.Unlock()
		return err
	}
	r.changed(*r.workers[spec.ID], false)
	return nil
}

// Update replaces a registered worker's spec (same id) and keeps its state: health, drain,
// readiness and what was learned from it. It reports whether anything changed; a spec that
// does not validate is refused and changes nothing.
func (r *Registry) Update(spec WorkerSpec) (bool, error) {
	if err := ValidateSpec(&spec); err != nil {
		return false, err
	}
	r.mu.Lock()
	st, ok := r.workers[spec.ID]
	if !ok {
		r.mu.Unlock()
		return false, fmt.Errorf("worker %s: %w", spec.ID, ErrUnknownTarget)
	}
	if reflect.DeepEqual(st.Spec, spec) {
		r.mu.Unlock()
		return false, nil
	}
	st.Spec = spec
	r.changed(*st, false)
	return true, nil
}

// Drain stops new requests to a worker; in-flight ones finish.
func (r *Registry) Drain(id string) error {
	r.mu.Lock()
	st, ok := r.workers[id]
	if !ok {
		r.mu.Unlock()
		return fmt.Errorf("worker %s: %w", id, ErrUnknownTarget)
	}
	st.Drained = true
	r.changed(*st, false)
	return nil
}

// Undrain lets a drained worker take new requests again.
func (r *Registry) Undrain(id string) error {
	r.mu.Lock()
	st, ok := r.workers[id]
	if !ok {
		r.mu.Unlock()
		return fmt.Errorf("worker %s: %w", id, ErrUnknownTarget)
	}
	if !st.Drained {
		r.mu.Unlock()
		return nil
	}
	st.Drained = false
	r.changed(*st, false)
	return nil
}

// SetNotReady takes a worker out of rotation while keeping its bindings (notReady), or puts
// it back.
func (r *Registry) SetNotReady(id string, notReady bool) error {
	r.mu.Lock()
	st, ok := r.workers[id]
	if !ok {
		r.mu.Unlock()
		return fmt.Errorf("worker %s: %w", id, ErrUnknownTarget)
	}
	if st.NotReady == notReady {
		r.mu.Unlock()
		return nil
	}
	st.NotReady = notReady
	r.changed(*st, false)
	return nil
}

// NotReady implements Workers.
func (r *Registry) NotReady(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	st, ok := r.workers[id]
	return ok && st.NotReady
}

// Remove forgets a worker.
func (r *Registry) Remove(id string) error {
	r.mu.Lock()
	st, ok := r.workers[id]
	if !ok {
		r.mu.Unlock()
		return fmt.Errorf("worker %s: %w", id, ErrUnknownTarget)
	}
	delete(r.workers, id)
	r.changed(*st, true)
	return nil
}
