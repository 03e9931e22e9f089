// Package proc is the one harness for running the real kvrouter-ha binary, and what stands
// around it, as child processes: the demo, the system tests and the fault harness (jepsen)
// all start replicas, simulated workers and HAProxy through it, signal them, kill them by
// pid, find the Raft leader over the admin API and wait for /readyz.
//
// It imports nothing of the router's own packages (only the standard library and
// internal/loopback): a harness that uses it still depends on the router through the wire
// alone, its flags, its HTTP interface and the admin API's JSON.
package proc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// Spec says how to run one child process. A Process runs it again, unchanged, on every Start.
type Spec struct {
	// Name names the process in errors and in the log's start and exit lines.
	Name string
	// Argv is the program and its arguments.
	Argv []string
	// Wrap, when set, is put before Argv: a command that runs the rest where it should, such
	// as "ip netns exec NAME".
	Wrap []string
	// Env is added to this process's own environment (nil: the child inherits it as it is).
	Env []string
	// LogPath, when set, is a file the child's stdout and stderr are appended to; it is kept
	// across restarts, each run marked by a start and an exit line.
	LogPath string
	// Output, when set, also receives the child's output and the start and exit lines. It is
	// written from one goroutine at a time, but may be written while its owner reads it.
	Output io.Writer
}

// argv is the command line Start runs: Wrap, then Argv.
func (s Spec) argv() []string {
	return append(append([]string(nil), s.Wrap...), s.Argv...)
}

// Process is one child process that is started, signalled, stopped and started again by its
// pid. It runs in a process group of its own, so a terminal's ^C reaches only the harness,
// which then stops its children; on Linux the kernel also kills it should the harness die
// without doing so (Pdeathsig). Its methods are safe for concurrent use.
type Process struct {
	spec Spec

	mu     sync.Mutex
	cmd    *exec.Cmd     // the current or the last run; nil before the first Start
	done   chan struct{} // closed when cmd's run has ended and been reaped
	ended  *os.ProcessState
	halted bool // the last run was ended by Kill or Stop, not on its own
}

// New returns a Process that runs spec; it does not start it.
func New(spec Spec) *Process {
	spec.Argv = append([]string(nil), spec.Argv...)
	spec.Wrap = append([]string(nil), spec.Wrap...)
	spec.Env = append([]string(nil), spec.Env...)
	return &Process{spec: spec}
}

// Name returns the name of the process.
func (p *Process) Name() string { return p.spec.Name }

// Start runs the process: for the first time, or again with the same arguments after it
// ended (killed, stopped or on its own). It fails if the process is running.
func (p *Process) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.runningLocked() {
		return fmt.Errorf("%s is already running (pid %d)", p.spec.Name, p.cmd.Process.Pid)
	}
	argv := p.spec.argv()
	if len(argv) == 0 {
		return fmt.Errorf("start %s: no command", p.spec.Name)
	}
	var logf *os.File
	var outs []io.Writer
	if p.spec.LogPath != "" {
		f, err := os.OpenFile(p.spec.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return fmt.Errorf("%s log: %w", p.spec.Name, err)
		}
		logf = f
		outs = append(outs, f)
	}
	if p.spec.Output != nil {
		outs = append(outs, p.spec.Output)
	}
	var out io.Writer
	switch len(outs) {
	case 0:
	case 1:
		out = outs[0] // a file alone is handed to the child as it is, with no copying
	default:
		out = io.MultiWriter(outs...)
	}
	closeLog := func() {
		if logf != nil {
			logf.Close()
		}
	}
	if out != nil {
		fmt.Fprintf(out, "---- start %s at %s: %s\n", p.spec.Name, time.Now().Format(time.RFC3339Nano), strings.Join(argv, " "))
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	if p.spec.Env != nil {
		cmd.Env = append(os.Environ(), p.spec.Env...)
	}
	if out != nil {
		cmd.Stdout, cmd.Stderr = out, out
	}
	cmd.SysProcAttr = childAttr()
	if err := cmd.Start(); err != nil {
		closeLog()
		return fmt.Errorf("start %s: %w", p.spec.Name, err)
	}
	done := make(chan struct{})
	go func() {
		err := cmd.Wait()
		if out != nil {
			fmt.Fprintf(out, "---- %s (pid %d) exited: %v\n", p.spec.Name, cmd.Process.Pid, err)
		}
		closeLog()
		p.mu.Lock()
		p.ended = cmd.ProcessState
		p.mu.Unlock()
		close(done)
	}()
	p.cmd, p.done, p.ended, p.halted = cmd, done, nil, false
	return nil
}

func (p *Process) runningLocked() bool {
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// Running reports whether the process was started and has not ended yet (a paused process
// is running).
func (p *Process) Running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.runningLocked()
}

// Exited reports whether the last run ended on its own: not through Kill or Stop (a signal
// from Signal that ends it counts as its own end).
func (p *Process) Exited() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil && !p.runningLocked() && !p.halted
}

