// Package cluster runs a replica's membership in the router cluster: the Raft node that
// replicates session bindings (fsm), bootstrap and join, the leader's duties (idle timers,
// expiry, checkpoints), the consistency levels for reading a binding, and the Raft-backed
// routing.AffinityStore. DESIGN.md beside this file explains the choices.
package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/internal/ratelog"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// Level is how fresh a binding read on the hot path must be (DESIGN.md section 5).
type Level int

// The consistency levels.
const (
	// Bounded serves from the local FSM while the replica holds a read lease: a read-index
	// round through the leader, applied locally, that started less than Config.StaleBound
	// ago (lease.go). Without one reads fail with ErrStale and the replica is unready.
	Bounded Level = iota
	// Linearizable confirms the leader's commit index (read-index) before reading locally.
	Linearizable
	// Local serves whatever the local FSM holds.
	Local
)

// ParseLevel reads a level's flag spelling.
func ParseLevel(s string) (Level, error) {
	switch s {
	case "bounded", "":
		return Bounded, nil
	case "linearizable":
		return Linearizable, nil
	case "local":
		return Local, nil
	}
	return 0, fmt.Errorf("consistency level %q: want linearizable, bounded or local", s)
}

func (l Level) String() string {
	switch l {
	case Linearizable:
		return "linearizable"
	case Local:
		return "local"
	}
	return "bounded"
}

// Errors callers map to answers.
var (
	// ErrStale: the replica holds no valid read lease, so it cannot vouch that its state is
	// within the bound (503, Retry-After).
	ErrStale = fmt.Errorf("replica cannot vouch for its bindings (no read lease from the cluster leader): %w", routing.ErrUnavailable)
	// ErrNoLeader: no leader could be reached in time.
	ErrNoLeader = fmt.Errorf("no cluster leader: %w", routing.ErrUnavailable)
	// ErrClosed: the node is shutting down.
	ErrClosed = errors.New("cluster node closed")
)

// Config is one replica's cluster settings.
type Config struct {
	// ID is the replica's stable name (its Raft server id).
	ID string
	// DataDir holds the Raft log, stable store, snapshots and the cluster id.
	DataDir string
	// RaftListener, when set, is the Raft port, bound by the caller (so its address is known,
	// and can be advertised, before anything dials it); the node takes it over. Without it
	// the node binds RaftBind itself. RaftAdvertise is what peers dial (default: the
	// listener's address).
	RaftListener            net.Listener
	RaftBind, RaftAdvertise string
	// PeerAddr is the advertised address of this replica's peer gRPC port.
	PeerAddr string
	// BootstrapExpect is how many replicas form a new cluster (1: bootstrap alone).
	BootstrapExpect int
	// Join lists seeds' peer addresses (host:port; a host resolving to several addresses counts as each).
	Join []string

	HeartbeatTimeout, ElectionTimeout, LeaderLeaseTimeout, CommitTimeout time.Duration
	// MaxAppendEntries bounds a replication batch (bigger batches, more binds per fsync).
	MaxAppendEntries int
	SnapshotRetain   int
	// SnapshotThreshold is how many log entries trigger a snapshot.
	SnapshotThreshold uint64
	SnapshotInterval  time.Duration
	// TrailingLogs is how many entries a snapshot leaves in the log (for followers that lag a
	// little); with CompactMinBytes it sets raft.db's steady size (DESIGN.md).
	TrailingLogs uint64
	// CompactMinBytes is the least free space in raft.db worth rewriting it (logstore.go);
	// a compaction also needs half the file free.
	CompactMinBytes int64

	// Level and StaleBound govern hot-path reads.
	Level      Level
	StaleBound time.Duration
	// SessionTTL is a binding's idle TTL; MaxBindings caps bindings (0: none).
	SessionTTL  time.Duration
	MaxBindings int
	// BindWait is how long a new session waits for a leader before rendezvous placement.
	BindWait time.Duration
	// BindBeforeDispatch commits every new session's binding before its request reaches a
	// worker (BindFirst always true), not only while contact with the quorum is not fresh.
	BindBeforeDispatch bool
	// CheckpointInterval is how often the leader records remaining TTLs.
	CheckpointInterval time.Duration
	// TouchFlush is how long touches coalesce before they travel to the leader.
	TouchFlush time.Duration
	// OnChange, when set, is told of every change of the state, inside Apply (after the
	// node's own handling): it must not block.
	OnChange func(fsm.Change)

	// RaftTLS, when set, runs the Raft port over mutual TLS (raft_tls.go): the listener
	// requires a client certificate verified against ClientCAs, dials verify the server
	// against RootCAs (ServerName defaults to the dialled host) and present Certificates.
	// One config serves both sides. With it the leader also confirms a gossip member over
	// the peer port before making it a voter, so the gossip key alone admits nobody.
	RaftTLS *tls.Config

	// Transport and InMemory are for tests: raft's in-memory transport and stores.
	Transport raft.Transport
	InMemory  bool

	// Peers reaches other replicas' peer ports: the node forwards leader-only calls through
	// it to the leader its own Raft view names. Remote replaces it in tests (nil both: a
	// lone node).
	Peers  *peer.Pool
	Remote Remote
	// Version is the software version this replica reports in its status.
	Version string
	Logger  *slog.Logger
}

