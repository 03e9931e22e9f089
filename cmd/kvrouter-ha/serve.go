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
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/peterbourgon/ff/v3/ffcli"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvrouter-ha/kvrouter-ha/cluster"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// serveConfig is everything a router replica is started with.
type serveConfig struct {
	Listen, AdminListen string
	ReplicaID           string
	Workers             []routing.WorkerSpec
	Router              routing.Config
	ApproxTTL           time.Duration
	ApproxMaxBlocks     int
	SessionTTL          time.Duration
	MaxSessions         int
	Proxy               openai.Config
	Health              openai.HealthConfig
	// KVEventsBind, when set, binds one SUB socket that workers' PUB sockets connect to;
	// workers are told apart by TopicPattern. Workers whose spec names kv_events get their own
	// connecting subscriber either way.
	KVEventsBind string
	TopicPattern string
	// OverlayTTL is how long the replica's own decisions count in precise mode, on top of the
	// events (a burst of siblings must not all land before the first BlockStored arrives).
	OverlayTTL time.Duration
	// Tokenizer is "none" (text prompts hash in byte chunks) or "worker" (ask a worker's /tokenize).
	Tokenizer string
	// NoGossip keeps this replica's decisions and load to itself (comparison runs); bindings
	// are shared through Raft regardless.
	NoGossip bool
	// AdminToken guards /admin/* on the admin listener ("" leaves it open: loopback only).
	AdminToken string
	// TLS is the client port's certificate and the replicas' mutual TLS (tlswire.go).
	TLS tlsConfig
	// ShutdownDelay is how long a stopping replica keeps serving with /readyz failing, so a
	// load balancer's health checks take it out before its port closes (0: no wait).
	ShutdownDelay time.Duration
	// ShutdownTimeout bounds how long in-flight requests and streams may take to finish once
	// the client port has closed (0: 30s).
	ShutdownTimeout time.Duration
	// Cluster configures the Raft node that keeps session bindings.
	Cluster clusterConfig
	Logger  *slog.Logger
}

// workerFlag collects --worker values: "id=url" or a bare url (id w<n>).
type workerFlag struct{ specs *[]routing.WorkerSpec }

func (f workerFlag) String() string {
	if f.specs == nil {
		return ""
	}
	var parts []string
	for _, s := range *f.specs {
		parts = append(parts, s.ID+"="+s.URL)
	}
	return strings.Join(parts, ",")
}

func (f workerFlag) Set(v string) error {
	for _, item := range strings.Split(v, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		id, url, ok := strings.Cut(item, "=")
		if !ok {
			id, url = fmt.Sprintf("w%d", len(*f.specs)), item
		}
		*f.specs = append(*f.specs, routing.WorkerSpec{ID: id, URL: url})
	}
	return nil
}

// loadWorkersFile reads a JSON array of worker specs.
func loadWorkersFile(path string) ([]routing.WorkerSpec, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("workers file: %w", err)
	}
	var specs []routing.WorkerSpec
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&specs); err != nil {
		return nil, fmt.Errorf("workers file %s: %w", path, err)
	}
	return specs, nil
}

