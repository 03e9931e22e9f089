// Package workers owns one replica's worker lifecycle, the part of contract item 2 that says
// a binding changes when its worker fails, is drained or is removed:
//
//   - the spec schema: how a routing.WorkerSpec is stored in the cluster's worker registry
//     (the FSM keeps it as opaque bytes; EncodeSpec and DecodeSpec are its only readers);
//   - keeping this replica's routing registry in step with the cluster registry, driven by
//     the FSM's apply (Cluster.WorkersChanged), not by polling, the stored spec's
//     "not_ready" mark included;
//   - operator actions (Add, Drain, Remove), which go through the Raft leader from any replica;
//   - the leader duty that drops the bindings of a worker unhealthy for longer than a grace
//     period, once per unhealthy spell;
//   - the fan-out when a worker leaves: Forget hears of every worker (and data-parallel rank)
//     that this replica's registry no longer holds, so indexes, load and health views let go.
//
// Workers configured by flags live in the routing registry only, until an operator drains one
// (it is registered in the cluster first, so the drain reaches every replica).
package workers

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Cluster is what the lifecycle needs of the replicated state (cluster.Node is one).
type Cluster interface {
	// Workers lists the cluster registry's workers.
	Workers() []fsm.Worker
	// WorkersChanged receives a value (coalesced) after the registry changed.
	WorkersChanged() <-chan struct{}
	// Apply proposes a command through the leader and waits for its result.
	Apply(ctx context.Context, cmd fsm.Command) (*fsm.Result, error)
	// IsLeader reports whether this replica leads (one proposal per cluster, not per replica).
	IsLeader() bool
	// AddDuty runs work while this replica leads, from each term's start to its end.
	AddDuty(name string, run func(ctx context.Context))
}

// Config configures a Lifecycle.
type Config struct {
	// Registry is this replica's routing registry, holding the workers from flags already.
	Registry *routing.Registry
	Cluster  Cluster
	// Grace is how long a worker stays unhealthy before the leader drops its bindings
	// (0: never).
	Grace time.Duration
	// OwnHealthy, when set, is this replica's own verdict on a worker (its own probes, not
	// what other replicas report): the grace duty drops bindings only on evidence the leader
	// itself holds. Nil: the registry's health, which must then be this replica's own.
	OwnHealthy func(worker string) bool
	// Forget, when set, is told of every worker that leaves the routing registry.
	Forget func(spec routing.WorkerSpec)
	Logger *slog.Logger
}

// Lifecycle is one replica's owner of its workers' lifecycle.
type Lifecycle struct {
	cfg Config
	reg *routing.Registry
	log *slog.Logger
}

// New returns the lifecycle over cfg.Registry and registers the grace duty with the
// cluster; Run keeps the registry in step.
func New(cfg Config) (*Lifecycle, error) {
	if cfg.Registry == nil || cfg.Cluster == nil {
		return nil, errors.New("workers: a routing registry and a cluster are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	l := &Lifecycle{cfg: cfg, reg: cfg.Registry, log: cfg.Logger}
	if cfg.Forget != nil {
		cfg.Registry.OnChange(func(st routing.WorkerStatus, removed bool) {
			if removed {
				cfg.Forget(st.Spec)
			}
		})
	}
	if cfg.Grace > 0 {
		cfg.Cluster.AddDuty("invalidate the bindings of workers unhealthy past the grace", l.watchHealth)
	}
	return l, nil
}

// EncodeSpec is a worker spec as the cluster registry stores it.
func EncodeSpec(spec routing.WorkerSpec) ([]byte, error) {
	b, err := json.Marshal(spec)
	if err != nil {
		return nil, fmt.Errorf("workers: encode spec of %s: %w", spec.ID, err)
	}
	return b, nil
}

// Owned is what a stored spec says of the discovery source that owns its worker.
type Owned struct {
	// Source is the owner's name ("" for a worker from the admin API or a drain of a flag
	// worker).
	Source string `json:"source,omitempty"`
	// Gone marks a worker its source drained because it was gone (not an operator's drain).
	Gone bool `json:"gone,omitempty"`
	// NotReady marks a worker its source says is there but not ready: every replica takes it
	// out of rotation and keeps its bindings (routing.Registry.SetNotReady).
	NotReady bool `json:"not_ready,omitempty"`
}

// DiscoveryOwner is the owner name (Owned.Source) of the workers of the discovery source
// named source: "discovery:" and the source (discovery:file:/etc/fleet.json).
func DiscoveryOwner(source string) string { return "discovery:" + source }

// sourced is a spec as the cluster registry stores it for a worker that a discovery source
// owns: the spec's own fields and, beside them, the owner's. A replica that does not know
// the fields ignores them (DecodeSpec reads unknown fields as nothing).
type sourced struct {
	routing.WorkerSpec
	Owned
}

// EncodeOwned is a worker spec as the cluster registry stores it for its owner (the marker
// by which discovery knows the workers it may drain and remove).
func EncodeOwned(spec routing.WorkerSpec, owner Owned) ([]byte, error) {
	b, err := json.Marshal(sourced{WorkerSpec: spec, Owned: owner})
	if err != nil {
		return nil, fmt.Errorf("workers: encode spec of %s: %w", spec.ID, err)
	}
	return b, nil
}

// OwnerOf is what a stored spec says of its owner (the zero Owned for bytes that do not
// decode or name none).
func OwnerOf(raw []byte) Owned {
	var o Owned
	if json.Unmarshal(raw, &o) != nil {
		return Owned{}
	}
	return o
}

// ParseSpecs reads a JSON array of worker specs (the --workers-file shape): an unknown field
// is an error, as is a spec ValidateSpec refuses or an id given twice.
func ParseSpecs(b []byte) ([]routing.WorkerSpec, error) {
	var specs []routing.WorkerSpec
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&specs); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: more than one JSON value", ErrInvalid)
	}
	seen := make(map[string]bool, len(specs))
	for i := range specs {
		if err := routing.ValidateSpec(&specs[i]); err != nil {
			return nil, fmt.Errorf("%w: entry %d: %w", ErrInvalid, i, err)
		}
		if seen[specs[i].ID] {
			return nil, fmt.Errorf("%w: worker id %q given twice", ErrInvalid, specs[i].ID)
		}
		seen[specs[i].ID] = true
	}
	return specs, nil
}

