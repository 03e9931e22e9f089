// Package replica assembles and closes one kvrouter-ha replica: its listeners, the Raft
// node and peer port (cluster), gossip and the hints riding on it (cluster/gossip,
// cluster/hints), the prefix indexes and KV event subscribers, the worker lifecycle
// (workers), the router (routing), the OpenAI front (transport/openai) and the admin API
// (admin). Start opens everything in dependency order, every listener bound before anything
// dials it; Close drains and unwinds in reverse, and a Start that fails part-way unwinds what
// it opened the same way (etcd's embed.StartEtcd is the model). DESIGN.md beside this file
// gives the order and why.
package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/cluster"
	"github.com/kvrouter-ha/kvrouter-ha/discovery"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/version"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/enginemetrics"
	"github.com/kvrouter-ha/kvrouter-ha/transport/extproc"
	"github.com/kvrouter-ha/kvrouter-ha/transport/h1"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

// Replica is one running router replica.
type Replica struct {
	cfg Config
	log *slog.Logger

	registry *routing.Registry
	tracker  *routing.Tracker
	approx   *indexer.Index
	precise  *indexer.Index // fed by KV events (empty while no worker sends them)
	feed     *eventFeed     // the KV event subscribers, following the registry
	promReg  *prometheus.Registry

	// The ports, bound first (eln, the picker's, only when configured).
	ln, aln, pln, rln, eln net.Listener

	pool      *peer.Pool
	node      *cluster.Node
	affinity  *cluster.Affinity
	peerSrv   *peer.Server
	share     *sharing // nil with NoGossip
	lifecycle *workers.Lifecycle
	discovery *discovery.Duty // nil without --discovery
	router    *routing.Router
	server    *openai.Server
	picker    *extproc.Picker // nil without ExtProcListen
	http      httpServer      // the client port's: net/http's or transport/h1's (--http-server)
	admin     *http.Server

	// engineLoad and scraper fold the workers' engine metrics into the router's load; nil
	// with EngineMetrics off.
	engineLoad *routing.EngineLoad
	scraper    *enginemetrics.Scraper

	cancel context.CancelFunc
	wg     sync.WaitGroup
	// undo holds what Start opened, closed in reverse by Close and by a Start that fails.
	undo  []undoStep
	drain drainState

	// front is server for the FSM's changes, which start before it exists (limits.go).
	front atomic.Pointer[openai.Server]
}

