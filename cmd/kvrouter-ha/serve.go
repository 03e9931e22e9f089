package main

import (
	"context"
	"encoding/base64"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/peterbourgon/ff/v3/ffcli"

	"github.com/kvrouter-ha/kvrouter-ha/cluster"
	"github.com/kvrouter-ha/kvrouter-ha/cluster/hints"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/gcfloor"
	"github.com/kvrouter-ha/kvrouter-ha/internal/telemetry"
	"github.com/kvrouter-ha/kvrouter-ha/replica"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/enginemetrics"
	"github.com/kvrouter-ha/kvrouter-ha/transport/extproc"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

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
	for _, item := range splitList(v) {
		id, url, ok := strings.Cut(item, "=")
		if !ok {
			id, url = fmt.Sprintf("w%d", len(*f.specs)), item
		}
		*f.specs = append(*f.specs, routing.WorkerSpec{ID: id, URL: url})
	}
	return nil
}

// splitList is a comma-separated flag's items, trimmed, empty ones dropped.
func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// readSecret is a flag's value, else the named file's content, else the environment
// variable's, trimmed.
func readSecret(value, file, env, what string) (string, error) {
	if value == "" && file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return "", fmt.Errorf("%s file: %w", what, err)
		}
		value = string(b)
	}
	if value == "" && env != "" {
		value = os.Getenv(env)
	}
	return strings.TrimSpace(value), nil
}

// loadWorkersFile reads a JSON array of worker specs (workers.ParseSpecs, which the file
// discovery source reads with too).
func loadWorkersFile(path string) ([]routing.WorkerSpec, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("workers file: %w", err)
	}
	specs, err := workers.ParseSpecs(b)
	if err != nil {
		return nil, fmt.Errorf("workers file %s: %w", path, err)
	}
	return specs, nil
}

// gossipKeyFlags are the gossip key's sources: the flag, its file, $KVROUTER_GOSSIP_KEY.
type gossipKeyFlags struct{ key, file string }

// decode reads the configured base64 key (nil: none).
func (k gossipKeyFlags) decode() ([]byte, error) {
	raw, err := readSecret(k.key, k.file, "KVROUTER_GOSSIP_KEY", "gossip key")
	if err != nil || raw == "" {
		return nil, err
	}
	key, err := base64.StdEncoding.DecodeString(raw)
	if err != nil {
		return nil, fmt.Errorf("gossip key: not base64: %w", err)
	}
	return key, nil
}

// defaultGCHeapFloor is --gc-heap-floor-bytes' default: at 64 MiB a replica with a small
// index collects about a sixteenth as often under load as at GOGC 100 alone.
const defaultGCHeapFloor = 64 << 20

