package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter-ha/kvrouter-ha/cluster"
	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// clusterConfig is a replica's cluster settings (flags).
type clusterConfig struct {
	DataDir                string
	RaftListen, RaftAdvert string
	PeerListen, PeerAdvert string
	BootstrapExpect        int
	Join                   string
	Consistency            string
	StaleBound, BindWait   time.Duration
	Heartbeat, Election    time.Duration
	LeaderLease, Commit    time.Duration
	CheckpointInterval     time.Duration
	SnapshotInterval       time.Duration
	SnapshotThreshold      uint64
	SnapshotRetain         int
	WorkerGrace            time.Duration
	TouchFlush             time.Duration
	Gossip                 gossipConfig
}

// registerClusterFlags declares the cluster flags on fs.
func registerClusterFlags(fs *flag.FlagSet, c *clusterConfig) {
	fs.StringVar(&c.DataDir, "data-dir", "kvrouter-data", "directory for the Raft log, snapshots and the cluster id (one per replica)")
	fs.StringVar(&c.RaftListen, "raft-listen", "127.0.0.1:7000", "Raft TCP listen address")
	fs.StringVar(&c.RaftAdvert, "raft-advertise", "", "Raft address other replicas dial (default: --raft-listen)")
	fs.StringVar(&c.PeerListen, "peer-listen", "127.0.0.1:7001", "peer gRPC listen address (forwarding, read-index, join)")
	fs.StringVar(&c.PeerAdvert, "peer-advertise", "", "peer address other replicas dial (default: --peer-listen)")
	fs.IntVar(&c.BootstrapExpect, "bootstrap-expect", 1, "replicas that form a new cluster together (1: a lone replica bootstraps itself)")
	fs.StringVar(&c.Join, "join", "", "comma-separated peer addresses of other replicas, or a DNS name resolving to them (host:port)")
	fs.StringVar(&c.Consistency, "consistency", "bounded", "binding reads: linearizable, bounded or local")
	fs.DurationVar(&c.StaleBound, "stale-bound", time.Second, "bounded reads: a read reflects every binding change acknowledged longer ago than this; a replica that cannot renew its read lease through the leader within it answers 503 and turns unready")
	fs.DurationVar(&c.BindWait, "bind-wait", 3*time.Second, "how long a request waits for a leader (new session) or for contact (bounded read) before 503")
	fs.DurationVar(&c.Heartbeat, "raft-heartbeat-timeout", 500*time.Millisecond, "Raft heartbeat timeout")
	fs.DurationVar(&c.Election, "raft-election-timeout", 500*time.Millisecond, "Raft election timeout")
	fs.DurationVar(&c.LeaderLease, "raft-leader-lease-timeout", 250*time.Millisecond, "Raft leader lease timeout")
	fs.DurationVar(&c.Commit, "raft-commit-timeout", 5*time.Millisecond, "Raft commit timeout")
	fs.DurationVar(&c.CheckpointInterval, "checkpoint-interval", 30*time.Second, "how often the leader records remaining session TTLs")
	fs.DurationVar(&c.SnapshotInterval, "snapshot-interval", 2*time.Minute, "how often Raft checks whether to snapshot")
	fs.Uint64Var(&c.SnapshotThreshold, "snapshot-threshold", 65536, "log entries since the last snapshot that trigger one")
	fs.IntVar(&c.SnapshotRetain, "snapshot-retain", 3, "snapshots kept on disk")
	fs.DurationVar(&c.WorkerGrace, "worker-grace", 10*time.Second, "a worker unhealthy this long loses its session bindings")
	fs.DurationVar(&c.TouchFlush, "touch-flush", 20*time.Millisecond, "how long session touches coalesce before they go to the leader")
}

// clusterParts is a replica's running cluster membership.
type clusterParts struct {
	node *cluster.Node
	// peerAdvert and raftAdvert are the addresses other replicas dial.
	peerAdvert, raftAdvert string
	// snapshots serves this replica's index to peers once sharing has started.
	snapshots *lazySnapshots
	affinity  *cluster.Affinity
	peerSrv   *peer.Server
	peerLn    net.Listener
	pool      *peer.Pool
}

