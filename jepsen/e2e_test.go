package jepsen

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// buildBinary builds kvrouter-ha for the end-to-end test.
func buildBinary(t *testing.T, tags ...string) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go tool to build kvrouter-ha with")
	}
	bin := filepath.Join(t.TempDir(), "kvrouter-ha")
	args := []string{"build", "-o", bin}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	cmd := exec.Command("go", append(args, "github.com/kvrouter-ha/kvrouter-ha/cmd/kvrouter-ha")...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("build kvrouter-ha: %v\n%s", err, out.String())
	}
	return bin
}

// runLogged runs the harness with cfg (bounded to three minutes) and logs its summary.
func runLogged(t *testing.T, cfg Config) *Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var summary bytes.Buffer
	_ = rep.WriteText(&summary)
	t.Logf("\n%s", summary.String())
	return rep
}

// TestRealClusterUnderKillStopRestartAndWorkerFaultsKeepsItsPromises runs the real binary: three
// replica processes and three simulated workers on loopback, eight clients, and a seeded
// schedule of kill -9, SIGSTOP, a full-cluster restart and a worker crash or hang. The checker
// must find nothing.
func TestRealClusterUnderKillStopRestartAndWorkerFaultsKeepsItsPromises(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster for about a minute")
	}
	bin := buildBinary(t)
	out := t.TempDir()
	kinds := []FaultKind{FaultKill, FaultRestart, FaultStop, FaultWorker}
	cfg := Config{
		Binary: bin, Replicas: 3, Workers: 3, Clients: 6, Duration: 55 * time.Second, Seed: 8,
		Faults: kinds, OutDir: out, Netns: "off", SessionTTL: 30 * time.Second,
	}
	// With HAProxy on PATH half the requests go through it, and its log says which it retried.
	_, err := exec.LookPath("haproxy")
	cfg.HAProxy = err == nil
	rep := runLogged(t, cfg)
	if !rep.Valid() {
		for _, r := range []string{"r0", "r1", "r2"} {
			b, _ := os.ReadFile(filepath.Join(out, "logs", r+".log"))
			t.Logf("---- %s log (tail) ----\n%s", r, tail(string(b), 3000))
		}
		t.Fatalf("%d violations", len(rep.Analysis.Violations))
	}
	injected := map[FaultKind]bool{}
	for _, f := range rep.Injected {
		k := f.Kind
		if k == FaultWorkerCrash || k == FaultWorkerStop {
			k = FaultWorker
		}
		injected[k] = true
		if f.Error != "" {
			t.Errorf("fault #%d %s: %s", f.ID, f.Kind, f.Error)
		}
	}
	for _, k := range kinds {
		if !injected[k] {
			t.Errorf("no %s fault was injected (skipped: %v)", k, rep.Skipped)
		}
	}
	a := rep.Analysis
	if a.Ops.Observed < 100 || a.Register.Sessions < 10 || a.Durability.Restarts != 1 || a.Durability.Checked == 0 {
		t.Errorf("the run proved little: %+v %+v %+v", a.Ops, a.Register, a.Durability)
	}
	failed := 0
	for _, f := range a.Failures {
		failed += f.Ops
	}
	if failed != a.Ops.Fail+a.Ops.Unknown {
		t.Errorf("failures by cause count %d requests, the run %d failed and %d unknown", failed, a.Ops.Fail, a.Ops.Unknown)
	}
	if cfg.HAProxy {
		// HAProxy logs a request when it ends: every one it answered is in its log.
		for _, op := range rep.ops {
			if op.Target == "lb" && op.Status != 0 && !op.LBLogged {
				t.Errorf("the balancer answered op %d (%d) and did not log it", op.ID, op.Status)
			}
		}
		if a.Balancer.Ops == 0 || a.Balancer.Logged == 0 {
			t.Errorf("the balancer logged %d of the %d requests sent through it", a.Balancer.Logged, a.Balancer.Ops)
		}
	}
	for _, f := range []string{"summary.txt", "report.json", "history.json"} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Errorf("missing %s: %v", f, err)
		}
	}
	if _, err := os.Stat(filepath.Join(out, "data")); !os.IsNotExist(err) {
		t.Errorf("the replicas' data directories were left behind: %v", err)
	}
	h, err := ReadHistoryFile(filepath.Join(out, "history.json"))
	if err != nil {
		t.Fatal(err)
	}
	if again := Check(h, cfg.CheckConfig()); !again.Valid() || again.Ops != a.Ops {
		t.Fatalf("the saved history checks differently: %+v", again.Violations)
	}
	if !slices.ContainsFunc(h.Ops, func(o Op) bool { return o.Stream && o.Observed() }) {
		t.Error("no streaming request saw a binding")
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func TestConfigRejectsBadInput(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "bin")
	if err := os.WriteFile(bin, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	good := Config{Binary: bin, OutDir: t.TempDir()}
	cases := []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"no binary", func(c *Config) { c.Binary = "" }, "binary"},
		{"missing binary", func(c *Config) { c.Binary = filepath.Join(t.TempDir(), "nope") }, "not a file"},
		{"no out dir", func(c *Config) { c.OutDir = "" }, "output"},
		{"too short", func(c *Config) { c.Duration = 5 * time.Second }, "duration"},
		{"bad consistency", func(c *Config) { c.Consistency = "eventual" }, "consistency"},
		{"bad netns", func(c *Config) { c.Netns = "maybe" }, "netns"},
		{"bad fault", func(c *Config) { c.Faults = []FaultKind{"meteor"} }, "meteor"},
		{"too many replicas", func(c *Config) { c.Replicas = 100 }, "replicas"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := good
			tc.mod(&cfg)
			_, err := Run(context.Background(), cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Run: %v, want an error about %q", err, tc.want)
			}
		})
	}
}