func (c *Config) defaults() {
	setDefault(&c.BootstrapExpect, 1)
	setDefault(&c.HeartbeatTimeout, 500*time.Millisecond)
	setDefault(&c.ElectionTimeout, 500*time.Millisecond)
	setDefault(&c.LeaderLeaseTimeout, 250*time.Millisecond)
	setDefault(&c.CommitTimeout, 5*time.Millisecond)
	setDefault(&c.MaxAppendEntries, 1024)
	setDefault(&c.SnapshotRetain, 3)
	setDefault(&c.SnapshotThreshold, 65536)
	setDefault(&c.SnapshotInterval, 2*time.Minute)
	setDefault(&c.TrailingLogs, 10240)
	setDefault(&c.CompactMinBytes, DefaultCompactMinBytes)
	setDefault(&c.StaleBound, time.Second)
	setDefault(&c.SessionTTL, 10*time.Minute)
	setDefault(&c.BindWait, 3*time.Second)
	setDefault(&c.CheckpointInterval, 30*time.Second)
	setDefault(&c.TouchFlush, 20*time.Millisecond)
	setDefault(&c.Version, "unknown")
	setDefault(&c.Logger, slog.New(slog.DiscardHandler))
}

// setDefault sets *p to v when *p is the zero value.
func setDefault[T comparable](p *T, v T) {
	var zero T
	if *p == zero {
		*p = v
	}
}

// Node is one replica's Raft node and the state machine it drives.
type Node struct {
	cfg  Config
	log  *slog.Logger
	fsm  *fsm.FSM
	raft *raft.Raft
	// raftp is raft once it runs, for the transport's certificate check (identity.go),
	// which a connection can reach before Open has set raft.
	raftp atomic.Pointer[raft.Raft]
	trans raft.Transport
	store *logStore // raft.db, nil in memory
	logs  raft.LogStore
	lead  *leader
	lease *readLease
	// results keeps the last commands' results, for a command whose leader stepped down
	// before it committed (outcome.go).
	results *resultLog
	// contact is when this replica, as leader, last heard from a quorum (contact.go).
	contact *quorumContact

	clusterID atomic.Pointer[string]
	ctx       context.Context
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
	closed    atomic.Bool
	// stopping: the replica is stopping (SetStopping).
	stopping atomic.Bool
	// cutOff is when (lease clock, +1) this node stepped down as leader with no successor
	// known, while it has known no leader since; 0 otherwise (refusal.go).
	cutOff atomic.Int64

	// pendingMembers are the founders' addresses, recorded in the FSM by the first leader.
	memMu          sync.Mutex
	pendingMembers []fsm.Member

	// changes tells waiters (linearizable reads, bind waits) that something was applied.
	changeMu sync.Mutex
	changed  chan struct{}
	// workers receives a value (coalesced) when the FSM's worker registry changed.
	workers chan struct{}

	// leaderChanges counts the leaders this node learned of (raft_metrics.go): each time
	// the leader it knows becomes a known one other than the one before (none included).
	leaderChanges atomic.Uint64

	// discovery reports the discovery duty's looks for Status (nil: none).
	discovery atomic.Pointer[func() []peer.DiscoverySource]
}

// clusterIDFile names the file in the data directory that ties it to one cluster.
const clusterIDFile = "cluster-id"