// Done returns a channel that is closed once the current run has ended and been reaped; it
// is closed already when the process was never started.
func (p *Process) Done() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done == nil {
		c := make(chan struct{})
		close(c)
		return c
	}
	return p.done
}

// PID returns the pid of the current or the last run, 0 before the first Start.
func (p *Process) PID() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// ExitCode returns the exit status of the last run once it has ended, or -1: while it runs,
// before the first Start, or when a signal ended it.
func (p *Process) ExitCode() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ended == nil {
		return -1
	}
	return p.ended.ExitCode()
}

// Signal sends sig to the running process.
func (p *Process) Signal(sig os.Signal) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.runningLocked() {
		return fmt.Errorf("signal %s: %w", p.spec.Name, ErrNotRunning)
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal %s: %w", p.spec.Name, err)
	}
	return nil
}

// ErrNotRunning is what Signal, Pause and Resume return for a process that is not running.
var ErrNotRunning = errors.New("not running")

// Pause stops the process (SIGSTOP) until Resume; the kernel still queues connections to
// its listeners. It is Unix only.
func (p *Process) Pause() error {
	if !canPause {
		return fmt.Errorf("pause %s: %w", p.spec.Name, errors.ErrUnsupported)
	}
	return p.Signal(sigStop)
}

// Resume continues a paused process (SIGCONT). It is Unix only.
func (p *Process) Resume() error {
	if !canPause {
		return fmt.Errorf("resume %s: %w", p.spec.Name, errors.ErrUnsupported)
	}
	return p.Signal(sigCont)
}

// Kill sends SIGKILL, which also ends a paused process, and returns once the process is
// reaped. A process that is not running is left alone.
func (p *Process) Kill() {
	cmd, done, ok := p.halt()
	if !ok {
		return
	}
	_ = cmd.Process.Kill()
	<-done
}

// halt returns the current run, marked as ended by the harness, or false when there is none.
func (p *Process) halt() (*exec.Cmd, <-chan struct{}, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.runningLocked() {
		return nil, nil, false
	}
	p.halted = true
	return p.cmd, p.done, true
}

// Stop sends sig (SIGTERM, for a clean shutdown) and waits for the process to end; once
// grace has passed, or ctx has ended, it kills it (SIGKILL). It returns once the process is
// reaped, with an error if it had to be killed or sig could not be sent. A process that is
// not running is left alone.
func (p *Process) Stop(ctx context.Context, sig os.Signal, grace time.Duration) error {
	cmd, done, ok := p.halt()
	if !ok {
		return nil
	}
	// kill ends the run unless it has ended already, and says whether it had to.
	kill := func() bool {
		select {
		case <-done:
			return false
		default:
		}
		_ = cmd.Process.Kill()
		<-done
		return true
	}
	if err := cmd.Process.Signal(sig); err != nil {
		if !kill() {
			return nil // it ended on its own just before
		}
		return fmt.Errorf("stop %s: %w", p.spec.Name, err)
	}
	timer := time.NewTimer(grace)
	defer timer.Stop()
	select {
	case <-done:
		return nil
	case <-timer.C:
	case <-ctx.Done():
	}
	if !kill() {
		return nil // it ended just as the wait did
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("stop %s: killed: %w", p.spec.Name, err)
	}
	return fmt.Errorf("stop %s: killed: no exit within %s of %v", p.spec.Name, grace, sig)
}

// WaitStopped waits until every thread of the process is stopped, once it was sent
// SIGSTOP: the signal's sender returns before the kernel has stopped them all, and a
// request the process reads meanwhile runs before the pause, not after it. It reads
// /proc, so it is Linux only (elsewhere errors.ErrUnsupported).
func (p *Process) WaitStopped(ctx context.Context) error {
	p.mu.Lock()
	if !p.runningLocked() {
		p.mu.Unlock()
		return fmt.Errorf("wait for %s to stop: %w", p.spec.Name, ErrNotRunning)
	}
	pid := p.cmd.Process.Pid
	p.mu.Unlock()
	tasks := fmt.Sprintf("/proc/%d/task", pid)
	for {
		stopped, err := allStopped(tasks)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("wait for %s to stop: %w", p.spec.Name, errors.ErrUnsupported)
			}
			return fmt.Errorf("wait for %s to stop: %w", p.spec.Name, err)
		}
		if stopped {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for %s to stop: %w", p.spec.Name, ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

// allStopped reports whether every task under dir (/proc/PID/task) is in state T (stopped).
func allStopped(dir string) (bool, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return false, err
	}
	for _, e := range entries {
		b, err := os.ReadFile(dir + "/" + e.Name() + "/stat")
		if errors.Is(err, os.ErrNotExist) {
			continue // the thread has exited
		}
		if err != nil {
			return false, err
		}
		// The state follows the command name, which is in parentheses and may hold any byte.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 || i+2 >= len(s) {
			return false, fmt.Errorf("unreadable %s/%s/stat", dir, e.Name())
		}
		if s[i+2] != 'T' {
			return false, nil
		}
	}
	return true, nil
}
