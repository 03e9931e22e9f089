// Package demo runs kvrouter-ha's demonstrations on simulated workers and a trace: HA, three
// replica processes behind HAProxy with the Raft leader killed half-way (make demo), and
// Compare, side-by-side runs of policies, replica counts and index modes in one process.
package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster"
	"github.com/kvrouter-ha/kvrouter-ha/cluster/hints"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/replica"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// Config is a demo: simulated workers, the routers to compare, one trace slice.
type Config struct {
	// Binary is the kvrouter-ha executable HA runs as its replicas (default: this process's).
	Binary         string
	Workers        int
	CapacityBlocks int
	// ApproxTTL is the routers' approximate-index TTL in trace time (scaled by Speedup like
	// everything else); 0 keeps no TTL, the per-worker cap (CapacityBlocks, the workers' own
	// cache size) then standing in for eviction alone, as the workers' LRU does.
	ApproxTTL time.Duration
	// GossipBudget is each replica's outbound gossip budget in bytes per second (0: the
	// replicas' default, replica.DefaultGossipBudget).
	GossipBudget int
	Policies     []string
	// PrefillWeight is the kv policy's weight of prefill blocks against decode blocks in its
	// cost (0: the router's default), as serve's --prefill-weight.
	PrefillWeight float64
	// OverlapWeight is the kv policy's weight of uncached prompt blocks (0: the router's
	// default), as serve's --overlap-weight.
	OverlapWeight float64
	Modes         []string // approximate and/or precise (KV events)
	Topologies    []Topology
	// Fleets are the worker fleets to compare (default: Workers aggregated workers); a
	// fleet with prefill workers is run once per mode of DisaggModes.
	Fleets []Fleet
	// DisaggModes are the routers' disaggregation modes to compare on fleets with prefill
	// workers (default: conditional), and MinUncachedTokens their conditional threshold.
	DisaggModes       []string
	MinUncachedTokens int
	TracePath         string
	Start, Limit      int
	Speedup           float64
	Concurrency       int
	MaxOutput         int
	Sim               sim.Config
	JSONPath          string
	Progress          bool
	// NoStream replays non-streaming requests instead of streaming ones.
	NoStream bool
	// RequestLogDir, when set, receives each compare run's per-request log
	// (replay.RequestRecord lines), one file per run named after its label.
	RequestLogDir string
	// RecordAt lists where the compared routers record decisions: dispatch (the default: at
	// dispatch and again when the worker finishes the request) and, to show what that buys,
	// dispatch-only (not again at the end) and commit (only at the worker's first answer, as
	// before issue 14).
	RecordAt []string
	// ScaleUp is how many workers the scale demo adds at one third (to Workers), ScaleDown
	// how many of the oldest it removes at two thirds; ScaleNoFixed skips its run over a
	// fixed fleet of the same average size.
	ScaleUp, ScaleDown int
	ScaleNoFixed       bool
	// LoadWorkers are the capacity sweep's load levels: the fleet sizes the same slice is
	// replayed on (fewer workers, more load on each); Runs is how many times each policy
	// runs at each level, TTFTTarget the TTFT p90 a level must stay within, and OutDir where
	// the sweep writes its tables and JSON ("": only printed).
	LoadWorkers []int
	Runs        int
	// Parallel is how many of the capacity sweep's replays run at once (0: one).
	Parallel   int
	TTFTTarget time.Duration
	OutDir     string
	// HAProxyConfig is the balancer config the high-availability demo runs HAProxy with
	// (empty: the bundled deploy/haproxy.cfg).
	HAProxyConfig string
	Logger        *slog.Logger
}

