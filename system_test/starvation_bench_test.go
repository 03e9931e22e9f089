package system_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// raftTimeouts is one set of the replicas' Raft timeouts.
type raftTimeouts struct {
	name                        string
	heartbeat, election, leader time.Duration
}

// BenchmarkRaftUnderCPUStarvation is "at 100% CPU with no fault injected the leader stepped
// down", tried and measured: three replicas (the release build) and one fast simulated worker,
// one client binding a new session every 50 ms (each needs the leader), for a bounded window,
// with the CPU taken from the replicas in three ways: busy loops on every CPU (six per CPU, in
// this process, at the replicas' priority); the replicas pinned to one CPU beside four busy
// loops; and the same with the replicas at nice 10 (they get about 3% of that CPU when the
// loops want it; the replicas start un-pinned and are moved once they lead and serve). For each set of Raft timeouts (hashicorp/raft's defaults, the project's, and
// larger ones) it reports, from the replicas' logs, how many elections started and how often a
// leader stepped down, and, from polling every replica's status, the time no replica was
// leader and the longest stretch of it; also the new bindings that failed and the slowest one.
// Figures, not assertions (README, "CPU starvation and the Raft timeouts"). Run it once (about
// seven minutes, and all the machine's CPU):
//
//	go test -run '^$' -bench RaftUnderCPUStarvation -benchtime 1x ./system_test
func BenchmarkRaftUnderCPUStarvation(b *testing.B) {
	const window = 40 * time.Second
	sets := []raftTimeouts{
		{"hashicorp-defaults", time.Second, time.Second, 500 * time.Millisecond},
		{"project-defaults", 500 * time.Millisecond, 500 * time.Millisecond, 250 * time.Millisecond},
		{"larger", 2 * time.Second, 2 * time.Second, time.Second},
	}
	bin := releaseBinary(b)
	b.Run("project-defaults/idle", func(b *testing.B) {
		for b.Loop() {
			starveOnce(b, bin, sets[1], starveNone, window)
		}
	})
	for _, mode := range []starveMode{starveAllCPUs, starveOneCPU, starveOneCPUNiced} {
		for _, set := range sets {
			b.Run(set.name+"/"+string(mode), func(b *testing.B) {
				for b.Loop() {
					starveOnce(b, bin, set, mode, window)
				}
			})
		}
	}
}

// starveMode is how the CPU is taken from the replicas.
type starveMode string

const (
	starveNone starveMode = "idle"
	// starveAllCPUs: busy loops on every CPU, six per CPU, in this process.
	starveAllCPUs starveMode = "all-cpus-busy"
	// starveOneCPU: the replicas pinned to CPU 0 (taskset) beside four busy loops pinned there.
	starveOneCPU starveMode = "one-cpu-shared"
	// starveOneCPUNiced is starveOneCPU with the replicas at nice 10.
	starveOneCPUNiced starveMode = "one-cpu-niced"
)

