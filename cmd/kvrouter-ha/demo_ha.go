package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
)

// The high-availability demo, make demo's main job: three replica processes of this binary
// form a cluster behind HAProxy (when installed; else the client sends to the replicas in
// turn), simulated workers behind them, a trace slice replayed through the balancer, and
// the Raft leader killed (SIGKILL) half-way through and started again. It reports what a
// client saw: hit rate, TTFT, failed requests, sessions that changed worker, and how long
// the cluster had no leader.

// haProc is one replica process of the demo.
type haProc struct {
	id                               string
	client, admin, raft, peer, gossp string
	dataDir, logPath                 string
	args                             []string
	env                              []string // nil: this process's environment

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// start runs the replica; its output goes to its log file.
func (p *haProc) start() error {
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.args[0], p.args[1:]...)
	cmd.Env, cmd.Stdout, cmd.Stderr = p.env, logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", p.id, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(done) }()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	return nil
}

// signal sends sig and waits (bounded) for the process to end.
func (p *haProc) signal(sig syscall.Signal, wait time.Duration) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(wait):
		_ = cmd.Process.Kill()
		<-done
	}
}

// haStatus is what the demo reads of /admin/cluster.
type haStatus struct {
	Raft map[string]string `json:"raft"`
}

// isLeader asks the replica whether it leads (false if it does not answer in time; the
// bound is generous because a busy 2-core machine can be slow to answer).
func (p *haProc) isLeader(ctx context.Context, hc *http.Client) bool {
	ctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.admin+"/admin/cluster", nil)
	if err != nil {
		return false
	}
	resp, err := hc.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	var st haStatus
	if json.NewDecoder(resp.Body).Decode(&st) != nil {
		return false
	}
	return st.Raft["state"] == "Leader"
}

// pollReady polls url until it answers 200 or ctx ends.
func pollReady(ctx context.Context, hc *http.Client, url string) error {
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		if resp, err := hc.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not ready: %w", url, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

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

// runHADemo is the high-availability demo.
func runHADemo(ctx context.Context, cfg demoConfig, stdout, progress io.Writer) error {
	reqs, err := loadTrace(cfg.TracePath, cfg.Start)
	if err != nil {
		return err
	}
	if cfg.Limit > 0 && cfg.Limit < len(reqs) {
		reqs = reqs[:cfg.Limit]
	}
	if len(reqs) < 2 {
		return errors.New("the trace slice needs at least two requests")
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find this binary: %w", err)
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
	var procs []*haProc
	var peers, seeds []string
	for i := range replicas {
		p := &haProc{id: fmt.Sprintf("r%d", i), dataDir: filepath.Join(dir, fmt.Sprintf("r%d", i)),
			logPath: filepath.Join(dir, fmt.Sprintf("r%d.log", i))}
		for _, a := range []*string{&p.client, &p.admin, &p.raft, &p.peer, &p.gossp} {
			if *a, err = loopback.Addr(); err != nil {
				return err
			}
		}
		peers, seeds = append(peers, p.peer), append(seeds, p.gossp)
		procs = append(procs, p)
	}
	for _, p := range procs {
		p.args = []string{self, "serve", "--replica-id", p.id, "--data-dir", p.dataDir,
			"--listen", p.client, "--admin-listen", p.admin, "--raft-listen", p.raft, "--peer-listen", p.peer,
			"--gossip-listen", p.gossp, "--bootstrap-expect", fmt.Sprint(replicas),
			"--join", strings.Join(peers, ","), "--gossip-join", strings.Join(seeds, ","),
			"--worker", strings.Join(workers, ","), "--log-level", "warn",
			// Time runs cfg.Speedup times faster: the TTLs and hint intervals shrink with it.
			"--approx-ttl", scaled(120*time.Second, cfg.Speedup).String(),
			"--approx-max-blocks", fmt.Sprint(cfg.CapacityBlocks),
			"--session-ttl", scaled(10*time.Minute, cfg.Speedup).String(),
			"--load-share-interval", scaled(150*time.Millisecond, cfg.Speedup).String(),
			"--decision-flush-interval", scaled(50*time.Millisecond, cfg.Speedup).String(),
			"--health-timeout", "2s",
			// Nothing needs draining when the demo ends.
			"--shutdown-delay", "0"}
	}
	hc := &http.Client{Timeout: 2 * time.Second}
	defer func() {
		var wg sync.WaitGroup
		for _, p := range procs {
			wg.Go(func() { p.signal(syscall.SIGTERM, 10*time.Second) })
		}
		wg.Wait()
	}()
	for _, p := range procs {
		if err := p.start(); err != nil {
			return err
		}
	}
	readyCtx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for _, p := range procs {
		if err := pollReady(readyCtx, hc, "http://"+p.client+"/readyz"); err != nil {
			return fmt.Errorf("replica %s (log %s): %w", p.id, p.logPath, err)
		}
	}

	targets, front, stopLB, err := startBalancer(ctx, cfg, dir, procs, hc)
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
			has := false
			for _, p := range procs {
				if p.isLeader(watchCtx, hc) {
					has = true
					break
				}
			}
			watch.observe(time.Now(), has)
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
		for _, p := range procs {
			if !p.isLeader(watchCtx, hc) {
				continue
			}
			killAt = time.Since(start)
			p.signal(syscall.SIGKILL, 5*time.Second)
			killed = p.id
			if err := p.start(); err != nil {
				cfg.Logger.Error("restarting the killed leader", "replica", p.id, "err", err)
				return
			}
			rctx, cancel := context.WithTimeout(watchCtx, 60*time.Second)
			defer cancel()
			if pollReady(rctx, hc, "http://"+p.client+"/readyz") == nil {
				backAt = time.Since(start)
				restarted = p.id
			}
			return
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
		fmt.Fprintf(stdout, "leader %s killed at %.1f s; it did not come back ready (log: %s)\n", killed, killAt.Seconds(), procs[0].logPath)
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
func startBalancer(ctx context.Context, cfg demoConfig, dir string, procs []*haProc, hc *http.Client) ([]string, string, func(), error) {
	var direct []string
	for _, p := range procs {
		direct = append(direct, "http://"+p.client)
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
	env := append(os.Environ(), "KVR_LISTEN="+listen)
	for i, p := range procs {
		env = append(env, fmt.Sprintf("KVR_REPLICA%d=%s", i, p.client))
	}
	check := exec.CommandContext(ctx, bin, "-c", "-f", cfg.HAProxyConfig)
	check.Env = env
	if out, err := check.CombinedOutput(); err != nil {
		return nil, "", nil, fmt.Errorf("haproxy -c -f %s: %w: %s", cfg.HAProxyConfig, err, out)
	}
	p := &haProc{id: "haproxy", logPath: filepath.Join(dir, "haproxy.log"), args: []string{bin, "-db", "-f", cfg.HAProxyConfig}, env: env}
	if err := p.start(); err != nil {
		return roundRobin(fmt.Sprintf("haproxy did not start: %v", err))
	}
	stop := func() { p.signal(syscall.SIGTERM, 5*time.Second) }
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := pollReady(rctx, hc, "http://"+listen+"/readyz"); err != nil {
		stop()
		return nil, "", nil, fmt.Errorf("haproxy on %s (log %s): %w", listen, p.logPath, err)
	}
	return []string{"http://" + listen}, fmt.Sprintf("behind HAProxy on %s (%s)", listen, cfg.HAProxyConfig), stop, nil
}
