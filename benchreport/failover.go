package benchreport

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
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

// binWidth is the failover timeline's bin.
const binWidth = 100 * time.Millisecond

// Failover is the leader kill: three replica processes, the trace slice replayed through them
// (behind HAProxy when installed), the Raft leader killed with SIGKILL half-way and started
// again. Times are seconds from the replay's start.
type Failover struct {
	Balancer string `json:"balancer"`
	// Bins are requests by the 100 ms in which they were sent: how many completed and how
	// many failed.
	Bins   []FailoverBin `json:"bins"`
	Killed string        `json:"killed,omitempty"`
	KillAt float64       `json:"kill_at_s"`
	// BackAt is when the killed replica answered ready again (0: it did not).
	BackAt float64 `json:"back_at_s"`
	// Leaders are the leader changes seen by polling every replica every 20 ms: who leads
	// from then on ("" for no leader).
	Leaders []LeaderChange `json:"leaders"`
	// NoLeaderSeconds is the time without a leader in all, LongestNoLeader the longest spell.
	NoLeaderSeconds float64         `json:"no_leader_s"`
	LongestNoLeader float64         `json:"longest_no_leader_s"`
	Summary         *replay.Summary `json:"summary"`
	Failures        map[string]int  `json:"failures"`
}

// FailoverBin is one 100 ms of the timeline.
type FailoverBin struct {
	At     float64 `json:"at_s"`
	OK     int     `json:"ok"`
	Failed int     `json:"failed"`
}

// LeaderChange is one change of who leads.
type LeaderChange struct {
	At     float64 `json:"at_s"`
	Leader string  `json:"leader"`
}

