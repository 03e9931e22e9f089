package replica

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/enginemetrics"
	"github.com/kvrouter-ha/kvrouter-ha/transport/extproc"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// Config is everything one replica is started with (kvrouter-ha serve's flags fill it).
// Zero values take the defaults the packages below document; Start checks the rest.
type Config struct {
	// ID is the replica's stable name (its Raft server id, sent as X-Kvrouter-Replica).
	ID string
	// Listen and AdminListen are the client (OpenAI) and admin listen addresses.
	Listen, AdminListen string
	// ExtProcListen, when set, serves the gateway endpoint picker (Envoy ext_proc, with the
	// gRPC health services) there; ExtProc tunes it.
	ExtProcListen string
	ExtProc       extproc.Config
	// Workers are the workers from flags; more come from the cluster's registry.
	Workers []routing.WorkerSpec
	Router  routing.Config
	// ApproxTTL is how long a routing decision counts as cached on its worker;
	// ApproxMaxBlocks caps a worker's remembered blocks.
	ApproxTTL       time.Duration
	ApproxMaxBlocks int
	// SessionTTL is a binding's idle TTL; MaxSessions caps bindings.
	SessionTTL  time.Duration
	MaxSessions int
	Proxy       openai.Config
	Health      openai.HealthConfig
	// KVEventsBind, when set, binds one SUB socket (and one per data-parallel rank of the
	// largest worker, on port + rank) that workers' PUB sockets connect to; workers are told
	// apart by TopicPattern. Workers whose spec names kv_events get their own connecting
	// subscriber either way.
	KVEventsBind string
	TopicPattern string
	// OverlayTTL is how long the replica's own decisions count in precise mode, on top of the
	// events (a burst of siblings must not all land before the first BlockStored arrives).
	OverlayTTL time.Duration
	// Tokenizer is "none" (text prompts hash in byte chunks) or "worker" (ask a worker's /tokenize).
	Tokenizer string
	// EngineMetrics scrapes every worker's Prometheus endpoint for the load its engine reports
	// beyond this cluster's own requests (other clients' requests, the engine's queue), which
	// the policies then read (routing.EngineLoad); Interval 0 is off. Its TLS defaults to
	// Proxy.WorkerTLS, its logger and registerer are the replica's.
	EngineMetrics enginemetrics.Config
	// EngineRequestTokens is the prompt size of a request seen only in an engine's metrics
	// when neither the engine's KV usage nor this cluster's requests there say more
	// (routing.DefaultEngineRequestTokens when 0).
	EngineRequestTokens int
	// NoGossip keeps this replica's decisions and load to itself (comparison runs); bindings
	// are shared through Raft regardless.
	NoGossip bool
	// AdminToken guards /admin/* on the admin listener ("" leaves it open: loopback only).
	AdminToken string
	TLS        TLSFiles
	// ShutdownDelay is how long a stopping replica keeps serving with /readyz failing, so a
	// load balancer's health checks take it out before its port closes (0: no wait).
	ShutdownDelay time.Duration
	// ShutdownTimeout bounds how long in-flight requests and streams may take to finish once
	// the client port has closed (0: 30s).
	ShutdownTimeout time.Duration
	Cluster         ClusterConfig
	Logger          *slog.Logger
}

// ClusterConfig is the replica's Raft node and peer port.
type ClusterConfig struct {
	// DataDir holds the Raft log, snapshots and the cluster id (default kvrouter-data/ID).
	DataDir                string
	RaftListen, RaftAdvert string
	PeerListen, PeerAdvert string
	BootstrapExpect        int
	// Join lists other replicas' peer addresses (or a DNS name resolving to them).
	Join []string
	// Consistency is linearizable, bounded or local (cluster.ParseLevel).
	Consistency          string
	StaleBound, BindWait time.Duration
	Heartbeat, Election  time.Duration
	LeaderLease, Commit  time.Duration
	CheckpointInterval   time.Duration
	SnapshotInterval     time.Duration
	SnapshotThreshold    uint64
	SnapshotRetain       int
	// TrailingLogs is how many log entries a snapshot leaves; CompactMinBytes the least free
	// space in raft.db worth rewriting it (cluster.Config has both).
	TrailingLogs    uint64
	CompactMinBytes int64
	// WorkerGrace is how long a worker stays unhealthy before its bindings go (0: never).
	WorkerGrace time.Duration
	TouchFlush  time.Duration
	Gossip      GossipConfig
}

// GossipConfig is the replica's gossip port and what rides on it.
type GossipConfig struct {
	Listen, Advertise string
	// Join lists gossip seeds; empty takes the hosts of ClusterConfig.Join at this replica's
	// gossip port.
	Join []string
	// Key is the raw key (16, 24 or 32 bytes) that encrypts and authenticates gossip (nil: none).
	Key               []byte
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

// DefaultGossipBudget is a replica's outbound gossip budget: decisions dominate it (about
// 8 bytes per new prompt or generated block per peer), and a slice of the bundled trace at ten
// times its rate needs about 260 KB/s, so 1 MiB/s leaves room on any LAN.
const DefaultGossipBudget = 1 << 20

// check refuses a config that cannot start, before anything is opened.
func (c *Config) check() error {
	var errs []error
	if c.ID == "" {
		errs = append(errs, errors.New("a replica id is required"))
	}
	switch c.Tokenizer {
	case "", "none", "worker":
	default:
		errs = append(errs, fmt.Errorf("--tokenizer %q: want none or worker", c.Tokenizer))
	}
	if c.ShutdownDelay < 0 || c.ShutdownTimeout < 0 {
		errs = append(errs, fmt.Errorf("--shutdown-delay %s, --shutdown-timeout %s: must not be negative", c.ShutdownDelay, c.ShutdownTimeout))
	}
	if em := c.EngineMetrics; em.Interval < 0 || em.Timeout < 0 || em.StaleAfter < 0 || em.MaxBodyBytes < 0 || c.EngineRequestTokens < 0 {
		errs = append(errs, errors.New("--engine-metrics-interval, -timeout, -stale-after, -max-bytes and -request-tokens must not be negative"))
	}
	switch n := len(c.Cluster.Gossip.Key); n {
	case 0, 16, 24, 32:
	default:
		errs = append(errs, fmt.Errorf("gossip key: %d bytes, want 16, 24 or 32", n))
	}
	return errors.Join(errs...)
}