// Open starts the replica's Raft node: a restarted node resumes from its data directory; a
// new one bootstraps or joins in the background (see Config.BootstrapExpect and Join).
func Open(ctx context.Context, cfg Config) (_ *Node, err error) {
	cfg.defaults()
	n := &Node{cfg: cfg, log: cfg.Logger.With("replica", cfg.ID), changed: make(chan struct{}), workers: make(chan struct{}, 1)}
	// A failed Open leaves no port or file open: the Raft listener it was given included.
	defer func() {
		if err != nil {
			n.unwindOpen()
		}
	}()
	if cfg.ID == "" {
		return nil, errors.New("cluster: a replica id is required")
	}
	n.lead = newLeader(n)
	n.lease = newReadLease()
	n.results = &resultLog{}
	n.contact = &quorumContact{now: n.lease.now, self: raft.ServerID(cfg.ID), raft: &n.raftp, last: make(map[raft.ServerID]time.Duration)}
	n.fsm = fsm.New(fsm.Options{OnChange: n.onChange, OnApplied: func(uint64) { n.notifyApplied() }})
	n.ctx, n.cancel = context.WithCancel(context.Background())
	rc := n.raftConfig()
	logs, stable, snaps, err := n.openStores(rc.Logger)
	if err != nil {
		return nil, err
	}
	n.logs = logs
	if err := restoreSnapshot(snaps, n.fsm); err != nil {
		return nil, err
	}
	if err := n.openTransport(rc.Logger); err != nil {
		return nil, err
	}
	existing, err := raft.HasExistingState(logs, stable, snaps)
	if err != nil {
		return nil, fmt.Errorf("cluster: read raft state: %w", err)
	}
	r, err := raft.NewRaft(rc, recordingFSM{FSM: n.fsm, results: n.results}, logs, stable, snaps, n.trans)
	if err != nil {
		return nil, fmt.Errorf("cluster: start raft (a corrupt snapshot or log refuses to start rather than serve partial state): %w", err)
	}
	n.raft = r
	n.raftp.Store(r)
	if n.cfg.Remote == nil && cfg.Peers != nil {
		n.cfg.Remote = newPeerRemote(cfg.Peers, n.leaderPeerAddr, n.log)
	}
	n.wg.Add(1)
	go n.watchLeadership()
	if cfg.Level != Local {
		n.wg.Add(1)
		go n.keepLease()
	}
	if !existing {
		n.wg.Add(1)
		go n.bootstrapOrJoin()
	}
	n.log.Info("raft node started", "raft", n.cfg.RaftAdvertise, "peer", cfg.PeerAddr, "existing_state", existing,
		"bootstrap_expect", cfg.BootstrapExpect, "join", cfg.Join)
	return n, nil
}

// unwindOpen closes what a failed Open made: the transport (or the listener it was given)
// and the stores.
func (n *Node) unwindOpen() {
	switch {
	case n.trans != nil && n.cfg.Transport == nil:
		n.closeTransport()
	case n.trans == nil && n.cfg.RaftListener != nil:
		_ = n.cfg.RaftListener.Close()
	}
	if n.store != nil {
		_ = n.store.Close()
	}
	if n.cancel != nil {
		n.cancel()
	}
}

// raftConfig is raft's configuration for this node.
func (n *Node) raftConfig() *raft.Config {
	cfg := n.cfg
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(cfg.ID)
	rc.HeartbeatTimeout = cfg.HeartbeatTimeout
	rc.ElectionTimeout = cfg.ElectionTimeout
	rc.LeaderLeaseTimeout = cfg.LeaderLeaseTimeout
	rc.CommitTimeout = cfg.CommitTimeout
	rc.MaxAppendEntries = cfg.MaxAppendEntries
	rc.BatchApplyCh = true
	rc.SnapshotThreshold = cfg.SnapshotThreshold
	rc.SnapshotInterval = cfg.SnapshotInterval
	rc.TrailingLogs = cfg.TrailingLogs
	// A node removed from the configuration keeps running (unready) so an operator can see it.
	rc.ShutdownOnRemove = false
	// restoreSnapshot has loaded (and checked) the newest snapshot already.
	rc.NoSnapshotRestoreOnStart = true
	rc.Logger = newHCLogger(n.log)
	return rc
}