// DecodeSpec reads a spec stored under id by EncodeSpec; the registry's id wins over one
// in the bytes.
func DecodeSpec(id string, raw []byte) (routing.WorkerSpec, error) {
	var spec routing.WorkerSpec
	// Unknown fields are ignored: a replica of an older release reads what it knows of a
	// spec a newer one wrote.
	if err := json.Unmarshal(raw, &spec); err != nil {
		return spec, fmt.Errorf("workers: spec of %s from the cluster: %w", id, err)
	}
	spec.ID = id
	return spec, nil
}

// Run keeps the routing registry in step with the cluster registry until ctx ends: once at
// once, then after every change the FSM applies.
func (l *Lifecycle) Run(ctx context.Context) {
	seen := map[string]fsm.Worker{}
	for {
		seen = l.sync(ctx, seen)
		select {
		case <-ctx.Done():
			return
		case <-l.cfg.Cluster.WorkersChanged():
		}
	}
}

// sync applies the cluster registry's differences from seen (what the last sync saw) to
// the routing registry and returns the registry as it is now.
func (l *Lifecycle) sync(ctx context.Context, seen map[string]fsm.Worker) map[string]fsm.Worker {
	cur := map[string]fsm.Worker{}
	for _, w := range l.cfg.Cluster.Workers() {
		cur[w.ID] = w
	}
	for id, w := range cur {
		if old, had := seen[id]; had && old.Draining == w.Draining && bytes.Equal(old.Spec, w.Spec) {
			continue
		}
		spec, err := DecodeSpec(id, w.Spec)
		if err != nil {
			l.log.Warn("worker spec from the cluster does not decode", "worker", id, "err", err)
			continue
		}
		if have, ok := l.reg.Lookup(id); !ok {
			if err := l.reg.Add(spec); err != nil {
				l.log.Warn("adding worker from the cluster", "worker", id, "err", err)
				continue
			}
		} else if have.URL != spec.URL {
			// Another endpoint is another cache: the worker's sessions start afresh.
			_ = l.reg.Remove(id)
			l.invalidate(ctx, id)
			if err := l.reg.Add(spec); err != nil {
				l.log.Warn("replacing worker from the cluster", "worker", id, "err", err)
				continue
			}
		} else if _, err := l.reg.Update(spec); err != nil {
			// The same endpoint with another spec (models, role, ranks, event ports): the
			// cache and the sessions stay.
			l.log.Warn("updating worker from the cluster", "worker", id, "err", err)
			continue
		}
		if w.Draining {
			_ = l.reg.Drain(id)
		} else {
			_ = l.reg.Undrain(id)
		}
		_ = l.reg.SetNotReady(id, OwnerOf(w.Spec).NotReady)
	}
	for id := range seen {
		if _, ok := cur[id]; !ok {
			_ = l.reg.Remove(id)
		}
	}
	return cur
}

