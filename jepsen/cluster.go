package jepsen

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	loaddr "github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
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

// proc is one child process the harness starts, signals and kills by its pid. Its output goes
// to a log file that survives restarts.
type proc struct {
	name    string
	argv    []string
	logPath string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// start runs the process (again, after a kill, with the same arguments).
func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		select {
		case <-p.done: // it died on its own: start it again
		default:
			return fmt.Errorf("%s is already running (pid %d)", p.name, p.cmd.Process.Pid)
		}
	}
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("%s log: %w", p.name, err)
	}
	fmt.Fprintf(logf, "---- jepsen: start %s at %s: %s\n", p.name, time.Now().Format(time.RFC3339Nano), strings.Join(p.argv, " "))
	cmd := exec.Command(p.argv[0], p.argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = childAttr()
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	go func() {
		err := cmd.Wait()
		fmt.Fprintf(logf, "---- jepsen: %s (pid %d) exited: %v\n", p.name, cmd.Process.Pid, err)
		logf.Close()
		close(done)
	}()
	p.cmd, p.done = cmd, done
	return nil
}

// kill sends SIGKILL (which also ends a stopped process) and reaps the process.
func (p *proc) kill() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.cmd = nil
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-done
}

// signal sends sig to the running process.
func (p *proc) signal(sig os.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return fmt.Errorf("%s is not running", p.name)
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal %s: %w", p.name, err)
	}
	return nil
}

// exited reports whether the process was started and has ended on its own.
func (p *proc) exited() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

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
	// command wraps argv so it runs where it should ("r0", ..., "workers", "lb").
	command(where string, argv []string) []string
	// dial connects from the harness's vantage point, which can reach every process.
	dial(ctx context.Context, network, addr string) (net.Conn, error)
	canPartition() (bool, string)
	partition(ctx context.Context, f *fleet, cut [][2]int) error
	heal(ctx context.Context, f *fleet) error
	close() error
}

// loopback runs everything on 127.0.0.1. It cannot partition.
type loopback struct{ why string }

func (l loopback) describe() string                       { return "loopback (127.0.0.1)" }
func (loopback) replicaHost(int) string                   { return "127.0.0.1" }
func (loopback) workerHost() string                       { return "127.0.0.1" }
func (loopback) lbHost() string                           { return "127.0.0.1" }
func (loopback) command(_ string, argv []string) []string { return argv }
func (l loopback) canPartition() (bool, string)           { return false, l.why }
func (loopback) close() error                             { return nil }
func (loopback) heal(context.Context, *fleet) error       { return nil }

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

// replica is one kvrouter-ha serve process and its addresses.
type replica struct {
	index                     int
	id                        string
	client, admin, raft, peer string
	gossip                    string
	dataDir                   string
	proc                      *proc
}

// workerNode is one simulated worker process.
type workerNode struct {
	id   string
	addr string
	proc *proc
}

