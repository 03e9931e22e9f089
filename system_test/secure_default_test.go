package system_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// holdPorts binds n loopback addresses and keeps them bound until the test ends: a replica
// given them cannot bind any of them, so a start refused with anything but "address already
// in use" refused before it bound a thing.
func holdPorts(t *testing.T, n int) []net.Listener {
	t.Helper()
	var out []net.Listener
	for range n {
		ln, err := net.Listen("tcp", loopbacktest.Addr(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		out = append(out, ln)
	}
	return out
}

// portOf is the port of a held listener.
func portOf(ln net.Listener) int { return ln.Addr().(*net.TCPAddr).Port }

// TestOpenClusterBeyondLoopbackIsRefusedBeforeItBinds starts the real binary with a Raft,
// peer or gossip address beyond loopback and no peer mutual TLS or gossip key. Each start
// must exit 1 with a message naming the address, what is missing and the flags that fix it,
// having bound nothing and written nothing: every port it is given (the 0.0.0.0 one too, on
// a port the test holds on loopback, which a wildcard bind would collide with) is held by
// the test, so a start that tried to listen would fail on "address already in use" instead,
// and its data directory must not exist afterwards.
func TestOpenClusterBeyondLoopbackIsRefusedBeforeItBinds(t *testing.T) {
	held := holdPorts(t, 5)
	addr := func(i int) string { return held[i].Addr().String() }
	certs := []string{"--peer-tls-cert-file", "/nonexistent/peer.crt", "--peer-tls-key-file", "/nonexistent/peer.key", "--peer-tls-ca-file", "/nonexistent/ca.crt"}
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"peer port on every interface", []string{"--peer-listen", fmt.Sprintf("0.0.0.0:%d", portOf(held[3]))},
			[]string{fmt.Sprintf("--peer-listen 0.0.0.0:%d", portOf(held[3])), "no peer mutual TLS", "--peer-tls-cert-file", "--peer-tls-key-file", "--peer-tls-ca-file", "no gossip key", "--gossip-key-file", "--insecure-open-cluster"}},
		{"raft advertised beyond loopback", []string{"--raft-advertise", "192.0.2.10:7000"},
			[]string{"--raft-advertise 192.0.2.10:7000", "no peer mutual TLS", "no gossip key"}},
		{"gossip on every IPv6 interface", []string{"--gossip-listen", fmt.Sprintf("[::]:%d", portOf(held[4]))},
			[]string{"--gossip-listen [::]:", "no peer mutual TLS"}},
		{"peer TLS but no gossip key", append([]string{"--peer-advertise", "peer.example.internal:7001"}, certs...),
			[]string{"--peer-advertise peer.example.internal:7001", "no gossip key", "--gossip-key-file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dataDir := filepath.Join(t.TempDir(), "data")
			args := append([]string{"serve", "--replica-id", "r0", "--data-dir", dataDir,
				"--listen", addr(0), "--admin-listen", addr(1), "--raft-listen", addr(2), "--peer-listen", addr(3), "--gossip-listen", addr(4)},
				tc.args...)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, binary, args...)
			cmd.Env = cleanEnv()
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) || exit.ExitCode() != 1 {
				t.Fatalf("exit %v, want status 1; output:\n%s", err, out)
			}
			for _, w := range append([]string{"refusing to start an open cluster"}, tc.want...) {
				if !strings.Contains(string(out), w) {
					t.Errorf("the refusal does not say %q:\n%s", w, out)
				}
			}
			if strings.Contains(string(out), "address already in use") || strings.Contains(string(out), "serving on") {
				t.Errorf("the start went as far as its listeners:\n%s", out)
			}
			if _, err := os.Stat(dataDir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("the refused start wrote its data directory %s (%v)", dataDir, err)
			}
			t.Logf("refused: %s", strings.TrimSpace(string(out)))
		})
	}
}

// cleanEnv is this process's environment without KVROUTER_ variables, which would set flags.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KVROUTER_") {
			env = append(env, kv)
		}
	}
	return env
}

// inNewNetns is the wrapper that runs a command in a network namespace of its own, with only
// its loopback interface up: nothing it sends can leave the host, whatever address it names.
func inNewNetns(t *testing.T) []string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("a network namespace needs root")
	}
	for _, tool := range []string{"unshare", "ip", "nsenter"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("a network namespace needs %s: %v", tool, err)
		}
	}
	return []string{"unshare", "--net", "sh", "-c", `ip link set lo up && exec "$0" "$@"`}
}

// serveUntilServing starts p and waits (bounded) for its "serving on" line in the log at
// logPath, past offset.
func serveUntilServing(t *testing.T, p *proc.Process, logPath string, offset int) string {
	t.Helper()
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	var log string
	poll.Until(t, 60*time.Second, func() error {
		b, _ := os.ReadFile(logPath)
		log = string(b[min(offset, len(b)):])
		if strings.Contains(log, "serving on") {
			return nil
		}
		if p.Exited() {
			t.Fatalf("%s exited:\n%s", p.Name(), log)
		}
		return errors.New("not serving yet")
	})
	return log
}

// stop ends p with SIGTERM, bounded.
func stop(t *testing.T, p *proc.Process) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.Stop(ctx, syscall.SIGTERM, 20*time.Second); err != nil {
		t.Fatal(err)
	}
}

