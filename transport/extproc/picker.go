// Package extproc is the replica's endpoint picker for gateways: the Gateway API Inference
// Extension's endpoint-picker protocol over Envoy's ext_proc. The gateway streams each
// request's headers and body to the picker, which routes it with the same code as the
// replica's own proxy (transport/openai's Hold: the session bound in Raft, the KV-aware
// selection, the load counted and gossiped, P/D) and names the chosen endpoint in the
// x-gateway-destination-endpoint header and envoy.lb metadata; the gateway carries the
// bytes, and the picker releases the decision when the answer's stream ends. Every replica
// picks and reports serving: the pickers are active-active. See DESIGN.md.
package extproc

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// The protocol's names.
const (
	// HeaderDestination names the picked endpoint(s) on the request to the gateway.
	HeaderDestination = "x-gateway-destination-endpoint"
	// KeyServed is the envoy.lb metadata key the gateway names the endpoint that served with.
	KeyServed = "x-gateway-destination-endpoint-served"
	// KeySubset is the subset hint's key: the endpoints the picker may choose from.
	KeySubset = "x-gateway-destination-endpoint-subset"
	// NamespaceLB is the metadata namespace of the picked and served endpoints.
	NamespaceLB = "envoy.lb"
	// NamespaceSubset is the metadata namespace of the subset hint.
	NamespaceSubset = "envoy.lb.subset_hint"
	// HeaderPrefiller names a disaggregated request's prefill endpoint, as llm-d's decode
	// sidecar reads it.
	HeaderPrefiller = "x-prefiller-host-port"
	// headerDPRank names a worker's data-parallel rank when the ranks share one port.
	headerDPRank = "x-data-parallel-rank"
)

// Front is the replica's OpenAI front, whose decisions the picker holds.
type Front interface {
	Hold(ctx context.Context, h http.Header, body []byte, opts openai.HoldOptions) (*openai.Held, *openai.Error)
	MaxBodyBytes() int64
	Readiness() error
}

// Config tunes a Picker.
type Config struct {
	// TargetPorts are the InferencePool's targetPorts: rank r of a worker is the endpoint
	// at its URL's host and TargetPorts[r]. Empty: every rank is at its URL's port, and the
	// rank goes to the worker in the X-Data-Parallel-Rank header, as the proxy sends it.
	TargetPorts []int
	// Ready, when set, is checked before the front's readiness (a replica that is stopping).
	Ready func() error
	// TLS, when set, serves the port over TLS (with ClientAuth and ClientCAs set, only to
	// gateways whose certificate verifies).
	TLS *tls.Config
	// IdleTimeout ends a stream that owes the picker its next message for this long: before
	// the request is complete (headers, body, trailers) or after its response has ended. A
	// stream waiting for the upstream's answer is not idle. 0: DefaultIdleTimeout; <0: none.
	IdleTimeout time.Duration
	// MaxStreams caps the streams open at once across every connection (ext_proc streams and
	// health Watch streams together); an ext_proc stream past it is answered 503 at once and
	// ended with RESOURCE_EXHAUSTED, a Watch refused RESOURCE_EXHAUSTED. 0: DefaultMaxStreams;
	// <0: none.
	MaxStreams int
	// MaxStreamsPerConnection is each HTTP/2 connection's SETTINGS_MAX_CONCURRENT_STREAMS.
	// 0: DefaultMaxStreamsPerConnection.
	MaxStreamsPerConnection uint32
	// Keepalive pings a connection quiet for this long, and KeepaliveTimeout closes it when
	// the ping goes unanswered: a dead gateway's connection and its streams go.
	// 0: DefaultKeepalive, DefaultKeepaliveTimeout.
	Keepalive, KeepaliveTimeout time.Duration
	Logger                      *slog.Logger
	Registerer                  prometheus.Registerer
}

// The defaults, sized for Envoy: it opens one stream per request and keeps it for the
// whole response, so a replica carrying thousands of generations holds as many streams.
const (
	DefaultIdleTimeout             = 30 * time.Second
	DefaultMaxStreams              = 10000
	DefaultMaxStreamsPerConnection = 1000
	DefaultKeepalive               = 30 * time.Second
	DefaultKeepaliveTimeout        = 10 * time.Second
)

