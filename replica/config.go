package replica

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/discovery"
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
	// ExtProcTLS serves the picker's port over TLS, verifying gateways' certificates against
	// a CA when one is given.
	ExtProcTLS ExtProcTLSFiles
	// ClientPort bounds the client port's connections: a quiet keep-alive connection, a
	// request's headers, a request's body.
	ClientPort ClientPortConfig
	// Workers are the workers from flags; more come from the cluster's registry.
	Workers []routing.WorkerSpec
	// WorkersFromFile are the ids of the Workers read from --workers-file (the workers list
	// shows their source as "file", the others' as "flags").
	WorkersFromFile map[string]bool
	Router          routing.Config
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
	// KVEventsPublisherHosts (comma-separated) are hosts from which any worker's publisher may
	// connect to KVEventsBind, beyond the hosts of each worker's URL and kv_events endpoint
	// (for NAT or multi-homed workers); "*" admits any address.
	KVEventsPublisherHosts string
	TopicPattern           string
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
	// AdminToken guards /admin/* on the admin listener. Empty: on a loopback AdminListen the
	// API stays open (with a warning at every start); beyond loopback Start makes a token in
	// the data directory (admin.TokenFileName) at first start, reuses it later, and requires it.
	AdminToken string
	// InsecureOpenCluster lets a replica whose Raft, peer or gossip port reaches beyond
	// loopback start without peer mutual TLS or a gossip key: anyone who reaches those ports
	// is then a full member. Without it such a start is refused; with it, every start logs a
	// warning per open port.
	InsecureOpenCluster bool
	TLS                 TLSFiles
	// ShutdownDelay is how long a stopping replica keeps serving with /readyz failing, so a
	// load balancer's health checks take it out before its port closes (0: no wait).
	ShutdownDelay time.Duration
	// ShutdownTimeout bounds how long in-flight requests and streams may take to finish once
	// the client port has closed, and then how long closing the replica's parts may take
	// (0: 30s).
	ShutdownTimeout time.Duration
	Cluster         ClusterConfig
	// Discovery finds workers as they come and go (a leader duty writing the cluster registry).
	Discovery DiscoveryConfig
	Logger    *slog.Logger
}

// DiscoveryConfig is where the replicas find their workers at run time (discovery.Parse
// reads each source); zero durations take discovery's defaults.
type DiscoveryConfig struct {
	// Sources are "file:PATH", "dns:NAME:PORT" or "dns-srv:NAME".
	Sources []string
	// DNSServer (host:port), when set, is the only DNS server the dns sources ask.
	DNSServer                      string
	Interval, DrainFor, SuspectFor time.Duration
	// NotReadyGrace is how long a worker its source sees but not ready keeps its bindings,
	// out of rotation, before it drains as a gone one; zero drains it at once.
	NotReadyGrace time.Duration
}

// ClientPortConfig bounds what a client connection may hold without sending: zero takes the
// defaults below. Answers are not bounded by them: a long stream writes as long as it lasts.
type ClientPortConfig struct {
	// IdleTimeout closes a keep-alive connection quiet this long between requests (90s).
	IdleTimeout time.Duration
	// HeaderTimeout bounds reading a request's headers (10s).
	HeaderTimeout time.Duration
	// BodyTimeout bounds reading a request's whole body, from its headers on; a body not
	// complete by then is answered 408 (60s).
	BodyTimeout time.Duration
	// Server is the HTTP server of the client port: ServerFast (transport/h1's, the serve
	// command's default) or ServerNet (net/http's; "" too, so that a Config made in code
	// keeps the server it had); both run the same handlers, HTTP/1.1 only.
	Server string
}

// The client port's HTTP servers (--http-server).
const (
	ServerNet  = "net"
	ServerFast = "fast"
)

// The client port's defaults.
const (
	DefaultClientIdleTimeout   = 90 * time.Second
	DefaultClientHeaderTimeout = 10 * time.Second
	DefaultClientBodyTimeout   = 60 * time.Second
)

