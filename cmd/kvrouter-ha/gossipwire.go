package main

import (
	"context"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter-ha/kvrouter-ha/cluster"
	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/cluster/hints"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// gossipConfig is a replica's gossip settings (flags).
type gossipConfig struct {
	Listen, Advertise string
	// Join lists gossip seeds; empty takes the hosts of --join at this replica's gossip port.
	Join              string
	Key, KeyFile      string
	MaxBytesPerSecond int
	MinQuorum         int
	CleanupInterval   time.Duration
	LoadInterval      time.Duration
	DecisionFlush     time.Duration
	HealthInterval    time.Duration
	SnapshotDiscovery time.Duration
	SnapshotMaxBytes  int64
	JoinWait          time.Duration
}

// defaultGossipBudget is a replica's outbound gossip budget: decisions dominate it (about
// 8 bytes per new prompt block per peer), and the bundled trace at ten times its rate needs
// about 230 KB/s, so 1 MiB/s leaves room on any LAN.
const defaultGossipBudget = 1 << 20

// registerGossipFlags declares the gossip flags on fs.
func registerGossipFlags(fs *flag.FlagSet, c *gossipConfig, noGossip *bool) {
	fs.BoolVar(noGossip, "no-gossip", false, "share nothing with other replicas but the Raft bindings: no membership, merged health, decisions, load or index snapshots (for comparison runs)")
	fs.StringVar(&c.Listen, "gossip-listen", "127.0.0.1:7002", "gossip TCP+UDP listen address")
	fs.StringVar(&c.Advertise, "gossip-advertise", "", "gossip address other replicas dial (default: --gossip-listen)")
	fs.StringVar(&c.Join, "gossip-join", "", "comma-separated gossip addresses of other replicas, or a DNS name (default: the hosts of --join at this replica's gossip port)")
	fs.StringVar(&c.Key, "gossip-key", "", "base64 key (16, 24 or 32 bytes) that encrypts and authenticates gossip; every replica needs the same (prefer --gossip-key-file or KVROUTER_GOSSIP_KEY)")
	fs.StringVar(&c.KeyFile, "gossip-key-file", "", "file holding the base64 gossip key")
	fs.IntVar(&c.MaxBytesPerSecond, "gossip-max-bytes-per-second", defaultGossipBudget, "outbound gossip budget of this replica; past it hints are dropped and counted (decisions dominate: about 8 bytes per new prompt block per peer)")
	fs.IntVar(&c.MinQuorum, "min-quorum", 3, "reconciliation never removes a dead replica's vote below this many voters")
	fs.DurationVar(&c.CleanupInterval, "cleanup-interval", 5*time.Minute, "a replica dead this long (and unreachable by Raft) loses its vote")
	fs.DurationVar(&c.LoadInterval, "load-share-interval", hints.DefaultLoadInterval, "how often this replica publishes its per-worker in-flight load")
	fs.DurationVar(&c.DecisionFlush, "decision-flush-interval", hints.DefaultDecisionFlush, "how often this replica's routing decisions go to the others, batched")
	fs.DurationVar(&c.HealthInterval, "health-gossip-interval", 200*time.Millisecond, "how often worker health changes are gossiped")
	fs.DurationVar(&c.SnapshotDiscovery, "index-snapshot-discovery", hints.DefaultSnapshotDiscovery, "how long a starting replica waits for a peer to pull the index from before it starts empty")
	fs.Int64Var(&c.SnapshotMaxBytes, "index-snapshot-max-bytes", peer.DefaultMaxSnapshotBytes, "largest index snapshot accepted from a peer")
	fs.DurationVar(&c.JoinWait, "gossip-join-wait", 5*time.Second, "how long start waits for a gossip seed before it goes on and keeps trying in the background")
}

// sharing is what a replica shares over gossip: membership, worker health, decisions, load
// and index snapshots.
type sharing struct {
	g         *gossip.Gossip
	health    *hints.HealthView
	decisions *hints.Decisions
	remote    *routing.RemoteLoad
	load      *hints.LoadShare
	sync      *hints.IndexSync
	seeds     bool           // whether there were seeds to join
	metrics   *hints.Metrics // the sharing counters, for the demo's summary
	cfg       gossipConfig
}

// lazySnapshots serves index snapshots once the sync exists; the peer port starts before.
type lazySnapshots struct {
	s atomic.Pointer[hints.IndexSync]
}

func (l *lazySnapshots) WriteIndexSnapshot(ctx context.Context, w io.Writer) error {
	s := l.s.Load()
	if s == nil {
		return peer.ErrNotWarm
	}
	return s.WriteIndexSnapshot(ctx, w)
}

// gossipKey decodes the configured key: the flag, else the file, else $KVROUTER_GOSSIP_KEY.
func gossipKey(c gossipConfig) ([]byte, error) {
	raw := c.Key
	if raw == "" && c.KeyFile != "" {
		b, err := os.ReadFile(c.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("gossip key file: %w", err)
		}
		raw = string(b)
	}
	if raw == "" {
		raw = os.Getenv("KVROUTER_GOSSIP_KEY")
	}
	raw = strings.TrimSpace(raw)
	if raw == "" {
		return nil, nil
	}
	key, err := base64.StdEncoding.DecodeString(raw)
	if err != nil {
		return nil, fmt.Errorf("gossip key: not base64: %w", err)
	}
	switch len(key) {
	case 16, 24, 32:
		return key, nil
	}
	return nil, fmt.Errorf("gossip key: %d bytes, want 16, 24 or 32", len(key))
}

// gossipSeeds are --gossip-join's entries, or --join's hosts without a port (the gossip
// layer then uses our own gossip port: every replica listening on the same ports is the
// usual deployment).
func gossipSeeds(c clusterConfig) []string {
	split := func(s string) []string {
		var out []string
		for _, x := range strings.Split(s, ",") {
			if x = strings.TrimSpace(x); x != "" {
				out = append(out, x)
			}
		}
		return out
	}
	if c.Gossip.Join != "" {
		return split(c.Gossip.Join)
	}
	var out []string
	for _, s := range split(c.Join) {
		if host, _, err := net.SplitHostPort(s); err == nil {
			out = append(out, host)
		} else {
			out = append(out, s)
		}
	}
	return out
}

// softwareVersion is the main module's version as the build recorded it.
func softwareVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "unknown"
}

