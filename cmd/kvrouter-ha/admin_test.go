package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/replica"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// startSimWorkers serves n fast simulated workers on loopback until the test ends.
func startSimWorkers(t *testing.T, n int) []routing.WorkerSpec {
	t.Helper()
	var specs []routing.WorkerSpec
	for i := range n {
		id := fmt.Sprintf("w%d", i)
		w, err := sim.New(sim.Config{ID: id, Speedup: 200, Logger: slog.New(slog.DiscardHandler), ShutdownTimeout: 500 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = w.Serve(ctx, ln) }()
		t.Cleanup(func() { cancel(); <-done })
		specs = append(specs, routing.WorkerSpec{ID: id, URL: "http://" + ln.Addr().String()})
	}
	return specs
}

// startLoneReplica starts a one-replica cluster over workers, with the admin token "tok".
func startLoneReplica(t *testing.T, workers []routing.WorkerSpec) *replica.Replica {
	t.Helper()
	return startLoneReplicaWith(t, workers, replica.DiscoveryConfig{})
}

// startLoneReplicaWith is startLoneReplica with discovery sources.
func startLoneReplicaWith(t *testing.T, workers []routing.WorkerSpec, disc replica.DiscoveryConfig) *replica.Replica {
	t.Helper()
	rep, err := replica.Start(t.Context(), replica.Config{
		ID: "ctl-replica", Listen: "127.0.0.1:0", AdminListen: "127.0.0.1:0", Workers: workers, AdminToken: "tok",
		Router: routing.Config{Policy: "kv"}, ApproxTTL: time.Minute, ApproxMaxBlocks: 1 << 20, SessionTTL: 10 * time.Minute,
		MaxSessions: 1000, Health: openai.HealthConfig{Interval: time.Hour},
		Cluster: replica.ClusterConfig{DataDir: t.TempDir(), RaftListen: "127.0.0.1:0", PeerListen: "127.0.0.1:0", BootstrapExpect: 1,
			Heartbeat: 100 * time.Millisecond, Election: 100 * time.Millisecond, LeaderLease: 50 * time.Millisecond, BindWait: 5 * time.Second},
		Discovery: disc,
		Logger:    slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := rep.Close(); err != nil {
			t.Errorf("replica close: %v", err)
		}
	})
	poll.Until(t, 15*time.Second, rep.Ready)
	return rep
}

// complete sends one completion of a session through rep and returns the worker and the
// binding's revision it reports.
func complete(t *testing.T, rep *replica.Replica, session, prompt string) (string, uint64) {
	t.Helper()
	body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, sim.DefaultModel, prompt)
	req, err := http.NewRequest(http.MethodPost, "http://"+rep.Addr()+"/v1/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("completion of %s: %s %s", session, resp.Status, b)
	}
	rev, err := strconv.ParseUint(resp.Header.Get("X-Kvrouter-Binding-Revision"), 10, 64)
	if err != nil {
		t.Fatalf("completion of %s: revision: %v", session, err)
	}
	return resp.Header.Get("X-Kvrouter-Worker"), rev
}

// runCtl runs `kvrouter-ha ctl` against rep's admin port and returns its output.
func runCtl(t *testing.T, rep *replica.Replica, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	all := append([]string{"ctl", "--addr", rep.AdminAddr(), "--token", "tok"}, args...)
	err := run(context.Background(), all, &out, &errOut)
	return out.String() + errOut.String(), err
}