func serveCommand(stdout, stderr io.Writer) *ffcli.Command {
	fs := flag.NewFlagSet("kvrouter-ha serve", flag.ContinueOnError)
	var cfg replica.Config
	host, _ := os.Hostname()
	fs.StringVar(&cfg.Listen, "listen", "127.0.0.1:8080", "client (OpenAI) listen address")
	fs.StringVar(&cfg.AdminListen, "admin-listen", "127.0.0.1:9090", "admin listen address (/metrics)")
	fs.StringVar(&cfg.ID, "replica-id", host, "this replica's name, sent as X-Kvrouter-Replica")
	fs.StringVar(&cfg.ExtProcListen, "ext-proc-listen", "", "serve the Gateway API endpoint picker (Envoy ext_proc over gRPC, with the gRPC health services) on this address (empty: off)")
	fs.Func("ext-proc-target-ports", "endpoint picker: the InferencePool's targetPorts, comma-separated: rank r of a worker is its URL's host at the r-th port (empty: every rank at its URL's port, the rank in X-Data-Parallel-Rank)", func(v string) error {
		ports, err := parsePorts(v)
		cfg.ExtProc.TargetPorts = ports
		return err
	})
	// The endpoint picker's and the client port's bounds: what a gateway or client may hold
	// open without sending, and who may connect to the picker.
	fs.StringVar(&cfg.ExtProcTLS.CertFile, "ext-proc-tls-cert-file", "", "endpoint picker: serve its port over TLS with this certificate (PEM; with --ext-proc-tls-key-file)")
	fs.StringVar(&cfg.ExtProcTLS.KeyFile, "ext-proc-tls-key-file", "", "endpoint picker: the key of --ext-proc-tls-cert-file (PEM)")
	fs.StringVar(&cfg.ExtProcTLS.ClientCAFile, "ext-proc-tls-client-ca-file", "", "endpoint picker: take only gateways whose client certificate verifies against this CA (PEM; needs --ext-proc-tls-cert-file)")
	fs.DurationVar(&cfg.ExtProc.IdleTimeout, "ext-proc-idle-timeout", extproc.DefaultIdleTimeout, "endpoint picker: end a stream that owes the picker its next message this long (request incomplete, or response ended); a stream waiting for the upstream's answer is not idle (negative: never)")
	fs.IntVar(&cfg.ExtProc.MaxStreams, "ext-proc-max-streams", extproc.DefaultMaxStreams, "endpoint picker: streams open at once across all connections, ext_proc and health Watch together; an ext_proc stream past it is answered 503 and ended RESOURCE_EXHAUSTED (Envoy holds one per request until its response ends; negative: no cap)")
	fs.Func("ext-proc-max-streams-per-connection", fmt.Sprintf("endpoint picker: concurrent streams per HTTP/2 connection (SETTINGS_MAX_CONCURRENT_STREAMS; Envoy opens more connections past it) (default %d)", extproc.DefaultMaxStreamsPerConnection), func(v string) error {
		n, err := strconv.ParseUint(v, 10, 32)
		if err != nil || n == 0 {
			return fmt.Errorf("want a positive count, got %q", v)
		}
		cfg.ExtProc.MaxStreamsPerConnection = uint32(n)
		return nil
	})
	fs.DurationVar(&cfg.ExtProc.Keepalive, "ext-proc-keepalive", extproc.DefaultKeepalive, "endpoint picker: ping a gateway connection quiet this long")
	fs.DurationVar(&cfg.ExtProc.KeepaliveTimeout, "ext-proc-keepalive-timeout", extproc.DefaultKeepaliveTimeout, "endpoint picker: close a connection whose ping goes unanswered this long, ending its streams")
	fs.DurationVar(&cfg.ClientPort.IdleTimeout, "client-idle-timeout", replica.DefaultClientIdleTimeout, "client port: close a keep-alive connection quiet this long between requests")
	fs.DurationVar(&cfg.ClientPort.HeaderTimeout, "client-header-timeout", replica.DefaultClientHeaderTimeout, "client port: time to send a request's headers")
	fs.DurationVar(&cfg.ClientPort.BodyTimeout, "client-body-timeout", replica.DefaultClientBodyTimeout, "client port: time to send a request's whole body, from its headers on (408 past it); answers are not bounded by it")
	fs.StringVar(&cfg.ClientPort.Server, "http-server", replica.ServerFast, "client port: the HTTP server, "+replica.ServerFast+" (the router's own HTTP/1.1 server: less CPU per request, stricter parsing; see transport/h1/DESIGN.md) or "+replica.ServerNet+" (Go's net/http); both run the same handlers and serve HTTP/1.1 only, with TLS too")
	fs.Var(workerFlag{&cfg.Workers}, "worker", "a worker as id=url (repeatable, or comma-separated)")
	workersFile := fs.String("workers-file", "", "JSON array of worker specs: id, url, kv_events (the worker's ZMQ KV-event PUB, rank 0), kv_replay (its replay ROUTER, rank 0: recovers gaps and detects engine restarts), role, dp_size, capacity_blocks, loras, models")
	registerDiscoveryFlags(fs, &cfg.Discovery)
	fs.StringVar(&cfg.Router.Policy, "policy", "kv", "selection policy: "+strings.Join(routing.Policies(), ", "))
	fs.IntVar(&cfg.Router.BlockSize, "block-size", indexer.DefaultBlockSize, "KV block size in tokens (must match the workers')")
	fs.Float64Var(&cfg.Router.PrefillWeight, "prefill-weight", 1, "kv policy: weight of prefill blocks in the cost")
	fs.Float64Var(&cfg.Router.OverlapWeight, "overlap-weight", routing.DefaultOverlapWeight, "kv policy: weight of each prompt block a worker does not cache against one block of prefill queued there (its prefill now, and a second copy of the prefix in the fleet's caches)")
	fs.Float64Var(&cfg.Router.Temperature, "temperature", 0, "kv policy: 0 picks the cheapest worker; >0 samples by softmax over costs")
	fs.Float64Var(&cfg.Router.BusyDecodeFraction, "busy-decode-fraction", 0, "a worker whose decode blocks exceed this share of capacity_blocks is busy (0: off)")
	fs.Int64Var(&cfg.Router.BusyPrefillTokens, "busy-prefill-tokens", 0, "a worker with more in-flight prefill tokens is busy (0: off)")
	fs.StringVar(&cfg.Router.Disagg.Mode, "disagg", routing.DisaggConditional, "prefill/decode disaggregation, with workers of role prefill: "+strings.Join(routing.DisaggModes(), ", ")+" (conditional: only a prompt with --disagg-min-uncached-tokens uncached where it decodes, while the prefill worker is not over --disagg-max-prefill-queue-tokens)")
	fs.IntVar(&cfg.Router.Disagg.MinUncachedTokens, "disagg-min-uncached-tokens", 1024, "conditional disaggregation: prompt tokens the decode worker lacks for its prefill to go to a prefill worker")
	fs.Int64Var(&cfg.Router.Disagg.MaxPrefillQueueTokens, "disagg-max-prefill-queue-tokens", 0, "conditional disaggregation: serve aggregated when the chosen prefill worker has more in-flight prefill tokens (0: no limit)")
	fs.IntVar(&cfg.Router.QueueSize, "queue-size", 64, "requests that may wait while every worker is busy")
	fs.DurationVar(&cfg.Router.QueueWait, "queue-wait", 5*time.Second, "how long a request waits for a non-busy worker before 503")
	fs.IntVar(&cfg.Router.MaxRetries, "max-retries", 2, "retries on another worker before the first byte")
	fs.IntVar(&cfg.Proxy.MigrationLimit, "migration-limit", 0, "times a streamed chat or completion whose worker fails after the first byte may move to another worker, continued from the text already sent (as Dynamo's --migration-limit; a move does not spend --max-retries); 0 ends such a stream with an error event")
	fs.DurationVar(&cfg.ApproxTTL, "approx-ttl", 120*time.Second, "how long a routing decision counts as cached on its worker")
	fs.IntVar(&cfg.ApproxMaxBlocks, "approx-max-blocks", 1<<20, "per-worker cap of remembered blocks from decisions (prompts, and the blocks their answers generated); the workers' KV cache size in blocks is the faithful value")
	fs.DurationVar(&cfg.SessionTTL, "session-ttl", 10*time.Minute, "a session binding idles out this long after its last request ends")
	fs.IntVar(&cfg.MaxSessions, "max-sessions", 1_000_000, "cap on bound sessions; beyond it new sessions get 429")
	fs.Int64Var(&cfg.Proxy.MaxBodyBytes, "max-body-bytes", 8<<20, "largest request body accepted (413 beyond)")
	fs.DurationVar(&cfg.Proxy.ConnectTimeout, "connect-timeout", 2*time.Second, "worker connect timeout")
	fs.DurationVar(&cfg.Proxy.FirstByteTimeout, "first-byte-timeout", 5*time.Minute, "time for a worker to start answering")
	fs.DurationVar(&cfg.Proxy.IdleTimeout, "idle-timeout", 2*time.Minute, "longest gap between streamed chunks")
	fs.DurationVar(&cfg.Proxy.ReservationTTL, "reservation-ttl", 10*time.Minute, "decision service: a reservation (POST /v1/reserve) not released within this ends by itself")
	fs.Func("session-headers", "headers a session key is read from, comma-separated, the first present winning (default X-Session-ID,X-Dynamo-Session-ID)", func(v string) error {
		cfg.Proxy.SessionHeaders = nil
		for h := range strings.SplitSeq(v, ",") {
			if h = strings.TrimSpace(h); h != "" {
				cfg.Proxy.SessionHeaders = append(cfg.Proxy.SessionHeaders, h)
			}
		}
		return nil
	})
	fs.BoolVar(&cfg.Proxy.NoResponsesAffinity, "no-responses-affinity", false, "do not bind stored Responses API answers to the worker that made them (one Raft write each) nor route previous_response_id there: for workers that keep no Responses state, such as vLLM without VLLM_ENABLE_RESPONSES_API_STORE=1")
	fs.IntVar(&cfg.Proxy.MaxReservations, "max-reservations", 1<<16, "decision service: reservations open at once; more are refused with 429")
	// Limits per client (transport/openai/limits.go): a client is its TCP peer's address, or
	// the trusted key header's last value.
	lim := &cfg.Proxy.ClientLimits
	fs.Float64Var(&lim.SessionRate, "client-session-rate", 50, "new sessions one client may open per second on this replica; past it and its burst, 429 with Retry-After (0: no limit; a request of a bound session is never limited)")
	fs.IntVar(&lim.SessionBurst, "client-session-burst", 200, "new sessions one client may open at once before --client-session-rate applies")
	fs.Float64Var(&lim.ReservationRate, "client-reservation-rate", 1000, "decision service: reservations (POST /v1/reserve) one client may make per second on this replica (0: no limit)")
	fs.IntVar(&lim.ReservationBurst, "client-reservation-burst", 2000, "decision service: reservations one client may make at once before --client-reservation-rate applies")
	fs.IntVar(&lim.MaxSessions, "client-max-sessions", 0, "live sessions this replica may bind for one client; past it new sessions get 429 until some end, so that one client cannot fill --max-sessions alone (0: a tenth of --max-sessions, at least 1000 or the whole cap if smaller)")
	fs.IntVar(&lim.MaxReservations, "client-max-reservations", 4096, "decision service: reservations one client may hold open (unreleased) on this replica; more get 429 (0: only --max-reservations)")
	fs.StringVar(&lim.KeyHeader, "client-key-header", "", "header naming the client for the limits per client instead of its address, e.g. X-Forwarded-For behind HAProxy or X-Api-Key; its last value counts, and only from a peer in --client-key-trusted-from (empty: the TCP peer's address)")
	fs.Func("client-key-trusted-from", "peers (CIDRs, comma-separated) whose --client-key-header is believed: the load balancers; from any other peer the header is ignored (default 127.0.0.0/8,::1/128)", func(v string) error {
		lim.TrustKeyFrom = []netip.Prefix{}
		for c := range strings.SplitSeq(v, ",") {
			if c = strings.TrimSpace(c); c == "" {
				continue
			}
			p, err := netip.ParsePrefix(c)
			if err != nil {
				return fmt.Errorf("client-key-trusted-from: %w", err)
			}
			lim.TrustKeyFrom = append(lim.TrustKeyFrom, p)
		}
		return nil
	})
	fs.IntVar(&lim.MaxClients, "client-limits-max-clients", 1<<16, "clients whose limits this replica remembers; the least recently seen is forgotten (and starts afresh)")
	fs.DurationVar(&cfg.Health.Interval, "health-interval", time.Second, "worker health probe interval")
	fs.DurationVar(&cfg.Health.Timeout, "health-timeout", time.Second, "one health probe's timeout (a busy worker answers slowly; too short a timeout drains a loaded fleet)")
	fs.IntVar(&cfg.Health.FailThreshold, "health-fail-threshold", 3, "consecutive failed probes that take a worker out")
	fs.IntVar(&cfg.Health.RiseThreshold, "health-rise-threshold", 2, "consecutive good probes that put it back")
	fs.DurationVar(&cfg.EngineMetrics.Interval, "engine-metrics-interval", enginemetrics.DefaultInterval, "how often each worker's Prometheus endpoint is scraped for the load its engine reports beyond this cluster's requests (vLLM's num_requests_running and _waiting, kv_cache_usage_perc, cache_config_info; SGLang's equivalents), which the policies then count: other clients' requests and the engine's queue (0: off)")
	fs.DurationVar(&cfg.EngineMetrics.Timeout, "engine-metrics-timeout", enginemetrics.DefaultTimeout, "one engine metrics scrape's timeout, connection included (a round waits for its slowest scrape)")
	fs.StringVar(&cfg.EngineMetrics.Path, "engine-metrics-path", enginemetrics.DefaultPath, "path of the workers' Prometheus endpoint")
	fs.Int64Var(&cfg.EngineMetrics.MaxBodyBytes, "engine-metrics-max-bytes", enginemetrics.DefaultMaxBodyBytes, "largest metrics body read from a worker; a larger one is a counted scrape error")
	fs.DurationVar(&cfg.EngineMetrics.StaleAfter, "engine-metrics-stale-after", 0, "a worker's engine load stops counting when its last good scrape is older than this (0: three intervals)")
	fs.IntVar(&cfg.EngineRequestTokens, "engine-metrics-request-tokens", routing.DefaultEngineRequestTokens, "prompt size given to a request seen only in an engine's metrics when neither its KV usage and capacity nor this cluster's requests there tell more")
	fs.StringVar(&cfg.KVEventsBind, "kv-events-bind", "", "bind a ZMQ SUB socket here for workers that connect their KV events to the router, e.g. tcp://127.0.0.1:5557, and one on each port + r for the data-parallel ranks r of the largest worker, where vLLM connects them (workers with kv_events in --workers-file get their own subscriber)")
	fs.StringVar(&cfg.KVEventsPublisherHosts, "kv-events-publisher-hosts", "", "comma-separated hosts (names or addresses) from which any worker's KV events may also connect to --kv-events-bind; by default a worker's publisher is accepted only from the host of its URL or kv_events endpoint, and only under its own topic (for NAT or multi-homed workers; * accepts any address: anyone who reaches the port can then forge or purge every worker's events)")
	fs.StringVar(&cfg.TopicPattern, "kv-events-topic-pattern", "kv@{host:port}@{model}", "how a bound subscriber tells workers apart: the {host:port} in a topic is matched against worker URLs")
	fs.DurationVar(&cfg.OverlayTTL, "overlay-ttl", 10*time.Second, "precise mode: how long the replica's own decisions count on top of the KV events")
	fs.StringVar(&cfg.Tokenizer, "tokenizer", "none", "text prompts: none (hash text in byte chunks) or worker (ask a worker's POST /tokenize, so text routes on exact token blocks)")
	fs.DurationVar(&cfg.ShutdownDelay, "shutdown-delay", 5*time.Second, "on SIGTERM, how long /readyz fails while the client port still serves, so a load balancer's health checks (e.g. HAProxy inter 1s fall 2) take the replica out first; a second signal cuts it short (0: no wait)")
	fs.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", 30*time.Second, "on SIGTERM, how long in-flight requests and streams may take to finish after the client port closes (the rest are cut), and then how long closing the replica's parts may take (one still closing is logged and left behind)")
	var join, gossipJoin string
	var key gossipKeyFlags
	registerClusterFlags(fs, &cfg.Cluster, &join)
	registerGossipFlags(fs, &cfg.Cluster.Gossip, &cfg.NoGossip, &gossipJoin, &key)
	registerTLSFlags(fs, &cfg.TLS)
	fs.StringVar(&cfg.AdminToken, "admin-token", "", "bearer token for the admin API (prefer --admin-token-file or KVROUTER_ADMIN_TOKEN: flags show in ps)")
	adminTokenFile := fs.String("admin-token-file", "", "file holding the admin API bearer token; without a token, an --admin-listen beyond loopback requires one made at first start in --data-dir/admin.token (mode 0600; kvrouter-ha ctl --token-file reads it), and one on loopback stays open")
	fs.BoolVar(&cfg.InsecureOpenCluster, "insecure-open-cluster", false, "INSECURE: start even though a Raft, peer or gossip listen or advertise address reaches beyond loopback without peer mutual TLS (--peer-tls-*) and a gossip key; anyone who reaches those ports is then a full member of the cluster (every start warns, port by port)")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	gcHeapFloor := fs.Uint64("gc-heap-floor-bytes", defaultGCHeapFloor, "the Go collector runs no sooner than the heap reaches this size (GOGC is raised while the live heap is smaller, and given back once it is not): fewer collections per request, up to this much more resident memory; 0: GOGC alone decides (GOMEMLIMIT still applies)")
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
				cfg.WorkersFromFile = map[string]bool{}
				for _, s := range specs {
					cfg.WorkersFromFile[s.ID] = true
				}
			}
			if cfg.AdminToken, err = readSecret(cfg.AdminToken, *adminTokenFile, "", "admin token"); err != nil {
				return err
			}
			cfg.Cluster.Join, cfg.Cluster.Gossip.Join = splitList(join), splitList(gossipJoin)
			if cfg.Cluster.Gossip.Key, err = key.decode(); err != nil {
				return err
			}
			// Tracing is off unless the standard OTEL_* variables turn it on.
			tracing, err := telemetry.FromEnv(ctx, cfg.ID)
			if err != nil {
				return err
			}
			defer func() {
				sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				if err := tracing.Shutdown(sctx); err != nil {
					log.Warn("tracing shutdown", "err", err)
				}
			}()
			if tracing.Enabled() {
				cfg.Proxy.Tracer = tracing.Provider
				log.Info("tracing on: spans go to the OTLP endpoint of the OTEL_* variables")
			}
			gcCtx, stopGC := context.WithCancel(ctx)
			defer stopGC()
			go gcfloor.Run(gcCtx, *gcHeapFloor)
			rep, err := replica.Start(ctx, cfg)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, "kvrouter-ha %s: serving on %s://%s, admin on http://%s, %d workers, policy %s\n",
				cfg.ID, rep.Scheme(), rep.Addr(), rep.AdminAddr(), len(cfg.Workers), rep.Policy())
			<-ctx.Done()
			skip, stopSignals := secondSignal()
			defer stopSignals()
			return rep.Shutdown(skip)
		},
	}
}