// TestInsecureOpenClusterWarnsAtEveryStart starts a lone replica with
// --insecure-open-cluster whose Raft, peer and gossip ports are advertised beyond loopback
// (192.0.2.10, a documentation address) without peer TLS or a gossip key, twice on the same
// data directory. It runs in a network namespace of its own with only loopback up, so
// nothing can be sent to that address even if something dialled it. Both starts must serve
// and log one warning per open port, naming the port, its address and what anyone who
// reaches it can do.
func TestInsecureOpenClusterWarnsAtEveryStart(t *testing.T) {
	wrap := inNewNetns(t)
	dir := t.TempDir()
	logPath := filepath.Join(dir, "r0.log")
	args := []string{binary, "serve", "--replica-id", "r0", "--data-dir", filepath.Join(dir, "data"),
		"--listen", loopbacktest.Addr(t), "--admin-listen", loopbacktest.Addr(t),
		"--raft-listen", "127.0.0.1:7000", "--raft-advertise", "192.0.2.10:7000",
		"--peer-listen", "127.0.0.1:7001", "--peer-advertise", "192.0.2.10:7001",
		"--gossip-listen", "127.0.0.1:7002", "--gossip-advertise", "192.0.2.10:7002",
		"--insecure-open-cluster", "--shutdown-delay", "0s"}
	p := newProcess(t, proc.Spec{Name: "r0", Argv: args, Wrap: wrap, LogPath: logPath})
	offset := 0
	for start := 1; start <= 2; start++ {
		log := serveUntilServing(t, p, logPath, offset)
		for _, port := range []string{"raft", "peer", "gossip"} {
			var line string
			for _, l := range strings.Split(log, "\n") {
				if strings.Contains(l, "level=WARN") && strings.Contains(l, "port="+port) {
					line = l
				}
			}
			switch {
			case line == "":
				t.Errorf("start %d: no warning for the open %s port:\n%s", start, port, log)
			case !strings.Contains(line, "192.0.2.10:70") || !strings.Contains(line, "anyone_can=") || !strings.Contains(line, "insecure-open-cluster"):
				t.Errorf("start %d: the %s warning does not name its address and what anyone can do: %s", start, port, line)
			default:
				t.Logf("start %d: %s", start, line)
			}
		}
		stop(t, p)
		b, _ := os.ReadFile(logPath)
		offset = len(b)
	}
}

// TestAdminAPIBeyondLoopbackRequiresTheGeneratedToken starts a lone replica whose admin API
// listens on every interface (in a network namespace of the test's own, with only loopback
// up) and is given no token. An outsider's POST /admin/workers (kvrouter-ha ctl without a
// token) must get 401 and add nothing; ctl with --token-file pointing at the data
// directory's admin.token must add the worker; and after a restart the same file still works
// (the token is reused), while the log names the file and never the token.
func TestAdminAPIBeyondLoopbackRequiresTheGeneratedToken(t *testing.T) {
	wrap := inNewNetns(t)
	dir := t.TempDir()
	dataDir := filepath.Join(dir, "data")
	logPath := filepath.Join(dir, "r0.log")
	p := newProcess(t, proc.Spec{Name: "r0", Wrap: wrap, LogPath: logPath, Argv: []string{
		binary, "serve", "--replica-id", "r0", "--data-dir", dataDir,
		"--listen", "127.0.0.1:8080", "--admin-listen", "0.0.0.0:9090",
		"--raft-listen", "127.0.0.1:7000", "--peer-listen", "127.0.0.1:7001", "--gossip-listen", "127.0.0.1:7002",
		"--shutdown-delay", "0s"}})
	tokenFile := filepath.Join(dataDir, "admin.token")
	// ctl runs in the replica's namespace, where 0.0.0.0:9090 is reachable.
	ctl := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		argv := append([]string{fmt.Sprintf("--net=/proc/%d/ns/net", p.PID()), binary, "ctl", "--addr", "127.0.0.1:9090"}, args...)
		cmd := exec.CommandContext(ctx, "nsenter", argv...)
		cmd.Env = cleanEnv()
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	offset := 0
	for start := 1; start <= 2; start++ {
		serveUntilServing(t, p, logPath, offset)
		worker := fmt.Sprintf("intruder%d", start)
		out, err := ctl("workers", "add", worker, "http://127.0.0.1:1")
		if err == nil || !strings.Contains(out, "401") {
			t.Errorf("start %d: an outsider's POST /admin/workers without the token: %v\n%s", start, err, out)
		}
		// The token file is what the operator hands ctl; the leader may still be coming.
		poll.Until(t, 30*time.Second, func() error {
			out, err := ctl("--token-file", tokenFile, "workers", "add", fmt.Sprintf("w%d", start), "http://127.0.0.1:1")
			if err != nil {
				return fmt.Errorf("ctl --token-file workers add: %v\n%s", err, out)
			}
			return nil
		})
		out, err = ctl("--token-file", tokenFile, "workers", "list")
		if err != nil || !strings.Contains(out, fmt.Sprintf("w%d", start)) || strings.Contains(out, "intruder") {
			t.Errorf("start %d: workers list with the token: %v\n%s", start, err, out)
		}
		stop(t, p)
		b, _ := os.ReadFile(logPath)
		log := string(b[offset:])
		offset = len(b)
		token, err := os.ReadFile(tokenFile)
		if err != nil {
			t.Fatal(err)
		}
		if st, _ := os.Stat(tokenFile); st.Mode().Perm() != 0o600 {
			t.Errorf("the token file's mode is %v, want 0600", st.Mode().Perm())
		}
		if !strings.Contains(log, tokenFile) {
			t.Errorf("start %d: the log does not name the token file %s:\n%s", start, tokenFile, log)
		}
		if strings.Contains(log, strings.TrimSpace(string(token))) {
			t.Errorf("start %d: the log shows the token", start)
		}
	}
}
