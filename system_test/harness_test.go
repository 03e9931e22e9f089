// Package system_test runs the real kvrouter-ha binary as separate processes on loopback,
// with simulated workers, and checks what the cluster promises (DESIGN.md sections 2 and 9).
package system_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// binary is the kvrouter-ha binary built once for the package.
var binary string

func TestMain(m *testing.M) {
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
}

func startFleet(t *testing.T, n int) *fleet {
	t.Helper()
	f := &fleet{}
	for i := range n {
		w, err := sim.New(sim.Config{ID: fmt.Sprintf("w%d", i)})
		if err != nil {
			t.Fatal(err)
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: w.Handler()}
		go srv.Serve(l)
		t.Cleanup(func() { srv.Close() })
		f.urls = append(f.urls, "http://"+l.Addr().String())
		f.ids = append(f.ids, fmt.Sprintf("w%d", i))
	}
	return f
}

// replica is one kvrouter-ha serve process.
type replica struct {
	id                     string
	client, admin, raft, p string
	gossip                 string
	dataDir                string
	args                   []string
	cmd                    *exec.Cmd
	log                    *bytes.Buffer
	mu                     sync.Mutex
	done                   chan struct{}
}

// cluster is n replica processes that bootstrap together.
type cluster struct {
	t        testing.TB
	bin      string // the kvrouter-ha binary the replicas run
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
	c := &cluster{t: t, bin: bin}
	base := t.TempDir()
	var peers, gossipSeeds []string
	for i := range n {
		r := &replica{
			id:     fmt.Sprintf("r%d", i),
			client: loopbacktest.Addr(t), admin: loopbacktest.Addr(t), raft: loopbacktest.Addr(t),
			p: loopbacktest.Addr(t), gossip: loopbacktest.Addr(t),
			dataDir: filepath.Join(base, fmt.Sprintf("r%d", i)),
		}
		peers = append(peers, r.p)
		gossipSeeds = append(gossipSeeds, r.gossip)
		c.replicas = append(c.replicas, r)
	}
	for _, r := range c.replicas {
		r.args = append([]string{"serve",
			"--replica-id", r.id, "--listen", r.client, "--admin-listen", r.admin,
			"--raft-listen", r.raft, "--peer-listen", r.p, "--data-dir", r.dataDir,
			"--bootstrap-expect", strconv.Itoa(n), "--join", strings.Join(peers, ","),
			"--gossip-listen", r.gossip, "--gossip-join", strings.Join(gossipSeeds, ","),
			"--worker", strings.Join(workers, ","), "--log-level", "info",
			"--health-interval", "200ms",
		}, extra...)
	}
	for _, r := range c.replicas {
		c.start(r)
	}
	t.Cleanup(func() {
		for _, r := range c.replicas {
			c.kill(r)
		}
		if t.Failed() {
			for _, r := range c.replicas {
				r.mu.Lock()
				t.Logf("---- %s log (tail) ----\n%s", r.id, tail(r.log.String(), 6000))
				r.mu.Unlock()
			}
		}
	})
	for _, r := range c.replicas {
		c.waitReady(r)
	}
	return c
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// start runs the replica's process (again, after a kill, on the same data directory).
func (c *cluster) start(r *replica) {
	c.t.Helper()
	cmd := exec.Command(c.bin, r.args...)
	if r.log == nil {
		r.log = &bytes.Buffer{}
	}
	w := lockedWriter{&r.mu, r.log}
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("start %s: %v", r.id, err)
	}
	r.cmd = cmd
	r.done = make(chan struct{})
	go func(done chan struct{}) { _ = cmd.Wait(); close(done) }(r.done)
}

// kill sends SIGKILL and reaps the process.
func (c *cluster) kill(r *replica) {
	if r.cmd == nil {
		return
	}
	_ = r.cmd.Process.Signal(syscall.SIGCONT) // a stopped process must be able to die
	_ = r.cmd.Process.Kill()
	<-r.done
	r.cmd = nil
}

// signal sends sig to the replica's process.
func (c *cluster) signal(r *replica, sig syscall.Signal) {
	c.t.Helper()
	if err := r.cmd.Process.Signal(sig); err != nil {
		c.t.Fatalf("signal %s: %v", r.id, err)
	}
}

var httpClient = &http.Client{Timeout: 30 * time.Second}

// ready reports /readyz of the replica.
func (r *replica) ready() error {
	resp, err := httpClient.Get("http://" + r.client + "/readyz")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s /readyz: %d %s", r.id, resp.StatusCode, b)
	}
	return nil
}

func (c *cluster) waitReady(r *replica) {
	c.t.Helper()
	eventually(c.t, 60*time.Second, r.ready)
}

// clusterStatus is the part of GET /admin/cluster the tests read.
type clusterStatus struct {
	Self struct {
		ID       string `json:"id"`
		State    string `json:"state"`
		LeaderID string `json:"leader_id"`
	} `json:"self"`
	Bindings int `json:"bindings"`
}

func (r *replica) status() (clusterStatus, error) {
	var st clusterStatus
	resp, err := httpClient.Get("http://" + r.admin + "/admin/cluster")
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("status %d", resp.StatusCode)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// leader waits until a replica reports itself leader and returns it.
func (c *cluster) leader() *replica {
	c.t.Helper()
	var out *replica
	eventually(c.t, 30*time.Second, func() error {
		for _, r := range c.replicas {
			if r.cmd == nil {
				continue
			}
			st, err := r.status()
			if err == nil && st.Self.State == "Leader" {
				out = r
				return nil
			}
		}
		return errors.New("no leader")
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
	return chatVia(ctx, httpClient, "http://"+r.client, session, prompt, 4)
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