// registerDiscoveryFlags declares the discovery flags on fs: where the leader finds workers
// at run time, beside --worker, --workers-file and the admin API.
func registerDiscoveryFlags(fs *flag.FlagSet, d *replica.DiscoveryConfig) {
	fs.Var(discoveryFlag{&d.Sources}, "discovery", "find workers at run time (repeatable, or comma-separated): file:PATH (a JSON array of worker specs, the --workers-file shape, re-read when it changes), dns:NAME:PORT (the name's A/AAAA records, each address:port a worker), dns-srv:NAME (its SRV records), or kubernetes:namespace=NS,selector=SEL,port=PORT or kubernetes:namespace=NS,pool=INFERENCEPOOL (the ready pods, watched through the API server; one that turns not ready keeps its sessions for --discovery-not-ready-grace; add kubeconfig=PATH outside a cluster; a kubernetes: value takes the rest of the flag value, commas and all); the leader adds, drains and removes them through Raft")
	fs.StringVar(&d.DNSServer, "discovery-dns-server", "", "host:port of the DNS server the dns discovery sources ask (default: the system's resolvers)")
	fs.DurationVar(&d.Interval, "discovery-interval", 10*time.Second, "how often the leader looks at each discovery source")
	fs.DurationVar(&d.DrainFor, "discovery-drain-for", 30*time.Second, "a discovered worker that is gone drains (no new requests, in-flight ones finish, its sessions move) this long before it is removed")
	fs.DurationVar(&d.SuspectFor, "discovery-suspect-for", time.Minute, "a look that would drain more than half of a source's workers at once waits this long (still saying so) before the drains go ahead")
	fs.DurationVar(&d.NotReadyGrace, "discovery-not-ready-grace", 30*time.Second, "a discovered worker its source sees but not ready (a Kubernetes pod whose readiness fails, not terminating) takes no new requests and keeps its sessions' bindings this long, then drains as a gone worker (0: drain at once)")
}