// starveOnce runs one cluster with the timeouts of set for window, the CPU taken from it as
// mode says, and reports what Raft did.
func starveOnce(b *testing.B, bin string, set raftTimeouts, mode starveMode, window time.Duration) {
	workers := fastWorker(b, bin)
	c := startClusterOf(b, bin, 3, workers, "--log-level", "info",
		"--raft-heartbeat-timeout", set.heartbeat.String(), "--raft-election-timeout", set.election.String(),
		"--raft-leader-lease-timeout", set.leader.String())
	c.leader()
	offsets := make([]int, len(c.replicas))
	for i, r := range c.replicas {
		offsets[i] = len(r.log())
	}
	ctx, cancel := context.WithTimeout(b.Context(), window)
	defer cancel()
	var wg sync.WaitGroup
	switch mode {
	case starveOneCPU, starveOneCPUNiced:
		// Started, ready and led first; then every thread of each replica is moved to CPU 0
		// (and reniced), beside four busy loops there. taskset execs sh, so each loop is the
		// process the harness kills at the end of the window.
		for _, r := range c.replicas {
			pinReplica(b, r.proc.PID(), mode == starveOneCPUNiced)
		}
		for i := range 4 {
			spin := newProcess(b, proc.Spec{Name: fmt.Sprintf("spin%d", i), Argv: []string{"taskset", "-c", "0", "sh", "-c", "while :; do :; done"}})
			if err := spin.Start(); err != nil {
				b.Fatal(err)
			}
			defer spin.Kill()
		}
	case starveAllCPUs:
		for range 6 * runtime.GOMAXPROCS(0) {
			wg.Go(func() {
				for x := uint64(1); ctx.Err() == nil; {
					for range 1 << 16 {
						x = x*6364136223846793005 + 1442695040888963407
					}
				}
			})
		}
	}
	// New sessions: each needs the leader to bind it.
	var (
		mu                sync.Mutex
		binds, failed     int
		slowest           time.Duration
		leaderless, gap   time.Duration
		longest           time.Duration
		polls, unanswered int
	)
	hc := &http.Client{Timeout: 10 * time.Second}
	wg.Go(func() {
		for n := 0; ctx.Err() == nil && n < 10_000; n++ {
			r := c.replicas[n%len(c.replicas)]
			start := time.Now()
			a, err := chatVia(context.Background(), hc, "http://"+r.Client, fmt.Sprintf("starve-%d", n), "bind me", 2)
			d := time.Since(start)
			mu.Lock()
			binds++
			if err != nil || a.status != http.StatusOK {
				failed++
			}
			slowest = max(slowest, d)
			mu.Unlock()
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	})
	// Leader polls: a tick with no replica saying it leads counts as leaderless.
	const tick = 100 * time.Millisecond
	for last := time.Now(); ctx.Err() == nil; {
		leads := false
		for _, r := range c.replicas {
			st, err := proc.GetStatus(ctx, hc, r.Admin)
			if err != nil {
				unanswered++
				continue
			}
			leads = leads || st.Self.State == "Leader"
		}
		polls++
		now := time.Now()
		if !leads && ctx.Err() == nil {
			leaderless += now.Sub(last)
			gap += now.Sub(last)
			longest = max(longest, gap)
		} else {
			gap = 0
		}
		last = now
		select {
		case <-ctx.Done():
		case <-time.After(tick):
		}
	}
	wg.Wait()
	var elections, stepDowns, heartbeats int
	for i, r := range c.replicas {
		tail := r.log()[offsets[i]:]
		elections += strings.Count(tail, "entering candidate state")
		stepDowns += strings.Count(tail, "failed to contact quorum")
		heartbeats += strings.Count(tail, "heartbeat timeout reached")
	}
	b.ReportMetric(float64(elections), "elections")
	b.ReportMetric(float64(stepDowns), "step-downs")
	b.ReportMetric(leaderless.Seconds(), "s-leaderless")
	b.ReportMetric(longest.Seconds(), "s-longest-leaderless")
	b.ReportMetric(float64(failed), "binds-failed")
	b.ReportMetric(slowest.Seconds(), "s-slowest-bind")
	b.Logf("%s %s over %s: %d elections started (%d heartbeat timeouts), %d leader step-downs, %s without a leader (longest %s), %d of %d new bindings failed, slowest %s; %d status polls, %d unanswered",
		set.name, mode, window, elections, heartbeats, stepDowns, leaderless.Round(time.Millisecond), longest.Round(time.Millisecond),
		failed, binds, slowest.Round(time.Millisecond), polls, unanswered)
}

// pinReplica moves every thread of process pid to CPU 0 and, when nice is set, lowers each
// thread's priority to nice 10 (a thread's nice value is its own on Linux).
func pinReplica(b *testing.B, pid int, nice bool) {
	b.Helper()
	if out, err := exec.Command("taskset", "-a", "-pc", "0", strconv.Itoa(pid)).CombinedOutput(); err != nil {
		b.Fatalf("taskset %d: %v: %s", pid, err, out)
	}
	if !nice {
		return
	}
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		b.Fatal(err)
	}
	for _, t := range tasks {
		if out, err := exec.Command("renice", "-n", "10", "-p", t.Name()).CombinedOutput(); err != nil {
			b.Fatalf("renice %s: %v: %s", t.Name(), err, out)
		}
	}
}
