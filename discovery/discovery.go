// Package discovery finds workers as they come and go and writes what it finds into the
// cluster's worker registry through Raft, as a leader duty: every replica routes to the same
// set, a removed worker's bindings go once, and a new leader resumes from the registry.
//
// A Source says which workers it sees now (a file of specs, a DNS name; a Kubernetes watch
// answers the same question from its cache). The leader looks every interval, compares what
// the sources see with the workers each source owns in the registry (a stored spec names its
// owner: see workers.EncodeOwned), and proposes AddWorker for a new or changed worker,
// DrainWorker for one that is gone (its bindings go; each session moves on its next request)
// and RemoveWorker once it has drained for the drain period. A worker a source sees but not
// ready is marked so (out of rotation, its bindings kept) and drained as a gone one once it
// stays not ready past the not-ready grace. A source that fails keeps its
// last known set; a look that would drain more than half of a source's workers at once is
// held as suspect (see DESIGN.md for the rules).
package discovery

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/internal/ratelog"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

// Source is one place the fleet is read from.
type Source interface {
	// Name identifies the source for good: it marks the workers the source owns in the
	// registry, so a new leader (or a restarted one) knows them again. "file:PATH", "dns:NAME:PORT".
	Name() string
	// Kind is the metric label of the source ("file", "dns"): a small, fixed set.
	Kind() string
	// Lookup returns the workers the source sees now; an error means it cannot tell (and
	// the source's workers stay as they are).
	Lookup(ctx context.Context) ([]routing.WorkerSpec, error)
}

// readiness is a Source that also sees workers that are there but not ready (the Kubernetes
// source): what its Lookup lists are the ready ones.
type readiness interface {
	// LookupReadiness is Lookup with, beside the ready workers, the ids of those that are
	// there but not ready.
	LookupReadiness(ctx context.Context) (ready []routing.WorkerSpec, notReady []string, err error)
}

// stopper is a Source that holds something open between looks (the Kubernetes source's
// watch on the API server), from its first look in a term until Stop. The duty stops it as
// its term ends, so a replica that does not lead holds nothing open, and the next term's
// first look opens it afresh.
type stopper interface {
	// Stop closes what the source holds open and returns once nothing of it runs.
	Stop()
}

// Cluster is what discovery needs of the replicated state (cluster.Node is one).
type Cluster interface {
	// Workers lists the cluster registry's workers.
	Workers() []fsm.Worker
	// Apply proposes a command through the leader and waits for its result.
	Apply(ctx context.Context, cmd fsm.Command) (*fsm.Result, error)
	// AddDuty runs work while this replica leads, from each term's start to its end.
	AddDuty(name string, run func(ctx context.Context))
}

// Config configures discovery.
type Config struct {
	Sources []Source
	Cluster Cluster
	// Static reports whether a worker id is configured on this replica outside the cluster
	// registry (a --worker flag or the workers file): discovery never takes such an id over.
	Static func(id string) bool
	// Interval between looks (default 10 s).
	Interval time.Duration
	// DrainFor is how long a gone worker drains (no new requests, in-flight ones finish)
	// before it is removed (default 30 s).
	DrainFor time.Duration
	// SuspectFor is how long a look that would drain more than half of a source's workers
	// at once is held before it is acted on (default 1 min; it still says so then).
	SuspectFor time.Duration
	// NotReadyGrace is how long a worker its source sees but not ready stays out of
	// rotation with its bindings kept before it is drained as a gone one (0: at once).
	NotReadyGrace time.Duration
	// Registerer, when set, gets the discovery metrics.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// Owner is the marker a source's workers carry in the registry.
func Owner(s Source) string { return workers.DiscoveryOwner(s.Name()) }

// Start registers the discovery leader duty with cfg.Cluster; it runs while this replica
// leads, from each term's start to its end. The Duty it returns reports the sources' status
// (nil without sources: no discovery).
func Start(cfg Config) (*Duty, error) {
	if cfg.Cluster == nil {
		return nil, errors.New("discovery: a cluster is required")
	}
	if len(cfg.Sources) == 0 {
		return nil, nil
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.DrainFor <= 0 {
		cfg.DrainFor = 30 * time.Second
	}
	if cfg.SuspectFor <= 0 {
		cfg.SuspectFor = time.Minute
	}
	if cfg.Static == nil {
		cfg.Static = func(string) bool { return false }
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	names := map[string]bool{}
	for _, s := range cfg.Sources {
		if names[s.Name()] {
			return nil, fmt.Errorf("discovery: source %s given twice", s.Name())
		}
		names[s.Name()] = true
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	d := newDuty(cfg.Sources)
	cfg.Cluster.AddDuty("discover workers", func(ctx context.Context) {
		d.begin()
		defer d.end()
		t := newTerm(cfg, m)
		t.duty = d
		t.run(ctx)
	})
	return d, nil
}

// metrics are the discovery counters (on the leader, which does the looking).
type metrics struct {
	errors  *prometheus.CounterVec
	changes *prometheus.CounterVec
	held    *prometheus.GaugeVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_discovery_errors_total",
			Help: "Looks at a discovery source that failed (the source's last known set is kept).",
		}, []string{"source"}),
		changes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvrouter_discovery_changes_total",
			Help: "Worker registry changes discovery proposed: add, ready, mark-not-ready, mark-gone, drain, remove.",
		}, []string{"source", "action"}),
		held: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvrouter_discovery_suspect_drains",
			Help: "Drains held because one look would drain more than half of a source's workers at once.",
		}, []string{"source"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.errors, m.changes, m.held} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("discovery: metrics: %w", err)
			}
		}
	}
	return m, nil
}