// fleet is the cluster under test: replicas, workers and, optionally, HAProxy in front.
type fleet struct {
	cfg      *Config
	net      network
	log      *slog.Logger
	replicas []*replica
	workers  []*workerNode
	lb       *proc
	lbAddr   string
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

func newFleet(cfg *Config, nw network, dir string) (*fleet, error) {
	f := &fleet{cfg: cfg, net: nw, log: cfg.Logger}
	tr := &http.Transport{
		DialContext:         nw.dial,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}
	f.client = &http.Client{Transport: tr}
	f.admin = &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{
		DialContext: nw.dial, MaxIdleConnsPerHost: 8, IdleConnTimeout: 30 * time.Second,
	}}
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
		w.proc = &proc{
			name:    w.id,
			argv:    nw.command("workers", []string{cfg.Binary, "sim-worker", "--listen", addr, "--id", w.id, "--log-level", "warn"}),
			logPath: filepath.Join(logs, w.id+".log"),
		}
		f.workers = append(f.workers, w)
		specs = append(specs, w.id+"=http://"+addr)
	}
	var peers, gossipSeeds []string
	for i := range cfg.Replicas {
		host := nw.replicaHost(i)
		r := &replica{index: i, id: fmt.Sprintf("r%d", i), dataDir: filepath.Join(dir, "data", fmt.Sprintf("r%d", i))}
		for _, a := range []struct {
			to   *string
			port int
		}{{&r.client, portClient}, {&r.admin, portAdmin}, {&r.raft, portRaft}, {&r.peer, portPeer}, {&r.gossip, portGossip}} {
			addr, err := nw.addr(host, a.port)
			if err != nil {
				return nil, err
			}
			*a.to = addr
		}
		peers = append(peers, r.peer)
		gossipSeeds = append(gossipSeeds, r.gossip)
		f.replicas = append(f.replicas, r)
	}
	for _, r := range f.replicas {
		args := []string{cfg.Binary, "serve",
			"--replica-id", r.id, "--listen", r.client, "--admin-listen", r.admin,
			"--raft-listen", r.raft, "--peer-listen", r.peer, "--data-dir", r.dataDir,
			"--bootstrap-expect", strconv.Itoa(cfg.Replicas), "--join", strings.Join(peers, ","),
			"--gossip-listen", r.gossip, "--gossip-join", strings.Join(gossipSeeds, ","),
			"--worker", strings.Join(specs, ","),
			"--consistency", cfg.Consistency, "--stale-bound", cfg.StaleBound.String(),
			"--bind-wait", cfg.BindWait.String(), "--session-ttl", cfg.SessionTTL.String(),
			"--health-interval", cfg.HealthInterval.String(), "--log-level", "info",
		}
		args = append(args, cfg.ServeArgs...)
		r.proc = &proc{name: r.id, argv: nw.command(r.id, args), logPath: filepath.Join(logs, r.id+".log")}
	}
	if cfg.HAProxy {
		addr, err := nw.addr(nw.lbHost(), portLB)
		if err != nil {
			return nil, err
		}
		cfgPath := filepath.Join(dir, "haproxy.cfg")
		if err := os.WriteFile(cfgPath, []byte(haproxyConfig(addr, f.replicas)), 0o644); err != nil {
			return nil, fmt.Errorf("haproxy config: %w", err)
		}
		f.lbAddr = addr
		f.lb = &proc{name: "haproxy", argv: nw.command("lb", []string{"haproxy", "-db", "-f", cfgPath}), logPath: filepath.Join(logs, "haproxy.log")}
	}
	return f, nil
}

// haproxyConfig puts HAProxy in front of the replicas the way an operator would: health checks
// on /readyz, so an unready replica (no quorum) is drained, and retries of requests that got no
// answer or a 503 on another replica.
func haproxyConfig(listen string, rs []*replica) string {
	var b strings.Builder
	b.WriteString(`global
    maxconn 2048

defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    timeout http-request 10s
    retries 2
    option redispatch
    retry-on conn-failure empty-response 503

frontend kvrouter
    bind ` + listen + `
    default_backend replicas

backend replicas
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter 300ms fall 2 rise 2
`)
	for _, r := range rs {
		fmt.Fprintf(&b, "    server %s %s check\n", r.id, r.client)
	}
	return b.String()
}

// start brings up the workers, then the replicas, then the load balancer, and waits until
// every replica is ready.
func (f *fleet) start(ctx context.Context) error {
	for _, w := range f.workers {
		if err := w.proc.start(); err != nil {
			return err
		}
	}
	for _, w := range f.workers {
		if err := f.poll(ctx, 30*time.Second, func(ctx context.Context) error {
			return f.get(ctx, "http://"+w.addr+"/health", nil)
		}); err != nil {
			return fmt.Errorf("worker %s: %w", w.id, err)
		}
	}
	for _, r := range f.replicas {
		if err := os.MkdirAll(r.dataDir, 0o755); err != nil {
			return fmt.Errorf("data dir: %w", err)
		}
		if err := r.proc.start(); err != nil {
			return err
		}
	}
	if err := f.waitAllReady(ctx, 90*time.Second); err != nil {
		return err
	}
	if f.lb != nil {
		if err := f.lb.start(); err != nil {
			return err
		}
		if err := f.poll(ctx, 30*time.Second, func(ctx context.Context) error {
			return f.get(ctx, "http://"+f.lbAddr+"/readyz", nil)
		}); err != nil {
			return fmt.Errorf("haproxy: %w", err)
		}
	}
	return nil
}

