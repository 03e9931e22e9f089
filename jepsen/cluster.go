package jepsen

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	loaddr "github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// Wire names of the router's HTTP interface (DESIGN.md sections 3 and 8). The harness speaks
// only the wire, never the router's packages.
const (
	headerSession  = "X-Session-ID"
	headerWorker   = "X-Kvrouter-Worker"
	headerReplica  = "X-Kvrouter-Replica"
	headerRevision = "X-Kvrouter-Binding-Revision"
	// headerTargetWorker places a new session on a named worker.
	headerTargetWorker = "X-Target-Worker"
)

// network is where the cluster's processes live: plain loopback, or network namespaces in
// which partitions can be made.
type network interface {
	// describe says what the network is, for the report.
	describe() string
	// replicaHost, workerHost and lbHost are the IP addresses processes listen on.
	replicaHost(i int) string
	workerHost() string
	lbHost() string
	// addr returns host:port for a listener: a fixed port where each host is private, a free
	// one on shared loopback.
	addr(host string, port int) (string, error)
	// wrap is the command that runs a process where it should ("r0", ..., "workers", "lb"),
	// put before its argv (nil: right here).
	wrap(where string) []string
	// dial connects from the harness's vantage point, which can reach every process.
	dial(ctx context.Context, network, addr string) (net.Conn, error)
	canPartition() (bool, string)
	partition(ctx context.Context, f *fleet, cut [][2]int) error
	heal(ctx context.Context, f *fleet) error
	close() error
}

// loopback runs everything on 127.0.0.1. It cannot partition.
type loopback struct{ why string }

func (l loopback) describe() string                 { return "loopback (127.0.0.1)" }
func (loopback) replicaHost(int) string             { return "127.0.0.1" }
func (loopback) workerHost() string                 { return "127.0.0.1" }
func (loopback) lbHost() string                     { return "127.0.0.1" }
func (loopback) wrap(string) []string               { return nil }
func (l loopback) canPartition() (bool, string)     { return false, l.why }
func (loopback) close() error                       { return nil }
func (loopback) heal(context.Context, *fleet) error { return nil }

func (loopback) addr(string, int) (string, error) {
	// A random 127.x.y.z host: a port picked on 127.0.0.1 and bound later races with the
	// clients' ephemeral ports there.
	return loaddr.Addr()
}

func (loopback) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, network, addr)
}

func (l loopback) partition(context.Context, *fleet, [][2]int) error {
	return fmt.Errorf("%w: %s", errNoPartitions, l.why)
}

// replica is one kvrouter-ha serve process: its addresses, data directory and process.
type replica struct {
	proc.Replica
	index int
	proc  *proc.Process
}

// workerNode is one simulated worker process.
type workerNode struct {
	id   string
	addr string
	proc *proc.Process
}

// fleet is the cluster under test: replicas, workers and, optionally, HAProxy in front.
type fleet struct {
	cfg      *Config
	net      network
	log      *slog.Logger
	replicas []*replica
	workers  []*workerNode
	// spares are workers not started with the fleet, which the discovery fault starts and
	// lists in fleetFile, the replicas' discovery file (both only with that fault).
	spares    []*workerNode
	fleetFile string
	lb        *proc.Process
	lbAddr    string
	// client carries the workload (each request has its own deadline); admin the harness's
	// own calls.
	client *http.Client
	admin  *http.Client
}

// Fixed ports used where every replica has an address of its own.
const (
	portClient = 8080
	portAdmin  = 9090
	portRaft   = 7000
	portPeer   = 7001
	portGossip = 7002
	portWorker = 8100
	portLB     = 8000
)

// adminToken makes a random admin token and writes it to dir/admin.token for the replicas.
func adminToken(dir string) (token, path string, err error) {
	raw := make([]byte, 24)
	if _, err := rand.Read(raw); err != nil {
		return "", "", fmt.Errorf("admin token: %w", err)
	}
	token = hex.EncodeToString(raw)
	path = filepath.Join(dir, "admin.token")
	if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
		return "", "", fmt.Errorf("admin token: %w", err)
	}
	return token, path, nil
}