// Start opens a replica with cfg and starts serving; Close stops it. On error nothing it
// opened is left open: no listener, goroutine or file.
func Start(ctx context.Context, cfg Config) (_ *Replica, err error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	r := &Replica{cfg: cfg, log: cfg.Logger, tracker: routing.NewTracker(), promReg: prometheus.NewRegistry()}
	defer func() {
		if err != nil {
			_ = r.unwind(r.closeBound())
		}
	}()
	// The safe defaults (open-cluster warnings, the admin token) and the certificates
	// first: a refusal must stop the start before anything listens.
	if err = r.cfg.secure(r.log, r.dataDir()); err != nil {
		return nil, err
	}
	if r.cfg.TLS, err = cfg.TLS.load(r.log); err != nil {
		return nil, err
	}
	if r.cfg.ExtProc.TLS, err = cfg.ExtProcTLS.load(r.log); err != nil {
		return nil, err
	}
	if r.registry, err = routing.NewRegistry(cfg.Workers); err != nil {
		return nil, err
	}
	r.promReg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// The peer clients: gossip's index-snapshot pulls and the Raft node's forwarding share them.
	r.pool = peer.NewPool(peer.ClientOptions{TLS: r.cfg.TLS.peerConfig()})
	r.onClose("peer clients", func() { r.pool.Close() })
	steps := []func(context.Context) error{
		r.listen,       // every port, before anything can dial one
		r.openIndexes,  // the prefix indexes and KV event subscribers (not running yet)
		r.openSharing,  // gossip's port and the hints (not joined yet)
		r.openNode,     // the Raft node on its port, the affinity store, the peer port serving
		r.joinSharing,  // gossip joins its seeds (bounded): a key mismatch fails the start
		r.openRouting,  // the worker lifecycle, the router, the OpenAI front, the admin API
		r.startServing, // background loops, then the client and admin ports serve
	}
	for _, step := range steps {
		if err := step(ctx); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// undoStep is one thing Start opened, and how to close it; what names it in the log.
type undoStep struct {
	what string
	fn   func()
}

// onClose pushes an undo step.
func (r *Replica) onClose(what string, fn func()) {
	r.undo = append(r.undo, undoStep{what: what, fn: fn})
}

// closeBound is how long the undo steps may take together: --shutdown-timeout (its
// default when 0).
func (r *Replica) closeBound() time.Duration {
	if r.cfg.ShutdownTimeout > 0 {
		return r.cfg.ShutdownTimeout
	}
	return defaultShutdownTimeout
}

// unwind runs the undo steps in reverse, once, within bound all together. A step still
// running at the bound is given up on: the log names it and carries every goroutine's
// stack (what it waits for), the steps after it run, so a replica that was asked to stop
// does stop (a stuck close is no reason to keep the ports and the process), and the error
// names the steps given up on.
func (r *Replica) unwind(bound time.Duration) error {
	deadline := time.NewTimer(bound)
	defer deadline.Stop()
	var left []string
	for i := len(r.undo) - 1; i >= 0; i-- {
		step := r.undo[i]
		until := deadline.C
		if len(left) > 0 {
			// Past the bound every step gets a moment only: most return at once.
			until = time.After(time.Second)
		}
		if !r.runBounded(step, until) {
			left = append(left, step.what)
		}
	}
	r.undo = nil
	if len(left) > 0 {
		return fmt.Errorf("closing the replica: gave up on %s after %s", strings.Join(left, ", "), bound)
	}
	return nil
}

// runBounded runs step until it returns or until is ready; it reports whether it returned.
func (r *Replica) runBounded(step undoStep, until <-chan time.Time) bool {
	done := make(chan struct{})
	go func() {
		defer close(done)
		step.fn()
	}()
	select {
	case <-done:
		return true
	case <-until:
		r.log.Error("shutdown: gave up waiting for a part to close; going on without it",
			"part", step.what, "bound", r.closeBound(), "goroutines", goroutineStacks())
		return false
	}
}

// goroutineStacks is every goroutine's stack, for the log of a close that hung.
func goroutineStacks() string {
	var b strings.Builder
	_ = pprof.Lookup("goroutine").WriteTo(&b, 2)
	return b.String()
}

// listen binds the client, admin, peer and Raft ports.
func (r *Replica) listen(context.Context) error {
	cc := r.cfg.Cluster
	for _, l := range []struct {
		to   *net.Listener
		addr string
		what string
	}{
		{&r.ln, r.cfg.Listen, "client"},
		{&r.aln, r.cfg.AdminListen, "admin"},
		{&r.pln, cc.PeerListen, "peer"},
		{&r.rln, cc.RaftListen, "raft"},
	} {
		ln, err := net.Listen("tcp", l.addr)
		if err != nil {
			return fmt.Errorf("%s listener: %w", l.what, err)
		}
		*l.to = ln
		r.onClose(l.what+" listener", func() { _ = ln.Close() })
	}
	r.ln = r.cfg.TLS.clientListener(r.ln)
	if r.cfg.ExtProcListen != "" {
		ln, err := net.Listen("tcp", r.cfg.ExtProcListen)
		if err != nil {
			return fmt.Errorf("ext_proc listener: %w", err)
		}
		r.eln = ln
		r.onClose("ext_proc listener", func() { _ = ln.Close() })
	}
	return nil
}

// dataDir is the replica's data directory (default kvrouter-data/ID).
func (r *Replica) dataDir() string {
	if d := r.cfg.Cluster.DataDir; d != "" {
		return d
	}
	return filepath.Join("kvrouter-data", r.cfg.ID)
}

// peerAdvert and raftAdvert are what other replicas dial.
func (r *Replica) peerAdvert() string {
	if a := r.cfg.Cluster.PeerAdvert; a != "" {
		return a
	}
	return r.pln.Addr().String()
}

func (r *Replica) raftAdvert() string {
	if a := r.cfg.Cluster.RaftAdvert; a != "" {
		return a
	}
	return r.rln.Addr().String()
}

// openNode opens the Raft node on the bound Raft port, serves the peer port, and makes the
// Raft-backed affinity store.
func (r *Replica) openNode(ctx context.Context) error {
	cc := r.cfg.Cluster
	level, err := cluster.ParseLevel(cc.Consistency)
	if err != nil {
		return err
	}
	tc := r.cfg.TLS
	n, err := cluster.Open(ctx, cluster.Config{
		ID: r.cfg.ID, DataDir: r.dataDir(),
		RaftListener: r.rln, RaftAdvertise: cc.RaftAdvert, PeerAddr: r.peerAdvert(),
		BootstrapExpect: cc.BootstrapExpect, Join: cc.Join,
		HeartbeatTimeout: cc.Heartbeat, ElectionTimeout: cc.Election,
		LeaderLeaseTimeout: cc.LeaderLease, CommitTimeout: cc.Commit,
		SnapshotRetain: cc.SnapshotRetain, SnapshotThreshold: cc.SnapshotThreshold, SnapshotInterval: cc.SnapshotInterval,
		TrailingLogs: cc.TrailingLogs, CompactMinBytes: cc.CompactMinBytes,
		Level: level, StaleBound: cc.StaleBound, BindWait: cc.BindWait, BindBeforeDispatch: cc.BindBeforeDispatch,
		SessionTTL: r.cfg.SessionTTL, MaxBindings: r.cfg.MaxSessions,
		CheckpointInterval: cc.CheckpointInterval, TouchFlush: cc.TouchFlush, OnChange: r.bindingChanged,
		Peers: r.pool, Version: version.String(), Logger: r.log, RaftTLS: tc.peerConfig(),
	})
	if err != nil {
		return err
	}
	r.node = n
	r.onClose("raft node", func() {
		if err := n.Close(); err != nil {
			r.log.Warn("raft node close", "err", err)
		}
	})
	// Raft's state is read from the node at scrape time: operators watch leader, term and
	// indexes on /metrics rather than polling `ctl cluster status`.
	if err := r.promReg.Register(cluster.NewRaftCollector(n)); err != nil {
		return fmt.Errorf("raft metrics: %w", err)
	}
	var snaps peer.SnapshotSource
	if r.share != nil {
		r.share.node.Store(n)
		snaps = r.share.sync
		n.ReconcileMembers(r.share.g, cluster.ReconcileConfig{MinQuorum: cc.Gossip.MinQuorum, CleanupInterval: cc.Gossip.CleanupInterval})
	}
	r.peerSrv = peer.NewServer(n.PeerHandler(), peer.ServerOptions{Logger: r.log, Snapshots: snaps, TLS: tc.peerConfig(), Member: n.AuthorizeMember})
	pln := r.pln
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := r.peerSrv.Serve(pln); err != nil && !errors.Is(err, net.ErrClosed) {
			r.log.Error("peer listener stopped", "err", err)
		}
	}()
	r.onClose("peer port", func() { r.peerSrv.Stop(); <-done })
	r.affinity = cluster.NewAffinity(n)
	return nil
}

// ownHealthy is this replica's own verdict on a worker, for the grace duty: with gossip, its
// health view's own probes (the merged view also counts what others say); without, nil, and
// the registry's health is this replica's own probes already.
func (r *Replica) ownHealthy() func(worker string) bool {
	if r.share == nil {
		return nil
	}
	return r.share.health.OwnHealthy
}

// openRouting makes the worker lifecycle, the router, the OpenAI front and the admin API.
func (r *Replica) openRouting(context.Context) error {
	cfg := r.cfg
	lc, err := workers.New(workers.Config{
		Registry: r.registry, Cluster: r.node, Grace: cfg.Cluster.WorkerGrace, Forget: r.forgetWorker, Logger: r.log,
		OwnHealthy: r.ownHealthy(),
	})
	if err != nil {
		return err
	}
	r.lifecycle = lc
	if err := r.openDiscovery(); err != nil {
		return err
	}
	index := routing.Overlay{r.precise, r.approx}
	deps := routing.Deps{Index: index, Recorder: r.approx, Workers: r.registry, Tracker: r.tracker, Affinity: r.affinity}
	if r.share != nil {
		deps.Recorder = r.share.decisions
		deps.Load = r.share.remote
	}
	if err := r.openEngineMetrics(&deps); err != nil {
		return err
	}
	if r.router, err = routing.New(cfg.Router, deps); err != nil {
		return err
	}
	pcfg := cfg.Proxy
	pcfg.ReplicaID = cfg.ID
	pcfg.Aliases = aliases{r.node.FSM()}
	pcfg.Logger = r.log
	pcfg.Registerer = r.promReg
	if pcfg.ClientLimits.MaxSessions == 0 && cfg.MaxSessions > 0 {
		// One client cannot fill --max-sessions alone (per replica: see transport/openai/limits.go).
		// A tenth of it, but never under 1,000 (or the whole cap where it is smaller): a small
		// cap is a small fleet's, where a tenth would refuse an honest client.
		pcfg.ClientLimits.MaxSessions = max(cfg.MaxSessions/10, min(cfg.MaxSessions, 1000))
	}
	if cfg.Tokenizer == "worker" {
		pcfg.Tokenizer = openai.NewWorkerTokenizer(r.registry, openai.TokenizerConfig{})
	}
	if r.share != nil {
		// Routability is the merged view's call: this replica's probes and bad responses
		// feed it, the other replicas' reports arrive over gossip.
		pcfg.MarkUnhealthy = r.share.health.MarkDown
	}
	if r.server, err = openai.NewServer(pcfg, r.router, r.registry, r.tracker); err != nil {
		return err
	}
	r.server.SetReady(r.Ready)
	r.front.Store(r.server)
	if r.eln != nil {
		ecfg := cfg.ExtProc
		ecfg.Logger, ecfg.Registerer = r.log, r.promReg
		if r.picker, err = extproc.New(ecfg, r.server); err != nil {
			return err
		}
	}
	// The server's own complaints (a scanner's failed TLS handshake, a malformed request
	// line) go to the structured log at debug: a client cannot flood the error log. A
	// connection holds the port only while it sends: quiet keep-alive connections, slow
	// headers and slow bodies are cut; answers, however long they stream, are not.
	cp := cfg.ClientPort.withDefaults()
	if cp.Server == ServerFast {
		// The server keeps the body's deadline itself, on its clock.
		front := r.closeWhileDraining(r.server.Handler())
		fast, err := h1.New(h1.Config{Handler: front, HeaderTimeout: cp.HeaderTimeout, IdleTimeout: cp.IdleTimeout,
			BodyTimeout: cp.BodyTimeout, Logger: r.log.With("part", "client-port"), Refusal: openai.RefusalBody})
		if err != nil {
			return err
		}
		r.http = fast
		r.log.Info("client port: the router's own HTTP/1.1 server (--http-server fast)")
	} else {
		front := r.closeWhileDraining(bodyDeadline(r.server.Handler(), cp.BodyTimeout))
		r.http = &http.Server{Handler: front, ReadHeaderTimeout: cp.HeaderTimeout, IdleTimeout: cp.IdleTimeout,
			ErrorLog: slog.NewLogLogger(r.log.Handler(), slog.LevelDebug)}
	}
	var disc admin.Discovery
	if r.discovery != nil {
		disc = discoveryStatus{d: r.discovery, node: r.node}
	}
	r.admin = &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: admin.Handler(admin.Config{
		Token: cfg.AdminToken, Cluster: r.node, Bindings: r.node.FSM(), Workers: lc, Registry: r.registry, Aliases: r.node.FSM(),
		Metrics: openai.AdminHandler(r.promReg), Discovery: disc,
		StaticSource: func(id string) string {
			if cfg.WorkersFromFile[id] {
				return admin.SourceFile
			}
			return admin.SourceFlags
		},
	})}
	return nil
}

