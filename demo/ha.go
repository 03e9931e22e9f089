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

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
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
	reqs, err := trace.ForReplay(cfg.TracePath, cfg.Start)
	if err != nil {
		return err
	}
	if cfg.Limit > 0 && cfg.Limit < len(reqs) {
		reqs = reqs[:cfg.Limit]
	}
	if len(reqs) < 2 {
		return errors.New("the trace slice needs at least two requests")
	}
	self := cfg.Binary
	if self == "" {
		if self, err = os.Executable(); err != nil {
			return fmt.Errorf("find this binary: %w", err)
		}
	}
	dir, err := os.MkdirTemp("", "kvrouter-ha-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	sc := cfg.Sim
	sc.CapacityBlocks = cfg.CapacityBlocks
	sc.Speedup = cfg.Speedup
	sc.MaxModelLen = 262144
	sc.Logger = cfg.Logger
	fleet, err := startSimFleet(ctx, cfg.Workers, sc, false)
	if err != nil {
		return err
	}
	defer fleet.Close()
	var workers []string
	for _, s := range fleet.specs {
		workers = append(workers, s.ID+"="+s.URL)
	}

	const replicas = 3
	members, err := proc.LoopbackReplicas(replicas, dir)
	if err != nil {
		return err
	}
	procs := make([]*proc.Process, len(members))
	admins := make([]string, len(members))
	for i, m := range members {
		admins[i] = m.Admin
		procs[i] = proc.New(proc.Spec{Name: m.ID, LogPath: filepath.Join(dir, m.ID+".log"), Argv: m.ServeArgv(self, members, workers,
			"--log-level", "warn",
			// Time runs cfg.Speedup times faster: the TTLs and hint intervals shrink with it.
			"--approx-ttl", scaled(120*time.Second, cfg.Speedup).String(),
			"--approx-max-blocks", fmt.Sprint(cfg.CapacityBlocks),
			"--session-ttl", scaled(10*time.Minute, cfg.Speedup).String(),
			"--load-share-interval", scaled(150*time.Millisecond, cfg.Speedup).String(),
			"--decision-flush-interval", scaled(50*time.Millisecond, cfg.Speedup).String(),
			"--health-timeout", "2s",
			// Nothing needs draining when the demo ends.
			"--shutdown-delay", "0")})
	}
	hc := &http.Client{Timeout: 2 * time.Second}
	defer func() {
		var wg sync.WaitGroup
		for _, p := range procs {
			wg.Go(func() { _ = p.Stop(context.WithoutCancel(ctx), syscall.SIGTERM, 10*time.Second) })
		}
		wg.Wait()
	}()
	for _, p := range procs {
		if err := p.Start(); err != nil {
			return err
		}
	}
	readyCtx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for _, m := range members {
		if err := proc.WaitReady(readyCtx, hc, "http://"+m.Client+"/readyz", 60*time.Second); err != nil {
			return fmt.Errorf("replica %s (log %s): %w", m.ID, filepath.Join(dir, m.ID+".log"), err)
		}
	}
	// leader asks every replica which one leads (bounded: a busy 2-core machine can be slow to
	// answer, and a replica that does not answer in time counts as not leading).
	leader := func(ctx context.Context) (int, error) {
		ctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		return proc.FindLeader(ctx, hc, admins)
	}

	targets, front, stopLB, err := startBalancer(ctx, cfg, dir, members, hc)
	if err != nil {
		return err
	}
	defer stopLB()
	fmt.Fprintf(stdout, "three replicas (Raft + gossip) over %d simulated workers, %s\n", cfg.Workers, front)

	// The leader watch polls every replica's admin API.
	watch := &leaderWatch{}
	watchCtx, stopWatch := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			_, err := leader(watchCtx)
			watch.observe(time.Now(), err == nil)
			select {
			case <-watchCtx.Done():
				return
			case <-t.C:
			}
		}
	})

	// Half-way through the slice (in replay time), the leader is killed and started again.
	half := scaled((reqs[len(reqs)-1].Timestamp-reqs[0].Timestamp)/2, cfg.Speedup)
	var killed, restarted string
	var killAt, backAt time.Duration
	start := time.Now()
	wg.Go(func() {
		select {
		case <-watchCtx.Done():
			return
		case <-time.After(half):
		}
		i, err := leader(watchCtx)
		if err != nil {
			return
		}
		killAt = time.Since(start)
		procs[i].Kill()
		killed = members[i].ID
		if err := procs[i].Start(); err != nil {
			cfg.Logger.Error("restarting the killed leader", "replica", killed, "err", err)
			return
		}
		if proc.WaitReady(watchCtx, hc, "http://"+members[i].Client+"/readyz", 60*time.Second) == nil {
			backAt = time.Since(start)
			restarted = killed
		}
	})

	rc := replay.DefaultConfig()
	rc.Targets = targets
	rc.Requests = reqs
	rc.Speedup = cfg.Speedup
	rc.Concurrency = cfg.Concurrency
	rc.MaxOutputTokens = cfg.MaxOutput
	rc.Model = sim.DefaultModel
	rc.Label = "kv x3, leader killed"
	rc.Progress = progress
	rc.Logger = cfg.Logger
	sum, err := replay.Run(ctx, rc)
	stopWatch()
	wg.Wait()
	if err != nil {
		return err
	}
	without, longest, episodes := watch.total(time.Now())

	fmt.Fprintln(stdout)
	replay.Table(stdout, []*replay.Summary{sum})
	fmt.Fprintln(stdout)
	switch {
	case killed == "":
		fmt.Fprintln(stdout, "no leader was found to kill half-way (the run was too short?)")
	case restarted == "":
		fmt.Fprintf(stdout, "leader %s killed at %.1f s; it did not come back ready (log: %s)\n", killed, killAt.Seconds(), filepath.Join(dir, killed+".log"))
	default:
		fmt.Fprintf(stdout, "leader %s killed (SIGKILL) at %.1f s, restarted and ready again at %.1f s\n", killed, killAt.Seconds(), backAt.Seconds())
	}
	fmt.Fprintf(stdout, "time without a leader: %.2f s in all (%d spell(s), longest %.2f s)\n", without.Seconds(), episodes, longest.Seconds())
	fmt.Fprintf(stdout, "requests failed: %d of %d %v\n", sum.Failed, sum.Requests, sum.Errors)
	fmt.Fprintf(stdout, "sessions that changed worker: %d of %d\n", sum.SessionsMoved, sum.Sessions)
	return nil
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
	if _, err := os.Stat(cfg.HAProxyConfig); err != nil {
		return roundRobin(fmt.Sprintf("no %s", cfg.HAProxyConfig))
	}
	listen, err := loopback.Addr()
	if err != nil {
		return nil, "", nil, err
	}
	env, err := proc.DeployEnv(listen, members)
	if err != nil {
		return nil, "", nil, err
	}
	h := proc.HAProxy{Binary: bin, Config: cfg.HAProxyConfig, Env: env}
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
	return []string{"http://" + listen}, fmt.Sprintf("behind HAProxy on %s (%s)", listen, cfg.HAProxyConfig), stop, nil
}
