// Package system_test runs the real kvrouter-ha binary as separate processes on loopback,
// with simulated workers, and checks what the cluster promises (DESIGN.md sections 2 and 9).
package system_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// binary is the kvrouter-ha binary built once for the package.
var binary string

func TestMain(m *testing.M) {
	// KVROUTER_SYSTEM_TEST_BINARY runs the tests against a binary built elsewhere (a machine
	// without the toolchain, or a build without -race for figures).
	if b := os.Getenv("KVROUTER_SYSTEM_TEST_BINARY"); b != "" {
		binary = b
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "kvrouter-system-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "kvrouter-ha")
	// KVROUTER_SYSTEM_TEST_TAGS builds a deliberately broken binary (jepsen_broken,
	// jepsen_broken_lease), to check that a test fails on the bug it guards against.
	build := exec.Command("go", "build", "-race", "-tags", os.Getenv("KVROUTER_SYSTEM_TEST_TAGS"), "-o", binary, "github.com/kvrouter-ha/kvrouter-ha/cmd/kvrouter-ha")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build kvrouter-ha:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// fleet is n simulated workers served in-process on loopback.
type fleet struct {
	urls []string
	ids  []string
	sims []*sim.Worker
}

func startFleet(t *testing.T, n int) *fleet {
	t.Helper()
	hosts := make([]string, n)
	for i := range hosts {
		hosts[i] = "127.0.0.1"
	}
	return startFleetAt(t, hosts...)
}

// startFleetAt serves one simulated worker on each host (a loopback address), w0, w1...
func startFleetAt(t *testing.T, hosts ...string) *fleet {
	t.Helper()
	return startFleetServing(t, hosts, nil)
}

// startFleetOf serves one simulated worker of each config on 127.0.0.1, w0, w1...
func startFleetOf(t *testing.T, cfgs ...sim.Config) *fleet {
	t.Helper()
	hosts := make([]string, len(cfgs))
	for i := range hosts {
		hosts[i] = "127.0.0.1"
	}
	return startFleetServing(t, hosts, cfgs)
}

// startFleetServing serves one simulated worker on each host, worker i of cfgs[i] (nil:
// the simulator's defaults), its ID set to w0, w1...
func startFleetServing(t *testing.T, hosts []string, cfgs []sim.Config) *fleet {
	t.Helper()
	f := &fleet{}
	for i, host := range hosts {
		id := fmt.Sprintf("w%d", i)
		var cfg sim.Config
		if cfgs != nil {
			cfg = cfgs[i]
		}
		cfg.ID = id
		w, err := sim.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: w.Handler()}
		go srv.Serve(l)
		t.Cleanup(func() { srv.Close() })
		f.urls = append(f.urls, "http://"+l.Addr().String())
		f.ids = append(f.ids, id)
		f.sims = append(f.sims, w)
	}
	return f
}

// replica is one kvrouter-ha serve process.
type replica struct {
	proc.Replica
	proc    *proc.Process
	logPath string // its output, appended across restarts
}

// log returns what the replica's processes have written so far.
func (r *replica) log() string {
	b, _ := os.ReadFile(r.logPath)
	return string(b)
}

// cluster is n replica processes that bootstrap together.
type cluster struct {
	t        testing.TB
	replicas []*replica
}

// startCluster starts n replicas of the race-detector build in front of the fleet,
// bootstrapped together.
func startCluster(t *testing.T, n int, fl *fleet, extra ...string) *cluster {
	t.Helper()
	var workers []string
	for i, u := range fl.urls {
		workers = append(workers, fl.ids[i]+"="+u)
	}
	return startClusterOf(t, binary, n, workers, extra...)
}

// startClusterOf starts n replicas of bin in front of workers (id=url specs).
func startClusterOf(t testing.TB, bin string, n int, workers []string, extra ...string) *cluster {
	t.Helper()
	return startClusterTuned(t, bin, n, workers, nil, extra...)
}

// startClusterTuned is startClusterOf with tune adjusting each replica's description first
// (nil: none).
func startClusterTuned(t testing.TB, bin string, n int, workers []string, tune func(*proc.Replica), extra ...string) *cluster {
	t.Helper()
	return startClusterWith(t, bin, n, workers, tune, nil, extra...)
}

// startClusterWith is startClusterTuned with flagsOf adding each replica's own flags, from
// its description once tuned (nil: none).
func startClusterWith(t testing.TB, bin string, n int, workers []string, tune func(*proc.Replica), flagsOf func(proc.Replica) []string, extra ...string) *cluster {
	t.Helper()
	c := &cluster{t: t}
	base := t.TempDir()
	members, err := proc.LoopbackReplicas(n, base)
	if err != nil {
		t.Fatal(err)
	}
	if tune != nil {
		for i := range members {
			tune(&members[i])
		}
	}
	flags := append([]string{"--log-level", "info", "--health-interval", "200ms"}, extra...)
	for _, m := range members {
		r := &replica{Replica: m, logPath: filepath.Join(base, m.ID+".log")}
		own := flags
		if flagsOf != nil {
			own = append(slices.Clip(flags), flagsOf(m)...)
		}
		r.proc = newProcess(t, proc.Spec{Name: m.ID, Argv: m.ServeArgv(bin, members, workers, own...), LogPath: r.logPath})
		c.replicas = append(c.replicas, r)
	}
	for _, r := range c.replicas {
		c.start(r)
	}
	for _, r := range c.replicas {
		c.waitReady(r)
	}
	return c
}

// newProcess returns a process of the test, not started, whose output goes to spec.LogPath
// (a file in a temporary directory when empty). At cleanup it is killed and, if the test
// failed, the tail of its log is logged.
func newProcess(t testing.TB, spec proc.Spec) *proc.Process {
	if spec.LogPath == "" {
		spec.LogPath = filepath.Join(t.TempDir(), spec.Name+".log")
	}
	p := proc.New(spec)
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("---- %s log (tail) ----\n%s", spec.Name, logTail(spec.LogPath, 6000))
		}
	})
	return p
}