// failover runs the leader kill.
func failover(ctx context.Context, cfg Config, reqs []trace.Request, logDir string) (*Failover, error) {
	bin := cfg.Binary
	if bin == "" {
		var err error
		if bin, err = os.Executable(); err != nil {
			return nil, fmt.Errorf("find this binary: %w", err)
		}
	}
	dir, err := os.MkdirTemp("", "kvrouter-benchreport-ha-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	wlog, err := os.Create(filepath.Join(logDir, "failover-workers.log"))
	if err != nil {
		return nil, err
	}
	defer wlog.Close()
	log := slog.New(slog.NewTextHandler(wlog, &slog.HandlerOptions{Level: slog.LevelWarn}))

	wctx, stopWorkers := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stopWorkers()
	var workers []string
	for i := range cfg.Workers {
		w, err := sim.New(sim.Config{ID: fmt.Sprintf("w%d", i), CapacityBlocks: cfg.CapacityBlocks, Speedup: cfg.Speedup,
			MaxModelLen: 262144, Logger: log})
		if err != nil {
			return nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		workers = append(workers, fmt.Sprintf("w%d=http://%s", i, ln.Addr()))
		wg.Go(func() { w.Serve(wctx, ln) })
	}

	members, err := proc.LoopbackReplicas(3, dir)
	if err != nil {
		return nil, err
	}
	scaled := func(d time.Duration) string {
		return max(time.Duration(float64(d)/cfg.Speedup), 5*time.Millisecond).String()
	}
	var procs []*proc.Process
	var admins []string
	for _, m := range members {
		admins = append(admins, m.Admin)
		// The demo's settings: time runs Speedup times faster, so the TTLs and the hints'
		// intervals shrink with it; the index's cap is the workers' cache.
		procs = append(procs, proc.New(proc.Spec{Name: m.ID, LogPath: filepath.Join(logDir, "failover-"+m.ID+".log"),
			Argv: m.ServeArgv(bin, members, workers, "--log-level", "warn",
				"--approx-ttl", "0s", "--approx-max-blocks", fmt.Sprint(cfg.CapacityBlocks),
				"--session-ttl", scaled(10*time.Minute),
				"--load-share-interval", scaled(150*time.Millisecond),
				"--decision-flush-interval", scaled(50*time.Millisecond),
				"--health-timeout", "2s", "--shutdown-delay", "0")}))
	}
	defer func() {
		var sw sync.WaitGroup
		for _, p := range procs {
			sw.Go(func() { _ = p.Stop(context.WithoutCancel(ctx), syscall.SIGTERM, 10*time.Second) })
		}
		sw.Wait()
	}()
	for _, p := range procs {
		if err := p.Start(); err != nil {
			return nil, err
		}
	}
	hc := &http.Client{Timeout: 2 * time.Second}
	defer hc.CloseIdleConnections()
	for _, m := range members {
		if err := proc.WaitReady(ctx, hc, "http://"+m.Client+"/readyz", 90*time.Second); err != nil {
			return nil, fmt.Errorf("replica %s (log in %s): %w", m.ID, logDir, err)
		}
	}
	targets, balancer, stopLB, err := balance(ctx, cfg, members, logDir, hc)
	if err != nil {
		return nil, err
	}
	defer stopLB()

	f := &Failover{Balancer: balancer}
	var reqLog bytes.Buffer
	rc := replay.DefaultConfig()
	rc.Targets = targets
	rc.Requests = reqs
	rc.Speedup = cfg.Speedup
	rc.Model = sim.DefaultModel
	rc.Label = "kv x3, leader killed"
	rc.RequestLog = &reqLog

	watchCtx, stopWatch := context.WithCancel(ctx)
	var watchers sync.WaitGroup
	start := time.Now()
	var mu sync.Mutex
	watchers.Go(func() {
		last := "?"
		var lostAt time.Time
		observe := func() {
			lctx, cancel := context.WithTimeout(watchCtx, 500*time.Millisecond)
			i, err := proc.FindLeader(lctx, hc, admins)
			cancel()
			now := time.Now()
			if watchCtx.Err() != nil {
				return // the poll was cut short: it says nothing
			}
			who := ""
			if err == nil {
				who = members[i].ID
			}
			mu.Lock()
			defer mu.Unlock()
			if who == last {
				return
			}
			f.Leaders = append(f.Leaders, LeaderChange{At: now.Sub(start).Seconds(), Leader: who})
			switch {
			case who == "" && lostAt.IsZero():
				lostAt = now
			case who != "" && !lostAt.IsZero():
				d := now.Sub(lostAt).Seconds()
				f.NoLeaderSeconds += d
				f.LongestNoLeader = max(f.LongestNoLeader, d)
				lostAt = time.Time{}
			}
			last = who
		}
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for watchCtx.Err() == nil {
			observe()
			select {
			case <-watchCtx.Done():
			case <-t.C:
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if !lostAt.IsZero() {
			d := time.Since(lostAt).Seconds()
			f.NoLeaderSeconds += d
			f.LongestNoLeader = max(f.LongestNoLeader, d)
		}
	})
	half := time.Duration(float64(reqs[len(reqs)-1].Timestamp-reqs[0].Timestamp) / 2 / cfg.Speedup)
	var killErr error
	// The kill runs on its own context, so that a replay shorter than the wait for a leader
	// (a starved machine, or a tiny slice) does not cut it short; the replay's end waits for it.
	killCtx, cancelKill := context.WithCancel(ctx)
	defer cancelKill()
	killDone := make(chan struct{})
	watchers.Go(func() {
		defer close(killDone)
		select {
		case <-killCtx.Done():
			return
		case <-time.After(half):
		}
		// A starved cluster may be between leaders just then: wait for one (bounded).
		i, err := proc.AwaitLeader(killCtx, hc, admins, 15*time.Second, 2*time.Second)
		if err != nil {
			killErr = fmt.Errorf("no leader to kill half-way: %w", err)
			return
		}
		mu.Lock()
		f.KillAt, f.Killed = time.Since(start).Seconds(), members[i].ID
		mu.Unlock()
		procs[i].Kill()
		if err := procs[i].Start(); err != nil {
			killErr = fmt.Errorf("restarting %s: %w", members[i].ID, err)
			return
		}
		if proc.WaitReady(killCtx, hc, "http://"+members[i].Client+"/readyz", 90*time.Second) == nil {
			mu.Lock()
			f.BackAt = time.Since(start).Seconds()
			mu.Unlock()
		}
	})
	sum, err := replay.Run(ctx, rc)
	// The kill, and the restarted replica's return, may still be on their way: give them a
	// bounded moment.
	select {
	case <-killDone:
	case <-ctx.Done():
	case <-time.After(30 * time.Second):
	}
	cancelKill()
	stopWatch()
	watchers.Wait()
	if err != nil {
		return nil, err
	}
	if killErr != nil {
		return nil, killErr
	}
	f.Summary = sum
	f.Failures = sum.Errors
	f.Bins, err = timeline(&reqLog)
	return f, err
}

// timeline bins a replay's request log by the 100 ms in which each request was sent.
func timeline(log io.Reader) ([]FailoverBin, error) {
	var bins []FailoverBin
	sc := bufio.NewScanner(log)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		var r replay.RequestRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("request log: %w", err)
		}
		i := int(r.SentMs / float64(binWidth.Milliseconds()))
		for len(bins) <= i {
			bins = append(bins, FailoverBin{At: float64(len(bins)) * binWidth.Seconds()})
		}
		if r.OK {
			bins[i].OK++
		} else {
			bins[i].Failed++
		}
	}
	return bins, sc.Err()
}

// balance puts HAProxy (with cfg.HAProxyConfig) in front of the replicas when both are there;
// otherwise the client sends to the replicas in turn. It returns the replay's targets, what
// balances them, and a stop function.
func balance(ctx context.Context, cfg Config, members []proc.Replica, logDir string, hc *http.Client) ([]string, string, func(), error) {
	var direct []string
	for _, m := range members {
		direct = append(direct, "http://"+m.Client)
	}
	none := func(why string) ([]string, string, func(), error) {
		return direct, "no load balancer (" + why + "): the client sends to the three replicas in turn", func() {}, nil
	}
	if cfg.HAProxyConfig == "" {
		return none("none configured")
	}
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		return none("haproxy is not installed")
	}
	if _, err := os.Stat(cfg.HAProxyConfig); err != nil {
		return none("no " + cfg.HAProxyConfig)
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
	spec.LogPath = filepath.Join(logDir, "failover-haproxy.log")
	p := proc.New(spec)
	if err := p.Start(); err != nil {
		return none(fmt.Sprintf("haproxy did not start: %v", err))
	}
	stop := func() { _ = p.Stop(context.WithoutCancel(ctx), syscall.SIGTERM, 5*time.Second) }
	if err := proc.WaitReady(ctx, hc, "http://"+listen+"/readyz", 30*time.Second); err != nil {
		stop()
		return nil, "", nil, errors.Join(fmt.Errorf("haproxy on %s", listen), err)
	}
	return []string{"http://" + listen}, "HAProxy with " + cfg.HAProxyConfig, stop, nil
}