// listFlag collects a repeatable, comma-separated flag's values.
type listFlag struct{ values *[]string }

func (l listFlag) String() string {
	if l.values == nil {
		return ""
	}
	return strings.Join(*l.values, ",")
}

func (l listFlag) Set(v string) error {
	*l.values = append(*l.values, splitList(v)...)
	return nil
}

// discoveryFlag is --discovery: a comma-separated list, except that a kubernetes: source,
// whose options are themselves comma-separated, takes the rest of the value.
type discoveryFlag struct{ values *[]string }

func (l discoveryFlag) String() string { return listFlag(l).String() }

func (l discoveryFlag) Set(v string) error {
	head, k8s, found := strings.Cut(v, "kubernetes:")
	*l.values = append(*l.values, splitList(head)...)
	if found {
		*l.values = append(*l.values, "kubernetes:"+strings.TrimSpace(k8s))
	}
	return nil
}

// registerClusterFlags declares the cluster flags on fs (--join into join, comma-separated).
func registerClusterFlags(fs *flag.FlagSet, c *replica.ClusterConfig, join *string) {
	fs.StringVar(&c.DataDir, "data-dir", "kvrouter-data", "directory for the Raft log, snapshots and the cluster id (one per replica)")
	fs.StringVar(&c.RaftListen, "raft-listen", "127.0.0.1:7000", "Raft TCP listen address")
	fs.StringVar(&c.RaftAdvert, "raft-advertise", "", "Raft address other replicas dial (default: --raft-listen)")
	fs.StringVar(&c.PeerListen, "peer-listen", "127.0.0.1:7001", "peer gRPC listen address (forwarding, read-index, join)")
	fs.StringVar(&c.PeerAdvert, "peer-advertise", "", "peer address other replicas dial (default: --peer-listen)")
	fs.IntVar(&c.BootstrapExpect, "bootstrap-expect", 1, "replicas that form a new cluster together (1: a lone replica bootstraps itself)")
	fs.StringVar(join, "join", "", "comma-separated peer addresses of other replicas, or a DNS name resolving to them (host:port)")
	fs.StringVar(&c.Consistency, "consistency", "bounded", "binding reads: linearizable, bounded or local")
	fs.DurationVar(&c.StaleBound, "stale-bound", time.Second, "bounded reads: a read reflects every binding change acknowledged longer ago than this; a replica that cannot renew its read lease through the leader within it answers 503 and turns unready")
	fs.DurationVar(&c.BindWait, "bind-wait", 3*time.Second, "how long a request waits for a leader (new session) or for contact (bounded read) before 503")
	fs.BoolVar(&c.BindBeforeDispatch, "bind-before-dispatch", false, "commit every new session's binding before its first request reaches a worker: a leader cut off from its quorum then always refuses with a 503 the balancer retries, at the cost of one Raft commit before each new session's prefill; off, the binding commits beside the prefill, and first only while the replica's contact with its quorum is not fresh (a request reaching a leader within about 100 ms of its being cut off may then get a 502)")
	fs.DurationVar(&c.Heartbeat, "raft-heartbeat-timeout", 500*time.Millisecond, "Raft heartbeat timeout")
	fs.DurationVar(&c.Election, "raft-election-timeout", 500*time.Millisecond, "Raft election timeout")
	fs.DurationVar(&c.LeaderLease, "raft-leader-lease-timeout", 250*time.Millisecond, "Raft leader lease timeout")
	fs.DurationVar(&c.Commit, "raft-commit-timeout", 5*time.Millisecond, "Raft commit timeout")
	fs.DurationVar(&c.CheckpointInterval, "checkpoint-interval", 30*time.Second, "how often the leader records remaining session TTLs")
	fs.DurationVar(&c.SnapshotInterval, "snapshot-interval", 2*time.Minute, "how often Raft checks whether to snapshot")
	fs.Uint64Var(&c.SnapshotThreshold, "snapshot-threshold", 65536, "log entries since the last snapshot that trigger one")
	fs.IntVar(&c.SnapshotRetain, "snapshot-retain", 3, "snapshots kept on disk")
	fs.Uint64Var(&c.TrailingLogs, "raft-trailing-logs", 10240, "log entries a snapshot leaves in raft.db for followers that lag a little (it sets raft.db's size after a snapshot)")
	fs.Int64Var(&c.CompactMinBytes, "raft-log-compact-min-bytes", cluster.DefaultCompactMinBytes, "rewrite raft.db after a snapshot once at least this many bytes and half the file are free (bbolt never shrinks it otherwise)")
	fs.DurationVar(&c.WorkerGrace, "worker-grace", 10*time.Second, "a worker unhealthy this long loses its session bindings")
	fs.DurationVar(&c.TouchFlush, "touch-flush", 20*time.Millisecond, "how long session touches coalesce before they go to the leader")
}