// logTail returns the last n bytes of the file at path.
func logTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// start runs the replica's process (again, after a kill, on the same data directory).
func (c *cluster) start(r *replica) {
	c.t.Helper()
	if err := r.proc.Start(); err != nil {
		c.t.Fatal(err)
	}
}

// kill sends SIGKILL (which also ends a stopped process) and reaps the process.
func (c *cluster) kill(r *replica) { r.proc.Kill() }

// signal sends sig to the replica's process.
func (c *cluster) signal(r *replica, sig syscall.Signal) {
	c.t.Helper()
	if err := r.proc.Signal(sig); err != nil {
		c.t.Fatal(err)
	}
}

var httpClient = &http.Client{Timeout: 30 * time.Second}

// ready reports /readyz of the replica.
func (r *replica) ready() error {
	if err := proc.Get(context.Background(), httpClient, "http://"+r.Client+"/readyz", nil); err != nil {
		return fmt.Errorf("%s /readyz: %w", r.ID, err)
	}
	return nil
}

func (c *cluster) waitReady(r *replica) {
	c.t.Helper()
	if err := proc.WaitReady(c.t.Context(), httpClient, "http://"+r.Client+"/readyz", 60*time.Second); err != nil {
		c.t.Fatalf("%s: %v", r.ID, err)
	}
}

func (r *replica) status() (proc.Status, error) {
	return proc.GetStatus(context.Background(), httpClient, r.Admin)
}

// leader waits until a running replica reports itself leader and returns it.
func (c *cluster) leader() *replica {
	c.t.Helper()
	var running []*replica
	for _, r := range c.replicas {
		if r.proc.Running() {
			running = append(running, r)
		}
	}
	return c.leaderAmong(running)
}

// leaderAmong waits until one of rs reports itself leader and returns it.
func (c *cluster) leaderAmong(rs []*replica) *replica {
	c.t.Helper()
	admins := make([]string, len(rs))
	for i, r := range rs {
		admins[i] = r.Admin
	}
	var out *replica
	eventually(c.t, 30*time.Second, func() error {
		i, err := proc.FindLeader(c.t.Context(), httpClient, admins)
		if err == nil {
			out = rs[i]
		}
		return err
	})
	return out
}

// others returns the replicas other than r.
func (c *cluster) others(r *replica) []*replica {
	var out []*replica
	for _, x := range c.replicas {
		if x != r {
			out = append(out, x)
		}
	}
	return out
}

// answer is what one chat request got.
type answer struct {
	status   int
	worker   string
	replica  string
	revision uint64
	body     string
}

// chat sends one non-streaming chat request with a session key straight to a replica.
func chat(ctx context.Context, r *replica, session, prompt string) (answer, error) {
	return chatVia(ctx, httpClient, "http://"+r.Client, session, prompt, 4)
}

// chatVia sends one non-streaming chat request with a session key to base (a replica or a
// load balancer in front of them).
func chatVia(ctx context.Context, hc *http.Client, base, session, prompt string, maxTokens int) (answer, error) {
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":%d}`, sim.DefaultModel, prompt, maxTokens)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if session != "" {
		req.Header.Set("X-Session-ID", session)
	}
	return doChat(hc, req)
}

// doChat sends a chat request and reads its answer and the X-Kvrouter-* headers.
func doChat(hc *http.Client, req *http.Request) (answer, error) {
	resp, err := hc.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, fmt.Errorf("read answer: %w", err)
	}
	a := answer{status: resp.StatusCode, worker: resp.Header.Get("X-Kvrouter-Worker"),
		replica: resp.Header.Get("X-Kvrouter-Replica"), body: string(b)}
	if v := resp.Header.Get("X-Kvrouter-Binding-Revision"); v != "" {
		a.revision, _ = strconv.ParseUint(v, 10, 64)
	}
	return a, nil
}

// eventually polls cond until it returns nil or the deadline passes.
func eventually(t testing.TB, within time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %s: %v", within, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