// openStores opens the Raft log and stable store (raft.db: bbolt, fsync on, compacted once
// mostly free, behind a log cache) and the snapshot store in the data directory, or
// in-memory ones for tests.
func (n *Node) openStores(logger hclog.Logger) (raft.LogStore, raft.StableStore, raft.SnapshotStore, error) {
	cfg := n.cfg
	if cfg.InMemory {
		mem := raft.NewInmemStore()
		return mem, mem, raft.NewInmemSnapshotStore(), nil
	}
	if cfg.DataDir == "" {
		return nil, nil, nil, errors.New("cluster: a data directory is required")
	}
	if err := os.MkdirAll(cfg.DataDir, 0o750); err != nil {
		return nil, nil, nil, fmt.Errorf("cluster: data directory: %w", err)
	}
	if id, err := readClusterID(cfg.DataDir); err != nil {
		return nil, nil, nil, err
	} else if id != "" {
		n.clusterID.Store(&id)
	}
	bolt, err := openLogStore(filepath.Join(cfg.DataDir, "raft.db"), cfg.CompactMinBytes, n.log)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("cluster: open raft log in %s (is another replica using it?): %w", cfg.DataDir, err)
	}
	n.store = bolt
	cached, err := raft.NewLogCache(4096, bolt)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("cluster: log cache: %w", err)
	}
	snaps, err := raft.NewFileSnapshotStoreWithLogger(cfg.DataDir, cfg.SnapshotRetain, logger) // in DataDir/snapshots
	if err != nil {
		return nil, nil, nil, fmt.Errorf("cluster: snapshot store: %w", err)
	}
	return cached, bolt, snaps, nil
}

// openTransport makes the Raft transport: the configured one (tests), or TCP (with TLS when
// configured) on the listener the caller bound or on RaftBind.
func (n *Node) openTransport(logger hclog.Logger) error {
	cfg := n.cfg
	if cfg.Transport != nil {
		n.trans = cfg.Transport
	} else {
		var adv net.Addr
		if cfg.RaftAdvertise != "" {
			a, err := net.ResolveTCPAddr("tcp", cfg.RaftAdvertise)
			if err != nil {
				return fmt.Errorf("cluster: raft advertise address %q: %w", cfg.RaftAdvertise, err)
			}
			adv = a
		}
		var tt *raft.NetworkTransport
		var err error
		if cfg.RaftListener != nil {
			tt, err = newTransport(cfg.RaftListener, adv, cfg.RaftTLS, n.verifyRaftPeer, 4, 10*time.Second, logger)
		} else {
			tt, err = listenTransport(cfg.RaftBind, adv, cfg.RaftTLS, n.verifyRaftPeer, 4, 10*time.Second, logger)
		}
		if err != nil {
			return fmt.Errorf("cluster: raft port %s: %w", cfg.RaftBind, err)
		}
		n.trans = tt
	}
	// What peers dial is what the transport tells them, whoever bound the port.
	n.cfg.RaftAdvertise = string(n.trans.LocalAddr())
	if t, ok := n.trans.(fullTransport); ok {
		n.trans = &contactTransport{fullTransport: t, q: n.contact}
	}
	return nil
}

// restoreSnapshot loads the newest snapshot into f before Raft starts (Raft is told not to
// restore it again). A corrupt or truncated one stops the start with a clear message: the file
// store checks its CRC on Open, the FSM its own trailer; Raft would instead fall back to an
// older snapshot, which after log compaction means serving partial state.
func restoreSnapshot(snaps raft.SnapshotStore, f *fsm.FSM) error {
	list, err := snaps.List()
	if err != nil {
		return fmt.Errorf("cluster: list snapshots: %w", err)
	}
	if len(list) == 0 {
		return nil
	}
	const refuse = "is corrupt or truncated; refusing to start rather than serve partial state (move it aside to fall back to an older one)"
	meta, rc, err := snaps.Open(list[0].ID)
	if err != nil {
		return fmt.Errorf("cluster: snapshot %s in snapshots/ %s: %w", list[0].ID, refuse, err)
	}
	if err := f.Restore(rc); err != nil {
		return fmt.Errorf("cluster: snapshot %s (index %d) %s: %w", meta.ID, meta.Index, refuse, err)
	}
	return nil
}

func (n *Node) closeTransport() {
	if c, ok := n.trans.(io.Closer); ok {
		_ = c.Close()
	}
}

// DataDirClusterID is the cluster a data directory belongs to ("" for a new one, or one that
// does not exist yet): a replica tells the others in its gossip metadata before it opens
// its node.
func DataDirClusterID(dir string) (string, error) { return readClusterID(dir) }