// bodyDeadline gives a request with a body until d after its headers to send all of it: the
// connection's read deadline, which a slow or trickling body runs into (the front answers
// 408). net/http lifts the deadline as the body ends, when it starts watching the
// connection for the client's disconnect, so a long answer is never cut by it.
func bodyDeadline(h http.Handler, d time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Body != nil && req.Body != http.NoBody && d > 0 {
			_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(d))
		}
		h.ServeHTTP(w, req)
	})
}

// openEngineMetrics puts the workers' engine load on top of the load the router reads and
// makes the scraper that feeds it, when EngineMetrics is on. The engine load is not gossiped:
// every replica scrapes every worker and subtracts the whole cluster's requests (the merged
// view), so sharing the estimates would count them once per replica.
func (r *Replica) openEngineMetrics(deps *routing.Deps) error {
	cfg := r.cfg
	if cfg.EngineMetrics.Interval <= 0 {
		return nil
	}
	base := deps.Load
	if base == nil {
		base = r.tracker
	}
	r.engineLoad = routing.NewEngineLoad(base, routing.EngineLoadConfig{BlockSize: cfg.Router.BlockSize, RequestTokens: cfg.EngineRequestTokens})
	deps.Load = r.engineLoad
	ecfg := cfg.EngineMetrics
	ecfg.Logger, ecfg.Registerer = r.log.With("part", "engine-metrics"), r.promReg
	if ecfg.TLS == nil {
		ecfg.TLS = cfg.Proxy.WorkerTLS
	}
	s, err := enginemetrics.New(ecfg, r.registry, r.engineLoad)
	if err != nil {
		return err
	}
	r.scraper = s
	return nil
}