// Compare replays the trace slice through fresh fleets and routers, one run per topology,
// mode and policy, and prints the summaries side by side.
func Compare(ctx context.Context, cfg Config, stdout, progress io.Writer) error {
	if len(cfg.Policies) == 0 {
		return errors.New("no policies to compare")
	}
	reqs, err := cfg.traceSlice()
	if err != nil {
		return err
	}
	blocks, tokens := trace.Ceiling(reqs)
	fmt.Fprintf(stdout, "replaying %d requests over %d simulated workers (%d blocks of 16 tokens each), %.0fx speed\n",
		len(reqs), cfg.Workers, cfg.CapacityBlocks, cfg.Speedup)
	fmt.Fprintf(stdout, "unlimited single-cache ceiling for this slice: %.1f%% of blocks, %.1f%% of tokens\n\n", 100*blocks, 100*tokens)
	var sums []*replay.Summary
	if len(cfg.Topologies) == 0 {
		cfg.Topologies = []Topology{{Replicas: 1}}
	}
	records := cfg.RecordAt
	if len(records) == 0 {
		records = []string{"dispatch"}
	}
	fleets := cfg.Fleets
	if len(fleets) == 0 {
		fleets = []Fleet{{Aggregated: cfg.Workers}}
	}
	for _, fl := range fleets {
		disagg := []string{""}
		if fl.Disaggregated() {
			disagg = cfg.DisaggModes
			if len(disagg) == 0 {
				disagg = []string{routing.DisaggConditional}
			}
		}
		for _, dm := range disagg {
			for _, tp := range cfg.Topologies {
				for _, mode := range cfg.Modes {
					for _, policy := range cfg.Policies {
						for _, rec := range records {
							if err := ctx.Err(); err != nil {
								break
							}
							run := run{fleet: fl, disagg: dm, tp: tp, policy: policy, precise: mode == "precise", recordAt: rec, label: len(records) > 1,
								fleetLabel: len(fleets) > 1 || fl.Disaggregated()}
							s, err := runOne(ctx, cfg, run, reqs, progress)
							if err != nil {
								return fmt.Errorf("fleet %s %s, policy %s, %s mode, %s, record at %s: %w", fl, dm, policy, mode, tp, rec, err)
							}
							sums = append(sums, s)
						}
					}
				}
			}
		}
	}
	fmt.Fprintln(stdout)
	replay.Table(stdout, sums)
	if cfg.JSONPath != "" {
		b, err := json.MarshalIndent(sums, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(cfg.JSONPath, b, 0o644); err != nil {
			return fmt.Errorf("write %s: %w", cfg.JSONPath, err)
		}
	}
	return nil
}

// traceSlice is the trace's requests the demo replays: Limit of them (0: all) from Start.
func (cfg Config) traceSlice() ([]trace.Request, error) {
	reqs, err := trace.ForReplay(cfg.TracePath, cfg.Start)
	if err != nil {
		return nil, err
	}
	if cfg.Limit > 0 && cfg.Limit < len(reqs) {
		reqs = reqs[:cfg.Limit]
	}
	return reqs, nil
}

// simConfig is the simulated workers' configuration: cfg.Sim on the demo's cache size and
// speed, logging to log.
func (cfg Config) simConfig(log *slog.Logger) sim.Config {
	sc := cfg.Sim
	sc.CapacityBlocks = cfg.CapacityBlocks
	sc.Speedup = cfg.Speedup
	sc.MaxModelLen = 262144
	sc.Logger = log
	return sc
}

// scaledTTL is scaled for a TTL, where 0 means none and stays 0.
func scaledTTL(d time.Duration, speedup float64) time.Duration {
	if d <= 0 {
		return 0
	}
	return scaled(d, speedup)
}

// scaled is d in a simulation running speedup times faster than real time (at least 5 ms).
func scaled(d time.Duration, speedup float64) time.Duration {
	if speedup <= 1 {
		return d
	}
	return max(time.Duration(float64(d)/speedup), 5*time.Millisecond)
}

// startReplicas starts tp.Replicas router replicas in this process that form one Raft
// cluster on loopback (a lone replica is a one-node cluster), each sending at most
// gossipBudget bytes per second (0: replica.DefaultGossipBudget).
func startReplicas(ctx context.Context, tp Topology, base replica.Config, dataDir string, speedup float64, gossipBudget int) ([]*replica.Replica, error) {
	type addrs struct{ raft, peer, gossip string }
	var all []addrs
	var seeds, gossipSeeds []string
	for range tp.Replicas {
		a := addrs{raft: freeLoopback(), peer: freeLoopback(), gossip: freeLoopback()}
		if a.raft == "" || a.peer == "" || a.gossip == "" {
			return nil, errors.New("no free loopback port")
		}
		all = append(all, a)
		seeds = append(seeds, a.peer)
		gossipSeeds = append(gossipSeeds, a.gossip)
	}
	if gossipBudget <= 0 {
		gossipBudget = replica.DefaultGossipBudget
	}
	var reps []*replica.Replica
	for i, a := range all {
		cfg := base
		cfg.ID = fmt.Sprintf("demo-%d", i)
		cfg.NoGossip = tp.NoGossip
		cfg.Cluster = replica.ClusterConfig{
			DataDir: filepath.Join(dataDir, cfg.ID), RaftListen: a.raft, PeerListen: a.peer,
			BootstrapExpect: tp.Replicas, BindWait: 10 * time.Second,
			// The replicas start one after another here, so the first finds no seed up yet:
			// it goes on at once and keeps trying in the background.
			// Time runs speedup times faster here, so the hints' intervals shrink with it,
			// as the TTLs do: a load report every 150 ms of simulated time.
			Gossip: replica.GossipConfig{Listen: a.gossip, MaxBytesPerSecond: gossipBudget, JoinWait: 100 * time.Millisecond,
				HealthInterval: 200 * time.Millisecond, SnapshotDiscovery: time.Second, MinQuorum: 3, CleanupInterval: 5 * time.Minute,
				LoadInterval:  scaled(hints.DefaultLoadInterval, speedup),
				DecisionFlush: scaled(hints.DefaultDecisionFlush, speedup)},
		}
		if tp.Replicas > 1 {
			cfg.Cluster.Join = seeds
			cfg.Cluster.Gossip.Join = gossipSeeds
		}
		r, err := replica.Start(ctx, cfg)
		if err != nil {
			closeReplicas(reps)
			return nil, err
		}
		reps = append(reps, r)
	}
	// Wait until every replica is ready (a leader is elected and known).
	deadline := time.Now().Add(30 * time.Second)
	for _, r := range reps {
		for r.Ready() != nil {
			if time.Now().After(deadline) || ctx.Err() != nil {
				closeReplicas(reps)
				return nil, fmt.Errorf("replicas not ready: %w", r.Ready())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return reps, nil
}

// closeReplicas stops a run's replicas, one after another. (The survivors then log the
// absence of those gone; a run's logger is quiet by then, see untilOver.)
func closeReplicas(reps []*replica.Replica) {
	for _, r := range reps {
		_ = r.Close()
	}
}

// untilOver is a run's log handler: it goes quiet when the run is over, when the replicas
// stopping together log one another's absence (Raft's failed heartbeats and votes), which
// is no fault of theirs.
type untilOver struct {
	slog.Handler
	over *atomic.Bool
}

// Enabled implements slog.Handler.
func (h untilOver) Enabled(ctx context.Context, l slog.Level) bool {
	return !h.over.Load() && h.Handler.Enabled(ctx, l)
}

// Handle implements slog.Handler.
func (h untilOver) Handle(ctx context.Context, r slog.Record) error {
	if h.over.Load() {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

// WithAttrs implements slog.Handler.
func (h untilOver) WithAttrs(as []slog.Attr) slog.Handler {
	return untilOver{Handler: h.Handler.WithAttrs(as), over: h.over}
}

// WithGroup implements slog.Handler.
func (h untilOver) WithGroup(name string) slog.Handler {
	return untilOver{Handler: h.Handler.WithGroup(name), over: h.over}
}

// freeLoopback returns a loopback address with a port free now.
func freeLoopback() string {
	a, err := loopback.Addr()
	if err != nil {
		return ""
	}
	return a
}

// simFleet is a set of simulated workers serving on loopback; each can be stopped alone.
type simFleet struct {
	ctx        context.Context
	specs      []routing.WorkerSpec
	publishers []*kvevents.Publisher
	stops      map[string]func()
	cancel     context.CancelFunc
	wg         sync.WaitGroup
}

// startSimFleet starts fl's simulated workers on 127.0.0.1 ephemeral ports, each with its
// role; with events, each also publishes its KV events (and serves replay) on its own ZMQ
// ports, named in its spec.
func startSimFleet(ctx context.Context, fl Fleet, base sim.Config, events bool) (*simFleet, error) {
	f := newSimFleet(ctx)
	for _, w := range fl.roles() {
		if _, err := f.add(w.id, w.role, base, events); err != nil {
			f.Close()
			return nil, err
		}
	}
	return f, nil
}

// newSimFleet is an empty fleet whose workers serve until ctx ends or Close.
func newSimFleet(ctx context.Context) *simFleet {
	ctx, cancel := context.WithCancel(ctx)
	return &simFleet{ctx: ctx, cancel: cancel, stops: map[string]func(){}}
}

// add starts one simulated worker, id in role, and returns its spec (also kept in specs).
func (f *simFleet) add(id string, role routing.Role, base sim.Config, events bool) (routing.WorkerSpec, error) {
	ctx, cancel := context.WithCancel(f.ctx)
	c := base
	c.ID = id
	c.Role = map[routing.Role]string{routing.RolePrefill: sim.RolePrefill, routing.RoleDecode: sim.RoleDecode, routing.RoleBoth: sim.RoleBoth}[role]
	spec := routing.WorkerSpec{ID: c.ID, CapacityBlocks: c.CapacityBlocks, Role: role}
	if events {
		pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{
			Endpoint: "tcp://127.0.0.1:0", Bind: true, ReplayEndpoint: "tcp://127.0.0.1:0", Logger: c.Logger,
		})
		if err != nil {
			cancel()
			return spec, err
		}
		f.publishers = append(f.publishers, pub)
		spec.KVEvents = "tcp://" + pub.Addr().String()
		spec.KVReplay = "tcp://" + pub.ReplayAddr().String()
		c.OnEvent = sim.PublishEvents(ctx, pub, max(c.BlockSize, sim.DefaultBlockSize), c.Logger)
	}
	w, err := sim.New(c)
	if err != nil {
		cancel()
		return spec, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		cancel()
		return spec, err
	}
	spec.URL = "http://" + ln.Addr().String()
	f.specs = append(f.specs, spec)
	done := make(chan struct{})
	f.stops[id] = func() { cancel(); <-done }
	f.wg.Add(1)
	go func() { defer f.wg.Done(); defer close(done); w.Serve(ctx, ln) }()
	return spec, nil
}

// stop shuts worker id down (its in-flight requests get the worker's shutdown grace) and
// waits for it.
func (f *simFleet) stop(id string) {
	if s, ok := f.stops[id]; ok {
		s()
	}
}

// Close stops every worker and publisher and waits for them.
func (f *simFleet) Close() {
	f.cancel()
	f.wg.Wait()
	for _, p := range f.publishers {
		p.Close()
	}
}

// Topology is how many router replicas a demo run uses and whether they gossip.
type Topology struct {
	Replicas int
	NoGossip bool
}

// String is the topology as --replicas spells it (3, 3-nogossip).
func (t Topology) String() string {
	if t.NoGossip {
		return fmt.Sprintf("%d-nogossip", t.Replicas)
	}
	return fmt.Sprint(t.Replicas)
}

// ParseTopology reads one --replicas item: N or N-nogossip, N from 1 to 7.
func ParseTopology(s string) (Topology, error) {
	var t Topology
	n, rest, _ := strings.Cut(s, "-")
	v, err := strconv.Atoi(n)
	if err != nil || v < 1 || v > 7 || (rest != "" && rest != "nogossip") {
		return t, fmt.Errorf("--replicas item %q: want N or N-nogossip with N from 1 to 7", s)
	}
	return Topology{Replicas: v, NoGossip: rest == "nogossip"}, nil
}

// runOne replays reqs through a fresh fleet and fresh router replicas using policy.
// replayConfig is the replay of reqs through targets that every demo run makes.
func (cfg Config) replayConfig(targets []string, reqs []trace.Request, label string, progress io.Writer) replay.Config {
	rc := replay.DefaultConfig()
	rc.Targets = targets
	rc.Requests = reqs
	rc.Speedup = cfg.Speedup
	rc.Concurrency = cfg.Concurrency
	rc.MaxOutputTokens = cfg.MaxOutput
	rc.Model = sim.DefaultModel
	rc.Stream = !cfg.NoStream
	rc.Label = label
	rc.Progress = progress
	rc.Logger = cfg.Logger
	return rc
}

// run is one column of a comparison.
type run struct {
	// fleet is the workers, disagg the routers' disaggregation mode ("": the fleet has no
	// prefill workers); fleetLabel marks the column with them.
	fleet      Fleet
	disagg     string
	fleetLabel bool
	tp         Topology
	policy     string
	precise    bool
	// recordAt is where the routers record decisions (Config.RecordAt); label marks the
	// column with it.
	recordAt string
	label    bool
}

// RecordPoints are the values of Config.RecordAt.
func RecordPoints() []string { return []string{"dispatch", "dispatch-only", "commit"} }

// runOne replays reqs through a fresh fleet and fresh router replicas as r says.
func runOne(ctx context.Context, cfg Config, r run, reqs []trace.Request, progress io.Writer) (*replay.Summary, error) {
	tp, policy, precise := r.tp, r.policy, r.precise
	over := new(atomic.Bool)
	quiet := slog.New(untilOver{Handler: cfg.Logger.Handler(), over: over})
	sc := cfg.simConfig(quiet)
	fleet, err := startSimFleet(ctx, r.fleet, sc, precise)
	if err != nil {
		return nil, err
	}
	defer fleet.Close()
	dataDir, err := os.MkdirTemp("", "kvrouter-demo-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dataDir)
	base := replica.Config{
		Listen: "127.0.0.1:0", AdminListen: "127.0.0.1:0",
		Workers: fleet.specs,
		Router: routing.Config{Policy: policy, PrefillWeight: cfg.PrefillWeight, OverlapWeight: cfg.OverlapWeight, RecordAtCommit: r.recordAt == "commit",
			NoRefreshAtEnd: r.recordAt == "dispatch-only",
			Disagg:         routing.DisaggConfig{Mode: r.disagg, MinUncachedTokens: cfg.MinUncachedTokens}},
		// The decision index forgets on the workers' scale: a worker remembers no more than
		// its cache holds (and, with a TTL, a decision stays for the trace's reuse gap).
		ApproxTTL: scaledTTL(cfg.ApproxTTL, cfg.Speedup), ApproxMaxBlocks: cfg.CapacityBlocks,
		SessionTTL: time.Duration(float64(10*time.Minute) / cfg.Speedup), MaxSessions: 1_000_000,
		Health: openai.HealthConfig{Timeout: 2 * time.Second, FailThreshold: 3},
		Logger: quiet,
	}
	reps, err := startReplicas(ctx, tp, base, dataDir, cfg.Speedup, cfg.GossipBudget)
	if err != nil {
		return nil, err
	}
	defer func() {
		over.Store(true)
		closeReplicas(reps)
	}()
	var targets []string
	for _, r := range reps {
		targets = append(targets, "http://"+r.Addr())
	}
	rc := cfg.replayConfig(targets, reqs, policy, progress)
	if len(cfg.Modes) > 1 || precise {
		rc.Label = policy + map[bool]string{true: "/precise", false: "/approx"}[precise]
	}
	if len(cfg.Topologies) > 1 || tp.Replicas > 1 {
		rc.Label += " x" + tp.String()
	}
	if r.label {
		rc.Label += " @" + r.recordAt
	}
	if r.fleetLabel {
		rc.Label += " " + r.fleet.String()
		if r.disagg != "" {
			rc.Label += "/" + r.disagg
		}
	}
	sent := func() (bytes, dropped, gaps uint64, lag hints.LagHistogram, n int) {
		for _, r := range reps {
			if st, ok := r.SharingStats(); ok {
				bytes += st.Gossip.BytesOut
				for _, d := range st.Gossip.Dropped {
					dropped += d
				}
				gaps += st.Hints.DecisionGaps - min(st.Hints.DecisionLate, st.Hints.DecisionGaps)
				lag = lag.Add(st.Hints.DecisionLag)
				n++
			}
		}
		return bytes, dropped, gaps, lag, n
	}
	stability := func() (s cluster.Stability) {
		for _, r := range reps {
			st := r.ClusterStability()
			s.LeaderChanges += st.LeaderChanges
			s.LeaseFailures += st.LeaseFailures
		}
		return s
	}
	bytes0, dropped0, gaps0, lag0, _ := sent()
	stable0 := stability()
	if cfg.RequestLogDir != "" {
		f, err := os.Create(filepath.Join(cfg.RequestLogDir, strings.NewReplacer(" ", "_", "/", "-").Replace(rc.Label)+".jsonl"))
		if err != nil {
			return nil, err
		}
		defer f.Close()
		rc.RequestLog = f
	}
	sum, err := replay.Run(ctx, rc)
	if err != nil {
		return nil, err
	}
	stable1 := stability()
	sum.Replicas = len(reps)
	sum.LeaderChanges = stable1.LeaderChanges - stable0.LeaderChanges
	sum.ReadLeaseFailures = stable1.LeaseFailures - stable0.LeaseFailures
	if bytes1, dropped1, gaps1, lag1, n := sent(); n > 1 && sum.DurationSeconds > 0 {
		sum.GossipBytesPerSecond = float64(bytes1-bytes0) / float64(n) / sum.DurationSeconds
		sum.GossipDropped = dropped1 - dropped0
		// A message counted missing before the run may arrive during it.
		sum.DecisionGaps = gaps1 - min(gaps0, gaps1)
		if lag := lag1.Since(lag0); lag.Total() > 0 {
			for _, q := range []float64{0.5, 0.9, 0.99} {
				v := -1.0
				if d := lag.Quantile(q); d >= 0 {
					v = float64(d) / float64(time.Millisecond)
				}
				sum.DecisionLagMs = append(sum.DecisionLagMs, v)
			}
		}
	}
	return sum, nil
}