func serveCommand(stdout, stderr io.Writer) *ffcli.Command {
	fs := flag.NewFlagSet("kvrouter-ha serve", flag.ContinueOnError)
	var cfg serveConfig
	host, _ := os.Hostname()
	fs.StringVar(&cfg.Listen, "listen", "127.0.0.1:8080", "client (OpenAI) listen address")
	fs.StringVar(&cfg.AdminListen, "admin-listen", "127.0.0.1:9090", "admin listen address (/metrics)")
	fs.StringVar(&cfg.ReplicaID, "replica-id", host, "this replica's name, sent as X-Kvrouter-Replica")
	fs.Var(workerFlag{&cfg.Workers}, "worker", "a worker as id=url (repeatable, or comma-separated)")
	workersFile := fs.String("workers-file", "", "JSON array of worker specs: id, url, kv_events, role, dp_size, capacity_blocks, loras")
	fs.StringVar(&cfg.Router.Policy, "policy", "kv", "selection policy: "+strings.Join(routing.Policies(), ", "))
	fs.IntVar(&cfg.Router.BlockSize, "block-size", indexer.DefaultBlockSize, "KV block size in tokens (must match the workers')")
	fs.Float64Var(&cfg.Router.PrefillWeight, "prefill-weight", 1, "kv policy: weight of prefill blocks in the cost")
	fs.Float64Var(&cfg.Router.Temperature, "temperature", 0, "kv policy: 0 picks the cheapest worker; >0 samples by softmax over costs")
	fs.Float64Var(&cfg.Router.BusyDecodeFraction, "busy-decode-fraction", 0, "a worker whose decode blocks exceed this share of capacity_blocks is busy (0: off)")
	fs.Int64Var(&cfg.Router.BusyPrefillTokens, "busy-prefill-tokens", 0, "a worker with more in-flight prefill tokens is busy (0: off)")
	fs.IntVar(&cfg.Router.QueueSize, "queue-size", 64, "requests that may wait while every worker is busy")
	fs.DurationVar(&cfg.Router.QueueWait, "queue-wait", 5*time.Second, "how long a request waits for a non-busy worker before 503")
	fs.IntVar(&cfg.Router.MaxRetries, "max-retries", 2, "retries on another worker before the first byte")
	fs.DurationVar(&cfg.ApproxTTL, "approx-ttl", 120*time.Second, "how long a routing decision counts as cached on its worker")
	fs.IntVar(&cfg.ApproxMaxBlocks, "approx-max-blocks", 1<<20, "per-worker cap of remembered blocks from decisions")
	fs.DurationVar(&cfg.SessionTTL, "session-ttl", 10*time.Minute, "a session binding idles out this long after its last request ends")
	fs.IntVar(&cfg.MaxSessions, "max-sessions", 1_000_000, "cap on bound sessions; beyond it new sessions get 429")
	fs.Int64Var(&cfg.Proxy.MaxBodyBytes, "max-body-bytes", 8<<20, "largest request body accepted (413 beyond)")
	fs.DurationVar(&cfg.Proxy.ConnectTimeout, "connect-timeout", 2*time.Second, "worker connect timeout")
	fs.DurationVar(&cfg.Proxy.FirstByteTimeout, "first-byte-timeout", 5*time.Minute, "time for a worker to start answering")
	fs.DurationVar(&cfg.Proxy.IdleTimeout, "idle-timeout", 2*time.Minute, "longest gap between streamed chunks")
	fs.DurationVar(&cfg.Health.Interval, "health-interval", time.Second, "worker health probe interval")
	fs.DurationVar(&cfg.Health.Timeout, "health-timeout", time.Second, "one health probe's timeout (a busy worker answers slowly; too short a timeout drains a loaded fleet)")
	fs.IntVar(&cfg.Health.FailThreshold, "health-fail-threshold", 3, "consecutive failed probes that take a worker out")
	fs.IntVar(&cfg.Health.RiseThreshold, "health-rise-threshold", 2, "consecutive good probes that put it back")
	fs.StringVar(&cfg.KVEventsBind, "kv-events-bind", "", "bind a ZMQ SUB socket here for workers that connect their KV events to the router, e.g. tcp://127.0.0.1:5557, and one on each port + r for the data-parallel ranks r of the largest worker, where vLLM connects them (workers with kv_events in --workers-file get their own subscriber)")
	fs.StringVar(&cfg.TopicPattern, "kv-events-topic-pattern", "kv@{host:port}@{model}", "how a bound subscriber tells workers apart: the {host:port} in a topic is matched against worker URLs")
	fs.DurationVar(&cfg.OverlayTTL, "overlay-ttl", 10*time.Second, "precise mode: how long the replica's own decisions count on top of the KV events")
	fs.StringVar(&cfg.Tokenizer, "tokenizer", "none", "text prompts: none (hash text in byte chunks) or worker (ask a worker's POST /tokenize, so text routes on exact token blocks)")
	fs.DurationVar(&cfg.ShutdownDelay, "shutdown-delay", 5*time.Second, "on SIGTERM, how long /readyz fails while the client port still serves, so a load balancer's health checks (e.g. HAProxy inter 1s fall 2) take the replica out first; a second signal cuts it short (0: no wait)")
	fs.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", 30*time.Second, "on SIGTERM, how long in-flight requests and streams may take to finish after the client port closes; the rest are cut")
	registerClusterFlags(fs, &cfg.Cluster)
	registerGossipFlags(fs, &cfg.Cluster.Gossip, &cfg.NoGossip)
	registerTLSFlags(fs, &cfg.TLS)
	fs.StringVar(&cfg.AdminToken, "admin-token", "", "bearer token for the admin API (prefer --admin-token-file or KVROUTER_ADMIN_TOKEN: flags show in ps)")
	adminTokenFile := fs.String("admin-token-file", "", "file holding the admin API bearer token")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	return &ffcli.Command{
		Name:       "serve",
		ShortUsage: "kvrouter-ha serve --worker w0=http://127.0.0.1:8001 [--worker ...] [flags]",
		ShortHelp:  "run a router replica",
		FlagSet:    fs,
		Exec: func(ctx context.Context, _ []string) error {
			log, err := newLogger(stderr, *logLevel)
			if err != nil {
				return err
			}
			cfg.Logger = log
			if *workersFile != "" {
				specs, err := loadWorkersFile(*workersFile)
				if err != nil {
					return err
				}
				cfg.Workers = append(cfg.Workers, specs...)
			}
			if *adminTokenFile != "" {
				b, err := os.ReadFile(*adminTokenFile)
				if err != nil {
					return fmt.Errorf("admin token file: %w", err)
				}
				cfg.AdminToken = strings.TrimSpace(string(b))
			}
			if cfg.AdminToken == "" {
				log.Warn("no admin token: the admin API is open to anyone who reaches the admin listener")
			}
			if cfg.ShutdownDelay < 0 || cfg.ShutdownTimeout < 0 {
				return fmt.Errorf("--shutdown-delay %s, --shutdown-timeout %s: must not be negative", cfg.ShutdownDelay, cfg.ShutdownTimeout)
			}
			rep, err := startReplica(ctx, cfg)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "kvrouter-ha %s: serving on %s://%s, admin on http://%s, %d workers, policy %s\n",
				cfg.ReplicaID, cfg.TLS.clientScheme(), rep.Addr(), rep.AdminAddr(), len(cfg.Workers), rep.router.Policy())
			<-ctx.Done()
			skip, stopSignals := secondSignal()
			defer stopSignals()
			return rep.shutdown(skip)
		},
	}
}