func (c ClientPortConfig) withDefaults() ClientPortConfig {
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{{&c.IdleTimeout, DefaultClientIdleTimeout}, {&c.HeaderTimeout, DefaultClientHeaderTimeout}, {&c.BodyTimeout, DefaultClientBodyTimeout}} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	return c
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
	// BindBeforeDispatch commits every new session's binding before its first request
	// reaches a worker (cluster.Config.BindBeforeDispatch).
	BindBeforeDispatch  bool
	Heartbeat, Election time.Duration
	LeaderLease, Commit time.Duration
	CheckpointInterval  time.Duration
	SnapshotInterval    time.Duration
	SnapshotThreshold   uint64
	SnapshotRetain      int
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
	// LoadCoalesce is the least time between two reports of load changes (0: 5 ms).
	LoadCoalesce      time.Duration
	DecisionFlush     time.Duration
	HealthInterval    time.Duration
	SnapshotDiscovery time.Duration
	SnapshotMaxBytes  int64
	JoinWait          time.Duration
}

// listenAddr is the gossip listen address: Listen, or a free loopback port when empty.
func (g GossipConfig) listenAddr() string {
	if g.Listen == "" {
		return "127.0.0.1:0"
	}
	return g.Listen
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
	if cp := c.ClientPort; cp.IdleTimeout < 0 || cp.HeaderTimeout < 0 || cp.BodyTimeout < 0 {
		errs = append(errs, errors.New("--client-idle-timeout, --client-header-timeout and --client-body-timeout must not be negative"))
	}
	switch c.ClientPort.Server {
	case "", ServerNet, ServerFast:
	default:
		errs = append(errs, fmt.Errorf("--http-server %q: want %s or %s", c.ClientPort.Server, ServerNet, ServerFast))
	}
	if em := c.EngineMetrics; em.Interval < 0 || em.Timeout < 0 || em.StaleAfter < 0 || em.MaxBodyBytes < 0 || c.EngineRequestTokens < 0 {
		errs = append(errs, errors.New("--engine-metrics-interval, -timeout, -stale-after, -max-bytes and -request-tokens must not be negative"))
	}
	switch n := len(c.Cluster.Gossip.Key); n {
	case 0, 16, 24, 32:
	default:
		errs = append(errs, fmt.Errorf("gossip key: %d bytes, want 16, 24 or 32", n))
	}
	if d := c.Discovery; d.Interval < 0 || d.DrainFor < 0 || d.SuspectFor < 0 || d.NotReadyGrace < 0 {
		errs = append(errs, errors.New("--discovery-interval, --discovery-drain-for, --discovery-suspect-for and --discovery-not-ready-grace must not be negative"))
	}
	for _, s := range c.Discovery.Sources {
		if _, err := discovery.Parse(s, c.Discovery.DNSServer); err != nil {
			errs = append(errs, err)
		}
	}
	if err := c.checkOpenCluster(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// clusterPort is one of the ports replicas talk to each other on, as the flags set it.
type clusterPort struct {
	name                  string // raft, peer or gossip
	listen, advertise     string
	listenFlag, advFlag   string
	protected             bool   // mutual TLS (raft, peer) or the gossip key (gossip)
	protection, anyoneCan string // what protects it; what anyone who reaches it unprotected can do
}

// beyond reports whether the port is reachable from other hosts: its listen or advertise
// address is not loopback.
func (p clusterPort) beyond() bool {
	return beyondLoopback(p.listen) || (p.advertise != "" && beyondLoopback(p.advertise))
}

// addresses names the port's listen and advertise addresses for a message.
func (p clusterPort) addresses() string {
	s := fmt.Sprintf("%s %s", p.listenFlag, p.listen)
	if p.advertise != "" {
		s += fmt.Sprintf(", %s %s", p.advFlag, p.advertise)
	}
	return s
}

// peerMTLS reports whether the peer and Raft ports are configured for mutual TLS (all three
// files given; TLSFiles.load checks them).
func (c *Config) peerMTLS() bool {
	return c.TLS.PeerCertFile != "" && c.TLS.PeerKeyFile != "" && c.TLS.PeerCAFile != ""
}

// clusterPorts are the replica's Raft and peer ports, and its gossip port unless NoGossip.
func (c *Config) clusterPorts() []clusterPort {
	cc := c.Cluster
	mtls := c.peerMTLS()
	ports := []clusterPort{
		{name: "raft", listen: cc.RaftListen, advertise: cc.RaftAdvert, listenFlag: "--raft-listen", advFlag: "--raft-advertise",
			protected: mtls, protection: "peer mutual TLS",
			anyoneCan: "send Raft messages as a member: forged AppendEntries are applied, votes split or stall the cluster"},
		{name: "peer", listen: cc.PeerListen, advertise: cc.PeerAdvert, listenFlag: "--peer-listen", advFlag: "--peer-advertise",
			protected: mtls, protection: "peer mutual TLS",
			anyoneCan: "forward commands to the leader: bind and invalidate sessions, join and remove replicas, read the index"},
	}
	if !c.NoGossip {
		g := cc.Gossip
		ports = append(ports, clusterPort{name: "gossip", listen: g.listenAddr(), advertise: g.Advertise, listenFlag: "--gossip-listen", advFlag: "--gossip-advertise",
			protected: len(g.Key) > 0, protection: "a gossip key",
			anyoneCan: "join gossip as a member: report workers down, announce Raft addresses that become voters, inject routing hints"})
	}
	return ports
}

// checkOpenCluster refuses a replica whose cluster ports reach beyond loopback while one of
// them is unprotected, unless InsecureOpenCluster says the operator accepts that.
func (c *Config) checkOpenCluster() error {
	if c.InsecureOpenCluster {
		return nil
	}
	var exposed, missing []string
	open := false
	for _, p := range c.clusterPorts() {
		if p.beyond() {
			exposed = append(exposed, p.addresses())
		}
		open = open || !p.protected
	}
	if len(exposed) == 0 || !open {
		return nil
	}
	if !c.peerMTLS() {
		missing = append(missing, "peer mutual TLS (--peer-tls-cert-file, --peer-tls-key-file and --peer-tls-ca-file)")
	}
	if !c.NoGossip && len(c.Cluster.Gossip.Key) == 0 {
		missing = append(missing, "gossip key (--gossip-key-file or KVROUTER_GOSSIP_KEY)")
	}
	return fmt.Errorf("refusing to start an open cluster: cluster ports beyond loopback (%s) and no %s, so anyone who reaches them is a full member; "+
		"give them, keep every cluster port on loopback, or pass --insecure-open-cluster to accept an open cluster",
		strings.Join(exposed, "; "), strings.Join(missing, " and no "))
}

// warnOpenCluster logs, at every start of an accepted open cluster, one warning per cluster
// port that reaches beyond loopback unprotected.
func (c *Config) warnOpenCluster(log *slog.Logger) {
	if !c.InsecureOpenCluster {
		return
	}
	for _, p := range c.clusterPorts() {
		if p.protected || !p.beyond() {
			continue
		}
		log.Warn("--insecure-open-cluster: the "+p.name+" port is open to anyone who reaches it, without "+p.protection,
			"port", p.name, "addresses", p.addresses(), "anyone_can", p.anyoneCan)
	}
}

// secure applies the safe defaults at start, before anything listens: the warnings of an
// accepted open cluster, and the admin token. An admin API beyond loopback without a given
// token requires the one in dataDir/admin.token, made at its first start; on loopback it
// stays open, with a warning at every start.
func (c *Config) secure(log *slog.Logger, dataDir string) error {
	c.warnOpenCluster(log)
	if c.AdminToken != "" {
		return nil
	}
	if !beyondLoopback(c.AdminListen) {
		log.Warn("no admin token: the admin API on loopback is open to every process on this host; give --admin-token-file to require one",
			"admin_listen", c.AdminListen)
		return nil
	}
	path := filepath.Join(dataDir, admin.TokenFileName)
	token, created, err := admin.LoadOrCreateToken(path)
	if err != nil {
		return fmt.Errorf("the admin API listens beyond loopback (--admin-listen %s) without --admin-token-file: %w", c.AdminListen, err)
	}
	c.AdminToken = token
	verb := "reused"
	if created {
		verb = "made"
	}
	log.Info("the admin API requires the token "+verb+" in the data directory (kvrouter-ha ctl --token-file)",
		"admin_listen", c.AdminListen, "token_file", path)
	return nil
}

// beyondLoopback reports whether addr (host:port) may be reached from another host: an
// unspecified host (0.0.0.0, ::, empty), any address outside 127.0.0.0/8 and ::1, and any
// name but localhost (names are not resolved here; a name is taken to reach beyond).
func beyondLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return true
	}
	if strings.EqualFold(host, "localhost") {
		return false
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return true
	}
	return !ip.Unmap().IsLoopback()
}