func TestCtlOperatesSessionsWorkersAndCluster(t *testing.T) {
	rep := startLoneReplica(t, startSimWorkers(t, 2))
	prompt := strings.Repeat("a prompt long enough for two blocks of tokens ", 8)
	bound, rev := complete(t, rep, "ctl-session", prompt)

	out, err := runCtl(t, rep, "sessions", "get", "ctl-session")
	if err != nil || !strings.Contains(out, bound) || !strings.Contains(out, fmt.Sprint(rev)) {
		t.Fatalf("ctl sessions get: %v\n%s", err, out)
	}
	out, err = runCtl(t, rep, "--json", "cluster", "status")
	if err != nil {
		t.Fatalf("ctl cluster status: %v\n%s", err, out)
	}
	var view admin.ClusterView
	if err := json.Unmarshal([]byte(out), &view); err != nil || view.Self.State != "Leader" || view.Bindings != 1 || len(view.Servers) != 1 {
		t.Fatalf("cluster status JSON: %v %+v", err, view)
	}
	// The table names Raft's applied index and the state machine's apart: Raft's counts its
	// own no-op and barrier entries too, so it is never below the state machine's.
	out, err = runCtl(t, rep, "cluster", "status")
	if err != nil {
		t.Fatalf("ctl cluster status: %v\n%s", err, out)
	}
	raftApplied := regexp.MustCompile(`(?m)^applied index \(Raft log\):\s+(\d+)$`).FindStringSubmatch(out)
	fsmApplied := regexp.MustCompile(`(?m)^applied index \(state machine\):\s+(\d+)$`).FindStringSubmatch(out)
	if raftApplied == nil || fsmApplied == nil || strings.Contains(out, "commit / applied") {
		t.Fatalf("ctl cluster status does not name the two applied indexes apart:\n%s", out)
	}
	if r, _ := strconv.ParseUint(raftApplied[1], 10, 64); r == 0 || r < view.Self.AppliedIndex {
		t.Fatalf("ctl cluster status: Raft's applied index %d, the state machine's %d a moment before:\n%s", r, view.Self.AppliedIndex, out)
	}
	out, err = runCtl(t, rep, "workers", "list")
	if err != nil || !strings.Contains(out, "BINDINGS") || !strings.Contains(out, bound) ||
		!strings.Contains(out, "SOURCE") || !strings.Contains(out, admin.SourceFlags) || !strings.Contains(out, admin.StateActive) {
		t.Fatalf("ctl workers list: %v\n%s", err, out)
	}

	// Draining the bound worker moves the session: its next request gets another worker
	// and a higher revision.
	if out, err = runCtl(t, rep, "workers", "drain", bound); err != nil {
		t.Fatalf("ctl workers drain: %v\n%s", err, out)
	}
	poll.Until(t, 15*time.Second, func() error {
		out, err := runCtl(t, rep, "--json", "workers", "list")
		if err != nil {
			return err
		}
		var ws []admin.WorkerView
		if err := json.Unmarshal([]byte(out), &ws); err != nil {
			return err
		}
		for _, w := range ws {
			if w.Spec.ID == bound && !w.Drained {
				return fmt.Errorf("%s still routable: %+v", bound, w)
			}
		}
		return nil
	})
	moved, movedRev := complete(t, rep, "ctl-session", prompt+" and more")
	if moved == bound || movedRev <= rev {
		t.Fatalf("after draining %s: worker %s revision %d (was %d)", bound, moved, movedRev, rev)
	}
	if out, err = runCtl(t, rep, "sessions", "invalidate", "ctl-session"); err != nil {
		t.Fatalf("ctl sessions invalidate: %v\n%s", err, out)
	}
	if out, err = runCtl(t, rep, "sessions", "get", "ctl-session"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("ctl sessions get after invalidate: %v\n%s", err, out)
	}
	if out, err = runCtl(t, rep, "cluster", "snapshot"); err != nil || !strings.Contains(out, "index") {
		t.Fatalf("ctl cluster snapshot: %v\n%s", err, out)
	}
}