// replica is one running router: listeners, router, health checks and housekeeping.
type replica struct {
	cfg      serveConfig
	router   *routing.Router
	registry *routing.Registry
	tracker  *routing.Tracker
	approx   *indexer.Index
	precise  *indexer.Index // fed by KV events; nil without them
	subs     []*kvevents.Subscriber
	share    *sharing // nil with --no-gossip
	affinity *cluster.Affinity
	cluster  *clusterParts
	log      *slog.Logger
	server   *openai.Server
	http     *http.Server
	admin    *http.Server
	ln, aln  net.Listener
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	drain    drainState
}

// startReplica wires a router replica and starts serving; Close stops it.
func startReplica(ctx context.Context, cfg serveConfig) (*replica, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// Certificates first: a bad file must stop the start before anything listens.
	tlsc, err := cfg.TLS.load(log)
	if err != nil {
		return nil, err
	}
	cfg.TLS = tlsc
	reg, err := routing.NewRegistry(cfg.Workers)
	if err != nil {
		return nil, err
	}
	r := &replica{cfg: cfg, registry: reg, tracker: routing.NewTracker(), log: log}
	promReg := prometheus.NewRegistry()
	promReg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	subs, err := r.kvEventSubscribers(promReg, log)
	if err != nil {
		return nil, err
	}
	approxTTL := cfg.ApproxTTL
	var index routing.PrefixIndex
	if r.precise != nil {
		approxTTL = cfg.OverlayTTL
		if approxTTL <= 0 {
			approxTTL = 10 * time.Second // a TTL of 0 would keep decisions for ever
		}
	}
	r.approx = indexer.New(indexer.Options{TTL: approxTTL, MaxBlocksPerWorker: cfg.ApproxMaxBlocks})
	index = r.approx
	if r.precise != nil {
		index = routing.Overlay{r.precise, r.approx}
	}
	if r.cluster, err = startCluster(ctx, cfg, promReg, log); err != nil {
		return nil, err
	}
	r.affinity = r.cluster.affinity
	r.subs = subs
	deps := routing.Deps{Index: index, Recorder: r.approx, Workers: reg, Tracker: r.tracker, Affinity: r.affinity}
	if !cfg.NoGossip {
		if r.share, err = r.startSharing(ctx, promReg, approxTTL, log); err != nil {
			r.cluster.Close()
			return nil, err
		}
		deps.Recorder = r.share.decisions
		deps.Load = r.share.remote
	}
	// closeCluster undoes the above when a later step fails.
	closeCluster := func() {
		if r.share != nil {
			r.share.close()
		}
		r.cluster.Close()
	}
	r.router, err = routing.New(cfg.Router, deps)
	if err != nil {
		closeCluster()
		return nil, err
	}
	reg.OnChange(func(st routing.WorkerStatus, removed bool) {
		if !removed {
			return
		}
		for rank := 0; rank < st.Spec.DPSize; rank++ {
			w := indexer.Worker{ID: st.Spec.ID, DPRank: uint32(rank)}
			r.approx.RemoveWorker(w)
			if r.precise != nil {
				r.precise.RemoveWorker(w)
			}
			r.tracker.Forget(w)
		}
		if r.share != nil {
			r.share.health.ForgetWorker(st.Spec.ID)
		}
	})
	pcfg := cfg.Proxy
	pcfg.ReplicaID = cfg.ReplicaID
	pcfg.Logger = log
	pcfg.Registerer = promReg
	switch cfg.Tokenizer {
	case "", "none":
	case "worker":
		pcfg.Tokenizer = openai.NewWorkerTokenizer(reg, openai.TokenizerConfig{})
	default:
		return nil, fmt.Errorf("--tokenizer %q: want none or worker", cfg.Tokenizer)
	}
	hcfg := cfg.Health
	if r.share != nil {
		// Routability is the merged view's call: this replica's probes and bad responses
		// feed it, the other replicas' reports arrive over gossip.
		pcfg.MarkUnhealthy = r.share.health.MarkDown
		hcfg.Observe = r.share.health.Observe
	}
	r.server, err = openai.NewServer(pcfg, r.router, reg, r.tracker)
	if err != nil {
		closeCluster()
		return nil, err
	}
	r.server.SetReady(func() error {
		if r.drain.draining.Load() {
			return errShuttingDown
		}
		if err := r.cluster.node.Ready(); err != nil {
			return err
		}
		if r.share != nil {
			return r.share.ready()
		}
		return nil
	})
	if r.ln, err = net.Listen("tcp", cfg.Listen); err != nil {
		closeCluster()
		return nil, fmt.Errorf("client listener: %w", err)
	}
	r.ln = cfg.TLS.clientListener(r.ln)
	if r.aln, err = net.Listen("tcp", cfg.AdminListen); err != nil {
		r.ln.Close()
		closeCluster()
		return nil, fmt.Errorf("admin listener: %w", err)
	}
	bg, cancel := context.WithCancel(context.WithoutCancel(ctx))
	r.cancel = cancel
	hcfg.Logger = log
	hcfg.Registerer = promReg
	checker, err := openai.NewHealthChecker(reg, hcfg)
	if err != nil {
		cancel()
		r.ln.Close()
		r.aln.Close()
		closeCluster()
		return nil, err
	}
	// The server's own complaints (a scanner's failed TLS handshake, a malformed request
	// line) go to the structured log at debug: a client cannot flood the error log.
	r.http = &http.Server{Handler: r.closeWhileDraining(r.server.Handler()), ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	admin := &adminAPI{rep: r, token: cfg.AdminToken}
	r.admin = &http.Server{Handler: admin.handler(openai.AdminHandler(promReg)), ReadHeaderTimeout: 10 * time.Second}
	r.goRun(func() { checker.Run(bg) })
	for _, sub := range subs {
		r.goRun(func() {
			if err := sub.Run(bg); err != nil && bg.Err() == nil {
				log.Error("KV event subscriber stopped", "err", err)
			}
		})
	}
	if r.share != nil {
		r.share.run(r, bg, log)
	}
	r.goRun(func() { r.housekeeping(bg) })
	r.goRun(func() { r.syncWorkers(bg) })
	r.goRun(func() { r.watchWorkerHealth(bg) })
	r.goRun(func() {
		if err := r.http.Serve(r.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("client listener stopped", "err", err)
		}
	})
	r.goRun(func() {
		if err := r.admin.Serve(r.aln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("admin listener stopped", "err", err)
		}
	})
	return r, nil
}

func (r *replica) goRun(fn func()) {
	r.wg.Add(1)
	go func() { defer r.wg.Done(); fn() }()
}

// housekeeping expires approximate index entries and idle sessions.
func (r *replica) housekeeping(ctx context.Context) {
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

// Addr is the client listener's address.
func (r *replica) Addr() string { return r.ln.Addr().String() }

// AdminAddr is the admin listener's address.
func (r *replica) AdminAddr() string { return r.aln.Addr().String() }

// kvEventSubscribers builds the precise index and its KV event subscribers: one connecting
// SUB per worker rank whose spec names kv_events, and, when KVEventsBind is set, one bound SUB
// per data-parallel rank of the largest worker, on that endpoint's port + rank.
// Without either, precise mode is off and r.precise stays nil.
func (r *replica) kvEventSubscribers(reg prometheus.Registerer, log *slog.Logger) ([]*kvevents.Subscriber, error) {
	cfg := r.cfg
	var specs []routing.WorkerSpec
	for _, st := range r.registry.List() {
		if st.Spec.KVEvents != "" {
			specs = append(specs, st.Spec)
		}
	}
	if len(specs) == 0 && cfg.KVEventsBind == "" {
		return nil, nil
	}
	r.precise = indexer.New(indexer.Options{})
	metrics, err := kvevents.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	base := kvevents.Config{BlockSize: r.blockSize(), Sink: r.precise, Metrics: metrics, Logger: log}
	var subs []*kvevents.Subscriber
	for _, spec := range specs {
		for rank := range max(spec.DPSize, 1) {
			c := base
			c.Mode = kvevents.Connect
			c.Worker = indexer.Worker{ID: spec.ID, DPRank: uint32(rank)}
			if c.Endpoint, err = kvevents.OffsetPort(spec.KVEvents, rank); err != nil {
				return nil, fmt.Errorf("worker %s kv_events: %w", spec.ID, err)
			}
			if spec.KVReplay != "" {
				if c.Replay, err = kvevents.OffsetPort(spec.KVReplay, rank); err != nil {
					return nil, fmt.Errorf("worker %s kv_replay: %w", spec.ID, err)
				}
			}
			sub, err := kvevents.NewSubscriber(c)
			if err != nil {
				return nil, fmt.Errorf("worker %s: %w", spec.ID, err)
			}
			subs = append(subs, sub)
		}
	}
	if cfg.KVEventsBind != "" {
		c := base
		c.Mode = kvevents.Bind
		c.TopicPattern = cfg.TopicPattern
		c.URLs = map[string]string{}
		c.Replays = map[string]string{}
		ranks := 1
		for _, st := range r.registry.List() {
			c.URLs[st.Spec.ID] = st.Spec.URL
			if st.Spec.KVReplay != "" {
				c.Replays[st.Spec.ID] = st.Spec.KVReplay
			}
			ranks = max(ranks, st.Spec.DPSize)
		}
		if strings.HasSuffix(cfg.KVEventsBind, ":0") {
			ranks = 1 // an ephemeral port has no neighbours a worker could know
		}
		// vLLM connects rank r of a worker to our port + r: one bound socket per rank.
		for rank := range ranks {
			rc := c
			rc.Rank = rank
			ep, err := kvevents.OffsetPort(cfg.KVEventsBind, rank)
			if err != nil {
				return nil, fmt.Errorf("--kv-events-bind (dp rank %d): %w", rank, err)
			}
			rc.Endpoint = ep
			sub, err := kvevents.NewSubscriber(rc)
			if err != nil {
				return nil, fmt.Errorf("--kv-events-bind: %w", err)
			}
			subs = append(subs, sub)
		}
	}
	return subs, nil
}

// blockSize is the block size the router will use (its config's, or the default); the KV event
// subscribers are built before the router.
func (r *replica) blockSize() int {
	if r.cfg.Router.BlockSize > 0 {
		return r.cfg.Router.BlockSize
	}
	return indexer.DefaultBlockSize
}