// forgetWorker is the fan-out when a worker leaves the registry: every index, the load
// tracker and the merged health view let go of it.
func (r *Replica) forgetWorker(spec routing.WorkerSpec) {
	for rank := range max(spec.DPSize, 1) {
		w := indexer.Worker{ID: spec.ID, DPRank: uint32(rank)}
		r.approx.RemoveWorker(w)
		r.precise.RemoveWorker(w)
		r.tracker.Forget(w)
	}
	if r.share != nil {
		r.share.health.ForgetWorker(spec.ID)
	}
	if r.engineLoad != nil {
		r.engineLoad.Forget(spec.ID)
	}
}

// startServing starts the background loops (health probes, KV event subscribers, the hints,
// index expiry, the worker lifecycle), then serves the client and admin ports.
func (r *Replica) startServing(ctx context.Context) error {
	hcfg := r.cfg.Health
	hcfg.Logger = r.log
	hcfg.Registerer = r.promReg
	if r.share != nil {
		hcfg.Observe = r.share.health.Observe
	}
	checker, err := openai.NewHealthChecker(r.registry, hcfg)
	if err != nil {
		return err
	}
	bg, cancel := context.WithCancel(context.WithoutCancel(ctx))
	r.cancel = cancel
	r.onClose("background loops", func() { cancel(); r.wg.Wait() })
	r.goRun(func() { checker.Run(bg) })
	// Each replica learns the models of the workers from the workers themselves (see
	// DESIGN.md, "Models").
	r.goRun(func() { r.server.LearnModels(bg) })
	r.goRun(func() { r.feed.run(bg) })
	if r.share != nil {
		r.share.run(r, bg)
	}
	if r.scraper != nil {
		r.goRun(func() { r.scraper.Run(bg) })
	}
	r.goRun(func() { r.expireIndex(bg) })
	r.goRun(func() { r.lifecycle.Run(bg) })
	for _, s := range []struct {
		srv  httpServer
		ln   net.Listener
		what string
	}{{r.http, r.ln, "client"}, {r.admin, r.aln, "admin"}} {
		r.goRun(func() {
			if err := s.srv.Serve(s.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				r.log.Error(s.what+" listener stopped", "err", err)
			}
		})
		r.onClose(s.what+" port", func() { _ = s.srv.Close() })
	}
	if r.picker != nil {
		r.goRun(func() {
			if err := r.picker.Serve(r.eln); err != nil {
				r.log.Error("ext_proc listener stopped", "err", err)
			}
		})
		r.onClose("ext_proc port", r.picker.Close)
	}
	return nil
}

