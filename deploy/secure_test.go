package deploy_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestShippedReplicasAreNoOpenCluster gives every replica command line that deploy/ ships (the
// StatefulSet's pod, each compose replica, the systemd unit with env.example) to the real
// binary with its own listen and advertise addresses, which reach beyond loopback, so the
// binary's own safe-default check judges it: it must pass, which shows as a start that goes on
// to read its peer certificate (here a file that does not exist, so it stops there, before any
// listener). The same command line without its --peer-tls-* files must be refused as an open
// cluster, so the check is seen to bite. Each run is in a network namespace of its own with
// only loopback up: should a start go further than it should, it binds and sends nothing
// outside it.
func TestShippedReplicasAreNoOpenCluster(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the replicas run in network namespaces of their own, which need root")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skipf("no unshare for a network namespace: %v", err)
	}
	b := binary(t)
	k := readKube(t)
	c := readCompose(t)
	sysReplica, _, _, _ := systemdSpecs(t)
	dir := t.TempDir()
	files := newTestFiles(t, dir, nil)
	workersFile, err := filepath.Abs("workers.json")
	if err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "not-here")
	specs := append([]execSpec{k.pod("10.1.2.3"), sysReplica}, c.replicas...)
	for _, s := range specs {
		t.Run(s.source, func(t *testing.T) {
			set := b.setFlags(t, s)
			// The secrets the command line reads before the check are real; the
			// certificates, read after it, are missing.
			args := append(append([]string{}, s.args...), "--data-dir="+filepath.Join(dir, "data"), "--workers-file="+workersFile)
			for name := range set {
				switch name {
				case "gossip-key-file":
					args = append(args, "--gossip-key-file="+files.gossipKey)
				case "admin-token-file":
					args = append(args, "--admin-token-file="+files.adminToken)
				case "workers-file":
				default:
					if strings.HasSuffix(name, "-file") {
						args = append(args, "--"+name+"="+filepath.Join(missing, name))
					}
				}
			}
			out := runInNetns(t, b, s, args)
			if strings.Contains(out, "refusing to start an open cluster") || !strings.Contains(out, "--peer-tls-") || !strings.Contains(out, "not-here") {
				t.Errorf("%s: want a start that passes the open-cluster check and stops at its missing peer certificate, got:\n%s", s.source, out)
			}
			out = runInNetns(t, b, s, append(args, "--peer-tls-ca-file=", "--peer-tls-cert-file=", "--peer-tls-key-file="))
			if !strings.Contains(out, "refusing to start an open cluster") {
				t.Errorf("%s without peer TLS: want the open-cluster refusal, got:\n%s", s.source, out)
			}
		})
	}
}

// runInNetns runs `kvrouter-ha <sub> args` with the spec's environment in a network namespace
// of its own (only loopback up) and returns its output; it must exit with status 1 within a
// bound.
func runInNetns(t *testing.T, b *kvrBinary, s execSpec, args []string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	argv := append([]string{"--net", "sh", "-c", `ip link set lo up && exec "$0" "$@"`, b.path, s.sub}, args...)
	cmd := exec.CommandContext(ctx, "unshare", argv...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KVROUTER_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	for k, v := range s.env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("%s: exit %v, want status 1:\n%s", s.source, err, out)
	}
	return string(out)
}