// stop kills every process the fleet started.
func (f *fleet) stop() {
	var wg sync.WaitGroup
	for _, r := range f.replicas {
		wg.Go(r.proc.kill)
	}
	for _, w := range f.workers {
		wg.Go(w.proc.kill)
	}
	if f.lb != nil {
		wg.Go(f.lb.kill)
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

// get fetches url and decodes a 200 answer into out (when not nil).
func (f *fleet) get(ctx context.Context, u string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := f.admin.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return &statusError{code: resp.StatusCode, body: strings.TrimSpace(string(body))}
	}
	if out != nil {
		if err := json.Unmarshal(body, out); err != nil {
			return fmt.Errorf("decode %s: %w", u, err)
		}
	}
	return nil
}

type statusError struct {
	code int
	body string
}

func (e *statusError) Error() string {
	return fmt.Sprintf("status %d: %.200s", e.code, e.body)
}

// ready reports the replica's /readyz.
func (f *fleet) ready(ctx context.Context, r *replica) error {
	if err := f.get(ctx, "http://"+r.client+"/readyz", nil); err != nil {
		return fmt.Errorf("%s not ready: %w", r.id, err)
	}
	return nil
}

// waitAllReady waits until every replica answers /readyz with 200.
func (f *fleet) waitAllReady(ctx context.Context, within time.Duration) error {
	return f.poll(ctx, within, func(ctx context.Context) error {
		for _, r := range f.replicas {
			if r.proc.exited() {
				return fmt.Errorf("%w: %s exited (see its log)", errGaveUp, r.id)
			}
			if err := f.ready(ctx, r); err != nil {
				return err
			}
		}
		return nil
	})
}

// clusterStatus is the part of GET /admin/cluster the harness reads.
type clusterStatus struct {
	Self struct {
		ID       string `json:"id"`
		State    string `json:"state"`
		LeaderID string `json:"leader_id"`
		Term     uint64 `json:"term"`
	} `json:"self"`
	Bindings int `json:"bindings"`
}

func (f *fleet) status(ctx context.Context, r *replica) (clusterStatus, error) {
	var st clusterStatus
	err := f.get(ctx, "http://"+r.admin+"/admin/cluster", &st)
	return st, err
}

// leader returns the replica that says it leads, or nil if none does within a few seconds.
func (f *fleet) leader(ctx context.Context) *replica {
	var out *replica
	_ = f.poll(ctx, 5*time.Second, func(ctx context.Context) error {
		for _, r := range f.replicas {
			st, err := f.status(ctx, r)
			if err == nil && st.Self.State == "Leader" {
				out = r
				return nil
			}
		}
		return errors.New("no leader")
	})
	return out
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
	err := f.get(ctx, "http://"+r.admin+"/admin/workers", &out)
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
				return fmt.Errorf("%s does not route to %s yet", r.id, id)
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
	rd := Read{Session: session, Replica: r.id}
	var v sessionView
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		err = f.get(ctx, "http://"+r.admin+"/admin/sessions/"+url.PathEscape(session), &v)
		var se *statusError
		if err == nil || (errors.As(err, &se) && se.code == http.StatusNotFound) || ctx.Err() != nil {
			break
		}
		_ = sleep(ctx, 200*time.Millisecond)
	}
	var se *statusError
	switch {
	case err == nil:
		rd.Found, rd.Worker, rd.Revision = true, v.Worker, v.Revision
	case errors.As(err, &se) && se.code == http.StatusNotFound:
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
