package replica

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster"
	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/cluster/hints"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/version"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// sharing is what a replica shares over gossip: membership, worker health, decisions, load
// and index snapshots.
type sharing struct {
	g         *gossip.Gossip
	health    *hints.HealthView
	decisions *hints.Decisions
	remote    *routing.RemoteLoad
	load      *hints.LoadShare
	sync      *hints.IndexSync
	seeds     []string
	metrics   *hints.Metrics
	cfg       GossipConfig
	// node is the Raft node once it is open: a gossip member's word on worker health, and
	// its index snapshot, count only when it is a voter of the Raft configuration (under
	// mutual TLS, one admitted by its certificate); the gossip key alone proves nothing.
	node atomic.Pointer[cluster.Node]
}

// voter reports whether gossip member id is a voter of the Raft configuration, so that its
// reports may count here (false before the node is open).
func (s *sharing) voter(id string) bool {
	n := s.node.Load()
	return n != nil && n.IsServer(id)
}

// SharingStats are the gossip counters of a replica (the demo's summary).
type SharingStats struct {
	Gossip gossip.Stats
	Hints  hints.Stats
}

// SharingStats reports the replica's gossip counters; false with NoGossip.
func (r *Replica) SharingStats() (SharingStats, bool) {
	if r.share == nil {
		return SharingStats{}, false
	}
	return SharingStats{Gossip: r.share.g.Stats(), Hints: r.share.metrics.Stats()}, true
}

// gossipSeeds are GossipConfig.Join, or ClusterConfig.Join's hosts without a port (gossip
// then uses our own gossip port: every replica listening on the same ports is the usual
// deployment).
func gossipSeeds(c ClusterConfig) []string {
	if len(c.Gossip.Join) > 0 {
		return c.Gossip.Join
	}
	var out []string
	for _, s := range c.Join {
		if host, _, err := net.SplitHostPort(s); err == nil {
			out = append(out, host)
		} else {
			out = append(out, s)
		}
	}
	return out
}

// openSharing binds the gossip port and makes the hints that ride on it; nothing is sent
// until joinSharing and run. Without gossip (NoGossip) it does nothing.
func (r *Replica) openSharing(context.Context) error {
	if r.cfg.NoGossip {
		return nil
	}
	cc := r.cfg.Cluster
	gc := cc.Gossip
	listen := gc.listenAddr()
	clusterID, err := cluster.DataDirClusterID(r.dataDir())
	if err != nil {
		return err
	}
	seeds := gossipSeeds(cc)
	g, err := gossip.New(gossip.Config{
		Name: r.cfg.ID, BindAddr: listen, AdvertiseAddr: gc.Advertise, Seeds: seeds, SecretKey: gc.Key,
		Meta: gossip.Meta{ID: r.cfg.ID, Version: version.String(), PeerAddr: r.peerAdvert(),
			RaftAddr: r.raftAdvert(), ClusterID: clusterID},
		MaxBytesPerSecond: gc.MaxBytesPerSecond, Logger: r.log.With("part", "gossip"), Registerer: r.promReg,
	})
	if err != nil {
		return err
	}
	// No leave message on close: a replica that stops is dead to the others until it comes
	// back (a deliberate departure is `kvrouter-ha ctl cluster remove`, after which
	// reconciliation removes its vote once gossip reports it dead).
	r.onClose("gossip", func() {
		if err := g.Shutdown(); err != nil {
			r.log.Warn("gossip shutdown", "err", err)
		}
	})
	s := &sharing{g: g, seeds: seeds, cfg: gc}
	if s.metrics, err = hints.NewMetrics(r.promReg); err != nil {
		return err
	}
	known := func(w indexer.Worker) bool {
		spec, ok := r.registry.Lookup(w.ID)
		return ok && int(w.DPRank) < max(spec.DPSize, 1)
	}
	s.health = hints.NewHealthView(r.cfg.ID, hints.HealthViewOptions{
		FailThreshold: r.cfg.Health.FailThreshold, RiseThreshold: r.cfg.Health.RiseThreshold,
		Alive: func(id string) bool { return g.IsAlive(id) && s.voter(id) },
	})
	// Decisions, load and index snapshots are taken from (and sent to) the replicas of the
	// Raft configuration only: the gossip key alone makes a member, not a replica.
	voters := hints.FromVoters(g, s.voter)
	s.decisions, err = hints.NewDecisions(hints.DecisionsConfig{
		Messenger: voters, Index: r.approx, TTL: r.approxTTL(), Known: known, FlushInterval: gc.DecisionFlush,
		Metrics: s.metrics, Logger: r.log.With("part", "decisions"),
	})
	if err != nil {
		return err
	}
	interval := gc.LoadInterval
	if interval <= 0 {
		interval = hints.DefaultLoadInterval
	}
	s.remote = routing.NewRemoteLoad(r.tracker, 3*interval)
	s.load, err = hints.NewLoadShare(hints.LoadShareConfig{
		Messenger: voters, Local: r.tracker, Changes: r.tracker.Changes(), Coalesce: gc.LoadCoalesce,
		Remote: s.remote, Interval: interval, Known: known, Metrics: s.metrics, Logger: r.log.With("part", "load"),
	})
	if err != nil {
		return err
	}
	discovery := gc.SnapshotDiscovery
	if len(seeds) == 0 {
		// A replica told of nobody is the first (or only) one: there is no index to pull,
		// and nothing to wait for.
		discovery = time.Nanosecond
	}
	s.sync, err = hints.NewIndexSync(hints.IndexSyncConfig{
		Self: r.cfg.ID, Approx: r.approx, Precise: r.precise, EngineMaps: r.feed,
		Peers: hints.GossipPeers(voters), Fetch: hints.PoolFetcher(r.pool, r.cfg.ID, gc.SnapshotMaxBytes),
		DiscoveryWait: discovery, Metrics: s.metrics, Logger: r.log.With("part", "index-sync"),
	})
	if err != nil {
		return err
	}
	g.OnMemberChange(func(m gossip.Member) {
		if m.State == gossip.Dead || m.State == gossip.Left {
			s.health.ForgetReplica(m.Name)
		}
	})
	s.health.OnChange(func(w string, routable bool, reason string) {
		if r.registry.SetHealthy(w, routable, reason) {
			if routable {
				r.log.Info("worker routable", "worker", w)
			} else {
				r.log.Warn("worker not routable", "worker", w, "reason", reason)
			}
		}
	})
	r.share = s
	return nil
}