func readClusterID(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, clusterIDFile))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("cluster: read cluster id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// setClusterID records which cluster this node belongs to; a different one is refused.
func (n *Node) setClusterID(id string) error {
	if cur := n.ClusterID(); cur != "" {
		if cur != id {
			return fmt.Errorf("this data directory belongs to cluster %s, not %s: refusing to join", cur, id)
		}
		return nil
	}
	if !n.cfg.InMemory {
		tmp := filepath.Join(n.cfg.DataDir, clusterIDFile+".tmp")
		if err := os.WriteFile(tmp, []byte(id+"\n"), 0o640); err != nil {
			return fmt.Errorf("cluster: write cluster id: %w", err)
		}
		if err := os.Rename(tmp, filepath.Join(n.cfg.DataDir, clusterIDFile)); err != nil {
			return fmt.Errorf("cluster: write cluster id: %w", err)
		}
	}
	n.clusterID.Store(&id)
	return nil
}

// ClusterID is the id of the cluster this node belongs to ("" before it bootstrapped or joined).
func (n *Node) ClusterID() string {
	if p := n.clusterID.Load(); p != nil {
		return *p
	}
	return ""
}

// ID is this replica's id.
func (n *Node) ID() string { return n.cfg.ID }

// LogStoreStats reports raft.db's size and compactions (zero for an in-memory node).
func (n *Node) LogStoreStats() LogStoreStats {
	if n.store == nil {
		return LogStoreStats{}
	}
	return n.store.Stats()
}

// FSM is the node's state machine (read-only use).
func (n *Node) FSM() *fsm.FSM { return n.fsm }

// RaftAddr is the Raft address this replica advertises.
func (n *Node) RaftAddr() string { return n.cfg.RaftAdvertise }

// IsLeader reports whether this node leads.
func (n *Node) IsLeader() bool { return n.raft.State() == raft.Leader }

// Leader returns the leader's id and peer address, if a leader is known.
func (n *Node) Leader() (id, peerAddr string, ok bool) {
	_, lid := n.raft.LeaderWithID()
	if lid == "" {
		return "", "", false
	}
	id = string(lid)
	if id == n.cfg.ID {
		return id, n.cfg.PeerAddr, true
	}
	if m, found := n.fsm.Member(id); found {
		return id, m.PeerAddr, true
	}
	return id, "", true
}

// leaderPeerAddr is the leader's peer address as this node's Raft view knows it (the
// forwarder's view of where leader-only calls go).
func (n *Node) leaderPeerAddr() (string, bool) {
	_, addr, ok := n.Leader()
	return addr, ok && addr != ""
}

// Ready reports whether the replica may serve: it must hold a read lease (lease.go), the
// same rule bounded reads follow, or have held one less than BindWait ago and not be cut
// off (refusal.go): during an election every replica is without a lease, and a request sent
// to any of them waits for the new leader, so none should leave the balancer's rotation
// for it. Local consistency only needs the node running.
func (n *Node) Ready() error {
	if n.closed.Load() {
		return ErrClosed
	}
	if n.cfg.Level == Local {
		return nil
	}
	err := n.leaseHolds()
	if err == nil || n.hopeless() != "" || n.cutOffFor() >= 0 {
		return err
	}
	if last := n.lease.last.Load(); last > 0 && n.lease.now()-time.Duration(last) < n.cfg.BindWait {
		return nil
	}
	return err
}

// ReadFence makes a read of the local FSM valid at the configured level: nothing for
// local, the read lease for bounded (a missing one is asked for at once, and the caller
// gets ErrStale to wait on), a read-index round for linearizable. A bounded read must be
// confirmed with ReadValid after it is made: a pause between the fence and the read would
// otherwise let it run on a lease that ended meanwhile.
func (n *Node) ReadFence(ctx context.Context) error {
	switch n.cfg.Level {
	case Local:
		return nil
	case Bounded:
		err := n.leaseHolds()
		if err != nil {
			n.lease.wake()
		}
		return err
	}
	idx, err := n.readIndex(ctx, n.IsLeader())
	if err != nil {
		return err
	}
	return n.waitApplied(ctx, idx)
}

// readIndex returns an index that covers every write acknowledged before the call: the
// leader's own (confirmed by a quorum) when leading, else the leader's, asked over the peer port.
func (n *Node) readIndex(ctx context.Context, leading bool) (uint64, error) {
	if leading {
		return n.lead.readIndex(ctx)
	}
	if n.cfg.Remote == nil {
		return 0, ErrNoLeader
	}
	i, err := n.cfg.Remote.ReadIndex(ctx)
	if err != nil {
		return 0, fmt.Errorf("read index: %w", err)
	}
	return i, nil
}

// ReadValid reports whether a read of the local FSM made after a successful ReadFence is
// still valid: under bounded, the lease must still hold now that the read is done; under
// linearizable the read index already covers every write acknowledged before the fence.
func (n *Node) ReadValid() error {
	if n.cfg.Level != Bounded {
		return nil
	}
	return n.leaseHolds()
}

// waitApplied blocks until the FSM has applied index idx.
func (n *Node) waitApplied(ctx context.Context, idx uint64) error {
	for {
		ch := n.changeCh()
		if n.fsm.AppliedIndex() >= idx {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		case <-n.ctx.Done():
			return ErrClosed
		}
	}
}

func (n *Node) changeCh() chan struct{} {
	n.changeMu.Lock()
	defer n.changeMu.Unlock()
	return n.changed
}

func (n *Node) notifyApplied() {
	n.changeMu.Lock()
	close(n.changed)
	n.changed = make(chan struct{})
	n.changeMu.Unlock()
}

// onChange runs inside the FSM's Apply: it must not block.
func (n *Node) onChange(c fsm.Change) {
	n.lead.observe(c)
	if f := n.cfg.OnChange; f != nil {
		defer f(c)
	}
	if c.Kind == fsm.WorkersChanged || c.Kind == fsm.Reset {
		select {
		case n.workers <- struct{}{}:
		default: // one pending signal stands for any number of changes
		}
	}
}

// Stability is how steady this node's view of the cluster has been: the leaders it learned of
// (the first included) and its read-lease rounds that failed.
type Stability struct {
	LeaderChanges, LeaseFailures uint64
}

// Stability reports the node's Stability counters since it started.
func (n *Node) Stability() Stability {
	return Stability{LeaderChanges: n.leaderChanges.Load(), LeaseFailures: n.lease.failed.Load()}
}

// Workers lists the cluster registry's workers (the FSM's, sorted by id).
func (n *Node) Workers() []fsm.Worker { return n.fsm.Workers() }

// WorkersChanged receives a value after the FSM's worker registry changed (an AddWorker,
// DrainWorker or RemoveWorker applied, or a snapshot restored): read FSM().Workers() again.
// Signals coalesce, so one value may stand for many changes; it is meant for one consumer
// (the replica's worker lifecycle).
func (n *Node) WorkersChanged() <-chan struct{} { return n.workers }

// Apply proposes cmd through the leader: locally when this node leads, else forwarded over
// the peer port. It waits for the result until ctx ends. A leader that steps down before
// the command's entry commits learns what became of the entry before answering (outcome.go):
// the command's own result when the next term committed it, or the command sent again to
// the next leader when the entry was lost; ErrOutcomeUnknown when it cannot tell in time.
func (n *Node) Apply(ctx context.Context, cmd fsm.Command) (*fsm.Result, error) {
	b, err := fsm.Encode(cmd)
	if err != nil {
		return nil, err
	}
	// Traced when the caller's context carries a span (the request's): the tracer is the
	// span's own provider, so the node holds none.
	tracer := trace.SpanFromContext(ctx).TracerProvider().Tracer("github.com/kvrouter-ha/kvrouter-ha/cluster")
	if n.IsLeader() {
		lctx, span := tracer.Start(ctx, "raft apply", trace.WithAttributes(attribute.Bool("kvrouter.leader", true)))
		res, _, err := n.applyLeader(lctx, b)
		endSpan(span, err)
		if err == nil || !errors.Is(err, raft.ErrNotLeader) && !errors.Is(err, raft.ErrLeadershipLost) {
			return res, err
		}
	}
	if n.cfg.Remote == nil {
		return n.waitLocalLeader(ctx, b)
	}
	leader, _, _ := n.Leader()
	fctx, span := tracer.Start(ctx, "forward to the leader", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("kvrouter.leader", leader)))
	out, err := n.forward(fctx, b)
	endSpan(span, err)
	if err != nil {
		return nil, err
	}
	res, err := fsm.DecodeResult(out)
	if err != nil {
		return nil, err
	}
	return res, res.Err
}