// bearer adds the admin token to every request the harness makes.
type bearer struct {
	token string
	next  http.RoundTripper
}

// RoundTrip sends req with the token.
func (b bearer) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	req.Header.Set("Authorization", "Bearer "+b.token)
	return b.next.RoundTrip(req)
}

// CloseIdleConnections lets http.Client.CloseIdleConnections reach the transport.
func (b bearer) CloseIdleConnections() {
	if c, ok := b.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func newFleet(cfg *Config, nw network, dir string) (*fleet, error) {
	f := &fleet{cfg: cfg, net: nw, log: cfg.Logger}
	tr := &http.Transport{
		DialContext:         nw.dial,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}
	f.client = &http.Client{Transport: tr}
	// The replicas' admin APIs listen beyond loopback in the namespaces, where they require a
	// token: the harness gives every replica one and sends it.
	token, tokenFile, err := adminToken(dir)
	if err != nil {
		return nil, err
	}
	f.admin = &http.Client{Timeout: 3 * time.Second, Transport: bearer{token: token, next: &http.Transport{
		DialContext: nw.dial, MaxIdleConnsPerHost: 8, IdleConnTimeout: 30 * time.Second,
	}}}
	logs := filepath.Join(dir, "logs")
	if err := os.MkdirAll(logs, 0o755); err != nil {
		return nil, fmt.Errorf("log dir: %w", err)
	}
	var specs []string
	for i := range cfg.Workers {
		addr, err := nw.addr(nw.workerHost(), portWorker+i)
		if err != nil {
			return nil, err
		}
		w := &workerNode{id: fmt.Sprintf("w%d", i), addr: addr}
		w.proc = proc.New(proc.Spec{
			Name:    w.id,
			Argv:    []string{cfg.Binary, "sim-worker", "--listen", addr, "--id", w.id, "--log-level", "warn"},
			Wrap:    nw.wrap("workers"),
			LogPath: filepath.Join(logs, w.id+".log"),
		})
		f.workers = append(f.workers, w)
		specs = append(specs, w.id+"=http://"+addr)
	}
	var discovery []string
	if slices.Contains(cfg.Faults, FaultDiscovery) {
		if discovery, err = f.openDiscovery(dir, logs); err != nil {
			return nil, err
		}
	}
	var members []proc.Replica
	for i := range cfg.Replicas {
		host := nw.replicaHost(i)
		m := proc.Replica{ID: fmt.Sprintf("r%d", i), DataDir: filepath.Join(dir, "data", fmt.Sprintf("r%d", i))}
		for _, a := range []struct {
			to   *string
			port int
		}{{&m.Client, portClient}, {&m.Admin, portAdmin}, {&m.Raft, portRaft}, {&m.Peer, portPeer}, {&m.Gossip, portGossip}} {
			addr, err := nw.addr(host, a.port)
			if err != nil {
				return nil, err
			}
			*a.to = addr
		}
		members = append(members, m)
	}
	for i, m := range members {
		argv := m.ServeArgv(cfg.Binary, members, specs,
			"--consistency", cfg.Consistency, "--stale-bound", cfg.StaleBound.String(),
			"--bind-wait", cfg.BindWait.String(), "--session-ttl", cfg.SessionTTL.String(),
			"--health-interval", cfg.HealthInterval.String(), "--log-level", "info",
			"--admin-token-file", tokenFile,
			// The namespaces' subnet is the harness's own, reachable from nowhere else: the
			// replicas' cluster ports there need neither peer TLS nor a gossip key.
			"--insecure-open-cluster")
		argv = append(argv, discovery...)
		f.replicas = append(f.replicas, &replica{Replica: m, index: i, proc: proc.New(proc.Spec{
			Name:    m.ID,
			Argv:    append(argv, cfg.ServeArgs...),
			Wrap:    nw.wrap(m.ID),
			LogPath: filepath.Join(logs, m.ID+".log"),
		})})
	}
	if cfg.HAProxy {
		addr, err := nw.addr(nw.lbHost(), portLB)
		if err != nil {
			return nil, err
		}
		// Not deploy/haproxy.cfg itself: the harness runs up to nine replicas and logs what
		// the balancer retried; its retries and checks are the harness's own or, with
		// --lb-config, deploy/haproxy.cfg's (see proc.HAProxyConfig).
		cfgPath := filepath.Join(dir, "haproxy.cfg")
		if err := os.WriteFile(cfgPath, []byte(proc.HAProxyConfig(addr, members, cfg.LBPolicy)), 0o644); err != nil {
			return nil, fmt.Errorf("haproxy config: %w", err)
		}
		f.lbAddr = addr
		spec := proc.HAProxy{Config: cfgPath}.Spec()
		spec.Wrap, spec.LogPath = nw.wrap("lb"), filepath.Join(logs, "haproxy.log")
		f.lb = proc.New(spec)
	}
	return f, nil
}

// start brings up the workers, then the replicas, then the load balancer, and waits until
// every replica is ready.
func (f *fleet) start(ctx context.Context) error {
	for _, w := range f.workers {
		if err := w.proc.Start(); err != nil {
			return err
		}
	}
	for _, w := range f.workers {
		if err := proc.WaitReady(ctx, f.admin, "http://"+w.addr+"/health", 30*time.Second); err != nil {
			return fmt.Errorf("worker %s: %w", w.id, err)
		}
	}
	for _, r := range f.replicas {
		if err := os.MkdirAll(r.DataDir, 0o755); err != nil {
			return fmt.Errorf("data dir: %w", err)
		}
		if err := r.proc.Start(); err != nil {
			return err
		}
	}
	if err := f.waitAllReady(ctx, 90*time.Second); err != nil {
		return err
	}
	if f.lb != nil {
		if err := f.lb.Start(); err != nil {
			return err
		}
		if err := proc.WaitReady(ctx, f.admin, "http://"+f.lbAddr+"/readyz", 30*time.Second); err != nil {
			return fmt.Errorf("haproxy: %w", err)
		}
	}
	return nil
}

// stop kills every process the fleet started.
func (f *fleet) stop() {
	var wg sync.WaitGroup
	for _, r := range f.replicas {
		wg.Go(r.proc.Kill)
	}
	for _, w := range append(slices.Clone(f.workers), f.spares...) {
		wg.Go(w.proc.Kill)
	}
	if f.lb != nil {
		wg.Go(f.lb.Kill)
	}
	wg.Wait()
	f.client.CloseIdleConnections()
	f.admin.CloseIdleConnections()
}

// errGaveUp marks a condition that waiting will not bring about.
var errGaveUp = errors.New("gave up")

// poll calls cond until it succeeds, ctx ends, or within passes.
func (f *fleet) poll(ctx context.Context, within time.Duration, cond func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	for {
		err := cond(ctx)
		if err == nil {
			return nil
		}
		if errors.Is(err, errGaveUp) {
			return err
		}
		if sleep(ctx, 100*time.Millisecond) != nil {
			return fmt.Errorf("within %s: %w", within, err)
		}
	}
}

// waitAllReady waits until every replica answers /readyz with 200.
func (f *fleet) waitAllReady(ctx context.Context, within time.Duration) error {
	return f.poll(ctx, within, func(ctx context.Context) error {
		for _, r := range f.replicas {
			if r.proc.Exited() {
				return fmt.Errorf("%w: %s exited (see its log)", errGaveUp, r.ID)
			}
			if err := proc.Get(ctx, f.admin, "http://"+r.Client+"/readyz", nil); err != nil {
				return fmt.Errorf("%s not ready: %w", r.ID, err)
			}
		}
		return nil
	})
}

// status reads the replica's GET /admin/cluster.
func (f *fleet) status(ctx context.Context, r *replica) (proc.Status, error) {
	return proc.GetStatus(ctx, f.admin, r.Admin)
}

// leaderAmong returns the replica of rs that says it leads, waiting up to within for one.
func (f *fleet) leaderAmong(ctx context.Context, rs []*replica, within time.Duration) (*replica, error) {
	admins := make([]string, len(rs))
	for i, r := range rs {
		admins[i] = r.Admin
	}
	var out *replica
	err := f.poll(ctx, within, func(ctx context.Context) error {
		i, err := proc.FindLeader(ctx, f.admin, admins)
		if err == nil {
			out = rs[i]
		}
		return err
	})
	return out, err
}

// leader returns the replica that says it leads, or nil if none does within a few seconds.
func (f *fleet) leader(ctx context.Context) *replica {
	r, _ := f.leaderAmong(ctx, f.replicas, 5*time.Second)
	return r
}

// pick resolves a kill or stop step to a replica.
func (f *fleet) pick(ctx context.Context, s Step) (*replica, string) {
	if s.Leader {
		if r := f.leader(ctx); r != nil {
			return r, "leader"
		}
		return f.replicas[s.Index%len(f.replicas)], "no leader found; by index"
	}
	return f.replicas[s.Index%len(f.replicas)], "by index"
}

// workerStatus is one entry of GET /admin/workers.
type workerStatus struct {
	Spec struct {
		ID string `json:"id"`
	} `json:"spec"`
	Healthy bool   `json:"healthy"`
	Drained bool   `json:"drained"`
	Reason  string `json:"reason"`
}

func (f *fleet) workerStates(ctx context.Context, r *replica) ([]workerStatus, error) {
	var out []workerStatus
	err := proc.Get(ctx, f.admin, "http://"+r.Admin+"/admin/workers", &out)
	return out, err
}

// waitWorkerHealthy waits until every replica routes to the worker again.
func (f *fleet) waitWorkerHealthy(ctx context.Context, id string, within time.Duration) error {
	return f.poll(ctx, within, func(ctx context.Context) error {
		for _, r := range f.replicas {
			ws, err := f.workerStates(ctx, r)
			if err != nil {
				return err
			}
			i := slices.IndexFunc(ws, func(w workerStatus) bool { return w.Spec.ID == id })
			if i < 0 || !ws[i].Healthy {
				return fmt.Errorf("%s does not route to %s yet", r.ID, id)
			}
		}
		return nil
	})
}

// sessionView is GET /admin/sessions/{id}.
type sessionView struct {
	Session  string `json:"session"`
	Worker   string `json:"worker"`
	Revision uint64 `json:"revision"`
}

// readSession reads one session's binding from a replica's admin API.
func (f *fleet) readSession(ctx context.Context, r *replica, session string) Read {
	rd := Read{Session: session, Replica: r.ID}
	var v sessionView
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		err = proc.Get(ctx, f.admin, "http://"+r.Admin+"/admin/sessions/"+url.PathEscape(session), &v)
		var se *proc.StatusError
		if err == nil || (errors.As(err, &se) && se.Code == http.StatusNotFound) || ctx.Err() != nil {
			break
		}
		_ = sleep(ctx, 200*time.Millisecond)
	}
	var se *proc.StatusError
	switch {
	case err == nil:
		rd.Found, rd.Worker, rd.Revision = true, v.Worker, v.Revision
	case errors.As(err, &se) && se.Code == http.StatusNotFound:
	default:
		rd.Error = err.Error()
	}
	return rd
}

// readSessions reads the sessions' bindings (from the leader only, or from every replica),
// records each read against the fault and returns them.
func (f *fleet) readSessions(ctx context.Context, rec *recorder, sessions []string, fault int, leaderOnly bool) []Read {
	targets := f.replicas
	if leaderOnly {
		l := f.leader(ctx)
		if l == nil {
			rec.note("", "durability reads after fault %d: no leader", fault)
			return nil
		}
		targets = []*replica{l}
	}
	type job struct {
		r *replica
		s string
	}
	jobs := make(chan job)
	var (
		mu  sync.Mutex
		out []Read
		wg  sync.WaitGroup
	)
	for range 8 {
		wg.Go(func() {
			for j := range jobs {
				rd := f.readSession(ctx, j.r, j.s)
				rd.Fault = fault
				rd.At = rec.now()
				mu.Lock()
				out = append(out, rd)
				mu.Unlock()
			}
		})
	}
	for _, s := range sessions {
		for _, r := range targets {
			jobs <- job{r, s}
		}
	}
	close(jobs)
	wg.Wait()
	return out
}
