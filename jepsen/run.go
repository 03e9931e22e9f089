package jepsen

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// Config describes one run of the harness.
type Config struct {
	// Binary is the kvrouter-ha executable under test.
	Binary string
	// Replicas, Workers and Clients size the cluster and the workload.
	Replicas, Workers, Clients int
	// Duration is how long the workload runs; faults stop a cooldown before its end.
	Duration time.Duration
	// Seed makes the fault schedule and the clients' choices reproducible.
	Seed int64
	// Faults are the kinds of fault the nemesis may inject.
	Faults []FaultKind
	// OutDir receives the history, the report, the logs and porcupine's visualisations.
	OutDir string
	// HAProxy puts a real HAProxy in front of the replicas; LBShare of the requests (half
	// when 0) go through it, the rest straight to a random replica. A session's first
	// request raced on several replicas goes to them directly whatever the share.
	HAProxy bool
	LBShare float64
	// LBPolicy is the balancer's retries and health checks (proc.HarnessPolicy when empty);
	// LBPolicySource says where it came from, for the report.
	LBPolicy       proc.HAProxyPolicy
	LBPolicySource string
	// Netns is "auto" (namespaces when partitions are asked for and can be made), "on" or "off".
	Netns string
	// Consistency, StaleBound, BindWait, SessionTTL and HealthInterval go to every replica, and
	// tell the checker what to hold the replicas to.
	Consistency                                      string
	StaleBound, BindWait, SessionTTL, HealthInterval time.Duration
	// RequestTimeout bounds one client request; a request past it is "unknown".
	RequestTimeout time.Duration
	// ServeArgs are extra flags for every replica (for instance a deliberately broken mode).
	ServeArgs []string
	// KeepData keeps the replicas' data directories after the run.
	KeepData bool
	// Logger receives progress; nil discards it.
	Logger *slog.Logger
}

// Timing of a run around its faults.
const (
	warmup   = 3 * time.Second
	cooldown = 8 * time.Second
)

