//go:build unix

package proc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The test binary is also the child the tests run: with childEnv set, TestMain plays that
// part instead of running the tests.
const childEnv = "PROC_TEST_CHILD"

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(runChild(mode))
	}
	os.Exit(m.Run())
}

// runChild is the child's side: it says hello with its pid, then does what mode says.
func runChild(mode string) int {
	if mode == "ignore-term" {
		signal.Ignore(syscall.SIGTERM)
	}
	fmt.Printf("hello from %d\n", os.Getpid())
	switch mode {
	case "exit3":
		return 3
	case "env":
		fmt.Printf("wrapped=%s value=%s\n", os.Getenv("PROC_TEST_WRAPPED"), os.Getenv("PROC_TEST_VALUE"))
		return 0
	case "spawn":
		// A grandchild, left running when this process exits: Pdeathsig must end it.
		g := New(Spec{Name: "grandchild", Argv: childArgv(), Env: []string{childEnv + "=sleep"}})
		if err := g.Start(); err != nil {
			fmt.Println("spawn:", err)
			return 1
		}
		fmt.Printf("grandchild %d\n", g.PID())
		return 0
	}
	time.Sleep(time.Minute) // "sleep", "ignore-term": until a signal ends it
	return 0
}

func childArgv() []string { return []string{os.Args[0], "-test.run=^$"} }

// child is a Process running the test binary in mode, its output in a log file of the test.
func child(t *testing.T, mode string) (*Process, string) {
	t.Helper()
	log := filepath.Join(t.TempDir(), mode+".log")
	p := New(Spec{Name: mode, Argv: childArgv(), Env: []string{childEnv + "=" + mode}, LogPath: log})
	t.Cleanup(p.Kill)
	return p, log
}