// forward sends an encoded command to the leader in attempts of bounded length: a leader
// that stopped answering (SIGSTOP, a partition) must not hold the command until ctx ends
// while the others elect a new one. Retrying cannot make a command take effect twice
// (absent-only and compare-and-set binds, revision-guarded invalidations), but an attempt
// that timed out may have committed, and the retry then answers for a second copy (an
// invalidation's "not found"); a leader that steps down settles its own entries instead
// (applyLeader), so only a leader that stopped answering (a pause) leaves that.
func (n *Node) forward(ctx context.Context, b []byte) ([]byte, error) {
	attempt := max(4*n.cfg.ElectionTimeout, time.Second)
	for {
		actx, cancel := context.WithTimeout(ctx, attempt)
		out, _, err := n.cfg.Remote.Apply(actx, b)
		cancel()
		if err == nil {
			return out, nil
		}
		if ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
			return nil, err
		}
		n.log.Debug("forward to the leader timed out; asking again", "attempt", attempt)
	}
}

// waitLocalLeader is a lone node's path while it elects itself.
func (n *Node) waitLocalLeader(ctx context.Context, b []byte) (*fsm.Result, error) {
	for {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: %w", ErrNoLeader, ctx.Err())
		case <-n.ctx.Done():
			return nil, ErrClosed
		case <-time.After(10 * time.Millisecond):
		}
		if n.IsLeader() {
			res, _, err := n.applyLeader(ctx, b)
			return res, err
		}
	}
}