func (c *Config) defaults() {
	if c.Replicas == 0 {
		c.Replicas = 3
	}
	if c.Workers == 0 {
		c.Workers = 3
	}
	if c.Clients == 0 {
		c.Clients = 8
	}
	if c.Duration == 0 {
		c.Duration = 2 * time.Minute
	}
	if len(c.LBPolicy.Defaults)+len(c.LBPolicy.Backend) == 0 {
		c.LBPolicy, c.LBPolicySource = proc.HarnessPolicy(), "the harness's own (retries an empty answer too)"
	}
	if c.LBShare == 0 {
		c.LBShare = 0.5
	}
	if c.Netns == "" {
		c.Netns = "auto"
	}
	if c.Consistency == "" {
		c.Consistency = "bounded"
	}
	if c.StaleBound == 0 {
		c.StaleBound = time.Second
	}
	if c.BindWait == 0 {
		c.BindWait = 3 * time.Second
	}
	if c.SessionTTL == 0 {
		c.SessionTTL = 30 * time.Second
	}
	if c.HealthInterval == 0 {
		c.HealthInterval = 500 * time.Millisecond
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
}

func (c *Config) validate() error {
	var errs []error
	if c.Binary == "" {
		errs = append(errs, errors.New("no kvrouter-ha binary given"))
	} else if st, err := os.Stat(c.Binary); err != nil || st.IsDir() {
		errs = append(errs, fmt.Errorf("binary %q: not a file", c.Binary))
	}
	if c.OutDir == "" {
		errs = append(errs, errors.New("no output directory given"))
	}
	if c.Replicas < 1 || c.Replicas > 9 {
		errs = append(errs, fmt.Errorf("%d replicas: want 1 to 9", c.Replicas))
	}
	if c.Workers < 1 || c.Workers > 32 {
		errs = append(errs, fmt.Errorf("%d workers: want 1 to 32", c.Workers))
	}
	if c.Clients < 1 || c.Clients > 256 {
		errs = append(errs, fmt.Errorf("%d clients: want 1 to 256", c.Clients))
	}
	if c.Duration < warmup+cooldown+5*time.Second {
		errs = append(errs, fmt.Errorf("duration %s: want at least %s", c.Duration, warmup+cooldown+5*time.Second))
	}
	if c.LBShare < 0 || c.LBShare > 1 {
		errs = append(errs, fmt.Errorf("lb share %g: want 0 to 1", c.LBShare))
	}
	if !slices.Contains([]string{"auto", "on", "off"}, c.Netns) {
		errs = append(errs, fmt.Errorf("netns %q: want auto, on or off", c.Netns))
	}
	if !slices.Contains([]string{"bounded", "linearizable", "local"}, c.Consistency) {
		errs = append(errs, fmt.Errorf("consistency %q: want bounded, linearizable or local", c.Consistency))
	}
	if c.StaleBound < 0 || c.SessionTTL < 0 || c.BindWait < 0 || c.HealthInterval < 0 || c.RequestTimeout < 0 {
		errs = append(errs, errors.New("durations must not be negative"))
	}
	for _, k := range c.Faults {
		if !slices.Contains(nemesisKinds, k) {
			errs = append(errs, fmt.Errorf("unknown fault kind %q", k))
		}
	}
	return errors.Join(errs...)
}

// CheckConfig is what the checker holds the replicas to, from what they were told.
func (c Config) CheckConfig() CheckConfig {
	c.defaults()
	// A worker fault explains binding changes until its failure and return have been probed:
	// a few health intervals, plus slack for a loaded machine.
	cc := CheckConfig{SessionTTL: c.SessionTTL, Grace: 6*c.HealthInterval + 2*time.Second}
	switch c.Consistency {
	case "bounded":
		cc.Staleness = c.StaleBound
	case "local":
		cc.Staleness = -1
	}
	return cc
}

var errNetnsUnsupported = errors.New("network namespaces are Linux only")

// chooseNetwork picks loopback or namespaces, and says why partitions cannot be made when not.
func chooseNetwork(cfg *Config) (network, error) {
	wantPartitions := slices.Contains(cfg.Faults, FaultPartition)
	switch {
	case cfg.Netns == "off":
		return loopback{why: "--netns off: everything runs on loopback"}, nil
	case cfg.Netns == "auto" && !wantPartitions:
		return loopback{why: "partitions were not asked for"}, nil
	}
	var b [3]byte
	_, _ = rand.Read(b[:])
	nw, err := newNetns(hex.EncodeToString(b[:]), cfg.Replicas)
	if err == nil {
		return nw, nil
	}
	if cfg.Netns == "on" {
		return nil, fmt.Errorf("network namespaces: %w", err)
	}
	return loopback{why: fmt.Sprintf("network namespaces unavailable (%v) on %s/%s", err, runtime.GOOS, runtime.GOARCH)}, nil
}

// Run starts the cluster, drives the workload while the nemesis injects faults, checks the
// history and writes the report files. A run that found violations returns a Report whose
// Valid is false and no error; an error means the run itself could not be made.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.defaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(cfg.OutDir)
	if err != nil {
		return nil, fmt.Errorf("output directory: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("output directory: %w", err)
	}
	plan, err := Plan(PlanConfig{Seed: cfg.Seed, Kinds: cfg.Faults, Replicas: cfg.Replicas, Workers: cfg.Workers,
		Duration: cfg.Duration, Warmup: warmup, Cooldown: cooldown})
	if err != nil {
		return nil, err
	}
	log := cfg.Logger
	began := time.Now()
	nw, err := chooseNetwork(&cfg)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := nw.close(); err != nil {
			log.Warn("network teardown", "err", err)
		}
	}()
	f, err := newFleet(&cfg, nw, dir)
	if err != nil {
		return nil, err
	}
	stopped := false
	stopFleet := func() {
		if !stopped {
			stopped = true
			f.stop()
			if !cfg.KeepData {
				_ = os.RemoveAll(filepath.Join(dir, "data"))
			}
		}
	}
	defer stopFleet()
	log.Info("starting cluster", "replicas", cfg.Replicas, "workers", cfg.Workers, "network", nw.describe(), "haproxy", cfg.HAProxy)
	if err := f.start(ctx); err != nil {
		return nil, fmt.Errorf("start cluster: %w (logs in %s)", err, filepath.Join(dir, "logs"))
	}

	rec := newRecorder()
	monCtx, stopMon := context.WithCancel(ctx)
	mon := &monitor{f: f, rec: rec}
	var monWG sync.WaitGroup
	monWG.Go(func() { mon.run(monCtx) })

	until := time.Now().Add(cfg.Duration)
	nem := &nemesis{f: f, rec: rec, cfg: &cfg}
	var nemWG sync.WaitGroup
	nemWG.Go(func() {
		if sleep(ctx, warmup) == nil {
			nem.run(ctx, plan, until.Add(-cooldown))
		}
	})
	log.Info("workload running", "clients", cfg.Clients, "duration", cfg.Duration, "planned faults", len(plan))
	(&workload{f: f, rec: rec, cfg: &cfg}).run(ctx, until)
	nemWG.Wait()

	// Settle: every replica up and ready, then the final reads on every replica.
	if err := nw.heal(context.WithoutCancel(ctx), f); err != nil {
		log.Warn("heal", "err", err)
	}
	if ctx.Err() == nil {
		if err := f.waitAllReady(ctx, 60*time.Second); err != nil {
			rec.note("", "not every replica was ready at the end: %v", err)
		}
		f.converge(ctx, rec, cfg.SessionTTL)
	}
	stopMon()
	monWG.Wait()
	h := rec.snapshot()
	h.Crashes = mon.crashes()
	stopFleet()
	if cfg.HAProxy {
		// Stopped, HAProxy has written every request line: mark what it retried.
		if err := readBalancerLogFile(filepath.Join(dir, "logs", "haproxy.log"), h.Ops); err != nil {
			log.Warn("load balancer log", "err", err)
			h.Notes = append(h.Notes, Note{At: h.End, Text: "load balancer log: " + err.Error()})
		}
	}

	log.Info("checking history", "ops", len(h.Ops), "faults", len(h.Faults))
	rep := &Report{
		Seed: cfg.Seed, Replicas: cfg.Replicas, Workers: cfg.Workers, Clients: cfg.Clients,
		Duration: cfg.Duration, Consistency: cfg.Consistency, StaleBound: cfg.StaleBound, SessionTTL: cfg.SessionTTL,
		FaultsAsked: cfg.Faults, Network: nw.describe(), ServeArgs: cfg.ServeArgs,
		Plan: plan, Injected: h.Faults, Skipped: nem.skip,
	}
	if ok, why := nw.canPartition(); ok {
		rep.Partitions = "made with network namespaces and iptables"
	} else if slices.Contains(cfg.Faults, FaultPartition) {
		rep.Partitions = "NOT made: " + why
	} else {
		rep.Partitions = "not asked for"
	}
	if cfg.HAProxy {
		rep.LoadBalancer = fmt.Sprintf("haproxy at %s, retries and health checks from %s", f.lbAddr, cfg.LBPolicySource)
	}
	rep.Analysis = Check(h, cfg.CheckConfig())
	rep.Elapsed = time.Since(began)
	if err := rep.write(dir, h, cfg.CheckConfig()); err != nil {
		return rep, err
	}
	if err := ctx.Err(); err != nil {
		return rep, fmt.Errorf("run interrupted (the report covers what was recorded): %w", err)
	}
	return rep, nil
}