// startSharing starts gossip and the parts that ride on it, and waits (bounded by JoinWait)
// for a first seed. A key that does not match the seeds' fails the start: no retry can
// fix it. The parts run once run is called.
func (r *replica) startSharing(ctx context.Context, promReg prometheus.Registerer, approxTTL time.Duration, log *slog.Logger) (*sharing, error) {
	cc := r.cfg.Cluster
	gc := cc.Gossip
	key, err := gossipKey(gc)
	if err != nil {
		return nil, err
	}
	listen := gc.Listen
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	node := r.cluster.node
	seeds := gossipSeeds(cc)
	g, err := gossip.New(gossip.Config{
		Name: r.cfg.ReplicaID, BindAddr: listen, AdvertiseAddr: gc.Advertise, Seeds: seeds, SecretKey: key,
		Meta: gossip.Meta{ID: r.cfg.ReplicaID, Version: softwareVersion(), PeerAddr: r.cluster.peerAdvert,
			RaftAddr: r.cluster.raftAdvert, ClusterID: node.ClusterID()},
		MaxBytesPerSecond: gc.MaxBytesPerSecond, Logger: log.With("part", "gossip"), Registerer: promReg,
	})
	if err != nil {
		return nil, err
	}
	s := &sharing{g: g, seeds: len(seeds) > 0, cfg: gc}
	fail := func(err error) (*sharing, error) {
		g.Shutdown()
		return nil, err
	}
	if s.seeds {
		jctx, cancel := context.WithTimeout(ctx, max(gc.JoinWait, time.Millisecond))
		_, err := g.Join(jctx)
		cancel()
		if errors.Is(err, gossip.ErrKeyMismatch) {
			return fail(fmt.Errorf("cannot join the other replicas: %w (check --gossip-key)", err))
		}
		if err != nil {
			log.Warn("no gossip seed answered yet; trying in the background", "seeds", seeds, "err", err)
		}
	}
	metrics, err := hints.NewMetrics(promReg)
	if err != nil {
		return fail(err)
	}
	s.metrics = metrics
	known := func(w indexer.Worker) bool {
		spec, ok := r.registry.Lookup(w.ID)
		return ok && int(w.DPRank) < max(spec.DPSize, 1)
	}
	s.health = hints.NewHealthView(r.cfg.ReplicaID, hints.HealthViewOptions{
		FailThreshold: r.cfg.Health.FailThreshold, RiseThreshold: r.cfg.Health.RiseThreshold, Alive: g.IsAlive,
	})
	s.decisions, err = hints.NewDecisions(hints.DecisionsConfig{
		Messenger: g, Index: r.approx, TTL: approxTTL, Known: known, FlushInterval: gc.DecisionFlush,
		Metrics: metrics, Logger: log.With("part", "decisions"),
	})
	if err != nil {
		return fail(err)
	}
	interval := gc.LoadInterval
	if interval <= 0 {
		interval = hints.DefaultLoadInterval
	}
	s.remote = routing.NewRemoteLoad(r.tracker, 3*interval)
	s.load, err = hints.NewLoadShare(hints.LoadShareConfig{
		Messenger: g, Local: r.tracker, Remote: s.remote, Interval: interval, Known: known, Metrics: metrics, Logger: log.With("part", "load"),
	})
	if err != nil {
		return fail(err)
	}
	discovery := gc.SnapshotDiscovery
	if !s.seeds {
		// A replica told of nobody is the first (or only) one: there is no index to pull,
		// and nothing to wait for.
		discovery = time.Nanosecond
	}
	var engine hints.EngineMaps
	if len(r.subs) > 0 {
		engine = subscriberMaps(r.subs)
	}
	s.sync, err = hints.NewIndexSync(hints.IndexSyncConfig{
		Self: r.cfg.ReplicaID, Approx: r.approx, Precise: r.precise, EngineMaps: engine,
		Peers: hints.GossipPeers(g), Fetch: hints.PoolFetcher(r.cluster.pool, r.cfg.ReplicaID, gc.SnapshotMaxBytes),
		DiscoveryWait: discovery, Metrics: metrics, Logger: log.With("part", "index-sync"),
	})
	if err != nil {
		return fail(err)
	}
	r.cluster.snapshots.s.Store(s.sync)
	g.OnMemberChange(func(m gossip.Member) {
		if m.State == gossip.Dead || m.State == gossip.Left {
			s.health.ForgetReplica(m.Name)
		}
	})
	s.health.OnChange(func(w string, routable bool, reason string) {
		if r.registry.SetHealthy(w, routable, reason) {
			if routable {
				log.Info("worker routable", "worker", w)
			} else {
				log.Warn("worker not routable", "worker", w, "reason", reason)
			}
		}
	})
	return s, nil
}

