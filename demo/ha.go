package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/deploy"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
)

// The high-availability demo, make demo's main job: three replica processes of this binary
// form a cluster behind HAProxy (when installed; else the client sends to the replicas in
// turn), simulated workers behind them, a trace slice replayed through the balancer, and
// the Raft leader killed (SIGKILL) half-way through and started again. It reports what a
// client saw: hit rate, TTFT, failed requests, sessions that changed worker, and how long
// the cluster had no leader.

// leaderWatch measures how long no replica reported itself leader.
type leaderWatch struct {
	mu       sync.Mutex
	without  time.Duration
	lostAt   time.Time // zero while a leader is known
	longest  time.Duration
	episodes int
}

func (w *leaderWatch) observe(now time.Time, hasLeader bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case !hasLeader && w.lostAt.IsZero():
		w.lostAt = now
		w.episodes++
	case hasLeader && !w.lostAt.IsZero():
		d := now.Sub(w.lostAt)
		w.without += d
		w.longest = max(w.longest, d)
		w.lostAt = time.Time{}
	}
}

func (w *leaderWatch) total(now time.Time) (time.Duration, time.Duration, int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	total, longest := w.without, w.longest
	if !w.lostAt.IsZero() {
		total += now.Sub(w.lostAt)
		longest = max(longest, now.Sub(w.lostAt))
	}
	return total, longest, w.episodes
}