// awaitFuture waits for f's result, or until ctx ends. Raft runs with BatchApplyCh, so a
// command or barrier queued just as leadership ends or Raft shuts down can stay in the
// queue unanswered for ever: a leader loop that waited on it alone held Close (which waits
// for that loop) for good, the rare ten-minute test hang. The waiting goroutine then
// outlives the call; it is one per such future, and only at the end of a term.
func awaitFuture(ctx context.Context, f raft.Future) error {
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// applyLocal applies an encoded command on the leader. When the leader stepped down before
// the entry committed (ErrLeadershipLost) it also returns the entry's index: the entry may
// still commit in the next term (applyLeader settles it).
func (n *Node) applyLocal(ctx context.Context, b []byte) (*fsm.Result, uint64, error) {
	timeout := 10 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		timeout = max(time.Until(dl), time.Millisecond)
	}
	f := n.raft.Apply(b, timeout)
	if err := awaitFuture(ctx, f); err != nil {
		if ctx.Err() != nil {
			return nil, 0, err
		}
		var idx uint64
		if errors.Is(err, raft.ErrLeadershipLost) {
			idx = f.Index()
		}
		return nil, idx, fmt.Errorf("raft apply: %w", err)
	}
	res, ok := f.Response().(*fsm.Result)
	if !ok || res == nil {
		return nil, 0, fmt.Errorf("raft apply: unexpected response %T", f.Response())
	}
	if res.Err != nil {
		return res, f.Index(), res.Err
	}
	return res, f.Index(), nil
}

// HandOverLeadership transfers leadership to a follower when this node leads and the
// configuration has another voter, and reports whether it did. A lone voter, or a node that
// does not lead, has nothing to hand over (false, nil).
func (n *Node) HandOverLeadership() (bool, error) {
	if !n.IsLeader() {
		return false, nil
	}
	f := n.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return false, fmt.Errorf("cluster: reading the configuration: %w", err)
	}
	other := false
	for _, s := range f.Configuration().Servers {
		other = other || s.Suffrage == raft.Voter && string(s.ID) != n.cfg.ID
	}
	if !other {
		return false, nil
	}
	// Raft gives the chosen follower one election timeout to win; on a loaded machine it can
	// miss that, so a transfer that timed out is tried again (the follower most up to date
	// then may be another) while this node still leads.
	var err error
	for attempt := 0; attempt < handOverAttempts && n.IsLeader(); attempt++ {
		if err = n.raft.LeadershipTransfer().Error(); err == nil {
			return true, nil
		}
		n.log.Debug("leadership transfer attempt failed", "attempt", attempt+1, "err", err)
	}
	if !n.IsLeader() {
		// The last attempt timed out, yet another replica won meanwhile.
		return true, nil
	}
	return false, fmt.Errorf("cluster: leadership transfer (%d attempts): %w", handOverAttempts, err)
}

// handOverAttempts bounds HandOverLeadership's tries.
const handOverAttempts = 3

// Close stops the node: Raft shuts down and the log and stable store close. It does not
// hand leadership over first (a replica leaving gracefully calls HandOverLeadership before,
// at the point of its shutdown where that belongs), so it is also what a crash looks like
// to the others.
func (n *Node) Close() error {
	var err error
	n.closeOnce.Do(func() {
		n.closed.Store(true)
		n.cancel()
		err = n.raft.Shutdown().Error()
		n.wg.Wait()
		n.closeTransport()
		if n.store != nil {
			if cerr := n.store.Close(); cerr != nil && err == nil {
				err = cerr
			}
		}
	})
	return err
}