func TestCtlSetsListsAndDeletesModelAliases(t *testing.T) {
	rep := startLoneReplica(t, startSimWorkers(t, 2))
	ask := func(model string) (int, string, string) {
		t.Helper()
		body := fmt.Sprintf(`{"model":%q,"prompt":"hello","max_tokens":1}`, model)
		resp, err := http.Post("http://"+rep.Addr()+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header.Get(openai.HeaderModel), string(b)
	}
	// The workers serve sim.DefaultModel only: the alias's other target is never drawn.
	out, err := runCtl(t, rep, "models", "alias", "set", "llama", sim.DefaultModel+"=90", "not-served=10")
	if err != nil || !strings.Contains(out, "not-served") {
		t.Fatalf("ctl models alias set: %v\n%s", err, out)
	}
	out, err = runCtl(t, rep, "models", "alias", "list")
	if err != nil || !strings.Contains(out, "llama") || !strings.Contains(out, "90") {
		t.Fatalf("ctl models alias list: %v\n%s", err, out)
	}
	// The alias is a model the fleet serves: listed, and retrieved by its name.
	for _, path := range []string{"/v1/models", "/v1/models/llama"} {
		resp, err := http.Get("http://" + rep.Addr() + path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"id":"llama"`) {
			t.Fatalf("GET %s: %s %s", path, resp.Status, b)
		}
	}
	for range 20 {
		if code, target, body := ask("llama"); code != http.StatusOK || target != sim.DefaultModel || !strings.Contains(body, sim.DefaultModel) {
			t.Fatalf("llama: %d sent as %q: %s", code, target, body)
		}
	}
	// Bad input is refused and changes nothing.
	for _, bad := range [][]string{
		{"llama", sim.DefaultModel + "=1001"},
		{"llama", sim.DefaultModel + "=0"},
		{"llama", "no-weight"},
		{"llama"},
	} {
		if out, err := runCtl(t, rep, append([]string{"models", "alias", "set"}, bad...)...); err == nil {
			t.Fatalf("ctl models alias set %v accepted:\n%s", bad, out)
		}
	}
	out, err = runCtl(t, rep, "--json", "models", "alias", "list")
	var views []admin.AliasView
	if err != nil || json.Unmarshal([]byte(out), &views) != nil || len(views) != 1 || views[0].Targets[0].Weight != 90 {
		t.Fatalf("aliases after bad input: %v %+v\n%s", err, views, out)
	}
	if out, err := runCtl(t, rep, "models", "alias", "delete", "llama"); err != nil {
		t.Fatalf("ctl models alias delete: %v\n%s", err, out)
	}
	if code, _, body := ask("llama"); code != http.StatusNotFound || !strings.Contains(body, "model_not_found") {
		t.Fatalf("llama after delete: %d %s", code, body)
	}
}

func TestCtlWorkersListSaysAFailingDiscoverySourceKeepsItsWorkersAndClearsWhenFixed(t *testing.T) {
	specs := startSimWorkers(t, 2)
	path := filepath.Join(t.TempDir(), "fleet.json")
	good, err := json.Marshal(specs)
	if err != nil {
		t.Fatal(err)
	}
	write := func(b []byte) {
		t.Helper()
		if err := os.WriteFile(path+".tmp", b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".tmp", path); err != nil {
			t.Fatal(err)
		}
	}
	write(good)
	source := "file:" + path
	// A drain and a suspect hold far shorter than the failing spell below: a source that
	// drained on failure would show it.
	rep := startLoneReplicaWith(t, nil, replica.DiscoveryConfig{Sources: []string{source},
		Interval: 100 * time.Millisecond, DrainFor: 200 * time.Millisecond, SuspectFor: 200 * time.Millisecond})
	// list polls ctl workers list until its discovery line has want and both workers are
	// listed, active, as the source's.
	list := func(want string) string {
		t.Helper()
		var out string
		poll.Until(t, 20*time.Second, func() error {
			var err error
			if out, err = runCtl(t, rep, "workers", "list"); err != nil {
				return fmt.Errorf("%v: %s", err, out)
			}
			if !strings.Contains(out, "discovery "+source+": "+want) {
				return fmt.Errorf("no %q in:\n%s", want, out)
			}
			for _, s := range specs {
				if !regexp.MustCompile(`(?m)^` + s.ID + `\s+\S+\s+discovery:` + regexp.QuoteMeta(source) + `\s+active\s`).MatchString(out) {
					return fmt.Errorf("%s is not an active discovered worker:\n%s", s.ID, out)
				}
			}
			return nil
		})
		return out
	}
	out := list("ok, last good look ")
	t.Logf("a good source:\n%s", out)

	// A half-written file: the looks fail, and say so; the workers stay (the drain and
	// suspect periods pass several times over while it fails).
	write([]byte(`[{"id":"w0","url":`))
	poll.Until(t, 20*time.Second, func() error {
		out = list("FAILING since ")
		if !regexp.MustCompile(`FAILING since \d\d:\d\d:\d\d \((1[0-9]|[2-9][0-9]|\d{3,}) looks\): discovery file .*: invalid worker spec: unexpected EOF; last good look \d\d:\d\d:\d\d; 2 workers kept`).MatchString(out) {
			return fmt.Errorf("not ten failed looks with the error, the last good look and the workers kept:\n%s", out)
		}
		return nil
	})
	t.Logf("a failing source:\n%s", out)

	// Fixed: the next look clears it.
	write(good)
	out = list("ok, last good look ")
	if strings.Contains(out, "FAILING") {
		t.Errorf("still failing after the file was fixed:\n%s", out)
	}
}

func TestDiscoveryLinesSayWhatTheReplicaAskedKnows(t *testing.T) {
	at := func(s string) time.Time {
		v, err := time.Parse(time.TimeOnly, s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	src := "file:/etc/fleet.json"
	failing := admin.SourceView{DiscoverySource: peer.DiscoverySource{Source: src, LastGood: at("12:00:58"), FailingSince: at("12:01:02"),
		Failures: 3, LastError: "open /etc/fleet.json: no such file"}, Workers: 4}
	for _, tc := range []struct {
		name string
		view admin.DiscoveryView
		want string
	}{
		{"a failing source on the leader", admin.DiscoveryView{Replica: "r1", Running: true, LooksFrom: "r1", LeaderID: "r1", Sources: []admin.SourceView{failing}},
			"discovery file:/etc/fleet.json: FAILING since 12:01:02 (3 looks): open /etc/fleet.json: no such file; last good look 12:00:58; 4 workers kept"},
		{"a follower shows the leader's looks", admin.DiscoveryView{Replica: "r2", LooksFrom: "r1", LeaderID: "r1", Sources: []admin.SourceView{failing}},
			"discovery file:/etc/fleet.json: FAILING since 12:01:02 (3 looks): open /etc/fleet.json: no such file; last good look 12:00:58; 4 workers kept (the leader r1's looks)"},
		{"a source failing since the term began", admin.DiscoveryView{Replica: "r1", Running: true, LooksFrom: "r1", Sources: []admin.SourceView{{
			DiscoverySource: peer.DiscoverySource{Source: src, FailingSince: at("12:01:02"), Failures: 1, LastError: "boom"}, Workers: 2}}},
			"discovery file:/etc/fleet.json: FAILING since 12:01:02 (1 looks): boom; no good look yet in this term (its workers are left as they are); 2 workers kept"},
		{"a good source holding suspect drains", admin.DiscoveryView{Replica: "r1", Running: true, LooksFrom: "r1", Sources: []admin.SourceView{{
			DiscoverySource: peer.DiscoverySource{Source: src, LastGood: at("12:00:58"), SuspectDrains: 3}, Workers: 4, Gone: 1}}},
			"discovery file:/etc/fleet.json: ok, last good look 12:00:58; 4 workers (and 1 gone, draining); 3 drains held as suspect"},
		{"a follower that could not ask the leader names it", admin.DiscoveryView{Replica: "r2", LeaderID: "r1", LeaderPeerAddr: "127.0.0.1:7001",
			LeaderError: "connection refused", Sources: []admin.SourceView{{DiscoverySource: peer.DiscoverySource{Source: src}, Workers: 4}}},
			"discovery file:/etc/fleet.json: runs on the leader r1 (peer 127.0.0.1:7001), not on r2, which could not show its looks: connection refused; 4 workers in the registry"},
		{"no leader", admin.DiscoveryView{Replica: "r2", Sources: []admin.SourceView{{DiscoverySource: peer.DiscoverySource{Source: src}, Workers: 4}}},
			"discovery file:/etc/fleet.json: not looked at on r2, which does not lead; no leader is known now; 4 workers in the registry"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := strings.Join(discoveryLines(tc.view), "\n"); got != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}