// invalidate drops every binding of worker id when this replica leads (one proposal, not
// one per replica) and reports how many, and whether it did.
func (l *Lifecycle) invalidate(ctx context.Context, id string) (int, bool) {
	if !l.cfg.Cluster.IsLeader() {
		return 0, false
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	res, err := l.cfg.Cluster.Apply(cctx, &fsm.InvalidateWorker{Worker: id})
	if err != nil {
		l.log.Warn("invalidating a worker's bindings", "worker", id, "err", err)
		return 0, false
	}
	return res.Count, true
}

// watchHealth is the leader duty: it drops the bindings of a worker unhealthy for longer
// than the grace, once per unhealthy spell. Unhealthy means by the leader's own probes
// (Config.OwnHealthy): what gossip says may take a worker out of rotation, never a binding. A new term starts every clock afresh, which
// only ever lengthens a grace.
func (l *Lifecycle) watchHealth(ctx context.Context) {
	grace := l.cfg.Grace
	since := map[string]time.Time{}
	done := map[string]bool{}
	t := time.NewTicker(max(grace/4, 100*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		for _, st := range l.reg.List() {
			id := st.Spec.ID
			healthy := st.Healthy
			if l.cfg.OwnHealthy != nil {
				healthy = l.cfg.OwnHealthy(id)
			}
			if healthy {
				delete(since, id)
				delete(done, id)
				continue
			}
			if _, ok := since[id]; !ok {
				since[id] = now
			}
			if done[id] || now.Sub(since[id]) < grace {
				continue
			}
			if n, ok := l.invalidate(ctx, id); ok {
				done[id] = true
				l.log.Info("unhealthy worker's bindings invalidated", "worker", id, "bindings", n, "unhealthy_for", now.Sub(since[id]).Round(time.Millisecond))
			}
		}
	}
}

// ErrUnknown: no worker of that id is in the routing registry or the cluster's.
var ErrUnknown = errors.New("no such worker")

// Add registers a worker in the cluster registry (from any replica, through the leader);
// every replica's Run then routes to it. The spec is validated first.
func (l *Lifecycle) Add(ctx context.Context, spec routing.WorkerSpec) (routing.WorkerSpec, error) {
	if err := routing.ValidateSpec(&spec); err != nil {
		return spec, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	raw, err := EncodeSpec(spec)
	if err != nil {
		return spec, err
	}
	if _, err := l.cfg.Cluster.Apply(ctx, &fsm.AddWorker{ID: spec.ID, Spec: raw}); err != nil {
		return spec, err
	}
	return spec, nil
}

// ErrInvalid: the spec does not describe a worker.
var ErrInvalid = errors.New("invalid worker spec")

// Drain stops new sessions going to worker id on every replica and drops its bindings (each
// session moves on its next request); it returns how many bindings went. A worker from flags
// is registered in the cluster first, so the drain reaches every replica.
func (l *Lifecycle) Drain(ctx context.Context, id string) (int, error) {
	spec, ok := l.reg.Lookup(id)
	if !ok {
		return 0, fmt.Errorf("worker %q: %w", id, ErrUnknown)
	}
	if !l.inCluster(id) {
		raw, err := EncodeSpec(spec)
		if err != nil {
			return 0, err
		}
		if _, err := l.cfg.Cluster.Apply(ctx, &fsm.AddWorker{ID: id, Spec: raw}); err != nil {
			return 0, err
		}
	}
	res, err := l.cfg.Cluster.Apply(ctx, &fsm.DrainWorker{ID: id})
	if err != nil {
		return 0, err
	}
	return res.Count, nil
}

// Remove takes worker id out of every replica's routing and drops its bindings, and returns
// how many went. A worker from flags, which the cluster registry never held, leaves this
// replica's registry here (the others keep theirs until their own flags change).
func (l *Lifecycle) Remove(ctx context.Context, id string) (int, error) {
	_, inReg := l.reg.Lookup(id)
	inFSM := l.inCluster(id)
	if !inReg && !inFSM {
		return 0, fmt.Errorf("worker %q: %w", id, ErrUnknown)
	}
	res, err := l.cfg.Cluster.Apply(ctx, &fsm.RemoveWorker{ID: id})
	if err != nil {
		return 0, err
	}
	if !inFSM {
		_ = l.reg.Remove(id)
	}
	return res.Count, nil
}

// Owners is what the cluster registry's stored specs say of their owners, by worker id; a
// worker absent from it is not in the cluster registry (only in this replica's flags).
func (l *Lifecycle) Owners() map[string]Owned {
	ws := l.cfg.Cluster.Workers()
	out := make(map[string]Owned, len(ws))
	for _, w := range ws {
		out[w.ID] = OwnerOf(w.Spec)
	}
	return out
}

// InCluster reports whether the cluster registry holds worker id (not only this replica's flags).
func (l *Lifecycle) InCluster(id string) bool { return l.inCluster(id) }

func (l *Lifecycle) inCluster(id string) bool {
	for _, w := range l.cfg.Cluster.Workers() {
		if w.ID == id {
			return true
		}
	}
	return false
}