// httpServer is what a replica needs of an HTTP server: net/http's and transport/h1's.
type httpServer interface {
	Serve(net.Listener) error
	Shutdown(context.Context) error
	Close() error
}

func (r *Replica) goRun(fn func()) {
	r.wg.Add(1)
	go func() { defer r.wg.Done(); fn() }()
}

// expireIndex drops approximate index entries past their TTL.
func (r *Replica) expireIndex(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.approx.Expire()
		}
	}
}

// Ready reports whether the replica serves (/readyz): not stopping, holding a read lease
// (cluster), and, with gossip, holding a peer's index snapshot when there was one to pull.
func (r *Replica) Ready() error {
	if r.drain.draining.Load() {
		return errShuttingDown
	}
	if err := r.node.Ready(); err != nil {
		return err
	}
	if r.share != nil {
		return r.share.ready()
	}
	return nil
}

// ClusterStability is the Raft node's Stability counters (zero before the node is open).
func (r *Replica) ClusterStability() cluster.Stability {
	if r.node == nil {
		return cluster.Stability{}
	}
	return r.node.Stability()
}

// Addr is the client listener's address.
func (r *Replica) Addr() string { return r.ln.Addr().String() }

// ExtProcAddr is the endpoint picker's address, "" without one.
func (r *Replica) ExtProcAddr() string {
	if r.eln == nil {
		return ""
	}
	return r.eln.Addr().String()
}