// HA is the high-availability demo: the Raft leader of three replica processes is killed
// with SIGKILL half-way through the replay and started again; it reports what the client saw.
func HA(ctx context.Context, cfg Config, stdout, progress io.Writer) error {
	reqs, err := cfg.traceSlice()
	if err != nil {
		return err
	}
	if len(reqs) < 2 {
		return errors.New("the trace slice needs at least two requests")
	}
	dir, err := os.MkdirTemp("", "kvrouter-ha-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	fleet, err := startSimFleet(ctx, Fleet{Aggregated: cfg.Workers}, cfg.simConfig(cfg.Logger), false)
	if err != nil {
		return err
	}
	defer fleet.Close()
	h := &haCluster{cfg: cfg, dir: dir, hc: &http.Client{Timeout: 2 * time.Second}}
	defer h.stop(ctx)
	var workers []string
	for _, s := range fleet.specs {
		workers = append(workers, s.ID+"="+s.URL)
	}
	if err := h.start(ctx, workers); err != nil {
		return err
	}
	targets, front, stopLB, err := startBalancer(ctx, cfg, dir, h.members, h.hc)
	if err != nil {
		return err
	}
	defer stopLB()
	fmt.Fprintf(stdout, "three replicas (Raft + gossip) over %d simulated workers, %s\n", cfg.Workers, front)

	watchCtx, stopWatch := context.WithCancel(ctx)
	var wg sync.WaitGroup
	watch := &leaderWatch{}
	wg.Go(func() { h.watchLeader(watchCtx, watch) })
	// Half-way through the slice (in replay time), the leader is killed and started again.
	var kill killReport
	start := time.Now()
	half := scaled((reqs[len(reqs)-1].Timestamp-reqs[0].Timestamp)/2, cfg.Speedup)
	wg.Go(func() { kill = h.killLeader(watchCtx, start, half) })

	sum, err := replay.Run(ctx, cfg.replayConfig(targets, reqs, "kv x3, leader killed", progress))
	stopWatch()
	wg.Wait()
	if err != nil {
		return err
	}
	h.report(stdout, sum, kill, watch)
	if kill.killed == "" {
		// The demo's point is the failover: a run without one shows nothing.
		return fmt.Errorf("the leader was never killed: %w", kill.err)
	}
	return nil
}

// haCluster is the demo's three replica processes.
type haCluster struct {
	cfg     Config
	dir     string
	hc      *http.Client
	members []proc.Replica
	procs   []*proc.Process
	admins  []string
}

// start runs three replicas of this binary over the static workers (id=url; none: they come
// from the extra flags, --discovery) and waits until they are ready.
func (h *haCluster) start(ctx context.Context, workers []string, extra ...string) error {
	cfg := h.cfg
	self := cfg.Binary
	if self == "" {
		var err error
		if self, err = os.Executable(); err != nil {
			return fmt.Errorf("find this binary: %w", err)
		}
	}
	const replicas = 3
	members, err := proc.LoopbackReplicas(replicas, h.dir)
	if err != nil {
		return err
	}
	h.members = members
	for _, m := range members {
		h.admins = append(h.admins, m.Admin)
		flags := append([]string{"--log-level", "warn",
			// Time runs cfg.Speedup times faster: the TTLs and hint intervals shrink with it.
			"--approx-ttl", scaledTTL(cfg.ApproxTTL, cfg.Speedup).String(),
			"--approx-max-blocks", fmt.Sprint(cfg.CapacityBlocks),
			"--session-ttl", scaled(10*time.Minute, cfg.Speedup).String(),
			"--load-share-interval", scaled(150*time.Millisecond, cfg.Speedup).String(),
			"--decision-flush-interval", scaled(50*time.Millisecond, cfg.Speedup).String(),
			"--health-timeout", "2s",
			// A loaded machine (make test runs every package at once) can take seconds to
			// commit a binding; the in-process demo waits as long.
			"--bind-wait", "10s",
			// Nothing needs draining when the demo ends.
			"--shutdown-delay", "0"}, extra...)
		h.procs = append(h.procs, proc.New(proc.Spec{Name: m.ID, LogPath: h.log(m.ID), Argv: m.ServeArgv(self, members, workers, flags...)}))
	}
	for _, p := range h.procs {
		if err := p.Start(); err != nil {
			return err
		}
	}
	readyCtx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for _, m := range members {
		if err := proc.WaitReady(readyCtx, h.hc, "http://"+m.Client+"/readyz", 60*time.Second); err != nil {
			return fmt.Errorf("replica %s (log %s): %w", m.ID, h.log(m.ID), err)
		}
	}
	return nil
}

func (h *haCluster) log(id string) string { return filepath.Join(h.dir, id+".log") }

// stop sends every replica SIGTERM and waits (bounded) for them.
func (h *haCluster) stop(ctx context.Context) {
	var wg sync.WaitGroup
	for _, p := range h.procs {
		wg.Go(func() { _ = p.Stop(context.WithoutCancel(ctx), syscall.SIGTERM, 10*time.Second) })
	}
	wg.Wait()
}

// leader asks every replica which one leads (bounded: a busy 2-core machine can be slow to
// answer, and a replica that does not answer in time counts as not leading).
func (h *haCluster) leader(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	return proc.FindLeader(ctx, h.hc, h.admins)
}

// watchLeader records, every 20 ms until ctx ends, whether some replica leads.
func (h *haCluster) watchLeader(ctx context.Context, watch *leaderWatch) {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		_, err := h.leader(ctx)
		watch.observe(time.Now(), err == nil)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// killReport is what happened to the leader killed half-way.
type killReport struct {
	killed, restarted string
	killAt, backAt    time.Duration
	err               error // why no leader was killed (killed is empty)
}

// Asking for the leader to kill: each ask is bounded by killAsk (a replica on a starved
// machine can be slow to answer), and the asking goes on for killWithin after the
// half-way point (the cluster may be between leaders just then).
const (
	killAsk    = 2 * time.Second
	killWithin = 30 * time.Second
)

// killLeader kills the leader after the delay (SIGKILL), starts it again and waits until it
// is ready. It waits for a leader up to killWithin; r.err says why, if none was killed.
func (h *haCluster) killLeader(ctx context.Context, start time.Time, after time.Duration) (r killReport) {
	if !sleepCtx(ctx, after) {
		r.err = fmt.Errorf("the replay ended before the half-way point (%.1f s)", after.Seconds())
		return r
	}
	i, err := proc.AwaitLeader(ctx, h.hc, h.admins, killWithin, killAsk)
	if err != nil {
		r.err = fmt.Errorf("no leader to kill from %.1f s on: %w", after.Seconds(), err)
		return r
	}
	r.killAt = time.Since(start)
	h.procs[i].Kill()
	r.killed = h.members[i].ID
	if err := h.procs[i].Start(); err != nil {
		h.cfg.Logger.Error("restarting the killed leader", "replica", r.killed, "err", err)
		return r
	}
	if proc.WaitReady(ctx, h.hc, "http://"+h.members[i].Client+"/readyz", 60*time.Second) == nil {
		r.backAt = time.Since(start)
		r.restarted = r.killed
	}
	return r
}

// report prints the replay's summary and what the failover cost.
func (h *haCluster) report(stdout io.Writer, sum *replay.Summary, k killReport, watch *leaderWatch) {
	without, longest, episodes := watch.total(time.Now())
	fmt.Fprintln(stdout)
	replay.Table(stdout, []*replay.Summary{sum})
	fmt.Fprintln(stdout)
	switch {
	case k.killed == "":
		fmt.Fprintf(stdout, "no leader was killed: %v\n", k.err)
	case k.restarted == "":
		fmt.Fprintf(stdout, "leader %s killed at %.1f s; it did not come back ready (log: %s)\n", k.killed, k.killAt.Seconds(), h.log(k.killed))
	default:
		fmt.Fprintf(stdout, "leader %s killed (SIGKILL) at %.1f s, restarted and ready again at %.1f s\n", k.killed, k.killAt.Seconds(), k.backAt.Seconds())
	}
	fmt.Fprintf(stdout, "time without a leader: %.2f s in all (%d spell(s), longest %.2f s)\n", without.Seconds(), episodes, longest.Seconds())
	fmt.Fprintf(stdout, "requests failed: %d of %d (%s)\n", sum.Failed, sum.Requests, sum.ErrorList())
	fmt.Fprintf(stdout, "sessions that changed worker: %d of %d\n", sum.SessionsMoved, sum.Sessions)
}

// startBalancer puts HAProxy in front of the replicas when it is installed and its config
// is found; otherwise the client sends to the replicas in turn. It returns the replay
// targets, a description, and a stop function.
func startBalancer(ctx context.Context, cfg Config, dir string, members []proc.Replica, hc *http.Client) ([]string, string, func(), error) {
	var direct []string
	for _, m := range members {
		direct = append(direct, "http://"+m.Client)
	}
	roundRobin := func(why string) ([]string, string, func(), error) {
		return direct, "no load balancer (" + why + "): the client sends to the replicas in turn", func() {}, nil
	}
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		return roundRobin("haproxy is not installed")
	}
	config, name := cfg.HAProxyConfig, cfg.HAProxyConfig
	if config == "" {
		// The bundled one, written out: the demo runs from any working directory.
		config, name = filepath.Join(dir, "haproxy.cfg"), "the bundled deploy/haproxy.cfg"
		if err := os.WriteFile(config, []byte(deploy.HAProxyConfig), 0o600); err != nil {
			return nil, "", nil, fmt.Errorf("write the bundled HAProxy config: %w", err)
		}
	}
	if _, err := os.Stat(config); err != nil {
		return roundRobin(fmt.Sprintf("no %s", config))
	}
	listen, err := loopback.Addr()
	if err != nil {
		return nil, "", nil, err
	}
	env, err := proc.DeployEnv(listen, members)
	if err != nil {
		return nil, "", nil, err
	}
	h := proc.HAProxy{Binary: bin, Config: config, Env: env}
	if err := h.Check(ctx); err != nil {
		return nil, "", nil, err
	}
	spec := h.Spec()
	spec.LogPath = filepath.Join(dir, "haproxy.log")
	p := proc.New(spec)
	if err := p.Start(); err != nil {
		return roundRobin(fmt.Sprintf("haproxy did not start: %v", err))
	}
	stop := func() { _ = p.Stop(context.WithoutCancel(ctx), syscall.SIGTERM, 5*time.Second) }
	if err := proc.WaitReady(ctx, hc, "http://"+listen+"/readyz", 30*time.Second); err != nil {
		stop()
		return nil, "", nil, fmt.Errorf("haproxy on %s (log %s): %w", listen, spec.LogPath, err)
	}
	return []string{"http://" + listen}, fmt.Sprintf("behind HAProxy on %s (%s)", listen, name), stop, nil
}