// registerGossipFlags declares the gossip flags on fs.
func registerGossipFlags(fs *flag.FlagSet, c *replica.GossipConfig, noGossip *bool, join *string, k *gossipKeyFlags) {
	fs.BoolVar(noGossip, "no-gossip", false, "share nothing with other replicas but the Raft bindings: no membership, merged health, decisions, load or index snapshots (for comparison runs)")
	fs.StringVar(&c.Listen, "gossip-listen", "127.0.0.1:7002", "gossip TCP+UDP listen address")
	fs.StringVar(&c.Advertise, "gossip-advertise", "", "gossip address other replicas dial (default: --gossip-listen)")
	fs.StringVar(join, "gossip-join", "", "comma-separated gossip addresses of other replicas, or a DNS name (default: the hosts of --join at this replica's gossip port)")
	fs.StringVar(&k.key, "gossip-key", "", "base64 key (16, 24 or 32 bytes) that encrypts and authenticates gossip; every replica needs the same (prefer --gossip-key-file or KVROUTER_GOSSIP_KEY)")
	fs.StringVar(&k.file, "gossip-key-file", "", "file holding the base64 gossip key")
	fs.IntVar(&c.MaxBytesPerSecond, "gossip-max-bytes-per-second", replica.DefaultGossipBudget, "outbound gossip budget of this replica; past it hints are dropped and counted (decisions dominate: about 8 bytes per new prompt block per peer)")
	fs.IntVar(&c.MinQuorum, "min-quorum", 3, "reconciliation never removes a dead replica's vote below this many voters")
	fs.DurationVar(&c.CleanupInterval, "cleanup-interval", 5*time.Minute, "a replica dead this long (and unreachable by Raft) loses its vote")
	fs.DurationVar(&c.LoadInterval, "load-share-interval", hints.DefaultLoadInterval, "how often this replica publishes its per-worker in-flight load in full (changes go at once, see --load-share-coalesce)")
	fs.DurationVar(&c.LoadCoalesce, "load-share-coalesce", hints.DefaultLoadCoalesce, "least time between two reports of load changes (a request started, had its first token, ended): the first change goes at once, later ones wait this long so that each peer gets at most one report per this duration")
	fs.DurationVar(&c.DecisionFlush, "decision-flush-interval", hints.DefaultDecisionFlush, "how often this replica's routing decisions go to the others, batched")
	fs.DurationVar(&c.HealthInterval, "health-gossip-interval", 200*time.Millisecond, "how often worker health changes are gossiped")
	fs.DurationVar(&c.SnapshotDiscovery, "index-snapshot-discovery", hints.DefaultSnapshotDiscovery, "how long a starting replica waits for a peer to pull the index from before it starts empty")
	fs.Int64Var(&c.SnapshotMaxBytes, "index-snapshot-max-bytes", peer.DefaultMaxSnapshotBytes, "largest index snapshot accepted from a peer")
	fs.DurationVar(&c.JoinWait, "gossip-join-wait", 5*time.Second, "how long start waits for a gossip seed before it goes on and keeps trying in the background")
}