// joinSharing waits (bounded by JoinWait) for a first gossip seed. A key that does not match
// the seeds' fails the start: no retry can fix it. Otherwise run keeps trying.
func (r *Replica) joinSharing(ctx context.Context) error {
	s := r.share
	if s == nil || len(s.seeds) == 0 {
		return nil
	}
	jctx, cancel := context.WithTimeout(ctx, max(s.cfg.JoinWait, time.Millisecond))
	_, err := s.g.Join(jctx)
	cancel()
	if errors.Is(err, gossip.ErrKeyMismatch) {
		return fmt.Errorf("cannot join the other replicas: %w (check --gossip-key)", err)
	}
	if err != nil {
		r.log.Warn("no gossip seed answered yet; trying in the background", "seeds", s.seeds, "err", err)
	}
	return nil
}

// run starts the sharing loops on the replica's background context.
func (s *sharing) run(r *Replica, bg context.Context) {
	if len(s.seeds) > 0 && len(s.g.Members()) < 2 {
		// No seed answered within JoinWait: Join keeps trying (with backoff) until one does,
		// so a replica that started before the others finds them when they come up.
		r.goRun(func() {
			if _, err := s.g.Join(bg); errors.Is(err, gossip.ErrKeyMismatch) {
				r.log.Error("gossip: a seed has another key; this replica shares nothing until that is fixed", "err", err)
			}
		})
	}
	r.goRun(func() { s.health.Run(bg, s.g, s.cfg.HealthInterval) })
	r.goRun(func() { _ = s.decisions.Run(bg) })
	r.goRun(func() { _ = s.load.Run(bg) })
	r.goRun(func() {
		if err := s.sync.Run(bg); err != nil && bg.Err() == nil {
			r.log.Error("index sync stopped", "err", err)
		}
	})
}

// ready is nil once the index holds a peer's snapshot (or there was none to pull).
func (s *sharing) ready() error {
	if !s.sync.Warm() {
		return errors.New("index snapshot not loaded from a peer yet")
	}
	return nil
}
