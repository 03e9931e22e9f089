package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/peterbourgon/ff/v3/ffcli"

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

// demoConfig is one comparison run: simulated workers, a router per policy, one trace slice.
type demoConfig struct {
	Workers        int
	CapacityBlocks int
	Policies       []string
	Modes          []string // approximate and/or precise (KV events)
	Topologies     []topology
	TracePath      string
	Start, Limit   int
	Speedup        float64
	Concurrency    int
	MaxOutput      int
	Sim            sim.Config
	JSONPath       string
	Progress       bool
	// HAProxyConfig is the balancer config the high-availability demo runs HAProxy with.
	HAProxyConfig string
	Logger        *slog.Logger
}

func demoCommand(stdout, stderr io.Writer) *ffcli.Command {
	fs := flag.NewFlagSet("kvrouter-ha demo", flag.ContinueOnError)
	var cfg demoConfig
	scenario := fs.String("scenario", "ha", "ha: three replica processes behind HAProxy, the leader killed half-way (make demo); compare: side-by-side runs of --policies x --replicas x --modes")
	fs.StringVar(&cfg.HAProxyConfig, "haproxy-config", filepath.Join("deploy", "haproxy.cfg"), "ha: the HAProxy config (its addresses come from KVR_LISTEN and KVR_REPLICA0..2)")
	policies := fs.String("policies", "kv,round-robin", "comma-separated policies to compare ("+strings.Join(routing.Policies(), ", ")+")")
	topologies := fs.String("replicas", "1", "router topologies to compare: N replicas behind a round-robin client, N-nogossip for N replicas that share nothing but bindings (e.g. 1,3,3-nogossip)")
	modes := fs.String("modes", "approximate", "index modes to compare: approximate (the router learns from its own decisions) and/or precise (the workers publish vLLM KV events)")
	fs.IntVar(&cfg.Workers, "workers", 8, "simulated workers")
	fs.IntVar(&cfg.CapacityBlocks, "capacity-blocks", 32768, "each worker's KV cache in 16-token blocks (too small to hold the whole trace)")
	fs.StringVar(&cfg.TracePath, "trace", "", "Mooncake-format trace (default: the bundled synthetic trace)")
	fs.IntVar(&cfg.Start, "start", 2500, "first request of the trace to replay (the trace's reuse builds up over time; 2500 starts where sessions are in full swing)")
	fs.IntVar(&cfg.Limit, "requests", 1000, "requests to replay (0: all)")
	fs.Float64Var(&cfg.Speedup, "speedup", 10, "replay and simulate this many times faster than real time")
	fs.IntVar(&cfg.Concurrency, "concurrency", 256, "most requests in flight")
	fs.IntVar(&cfg.MaxOutput, "max-output-tokens", 0, "cap each request's output tokens (0: as in the trace)")
	fs.DurationVar(&cfg.Sim.PrefillPerToken, "prefill-per-token", 50*time.Microsecond, "simulated prefill time per uncached token")
	fs.DurationVar(&cfg.Sim.DecodePerToken, "decode-per-token", 10*time.Millisecond, "simulated time per output token")
	fs.StringVar(&cfg.JSONPath, "json", "", "also write the summaries as JSON to this file")
	fs.BoolVar(&cfg.Progress, "progress", true, "show a progress bar")
	logLevel := fs.String("log-level", "error", "router and worker log level: debug, info, warn or error")
	return &ffcli.Command{
		Name:       "demo",
		ShortUsage: "kvrouter-ha demo [flags]",
		ShortHelp:  "simulated workers and a router replaying a trace slice: kv routing against round-robin",
		FlagSet:    fs,
		Exec: func(ctx context.Context, _ []string) error {
			cfg.Policies = splitList(*policies)
			cfg.Modes = splitList(*modes)
			for _, t := range splitList(*topologies) {
				tp, err := parseTopology(t)
				if err != nil {
					return err
				}
				cfg.Topologies = append(cfg.Topologies, tp)
			}
			for _, m := range cfg.Modes {
				if m != "approximate" && m != "precise" {
					return fmt.Errorf("--modes: %q is neither approximate nor precise", m)
				}
			}
			log, err := newLogger(stderr, *logLevel)
			if err != nil {
				return err
			}
			cfg.Logger = log
			var progress io.Writer
			if cfg.Progress {
				progress = stderr
			}
			switch *scenario {
			case "ha":
				return runHADemo(ctx, cfg, stdout, progress)
			case "compare":
				return runDemo(ctx, cfg, stdout, progress)
			}
			return fmt.Errorf("--scenario %q: want ha or compare", *scenario)
		},
	}
}