// registerTLSFlags declares the TLS flags on fs.
func registerTLSFlags(fs *flag.FlagSet, c *replica.TLSFiles) {
	fs.StringVar(&c.CertFile, "tls-cert-file", "", "PEM certificate (leaf first, then intermediates) for HTTPS on the client port; needs --tls-key-file")
	fs.StringVar(&c.KeyFile, "tls-key-file", "", "PEM private key of --tls-cert-file")
	fs.StringVar(&c.PeerCertFile, "peer-tls-cert-file", "", "PEM certificate for mutual TLS between replicas on the peer and Raft ports: signed by --peer-tls-ca-file, with a SAN for every --peer-advertise/--raft-advertise host, usable for server and client auth; needs --peer-tls-key-file and --peer-tls-ca-file")
	fs.StringVar(&c.PeerKeyFile, "peer-tls-key-file", "", "PEM private key of --peer-tls-cert-file")
	fs.StringVar(&c.PeerCAFile, "peer-tls-ca-file", "", "PEM CA certificate(s) every replica's certificate must chain to; replicas refuse any other")
}

// secondSignal returns a channel closed when SIGINT or SIGTERM arrives again after the first
// (which cancelled the serve context), so an operator can cut the shutdown delay short; stop
// releases the signal handler.
func secondSignal() (skip <-chan struct{}, stop func()) {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	ch := make(chan struct{})
	done := make(chan struct{})
	go func() {
		select {
		case <-sigs:
			close(ch)
		case <-done:
		}
	}()
	return ch, func() {
		signal.Stop(sigs)
		close(done)
	}
}

// parsePorts reads a comma-separated list of TCP ports.
func parsePorts(v string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(v, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 || n > 65535 {
			return nil, fmt.Errorf("%q is not a TCP port", f)
		}
		out = append(out, n)
	}
	return out, nil
}