// withDefaults fills zero fields.
func (c Config) withDefaults() Config {
	if c.IdleTimeout == 0 {
		c.IdleTimeout = DefaultIdleTimeout
	}
	if c.MaxStreams == 0 {
		c.MaxStreams = DefaultMaxStreams
	}
	if c.MaxStreamsPerConnection == 0 {
		c.MaxStreamsPerConnection = DefaultMaxStreamsPerConnection
	}
	if c.Keepalive == 0 {
		c.Keepalive = DefaultKeepalive
	}
	if c.KeepaliveTimeout == 0 {
		c.KeepaliveTimeout = DefaultKeepaliveTimeout
	}
	return c
}

// Picker serves the endpoint-picker protocol. Create it with New, register it on a gRPC
// server with Register (or serve a listener with Serve), and Close it.
type Picker struct {
	extprocv3.UnimplementedExternalProcessorServer
	cfg     Config
	front   Front
	log     *slog.Logger
	metrics *metrics

	addrs  addrCache
	open   atomic.Int64 // streams open (ext_proc and health Watch), against MaxStreams
	mu     sync.Mutex
	closed bool
	srv    *grpc.Server
}

// New makes a picker over front.
func New(cfg Config, front Front) (*Picker, error) {
	for i, p := range cfg.TargetPorts {
		if p <= 0 || p > 65535 {
			return nil, fmt.Errorf("extproc: target port %d (rank %d) is not a TCP port", p, i)
		}
	}
	if cfg.Keepalive < 0 || cfg.KeepaliveTimeout < 0 {
		return nil, errors.New("extproc: keepalive durations must not be negative")
	}
	cfg = cfg.withDefaults()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	p := &Picker{cfg: cfg, front: front, log: cfg.Logger, metrics: newMetrics()}
	if cfg.Registerer != nil {
		if err := p.metrics.register(cfg.Registerer); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// Register adds the ext_proc service and the gRPC health service to s.
func (p *Picker) Register(s *grpc.Server) {
	extprocv3.RegisterExternalProcessorServer(s, p)
	healthpb.RegisterHealthServer(s, &health{p: p})
}

// ServerOptions are the gRPC server's options for the picker's port: TLS when configured,
// the per-connection stream cap, keepalive pings that close dead connections, and a
// lenient enforcement of the gateway's own pings (Envoy's interval is the operator's).
func (p *Picker) ServerOptions() []grpc.ServerOption {
	c := p.cfg
	opts := []grpc.ServerOption{
		grpc.MaxConcurrentStreams(c.MaxStreamsPerConnection),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: c.Keepalive, Timeout: c.KeepaliveTimeout}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: minPingInterval, PermitWithoutStream: true}),
	}
	if c.TLS != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(c.TLS)))
	}
	return opts
}

// minPingInterval is the shortest gap between a gateway's keepalive pings the picker
// accepts; a gateway pinging faster is sent away (GOAWAY), as gRPC does.
const minPingInterval = 5 * time.Second

// Serve serves the picker on ln until Close; it returns nil after Close.
func (p *Picker) Serve(ln net.Listener) error {
	s := grpc.NewServer(p.ServerOptions()...)
	p.Register(s)
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		ln.Close()
		return nil
	}
	p.srv = s
	p.mu.Unlock()
	if err := s.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("extproc: %w", err)
	}
	return nil
}

// Close stops serving: open streams end (their decisions released) and the port closes.
func (p *Picker) Close() {
	if srv := p.closing(); srv != nil {
		srv.Stop()
	}
}

// Shutdown stops taking streams and waits for the open ones to end, until ctx ends; then it
// cuts them (Close) and returns ctx's error.
func (p *Picker) Shutdown(ctx context.Context) error {
	srv := p.closing()
	if srv == nil {
		return nil
	}
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		srv.Stop()
		<-done
		return ctx.Err()
	}
}