// term is one leadership term's discovery: what it knows lives only as long as the term; the
// registry is the state a new term starts from.
type term struct {
	cfg  Config
	m    *metrics
	logs *ratelog.Limiter
	// last is each source's last good look (absent: none yet this term, so its workers
	// are left as they are).
	last map[string]sight
	// drainingSince is when this term first saw each gone worker draining.
	drainingSince map[string]time.Time
	// notReadySince is when this term first saw each active worker not ready.
	notReadySince map[string]time.Time
	// suspectSince is when a source's looks started to be suspect (absent: not suspect).
	suspectSince map[string]time.Time
	// duty gets each look's outcome (nil: nobody asks).
	duty *Duty
}

func newTerm(cfg Config, m *metrics) *term {
	return &term{
		cfg: cfg, m: m, logs: ratelog.New(time.Minute, 64),
		last:          map[string]sight{},
		drainingSince: map[string]time.Time{},
		notReadySince: map[string]time.Time{},
		suspectSince:  map[string]time.Time{},
	}
}

func (t *term) run(ctx context.Context) {
	tick := time.NewTicker(t.cfg.Interval)
	defer tick.Stop()
	defer func() {
		for _, s := range t.cfg.Sources {
			if st, ok := s.(stopper); ok {
				st.Stop()
			}
		}
	}()
	for {
		for _, s := range t.cfg.Sources {
			t.look(ctx, s)
			if ctx.Err() != nil {
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// sight is what one look at a source saw: the ready workers by id, and the ids of those
// there but not ready.
type sight struct {
	ready    map[string]routing.WorkerSpec
	notReady map[string]bool
}

// lookup asks s what it sees.
func lookup(ctx context.Context, s Source) (sight, error) {
	var specs []routing.WorkerSpec
	var notReady []string
	var err error
	if r, ok := s.(readiness); ok {
		specs, notReady, err = r.LookupReadiness(ctx)
	} else {
		specs, err = s.Lookup(ctx)
	}
	if err != nil {
		return sight{}, err
	}
	sg := sight{ready: make(map[string]routing.WorkerSpec, len(specs)), notReady: make(map[string]bool, len(notReady))}
	for _, sp := range specs {
		sg.ready[sp.ID] = sp
	}
	for _, id := range notReady {
		if _, dup := sg.ready[id]; !dup {
			sg.notReady[id] = true
		}
	}
	return sg, nil
}

// look asks source s what it sees and reconciles its workers in the registry.
func (t *term) look(ctx context.Context, s Source) { t.lookAt(ctx, s, time.Now()) }

// lookAt is look with the time it happens at.
func (t *term) lookAt(ctx context.Context, s Source, now time.Time) {
	lctx, cancel := context.WithTimeout(ctx, max(t.cfg.Interval, 5*time.Second))
	seen, err := lookup(lctx, s)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		t.duty.looked(s.Name(), now, err)
		t.m.errors.WithLabelValues(s.Kind()).Inc()
		_, known := t.last[s.Name()]
		t.logs.Log(t.cfg.Logger, "lookup "+s.Name(), slog.LevelWarn, "discovery source failed; its workers stay as they are",
			"source", s.Name(), "last_known", known, "err", err)
		if !known {
			return
		}
	} else {
		t.last[s.Name()] = seen
		t.duty.looked(s.Name(), now, nil)
	}
	t.reconcile(ctx, s, t.last[s.Name()], err == nil, now)
}

// reconcile moves the registry's workers owned by s towards what the source saw, in the
// order of the ids. A look that is not fresh (the source failed; seen is its last good one)
// drains no worker for being not ready: that may have changed since.
func (t *term) reconcile(ctx context.Context, s Source, seen sight, fresh bool, now time.Time) {
	want := seen.ready
	owner := Owner(s)
	inCluster := map[string]fsm.Worker{}
	owned := map[string]fsm.Worker{}
	for _, w := range t.cfg.Cluster.Workers() {
		inCluster[w.ID] = w
		if workers.OwnerOf(w.Spec).Source == owner {
			owned[w.ID] = w
		}
	}
	// Present: added (or brought back from draining, or updated).
	for _, id := range slices.Sorted(maps.Keys(want)) {
		spec := want[id]
		w, ours := owned[id]
		delete(t.notReadySince, id)
		if _, taken := inCluster[id]; (taken && !ours) || (!taken && t.cfg.Static(id)) {
			t.logs.Log(t.cfg.Logger, "taken "+id, slog.LevelWarn, "discovered worker id is configured otherwise; left alone",
				"source", s.Name(), "worker", id)
			continue
		}
		if ours && w.Draining && !workers.OwnerOf(w.Spec).Gone {
			// An operator's drain (ctl workers drain), not this source's: it stands while the
			// source lists the worker, and the worker goes once the source drops it.
			continue
		}
		raw, err := workers.EncodeOwned(spec, workers.Owned{Source: owner})
		if err == nil && len(raw) > fsm.MaxSpecLen {
			err = fmt.Errorf("spec of %d bytes, over %d", len(raw), fsm.MaxSpecLen)
		}
		if err != nil {
			// One bad entry must not stop the rest of the fleet's changes.
			t.logs.Log(t.cfg.Logger, "spec "+id, slog.LevelWarn, "discovered worker left out", "source", s.Name(), "worker", id, "err", err)
			continue
		}
		if ours && !w.Draining && bytes.Equal(w.Spec, raw) {
			continue
		}
		action := "add"
		if ours && !w.Draining && workers.OwnerOf(w.Spec).NotReady {
			action = "ready"
		}
		if !t.apply(ctx, s, action, id, &fsm.AddWorker{ID: id, Spec: raw}) {
			return
		}
		delete(t.drainingSince, id)
	}
	// Not ready: out of rotation with its bindings kept (marked), for the not-ready grace;
	// past it, drained as a gone worker. A worker never added is not added while not ready.
	// Gone: drained, then removed after the drain period. A look that would take more than
	// half of the source's active workers out (marked or drained) waits out the suspect
	// period first.
	var drain, mark []string
	active := 0
	for _, id := range slices.Sorted(maps.Keys(owned)) {
		w := owned[id]
		if _, present := want[id]; present {
			if !w.Draining {
				active++
			}
			continue
		}
		if !w.Draining {
			active++
			if seen.notReady[id] {
				since, ok := t.notReadySince[id]
				if !ok {
					// Seen not ready first by this term: a new term starts the grace afresh,
					// which only lengthens it.
					since = now
					t.notReadySince[id] = now
				}
				if now.Sub(since) < t.cfg.NotReadyGrace || !fresh {
					if !workers.OwnerOf(w.Spec).NotReady {
						mark = append(mark, id)
					}
					continue
				}
			}
			drain = append(drain, id)
			continue
		}
		since, ok := t.drainingSince[id]
		if !ok {
			// Drained by an earlier term (or this one): the drain period starts afresh,
			// which only lengthens it.
			t.drainingSince[id] = now
			continue
		}
		if now.Sub(since) >= t.cfg.DrainFor {
			if !t.apply(ctx, s, "remove", id, &fsm.RemoveWorker{ID: id}) {
				return
			}
			delete(t.drainingSince, id)
		}
	}
	if out := len(drain) + len(mark); suspect(out, active) {
		since, ok := t.suspectSince[s.Name()]
		if !ok {
			t.suspectSince[s.Name()] = now
			since = now
		}
		t.m.held.WithLabelValues(s.Kind()).Set(float64(out))
		t.duty.held(s.Name(), out)
		if now.Sub(since) < t.cfg.SuspectFor {
			t.logs.Log(t.cfg.Logger, "suspect "+s.Name(), slog.LevelWarn, "discovery source dropped more than half of its workers at once; holding the drains",
				"source", s.Name(), "gone", len(drain), "not_ready", len(mark), "active", active, "hold", t.cfg.SuspectFor)
			return
		}
	} else {
		delete(t.suspectSince, s.Name())
		t.m.held.WithLabelValues(s.Kind()).Set(0)
		t.duty.held(s.Name(), 0)
	}
	for _, id := range mark {
		raw, err := remark(id, owned[id].Spec, workers.Owned{Source: owner, NotReady: true})
		if err != nil {
			continue
		}
		if !t.apply(ctx, s, "mark-not-ready", id, &fsm.AddWorker{ID: id, Spec: raw}) {
			return
		}
	}
	for _, id := range drain {
		// Marked gone first, so that whoever leads when it comes back knows the drain was
		// this source's and undoes it (a leader lost between the two commands leaves a marked,
		// undrained worker, which the next look drains or clears).
		if o := workers.OwnerOf(owned[id].Spec); !o.Gone {
			raw, err := remark(id, owned[id].Spec, workers.Owned{Source: owner, Gone: true})
			if err != nil {
				continue
			}
			if !t.apply(ctx, s, "mark-gone", id, &fsm.AddWorker{ID: id, Spec: raw}) {
				return
			}
		}
		if !t.apply(ctx, s, "drain", id, &fsm.DrainWorker{ID: id}) {
			return
		}
		delete(t.notReadySince, id)
		t.drainingSince[id] = now
	}
	if len(drain)+len(mark) > 0 {
		delete(t.suspectSince, s.Name())
		t.m.held.WithLabelValues(s.Kind()).Set(0)
		t.duty.held(s.Name(), 0)
	}
}

// remark is worker id's stored spec (raw, as the registry holds it) with the marks of o.
func remark(id string, raw []byte, o workers.Owned) ([]byte, error) {
	spec, err := workers.DecodeSpec(id, raw)
	if err != nil {
		return nil, err
	}
	return workers.EncodeOwned(spec, o)
}

// suspect is the panic rule: one look that would drain more than half of a source's active
// workers is suspect.
func suspect(gone, active int) bool { return gone > 0 && 2*gone > active }

// apply proposes cmd and reports whether it went through (false ends this look: the next
// one starts again from the registry).
func (t *term) apply(ctx context.Context, s Source, action, id string, cmd fsm.Command) bool {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := t.cfg.Cluster.Apply(cctx, cmd); err != nil {
		if ctx.Err() == nil {
			t.logs.Log(t.cfg.Logger, "propose "+s.Name(), slog.LevelWarn, "discovery proposal failed; the next look tries again",
				"source", s.Name(), "action", action, "worker", id, "err", err)
		}
		return false
	}
	t.m.changes.WithLabelValues(s.Kind(), action).Inc()
	t.cfg.Logger.Info("discovery changed the worker registry", "source", s.Name(), "action", action, "worker", id)
	return true
}

// Parse makes a source from its flag form: "file:PATH", "dns:NAME:PORT" (A/AAAA records with
// the port) or "dns-srv:NAME" (SRV records). dnsServer (host:port), when set, is the DNS
// server the dns sources ask instead of the system's.
func Parse(spec, dnsServer string) (Source, error) {
	kind, rest, _ := strings.Cut(spec, ":")
	switch kind {
	case "file":
		if rest == "" {
			return nil, fmt.Errorf("discovery %q: file:PATH needs a path", spec)
		}
		return NewFile(rest), nil
	case "dns":
		name, port, ok := strings.Cut(rest, ":")
		p, err := strconv.Atoi(port)
		if !ok || err != nil || p < 1 || p > 65535 {
			return nil, fmt.Errorf("discovery %q: dns:NAME:PORT needs a port from 1 to 65535", spec)
		}
		return NewDNS(name, p, dnsServer)
	case "dns-srv":
		return NewDNS(rest, 0, dnsServer)
	case "kubernetes":
		return parseKubernetes(spec, rest)
	}
	return nil, fmt.Errorf("discovery %q: want file:PATH, dns:NAME:PORT, dns-srv:NAME or kubernetes:namespace=NS,...", spec)
}