// AdminAddr is the admin listener's address.
func (r *Replica) AdminAddr() string { return r.aln.Addr().String() }

// PeerAddr is the peer port's advertised address.
func (r *Replica) PeerAddr() string { return r.peerAdvert() }

// Policy is the router's selection policy.
func (r *Replica) Policy() string { return r.router.Policy() }

// Scheme is the client port's URL scheme (https with a certificate).
func (r *Replica) Scheme() string { return r.cfg.TLS.Scheme() }

// openDiscovery registers the discovery leader duty over the configured sources (none: off).
func (r *Replica) openDiscovery() (err error) {
	d := r.cfg.Discovery
	if len(d.Sources) == 0 {
		return nil
	}
	var sources []discovery.Source
	for _, spec := range d.Sources {
		s, err := discovery.Parse(spec, d.DNSServer)
		if err != nil {
			return err
		}
		sources = append(sources, s)
	}
	r.discovery, err = discovery.Start(discovery.Config{
		Sources: sources, Cluster: r.node, Interval: d.Interval, DrainFor: d.DrainFor, SuspectFor: d.SuspectFor,
		NotReadyGrace: d.NotReadyGrace,
		// A worker from --worker or the workers file is in the routing registry and not the
		// cluster's: discovery leaves its id alone.
		Static: func(id string) bool {
			_, ok := r.registry.Lookup(id)
			return ok && !r.lifecycle.InCluster(id)
		},
		Registerer: r.promReg, Logger: r.log.With("duty", "discovery"),
	})
	if err != nil {
		return err
	}
	// The peer Status carries the looks while the duty runs here: a follower's admin API
	// shows the leader's.
	duty := r.discovery
	r.node.SetDiscoveryStatus(func() []peer.DiscoverySource {
		if running, sts := duty.Status(); running {
			return looksOf(sts)
		}
		return nil
	})
	return nil
}

// discoveryStatus is the discovery duty as the admin API reads it.
type discoveryStatus struct {
	d    *discovery.Duty
	node *cluster.Node
}

func (s discoveryStatus) Sources() []string { return s.d.Sources() }

func (s discoveryStatus) Looks() (bool, []peer.DiscoverySource) {
	running, sts := s.d.Status()
	return running, looksOf(sts)
}

func (s discoveryStatus) LeaderStatus(ctx context.Context) (peer.Status, error) {
	return s.node.LeaderStatus(ctx)
}

// looksOf is the discovery duty's sources as the peer Status carries them.
func looksOf(sts []discovery.SourceStatus) []peer.DiscoverySource {
	out := make([]peer.DiscoverySource, 0, len(sts))
	for _, st := range sts {
		out = append(out, peer.DiscoverySource{Source: st.Source, LastGood: st.LastGood, FailingSince: st.FailingSince,
			Failures: st.Failures, LastError: st.LastError, SuspectDrains: st.SuspectDrains})
	}
	return out
}