// watchLeadership runs the leader's loop (and with it every leader duty) while this node
// leads, following raft's state and leader observations.
func (n *Node) watchLeadership() {
	defer n.wg.Done()
	obs := make(chan raft.Observation, 16)
	o := raft.NewObserver(obs, false, func(o *raft.Observation) bool {
		switch o.Data.(type) {
		case raft.LeaderObservation, raft.RaftState:
			return true
		}
		return false
	})
	n.raft.RegisterObserver(o)
	defer n.raft.DeregisterObserver(o)
	// A leader known before the observer was registered counts from here; the observer
	// reporting it too is the same leader, not a change.
	var lastLeader raft.ServerID
	_, known := n.raft.LeaderWithID()
	n.noteLeader(&lastLeader, known)
	// term is the running leader loop, if this node leads.
	type term struct {
		stop context.CancelFunc
		done chan struct{}
	}
	var cur *term
	revoke := func() {
		if cur != nil {
			cur.stop()
			<-cur.done
			cur = nil
		}
	}
	defer revoke()
	for {
		select {
		case <-n.ctx.Done():
			return
		case ob := <-obs:
			// A new leader, none, or a change of role ends the read lease; a new one is
			// asked for at once. (leaseHolds also checks term and role itself: observations
			// are delivered late, or dropped when this loop falls behind.)
			if lo, ok := ob.Data.(raft.LeaderObservation); ok {
				n.noteLeader(&lastLeader, lo.LeaderID)
			}
			n.lease.reset()
			n.lease.wake()
			// A new leader (or none) may unblock readers waiting for freshness.
			n.notifyApplied()
		case <-time.After(time.Second):
			// Raft drops an observation when this loop is behind; a change of role is
			// picked up here at the latest.
		}
		leading := n.raft.State() == raft.Leader
		switch {
		case leading && cur == nil:
			ctx, stop := context.WithCancel(n.ctx)
			t := &term{stop: stop, done: make(chan struct{})}
			go func() { defer close(t.done); n.lead.run(ctx) }()
			cur = t
		case !leading && cur != nil:
			revoke()
			// A leader that steps down with no successor in sight lost its quorum (a
			// partition, a pause): it refuses at once until it hears of a leader.
			if _, lid := n.raft.LeaderWithID(); lid == "" {
				n.cutOff.Store(int64(n.lease.now()) + 1)
				n.log.Warn("stepped down with no other leader known: refusing requests until a leader is heard of")
				n.notifyApplied()
			}
		}
	}
}

// noteLeader records that the leader is now id ("" while there is none) and counts a change
// when a leader becomes known that is not the one *last was: so a failover counts once
// (old, none, new) and so does a leader that wins again after an election (old, none, old),
// as etcd's leader_changes_seen counts.
func (n *Node) noteLeader(last *raft.ServerID, id raft.ServerID) {
	if id != "" && id != *last {
		n.leaderChanges.Add(1)
	}
	if id != "" {
		n.cutOff.Store(0)
	}
	*last = id
}

// hclogWriter turns raft's hclog lines into slog records. Lines about connections refused
// on the Raft port (garbage, a failed TLS handshake) are logged at most once per
// refusedEvery, with the count left out: a stranger cannot flood the log.
type hclogWriter struct {
	log     *slog.Logger
	refused *ratelog.Limiter
}

// refusedEvery is how often a refused connection on the Raft port is logged.
const refusedEvery = 10 * time.Second

// refusedLines are raft's words for an inbound connection it could not read.
var refusedLines = [...]string{"failed to decode incoming command"}

func (w hclogWriter) Write(p []byte) (int, error) {
	line := strings.TrimSpace(string(p))
	level := slog.LevelDebug
	switch {
	case strings.Contains(line, "[ERROR]"):
		level = slog.LevelError
	case strings.Contains(line, "[WARN]"):
		level = slog.LevelWarn
	case strings.Contains(line, "[INFO]"):
		level = slog.LevelInfo
	}
	if strings.Contains(line, "transport shutdown") {
		// Our own Close shut the transport: connections still open say so as "errors",
		// which told operators something was wrong on every clean stop.
		level = slog.LevelDebug
	}
	if level > slog.LevelDebug && w.refused != nil {
		for _, k := range refusedLines {
			if strings.Contains(line, k) {
				w.refused.Log(w.log, k, slog.LevelWarn, "raft port: refused a connection that did not speak Raft (or failed its TLS handshake)", "line", line)
				return len(p), nil
			}
		}
	}
	w.log.Log(context.Background(), level, "raft", "line", line)
	return len(p), nil
}

func newHCLogger(log *slog.Logger) hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{Name: "raft", Level: hclog.Info, DisableTime: true,
		Output: hclogWriter{log: log, refused: ratelog.New(refusedEvery, len(refusedLines))}})
}

// endSpan ends span, marking it failed with err when there is one.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