// waitLog waits until the log file holds want n times.
func waitLog(t *testing.T, path, want string, n int) string {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		b, _ := os.ReadFile(path)
		if strings.Count(string(b), want) >= n {
			return string(b)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s does not hold %q %d times within 20s:\n%s", path, want, n, b)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitDone waits (bounded) for the run to end.
func waitDone(t *testing.T, p *Process) {
	t.Helper()
	select {
	case <-p.Done():
	case <-time.After(20 * time.Second):
		t.Fatalf("%s (pid %d) did not end within 20s", p.Name(), p.PID())
	}
}

// state is the process's state letter in /proc (R, S, T, Z...), or 0 when it is gone.
func state(pid int) byte {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}

func TestEndingARun(t *testing.T) {
	cases := []struct {
		name, mode string
		// end ends the run and returns once it has ended.
		end        func(t *testing.T, p *Process)
		wantExited bool // ended on its own, as Exited reports
		wantCode   int
	}{
		{name: "exits on its own", mode: "exit3", end: waitDone, wantExited: true, wantCode: 3},
		{name: "SIGTERM by Signal", mode: "sleep", wantExited: true, wantCode: -1, end: func(t *testing.T, p *Process) {
			if err := p.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			waitDone(t, p)
		}},
		{name: "Kill", mode: "sleep", wantCode: -1, end: func(t *testing.T, p *Process) { p.Kill() }},
		{name: "Kill of a paused process", mode: "sleep", wantCode: -1, end: func(t *testing.T, p *Process) {
			if err := p.Pause(); err != nil {
				t.Fatal(err)
			}
			if runtime.GOOS == "linux" {
				deadline := time.Now().Add(10 * time.Second)
				for state(p.PID()) != 'T' {
					if time.Now().After(deadline) {
						t.Fatalf("pid %d is in state %q after SIGSTOP, want T", p.PID(), state(p.PID()))
					}
					time.Sleep(5 * time.Millisecond)
				}
			}
			p.Kill()
		}},
		{name: "Stop ends it with its signal", mode: "sleep", wantCode: -1, end: func(t *testing.T, p *Process) {
			if err := p.Stop(t.Context(), syscall.SIGTERM, 20*time.Second); err != nil {
				t.Fatal(err)
			}
		}},
		{name: "Stop kills what ignores its signal", mode: "ignore-term", wantCode: -1, end: func(t *testing.T, p *Process) {
			const grace = 300 * time.Millisecond
			began := time.Now()
			err := p.Stop(t.Context(), syscall.SIGTERM, grace)
			if err == nil || !strings.Contains(err.Error(), "killed") {
				t.Fatalf("Stop of a process that ignores SIGTERM: %v, want an error saying it was killed", err)
			}
			if d := time.Since(began); d < grace {
				t.Fatalf("killed after %s, before the grace of %s", d, grace)
			}
		}},
		{name: "Stop kills at once when ctx ends", mode: "ignore-term", wantCode: -1, end: func(t *testing.T, p *Process) {
			ctx, cancel := context.WithCancel(t.Context())
			cancel()
			if err := p.Stop(ctx, syscall.SIGTERM, time.Hour); !errors.Is(err, context.Canceled) {
				t.Fatalf("Stop with an ended ctx: %v, want context.Canceled", err)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, log := child(t, tc.mode)
			if p.Running() || p.PID() != 0 || p.ExitCode() != -1 {
				t.Fatalf("before Start: running %v, pid %d, exit code %d", p.Running(), p.PID(), p.ExitCode())
			}
			if err := p.Start(); err != nil {
				t.Fatal(err)
			}
			if tc.mode != "exit3" {
				waitLog(t, log, "hello from", 1) // its signal handling is in place
				if !p.Running() || p.Exited() || p.ExitCode() != -1 {
					t.Fatalf("while running: running %v, exited %v, exit code %d", p.Running(), p.Exited(), p.ExitCode())
				}
			}
			pid := p.PID()
			tc.end(t, p)
			select {
			case <-p.Done():
			default:
				t.Fatal("the run ended but Done is not closed")
			}
			if p.Running() || p.Exited() != tc.wantExited || p.ExitCode() != tc.wantCode {
				t.Fatalf("after the end: running %v, exited %v, exit code %d; want false, %v, %d",
					p.Running(), p.Exited(), p.ExitCode(), tc.wantExited, tc.wantCode)
			}
			if s := state(pid); s != 0 {
				t.Fatalf("pid %d still exists (state %q): not reaped", pid, s)
			}
			if err := p.Signal(syscall.SIGTERM); !errors.Is(err, ErrNotRunning) {
				t.Fatalf("Signal after the end: %v, want ErrNotRunning", err)
			}
			p.Kill() // no-op
			if err := p.Stop(t.Context(), syscall.SIGTERM, time.Second); err != nil {
				t.Fatalf("Stop of an ended process: %v", err)
			}
		})
	}
}

func TestStartAgainAfterKillAppendsToTheSameLog(t *testing.T) {
	p, log := child(t, "sleep")
	if err := os.WriteFile(log, []byte("written before\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var pids []int
	for run := 1; run <= 2; run++ {
		if err := p.Start(); err != nil {
			t.Fatalf("start %d: %v", run, err)
		}
		waitLog(t, log, "hello from", run)
		pids = append(pids, p.PID())
		p.Kill()
	}
	if pids[0] == pids[1] {
		t.Fatalf("both runs have pid %d", pids[0])
	}
	b, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	if !strings.HasPrefix(text, "written before\n") {
		t.Fatalf("the log lost what it held before:\n%s", text)
	}
	for _, pid := range pids {
		for _, want := range []string{fmt.Sprintf("hello from %d\n", pid), fmt.Sprintf("(pid %d) exited: signal: killed", pid)} {
			if !strings.Contains(text, want) {
				t.Errorf("log misses %q:\n%s", want, text)
			}
		}
	}
	if n := strings.Count(text, "---- start sleep at "); n != 2 {
		t.Errorf("%d start lines, want 2:\n%s", n, text)
	}
}

func TestStartFailsWhileRunning(t *testing.T) {
	p, _ := child(t, "sleep")
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	pid := p.PID()
	if err := p.Start(); err == nil {
		t.Fatal("a second Start of a running process succeeded")
	}
	if p.PID() != pid || !p.Running() {
		t.Fatalf("the failed Start changed the run: pid %d (was %d), running %v", p.PID(), pid, p.Running())
	}
}

func TestNeverStarted(t *testing.T) {
	p := New(Spec{Name: "idle", Argv: []string{"true"}})
	select {
	case <-p.Done():
	default:
		t.Fatal("Done of a process never started is not closed")
	}
	if p.Exited() || p.Running() {
		t.Fatal("a process never started says it ran")
	}
	if err := p.Pause(); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("Pause: %v, want ErrNotRunning", err)
	}
	p.Kill()
}

func TestStartFailsForAMissingProgram(t *testing.T) {
	p := New(Spec{Name: "missing", Argv: []string{filepath.Join(t.TempDir(), "no-such-program")}})
	if err := p.Start(); err == nil {
		p.Kill()
		t.Fatal("Start of a missing program succeeded")
	}
	if p.Running() {
		t.Fatal("running after a failed Start")
	}
}

func TestWrapEnvAndOutput(t *testing.T) {
	env, err := exec.LookPath("env")
	if err != nil {
		t.Skip("no env(1) to wrap the child with")
	}
	var out bytes.Buffer // read only once the run has ended, so with no lock
	log := filepath.Join(t.TempDir(), "env.log")
	p := New(Spec{
		Name: "env", Argv: childArgv(), Wrap: []string{env, "PROC_TEST_WRAPPED=yes"},
		Env: []string{childEnv + "=env", "PROC_TEST_VALUE=v1"}, Output: &out, LogPath: log,
	})
	t.Cleanup(p.Kill)
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	waitDone(t, p)
	if p.ExitCode() != 0 {
		t.Fatalf("exit code %d\n%s", p.ExitCode(), out.String())
	}
	b, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	for name, text := range map[string]string{"Output": out.String(), "LogPath": string(b)} {
		for _, want := range []string{"wrapped=yes value=v1\n", "---- start env at ", " " + env + " PROC_TEST_WRAPPED=yes " + os.Args[0]} {
			if !strings.Contains(text, want) {
				t.Errorf("%s misses %q:\n%s", name, want, text)
			}
		}
	}
}

func TestChildHasItsOwnProcessGroup(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("process groups are Unix")
	}
	p, log := child(t, "sleep")
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	waitLog(t, log, "hello from", 1)
	pgid, err := syscall.Getpgid(p.PID())
	if err != nil {
		t.Fatal(err)
	}
	if pgid != p.PID() || pgid == syscall.Getpgrp() {
		t.Fatalf("child %d is in process group %d (the test's is %d), want its own", p.PID(), pgid, syscall.Getpgrp())
	}
}

func TestChildDiesWithItsParent(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("Pdeathsig is Linux only")
	}
	p, log := child(t, "spawn")
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	waitDone(t, p)
	text := waitLog(t, log, "grandchild ", 1)
	var pid int
	for line := range strings.Lines(text) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "grandchild "); ok {
			pid, _ = strconv.Atoi(v)
		}
	}
	if pid <= 0 {
		t.Fatalf("no grandchild pid in the log:\n%s", text)
	}
	// If it outlives the test, it is the test's to stop.
	t.Cleanup(func() {
		if s := state(pid); s != 0 && s != 'Z' {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for s := state(pid); s != 0 && s != 'Z'; s = state(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("grandchild %d still runs (state %q) 10s after its parent exited", pid, s)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestWaitStoppedWaitsForEveryThread: WaitStopped does not return while the process runs,
// and returns once SIGSTOP has stopped it.
func TestWaitStoppedWaitsForEveryThread(t *testing.T) {
	p, log := child(t, "sleep")
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	waitLog(t, log, "hello from", 1)
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	if err := p.WaitStopped(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitStopped on a running process: %v, want the deadline", err)
	}
	if err := p.Pause(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel = context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := p.WaitStopped(ctx); err != nil {
		t.Fatal(err)
	}
	if st := state(p.PID()); st != 'T' {
		t.Fatalf("WaitStopped returned with the process in state %q", st)
	}
	if err := p.Resume(); err != nil {
		t.Fatal(err)
	}
}

// TestReadCPUTicksGrowsWithWork reads this process's times around a busy loop: they are
// read, and grow.
func TestReadCPUTicksGrowsWithWork(t *testing.T) {
	before, err := ReadCPUTicks("self")
	if err != nil {
		t.Fatal(err)
	}
	x := uint64(1)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		for range 1 << 20 {
			x = x*6364136223846793005 + 1442695040888963407
		}
		now, err := ReadCPUTicks("self")
		if err != nil {
			t.Fatal(err)
		}
		if now.Own() >= before.Own()+0.05 {
			return
		}
	}
	t.Fatalf("no CPU time counted in 10 s of work (%d)", x)
}