// loadTrace reads the trace at path, or the bundled one, with sessions assigned, from its
// request start on.
func loadTrace(path string, start int) ([]trace.Request, error) {
	var reqs []trace.Request
	var err error
	if path == "" {
		reqs, err = trace.Bundled()
	} else {
		reqs, err = trace.Load(path)
	}
	if err != nil {
		return nil, err
	}
	trace.AssignSessions(reqs)
	if start < 0 || start >= len(reqs) {
		return nil, fmt.Errorf("--start %d outside the trace's %d requests", start, len(reqs))
	}
	return reqs[start:], nil
}

func runDemo(ctx context.Context, cfg demoConfig, stdout, progress io.Writer) error {
	if len(cfg.Policies) == 0 {
		return errors.New("no policies to compare")
	}
	reqs, err := loadTrace(cfg.TracePath, cfg.Start)
	if err != nil {
		return err
	}
	if cfg.Limit > 0 && cfg.Limit < len(reqs) {
		reqs = reqs[:cfg.Limit]
	}
	blocks, tokens := trace.Ceiling(reqs)
	fmt.Fprintf(stdout, "replaying %d requests over %d simulated workers (%d blocks of 16 tokens each), %.0fx speed\n",
		len(reqs), cfg.Workers, cfg.CapacityBlocks, cfg.Speedup)
	fmt.Fprintf(stdout, "unlimited single-cache ceiling for this slice: %.1f%% of blocks, %.1f%% of tokens\n\n", 100*blocks, 100*tokens)
	var sums []*replay.Summary
	if len(cfg.Topologies) == 0 {
		cfg.Topologies = []topology{{Replicas: 1}}
	}
	for _, tp := range cfg.Topologies {
		for _, mode := range cfg.Modes {
			for _, policy := range cfg.Policies {
				if err := ctx.Err(); err != nil {
					break
				}
				s, err := demoRun(ctx, cfg, tp, policy, mode == "precise", reqs, progress)
				if err != nil {
					return fmt.Errorf("policy %s, %s mode, %s: %w", policy, mode, tp, err)
				}
				sums = append(sums, s)
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

// scaled is d in a simulation running speedup times faster than real time (at least 5 ms).
func scaled(d time.Duration, speedup float64) time.Duration {
	if speedup <= 1 {
		return d
	}
	return max(time.Duration(float64(d)/speedup), 5*time.Millisecond)
}

// startDemoReplicas starts tp.Replicas router replicas in this process that form one Raft
// cluster on loopback (a lone replica is a one-node cluster).
func startDemoReplicas(ctx context.Context, tp topology, base replica.Config, dataDir string, speedup float64) ([]*replica.Replica, error) {
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
			Gossip: replica.GossipConfig{Listen: a.gossip, MaxBytesPerSecond: replica.DefaultGossipBudget, JoinWait: 100 * time.Millisecond,
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
			for _, r := range reps {
				r.Close()
			}
			return nil, err
		}
		reps = append(reps, r)
	}
	// Wait until every replica is ready (a leader is elected and known).
	deadline := time.Now().Add(30 * time.Second)
	for _, r := range reps {
		for r.Ready() != nil {
			if time.Now().After(deadline) || ctx.Err() != nil {
				for _, r := range reps {
					r.Close()
				}
				return nil, fmt.Errorf("replicas not ready: %w", r.Ready())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return reps, nil
}

// freeLoopback returns a loopback address with a port free now.
func freeLoopback() string {
	a, err := loopback.Addr()
	if err != nil {
		return ""
	}
	return a
}

// simFleet is a set of simulated workers serving on loopback.
type simFleet struct {
	specs      []routing.WorkerSpec
	publishers []*kvevents.Publisher
	cancel     context.CancelFunc
	wg         sync.WaitGroup
}

// startSimFleet starts n simulated workers on 127.0.0.1 ephemeral ports; with events, each
// also publishes its KV events (and serves replay) on its own ZMQ ports, named in its spec.
func startSimFleet(ctx context.Context, n int, base sim.Config, events bool) (*simFleet, error) {
	ctx, cancel := context.WithCancel(ctx)
	f := &simFleet{cancel: cancel}
	for i := range n {
		c := base
		c.ID = fmt.Sprintf("w%d", i)
		spec := routing.WorkerSpec{ID: c.ID, CapacityBlocks: c.CapacityBlocks}
		if events {
			pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{
				Endpoint: "tcp://127.0.0.1:0", Bind: true, ReplayEndpoint: "tcp://127.0.0.1:0", Logger: c.Logger,
			})
			if err != nil {
				f.Close()
				return nil, err
			}
			f.publishers = append(f.publishers, pub)
			spec.KVEvents = "tcp://" + pub.Addr().String()
			spec.KVReplay = "tcp://" + pub.ReplayAddr().String()
			c.OnEvent = sim.PublishEvents(ctx, pub, max(c.BlockSize, sim.DefaultBlockSize), c.Logger)
		}
		w, err := sim.New(c)
		if err != nil {
			f.Close()
			return nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			f.Close()
			return nil, err
		}
		spec.URL = "http://" + ln.Addr().String()
		f.specs = append(f.specs, spec)
		f.wg.Add(1)
		go func() { defer f.wg.Done(); w.Serve(ctx, ln) }()
	}
	return f, nil
}

// Close stops every worker and publisher and waits for them.
func (f *simFleet) Close() {
	f.cancel()
	f.wg.Wait()
	for _, p := range f.publishers {
		p.Close()
	}
}

// topology is how many router replicas a demo run uses and whether they gossip.
type topology struct {
	Replicas int
	NoGossip bool
}

func (t topology) String() string {
	if t.NoGossip {
		return fmt.Sprintf("%d-nogossip", t.Replicas)
	}
	return fmt.Sprint(t.Replicas)
}

func parseTopology(s string) (topology, error) {
	var t topology
	n, rest, _ := strings.Cut(s, "-")
	v, err := strconv.Atoi(n)
	if err != nil || v < 1 || v > 7 || (rest != "" && rest != "nogossip") {
		return t, fmt.Errorf("--replicas item %q: want N or N-nogossip with N from 1 to 7", s)
	}
	return topology{Replicas: v, NoGossip: rest == "nogossip"}, nil
}

// demoRun replays reqs through a fresh fleet and fresh router replicas using policy.
func demoRun(ctx context.Context, cfg demoConfig, tp topology, policy string, precise bool, reqs []trace.Request, progress io.Writer) (*replay.Summary, error) {
	quiet := cfg.Logger
	sc := cfg.Sim
	sc.CapacityBlocks = cfg.CapacityBlocks
	sc.Speedup = cfg.Speedup
	sc.MaxModelLen = 262144
	sc.Logger = quiet
	fleet, err := startSimFleet(ctx, cfg.Workers, sc, precise)
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
		Router:  routing.Config{Policy: policy},
		// The decision index forgets on the workers' scale: a decision stays for the
		// trace's reuse gap, and a worker remembers no more than its cache holds.
		ApproxTTL: time.Duration(float64(120*time.Second) / cfg.Speedup), ApproxMaxBlocks: cfg.CapacityBlocks,
		SessionTTL: time.Duration(float64(10*time.Minute) / cfg.Speedup), MaxSessions: 1_000_000,
		Health: openai.HealthConfig{Timeout: 2 * time.Second, FailThreshold: 3},
		Logger: quiet,
	}
	reps, err := startDemoReplicas(ctx, tp, base, dataDir, cfg.Speedup)
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, r := range reps {
			r.Close()
		}
	}()
	rc := replay.DefaultConfig()
	for _, r := range reps {
		rc.Targets = append(rc.Targets, "http://"+r.Addr())
	}
	rc.Requests = reqs
	rc.Speedup = cfg.Speedup
	rc.Concurrency = cfg.Concurrency
	rc.MaxOutputTokens = cfg.MaxOutput
	rc.Model = sim.DefaultModel
	rc.Label = policy
	if len(cfg.Modes) > 1 || precise {
		rc.Label = policy + map[bool]string{true: "/precise", false: "/approx"}[precise]
	}
	if len(cfg.Topologies) > 1 || tp.Replicas > 1 {
		rc.Label += " x" + tp.String()
	}
	rc.Progress = progress
	rc.Logger = quiet
	sent := func() (bytes, dropped, gaps uint64, n int) {
		for _, r := range reps {
			if st, ok := r.SharingStats(); ok {
				bytes += st.Gossip.BytesOut
				for _, d := range st.Gossip.Dropped {
					dropped += d
				}
				gaps += st.Hints.DecisionGaps - min(st.Hints.DecisionLate, st.Hints.DecisionGaps)
				n++
			}
		}
		return bytes, dropped, gaps, n
	}
	bytes0, dropped0, gaps0, _ := sent()
	sum, err := replay.Run(ctx, rc)
	if err != nil {
		return nil, err
	}
	if bytes1, dropped1, gaps1, n := sent(); n > 1 && sum.DurationSeconds > 0 {
		sum.GossipBytesPerSecond = float64(bytes1-bytes0) / float64(n) / sum.DurationSeconds
		sum.GossipDropped = dropped1 - dropped0
		// A message counted missing before the run may arrive during it.
		sum.DecisionGaps = gaps1 - min(gaps0, gaps1)
	}
	return sum, nil
}
