package jepsen

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
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
		{"lb share above one", func(c *Config) { c.LBShare = 1.5 }, "lb share"},
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

// TestALeaderCutOffBehindDeployHAProxyFailsOnlyRequestsInFlightOnIt is issue 29's partition
// scenario with a real partition: three replicas, each in a network namespace of its own,
// behind HAProxy with deploy/haproxy.cfg's retries and health checks, eight clients of
// sessions sending every request through it (but a new session's first request raced on
// several replicas at once), and the leader cut off from the other replicas twice (iptables DROP between the
// replicas only: HAProxy, the clients and the workers still reach it) for longer than HAProxy
// takes to put it out of the rotation. Every request through the balancer must succeed except
// those already in flight on the cut-off replica when it was cut: what HAProxy sent it
// meanwhile is refused at once (a 503 no worker saw) and retried on another replica. Requests
// sent to the cut-off replica directly are refused too, and only counted. The replicas run
// with --bind-before-dispatch (see below). Root with ip,
// iptables and haproxy (CI has them); KVROUTER_SYSTEM_TEST_BINARY runs it against another
// build.
func TestALeaderCutOffBehindDeployHAProxyFailsOnlyRequestsInFlightOnIt(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster in network namespaces for about a minute")
	}
	if os.Geteuid() != 0 {
		t.Skip("network namespaces and iptables partitions need root")
	}
	for _, tool := range []string{"ip", "iptables", "haproxy"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not in PATH: partitions in network namespaces behind HAProxy need it", tool)
		}
	}
	bin := os.Getenv("KVROUTER_SYSTEM_TEST_BINARY")
	if bin == "" {
		bin = buildBinary(t)
	}
	b, err := os.ReadFile(filepath.Join("..", "deploy", "haproxy.cfg"))
	if err != nil {
		t.Fatal(err)
	}
	policy, err := proc.ReadHAProxyPolicy(string(b))
	if err != nil {
		t.Fatal(err)
	}
	// Every new session binds before its request reaches a worker: a request that reaches
	// the leader in the moments after it is cut off, before its contact with the quorum is
	// stale, is then refused (503, retried by HAProxy) too, instead of failing with a 502
	// after a worker ran it (by default it binds first only once contact is stale: the
	// window cluster/DESIGN.md describes, which a loaded CI machine met once).
	t.Setenv("KVROUTER_BIND_BEFORE_DISPATCH", "true")
	out := t.TempDir()
	// Seed 25 plans two partitions over 45 s, both isolating whoever leads, held 6.8 s and
	// 7.9 s: above the seconds a cut-off replica takes to fail /readyz plus deploy's checks
	// (fall 2, fastinter 250ms).
	cfg := Config{
		Binary: bin, Replicas: 3, Workers: 3, Clients: 8, Duration: 45 * time.Second, Seed: 25,
		Faults: []FaultKind{FaultPartition}, OutDir: out, Netns: "on", HAProxy: true, LBShare: 1,
		LBPolicy: policy, LBPolicySource: "deploy/haproxy.cfg",
	}
	rep := runLogged(t, cfg)
	if !rep.Valid() {
		t.Errorf("%d violations", len(rep.Analysis.Violations))
	}
	// Every fault isolated the leader, and HAProxy took the cut-off replica out meanwhile.
	lbLog, err := os.ReadFile(filepath.Join(out, "logs", "haproxy.log"))
	if err != nil {
		t.Fatal(err)
	}
	down := map[string]int{}
	for _, m := range regexp.MustCompile(`(?m)^Server replicas/(\S+) is DOWN`).FindAllStringSubmatch(string(lbLog), -1) {
		down[m[1]]++
	}
	cut := map[string]int{}
	for _, f := range rep.Injected {
		if f.Kind != FaultPartition || f.Error != "" || len(f.Targets) != 1 || !strings.HasPrefix(f.Detail, "isolate-leader") {
			t.Fatalf("fault #%d %s %v %q (error %q): want the leader cut off", f.ID, f.Kind, f.Targets, f.Detail, f.Error)
		}
		cut[f.Targets[0]]++
	}
	if len(rep.Injected) < 2 {
		t.Fatalf("%d partitions injected, want 2 (skipped: %v)", len(rep.Injected), rep.Skipped)
	}
	for id, n := range cut {
		if down[id] < n {
			t.Errorf("%s was cut off %d times and HAProxy took it out %d times: the partition did not last until the balancer noticed", id, n, down[id])
		}
	}
	// Through the balancer: every failure must be one in flight on the cut-off replica when
	// it was cut.
	h, err := ReadHistoryFile(filepath.Join(out, "history.json"))
	if err != nil {
		t.Fatal(err)
	}
	via, viaDuring, struck, others := throughTheBalancer(h)
	t.Logf("through the balancer: %d requests, %d of them while a partition lasted; failed: %d in flight on the cut-off replica when it was cut, %d otherwise; HAProxy retried %d (%d then succeeded)",
		via, viaDuring, struck, len(others), rep.Analysis.Balancer.Retried, rep.Analysis.Balancer.RetriedOK)
	if viaDuring < 50 {
		t.Errorf("only %d requests went through the balancer while a partition lasted: the run proved little", viaDuring)
	}
	if len(others) > 0 {
		t.Errorf("%d requests through the balancer failed that were not in flight on the cut-off replica when it was cut; first: %s",
			len(others), strings.Join(others[:min(8, len(others))], "; "))
	}
}

// throughTheBalancer counts the requests sent through the balancer, those of them sent while
// a fault lasted, and sorts their failures: in flight on the faulted replica when its fault
// began (struck), or other.
func throughTheBalancer(h *History) (via, viaDuring, struck int, others []string) {
	for i := range h.Ops {
		op := &h.Ops[i]
		if op.Target != "lb" {
			continue
		}
		via++
		if slices.ContainsFunc(h.Faults, func(f Fault) bool { return f.Start <= op.Complete && op.Invoke <= f.Until(h.End) }) {
			viaDuring++
		}
		if op.Result == ResultOK {
			continue
		}
		cause, phase, kind, inFlight := classifyFailure(op, h.Faults, h.End)
		if cause == CauseFaultedReplica && inFlight {
			struck++
			continue
		}
		msg, _, _ := strings.Cut(op.Error, "\n")
		others = append(others, fmt.Sprintf("op %d via %q (retried %d): %s/%s/%s %.160s", op.ID, op.LBServer, op.LBRetries, cause, phase, kind, msg))
	}
	return via, viaDuring, struck, others
}