// run starts the sharing loops on the replica's background context.
func (s *sharing) run(r *replica, bg context.Context, log *slog.Logger) {
	if s.seeds && len(s.g.Members()) < 2 {
		// No seed answered within JoinWait: Join keeps trying (with backoff) until one does,
		// so a replica that started before the others finds them when they come up.
		r.goRun(func() {
			if _, err := s.g.Join(bg); errors.Is(err, gossip.ErrKeyMismatch) {
				log.Error("gossip: a seed has another key; this replica shares nothing until that is fixed", "err", err)
			}
		})
	}
	r.goRun(func() { s.health.Run(bg, s.g, s.cfg.HealthInterval) })
	r.goRun(func() { _ = s.decisions.Run(bg) })
	r.goRun(func() { _ = s.load.Run(bg) })
	r.goRun(func() {
		if err := s.sync.Run(bg); err != nil && bg.Err() == nil {
			log.Error("index sync stopped", "err", err)
		}
	})
	r.goRun(func() {
		r.cluster.node.ReconcileMembers(bg, s.g, cluster.ReconcileConfig{MinQuorum: s.cfg.MinQuorum, CleanupInterval: s.cfg.CleanupInterval})
	})
}

// ready is nil once the index holds a peer's snapshot (or there was none to pull).
func (s *sharing) ready() error {
	if !s.sync.Warm() {
		return errors.New("index snapshot not loaded from a peer yet")
	}
	return nil
}

// close stops gossip without a leave message: a replica that stops is dead to the others
// until it comes back (a deliberate departure is `kvrouter-ha ctl cluster remove`, after
// which reconciliation removes its vote once gossip reports it dead).
func (s *sharing) close() error { return s.g.Shutdown() }

// subscriberMaps are precise mode's engine-hash maps across all of a replica's KV event
// subscribers (each serves its own workers).
type subscriberMaps []*kvevents.Subscriber

func (m subscriberMaps) SnapshotEngineMaps(ctx context.Context) (map[indexer.Worker]map[uint64]uint64, error) {
	out := map[indexer.Worker]map[uint64]uint64{}
	for _, sub := range m {
		part, err := sub.SnapshotEngineMaps(ctx)
		if err != nil {
			return nil, err
		}
		maps.Copy(out, part)
	}
	return out, nil
}

func (m subscriberMaps) RestoreEngineMaps(in map[indexer.Worker]map[uint64]uint64) error {
	for _, sub := range m {
		if err := sub.RestoreEngineMaps(in); err != nil {
			return err
		}
	}
	return nil
}