// startCluster opens the Raft node, registers its metrics on reg, serves the peer port and
// returns the Raft-backed affinity store.
func startCluster(ctx context.Context, cfg serveConfig, reg prometheus.Registerer, log *slog.Logger) (*clusterParts, error) {
	cc := cfg.Cluster
	level, err := cluster.ParseLevel(cc.Consistency)
	if err != nil {
		return nil, err
	}
	tc := cfg.TLS // loaded by startReplica
	peerLn, err := net.Listen("tcp", cc.PeerListen)
	if err != nil {
		return nil, fmt.Errorf("peer listener: %w", err)
	}
	peerAdvert := cc.PeerAdvert
	if peerAdvert == "" {
		peerAdvert = peerLn.Addr().String()
	}
	raftAdvert := cc.RaftAdvert
	raftBind := cc.RaftListen
	if raftAdvert == "" {
		// A port of 0 is for tests: pick one now so the advertised address is real.
		if strings.HasSuffix(raftBind, ":0") {
			l, err := net.Listen("tcp", raftBind)
			if err != nil {
				peerLn.Close()
				return nil, fmt.Errorf("raft listener: %w", err)
			}
			raftBind = l.Addr().String()
			l.Close()
		}
		raftAdvert = raftBind
	}
	var seeds []string
	for _, s := range strings.Split(cc.Join, ",") {
		if s = strings.TrimSpace(s); s != "" {
			seeds = append(seeds, s)
		}
	}
	pool := peer.NewPool(peer.ClientOptions{TLS: tc.peerConfig()})
	p := &clusterParts{pool: pool, peerLn: peerLn, peerAdvert: peerAdvert, raftAdvert: raftAdvert, snapshots: &lazySnapshots{}}
	remote := cluster.NewPeerRemote(pool, func() (string, bool) {
		if p.node == nil {
			return "", false
		}
		_, addr, ok := p.node.Leader()
		return addr, ok && addr != ""
	}, log)
	dataDir := cc.DataDir
	if dataDir == "" {
		dataDir = filepath.Join("kvrouter-data", cfg.ReplicaID)
	}
	n, err := cluster.Open(ctx, cluster.Config{
		ID: cfg.ReplicaID, DataDir: dataDir,
		RaftBind: raftBind, RaftAdvertise: raftAdvert, PeerAddr: peerAdvert,
		BootstrapExpect: cc.BootstrapExpect, Join: seeds,
		HeartbeatTimeout: cc.Heartbeat, ElectionTimeout: cc.Election,
		LeaderLeaseTimeout: cc.LeaderLease, CommitTimeout: cc.Commit,
		SnapshotRetain: cc.SnapshotRetain, SnapshotThreshold: cc.SnapshotThreshold, SnapshotInterval: cc.SnapshotInterval,
		Level: level, StaleBound: cc.StaleBound, BindWait: cc.BindWait,
		SessionTTL: cfg.SessionTTL, MaxBindings: cfg.MaxSessions,
		CheckpointInterval: cc.CheckpointInterval, TouchFlush: cc.TouchFlush,
		Remote: remote, Logger: log, RaftTLS: tc.peerConfig(),
	})
	if err != nil {
		peerLn.Close()
		pool.Close()
		return nil, err
	}
	// Raft's state is read from the node at scrape time: operators watch leader, term and
	// indexes on /metrics rather than polling `ctl cluster status`.
	if err := reg.Register(cluster.NewRaftCollector(n)); err != nil {
		_ = n.Close()
		peerLn.Close()
		pool.Close()
		return nil, fmt.Errorf("raft metrics: %w", err)
	}
	p.node = n
	p.peerSrv = peer.NewServer(n.PeerHandler(), peer.ServerOptions{Logger: log, Snapshots: p.snapshots, TLS: tc.peerConfig()})
	go func() {
		if err := p.peerSrv.Serve(peerLn); err != nil && !errors.Is(err, net.ErrClosed) {
			log.Error("peer listener stopped", "err", err)
		}
	}()
	p.affinity = cluster.NewAffinity(n)
	return p, nil
}

// Close leaves: leadership transferred if this replica leads, then Raft and the peer port stop.
func (p *clusterParts) Close() error {
	err := p.node.Close()
	p.peerSrv.Stop()
	p.pool.Close()
	return err
}

// syncWorkers mirrors the FSM's worker registry (workers added, drained or removed through
// the admin API of any replica) into this replica's routing registry; workers from flags
// stay unless the cluster drains or removes them.
func (r *replica) syncWorkers(ctx context.Context) {
	seen := map[string]fsm.Worker{}
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		cur := map[string]fsm.Worker{}
		for _, w := range r.cluster.node.FSM().Workers() {
			cur[w.ID] = w
		}
		for id, w := range cur {
			old, had := seen[id]
			if had && old.Draining == w.Draining && string(old.Spec) == string(w.Spec) {
				continue
			}
			var spec routing.WorkerSpec
			if err := json.Unmarshal(w.Spec, &spec); err != nil {
				r.log.Warn("worker spec from the cluster does not decode", "worker", id, "err", err)
				continue
			}
			spec.ID = id
			if cur, ok := r.registry.Lookup(id); !ok {
				if err := r.registry.Add(spec); err != nil {
					r.log.Warn("adding worker from the cluster", "worker", id, "err", err)
					continue
				}
			} else if cur.URL != spec.URL {
				// Another endpoint is another cache: the worker's sessions start afresh.
				_ = r.registry.Remove(id)
				r.invalidateWorker(ctx, id)
				if err := r.registry.Add(spec); err != nil {
					r.log.Warn("replacing worker from the cluster", "worker", id, "err", err)
					continue
				}
			}
			if w.Draining {
				_ = r.registry.Drain(id)
			} else {
				_ = r.registry.Undrain(id)
			}
		}
		for id := range seen {
			if _, ok := cur[id]; !ok {
				_ = r.registry.Remove(id)
			}
		}
		seen = cur
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// watchWorkerHealth (leader only) invalidates the bindings of a worker unhealthy for longer
// than the grace period, once per unhealthy spell.
func (r *replica) watchWorkerHealth(ctx context.Context) {
	grace := r.cfg.Cluster.WorkerGrace
	if grace <= 0 {
		return
	}
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
		for _, st := range r.registry.List() {
			id := st.Spec.ID
			if st.Healthy {
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
			if n, ok := r.invalidateWorker(ctx, id); ok {
				done[id] = true
				r.log.Info("unhealthy worker's bindings invalidated", "worker", id, "bindings", n, "unhealthy_for", now.Sub(since[id]).Round(time.Millisecond))
			}
		}
	}
}

// invalidateWorker (leader only: one proposal, not one per replica) drops every binding of
// worker id and reports how many, and whether it could.
func (r *replica) invalidateWorker(ctx context.Context, id string) (int, bool) {
	if !r.cluster.node.IsLeader() {
		return 0, false
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	res, err := r.cluster.node.Apply(cctx, &fsm.InvalidateWorker{Worker: id})
	if err != nil {
		r.log.Warn("invalidating a worker's bindings", "worker", id, "err", err)
		return 0, false
	}
	return res.Count, true
}