// converge reads every recently active session on every replica until they agree (or 20 s
// pass), and records the last reads: they feed the convergence and end-of-run durability checks.
func (f *fleet) converge(ctx context.Context, rec *recorder, ttl time.Duration) {
	end := rec.now()
	var sessions []string
	for s, last := range rec.sessionsBefore(end) {
		if ttl <= 0 || end-last <= ttl/2 {
			sessions = append(sessions, s)
		}
	}
	sort.Strings(sessions)
	deadline := time.Now().Add(20 * time.Second)
	final := map[string][]Read{}
	pending := sessions
	for attempt := 0; len(pending) > 0 && attempt < 40; attempt++ {
		reads := f.readSessions(ctx, rec, pending, 0, false)
		by := map[string][]Read{}
		for _, rd := range reads {
			by[rd.Session] = append(by[rd.Session], rd)
		}
		var again []string
		for _, s := range pending {
			final[s] = by[s]
			if !agree(by[s]) {
				again = append(again, s)
			}
		}
		pending = again
		if len(pending) == 0 || time.Now().After(deadline) || sleep(ctx, 500*time.Millisecond) != nil {
			break
		}
	}
	for _, s := range sessions {
		for _, rd := range final[s] {
			rec.addRead(rd)
		}
	}
}

func agree(rds []Read) bool {
	for _, rd := range rds {
		if rd.Error != "" || rd.Found != rds[0].Found || rd.Worker != rds[0].Worker || rd.Revision != rds[0].Revision {
			return false
		}
	}
	return true
}

// monitor watches the cluster without touching it: who leads, which workers each replica
// routes to, and whether a replica died on its own.
type monitor struct {
	f   *fleet
	rec *recorder
	mu  sync.Mutex
	out []Crash
}

func (m *monitor) crashes() []Crash {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.out)
}

func (m *monitor) run(ctx context.Context) {
	leaders := map[string]string{}
	health := map[string]bool{}
	dead := map[string]bool{}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		for _, r := range m.f.replicas {
			if r.proc.Exited() {
				if !dead[r.ID] {
					dead[r.ID] = true
					m.rec.note(r.ID, "%s exited on its own", r.ID)
					m.mu.Lock()
					m.out = append(m.out, Crash{Replica: r.ID, At: m.rec.now()})
					m.mu.Unlock()
				}
				continue
			}
			dead[r.ID] = false
			cctx, cancel := context.WithTimeout(ctx, 800*time.Millisecond)
			if st, err := m.f.status(cctx, r); err == nil && st.Self.LeaderID != leaders[r.ID] {
				leaders[r.ID] = st.Self.LeaderID
				m.rec.note(r.ID, "%s sees leader %q (term %d)", r.ID, st.Self.LeaderID, st.Self.Term)
			}
			if ws, err := m.f.workerStates(cctx, r); err == nil {
				for _, w := range ws {
					key := r.ID + "/" + w.Spec.ID
					ok := w.Healthy && !w.Drained
					if was, seen := health[key]; !seen || was != ok {
						health[key] = ok
						if seen {
							m.rec.note(r.ID, "%s: worker %s routable=%v %s", r.ID, w.Spec.ID, ok, w.Reason)
						}
					}
				}
			}
			cancel()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