// TestCheckerCatchesABuildThatOverwritesBindings runs the harness against a deliberately
// broken build (the jepsen_broken tag, never in a release): its Bind overwrites a live binding
// instead of answering with it, so racing first requests on different replicas move sessions.
// The checker must report it; a checker that cannot fail proves nothing.
func TestCheckerCatchesABuildThatOverwritesBindings(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster for about 40 seconds")
	}
	bin := buildBinary(t, "jepsen_broken")
	cfg := Config{
		Binary: bin, Replicas: 3, Workers: 3, Clients: 6, Duration: 35 * time.Second, Seed: 3,
		Faults: []FaultKind{FaultKill, FaultStop}, OutDir: t.TempDir(), Netns: "off", SessionTTL: 30 * time.Second,
	}
	rep := runLogged(t, cfg)
	if rep.Valid() || len(rep.Analysis.Violations) == 0 {
		t.Fatal("the checker found nothing wrong with a build that overwrites live bindings")
	}
}

// TestCheckerCatchesAReplicaServingBindingsOlderThanTheBound runs the stale fault against a
// build that keeps the freshness rule the read lease replaced (the jepsen_broken_lease tag,
// never in a release): a replica is fresh on contact, so one resumed from SIGSTOP answers
// with the bindings it held before the pause. The probes must see it and the checker must
// report revisions going backwards.
func TestCheckerCatchesAReplicaServingBindingsOlderThanTheBound(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster for about 40 seconds")
	}
	bin := buildBinary(t, "jepsen_broken_lease")
	cfg := Config{
		Binary: bin, Replicas: 3, Workers: 3, Clients: 6, Duration: 35 * time.Second, Seed: 2,
		Faults: []FaultKind{FaultStale}, OutDir: t.TempDir(), Netns: "off", SessionTTL: 30 * time.Second,
	}
	rep := runLogged(t, cfg)
	a := rep.Analysis
	if a.Probes.Sent == 0 {
		t.Fatalf("no stale probe was sent (skipped: %v)", rep.Skipped)
	}
	if a.Probes.Old == 0 || a.Register.Backwards == 0 {
		t.Fatalf("the checker found no old binding on a replica back from a pause: probes %+v, register %+v", a.Probes, a.Register)
	}
}