// closing marks the picker closed and returns its server, if serving.
func (p *Picker) closing() *grpc.Server {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	return p.srv
}

// ready is the picker's readiness: the replica's, then the front's (a routable worker).
func (p *Picker) ready() error {
	if p.cfg.Ready != nil {
		if err := p.cfg.Ready(); err != nil {
			return err
		}
	}
	return p.front.Readiness()
}

// Process serves one gateway stream: one HTTP request and its response.
func (p *Picker) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	st := &stream{p: p, srv: srv, started: time.Now()}
	if !p.admit() {
		return st.overloaded(p.cfg.MaxStreams)
	}
	defer p.release()
	return st.run()
}

// admit counts a stream (ext_proc, or a health Watch) against MaxStreams; false: the
// picker holds its limit, and the stream is not counted.
func (p *Picker) admit() bool {
	limit := p.cfg.MaxStreams
	if limit <= 0 {
		return true
	}
	if p.open.Add(1) > int64(limit) {
		p.open.Add(-1)
		return false
	}
	return true
}

// release uncounts a stream admit counted.
func (p *Picker) release() {
	if p.cfg.MaxStreams > 0 {
		p.open.Add(-1)
	}
}

// endpoint is the protocol's name of target t: ip:port, the port by its rank. A worker
// named by a DNS name (a pod's stable name, say) is resolved, as a gateway sends to the
// endpoint's address without resolving it.
func (p *Picker) endpoint(ctx context.Context, t routing.Target) (string, error) {
	if t.Spec == nil {
		return "", fmt.Errorf("worker %s has no spec", t.Worker)
	}
	u, err := url.Parse(t.Spec.URL)
	if err != nil || u.Host == "" {
		return "", fmt.Errorf("worker %s: url %q has no host", t.Worker, t.Spec.URL)
	}
	host, port := u.Hostname(), u.Port()
	if port == "" {
		port = "80"
		if u.Scheme == "https" {
			port = "443"
		}
	}
	if len(p.cfg.TargetPorts) > 0 {
		r := int(t.Worker.DPRank)
		if r >= len(p.cfg.TargetPorts) {
			return "", fmt.Errorf("worker %s: rank %d has no target port (%d given)", t.Worker, r, len(p.cfg.TargetPorts))
		}
		port = strconv.Itoa(p.cfg.TargetPorts[r])
	}
	ip, err := p.addrs.resolve(ctx, host)
	if err != nil {
		return "", fmt.Errorf("worker %s: %w", t.Worker, err)
	}
	return net.JoinHostPort(ip, port), nil
}

// resolveTTL is how long a worker's resolved address is used before it is looked up again.
const resolveTTL = 30 * time.Second

// addrCache resolves worker host names, keeping each answer for resolveTTL.
type addrCache struct {
	mu     sync.Mutex
	byHost map[string]resolved
}

type resolved struct {
	ip      string
	expires time.Time
}

// resolve is host's first address; an IP address is its own.
func (c *addrCache) resolve(ctx context.Context, host string) (string, error) {
	if net.ParseIP(host) != nil {
		return host, nil
	}
	now := time.Now()
	c.mu.Lock()
	r, ok := c.byHost[host]
	c.mu.Unlock()
	if ok && now.Before(r.expires) {
		return r.ip, nil
	}
	addrs, err := net.DefaultResolver.LookupHost(ctx, host)
	if err != nil || len(addrs) == 0 {
		if ok {
			// The last answer stands while the resolver fails.
			return r.ip, nil
		}
		return "", fmt.Errorf("resolve %s: %w", host, err)
	}
	c.mu.Lock()
	if c.byHost == nil {
		c.byHost = map[string]resolved{}
	}
	c.byHost[host] = resolved{ip: addrs[0], expires: now.Add(resolveTTL)}
	c.mu.Unlock()
	return addrs[0], nil
}

// ranksShareAPort: the rank goes to the worker in a header, not in the endpoint's port.
func (p *Picker) ranksShareAPort(t routing.Target) bool {
	return len(p.cfg.TargetPorts) == 0 && t.Spec != nil && t.Spec.DPSize > 1
}
