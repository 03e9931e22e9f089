package demo

import (
	"bytes"
	"context"
	"log/slog"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// buildBinary builds kvrouter-ha into the test's temporary directory: the scale demo runs it
// as its three replicas.
func buildBinary(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go tool to build kvrouter-ha with")
	}
	bin := filepath.Join(t.TempDir(), "kvrouter-ha")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/kvrouter-ha/kvrouter-ha/cmd/kvrouter-ha").CombinedOutput()
	if err != nil {
		t.Fatalf("build kvrouter-ha: %v\n%s", err, out)
	}
	return bin
}

// TestScalingThroughTheFleetFileMovesOnlyDrainedSessions runs the scale demo on a tiny fleet
// (2 workers, +2, -2) and a short slice: three real replica processes find their workers in
// the fleet file alone. Every replica's routable set must become the file's after each step,
// no request may fail but one in flight on a stopped worker, and every session that changed
// worker must have left one that left the file.
func TestScalingThroughTheFleetFileMovesOnlyDrainedSessions(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three replica processes")
	}
	cfg := Config{
		Binary:  buildBinary(t),
		Workers: 2, ScaleUp: 2, ScaleDown: 2, ScaleNoFixed: true,
		CapacityBlocks: 4096, Start: 2500, Limit: 300, Speedup: 10, Concurrency: 32, MaxOutput: 32,
		// The client sends to the replicas in turn: HAProxy's health checks on a loaded
		// machine would add failures that are the balancer's, not the fleet's.
		HAProxyConfig: filepath.Join(t.TempDir(), "no-haproxy.cfg"),
		Logger:        slog.New(slog.DiscardHandler),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rep, err := Scale(ctx, cfg, &out, nil)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	run := rep.Scaled
	wantSteps := []struct {
		name string
		want []string
	}{
		{"start", []string{"w0", "w1"}},
		{"scale up", []string{"w0", "w1", "w2", "w3"}},
		{"scale down", []string{"w2", "w3"}},
	}
	if len(run.Steps) != len(wantSteps) {
		t.Fatalf("%d steps, want %d: %+v", len(run.Steps), len(wantSteps), run.Steps)
	}
	for i, w := range wantSteps {
		st := run.Steps[i]
		if st.Name != w.name || !slices.Equal(st.Want, w.want) {
			t.Errorf("step %d is %s to %v, want %s to %v", i, st.Name, st.Want, w.name, w.want)
		}
		if !st.Converged {
			t.Errorf("step %s: not every replica routed to %v within the bound (timeline %v)", st.Name, st.Want, run.Timeline)
		}
	}
	for id, changes := range run.Timeline {
		if last := changes[len(changes)-1].Workers; !slices.Equal(last, wantSteps[2].want) {
			t.Errorf("replica %s ends routing to %v, want %v", id, last, wantSteps[2].want)
		}
	}
	if len(run.Timeline) != 3 {
		t.Errorf("timelines of %d replicas, want 3", len(run.Timeline))
	}
	if !slices.Equal(run.Stopped, []string{"w0", "w1"}) {
		t.Errorf("stopped %v, want w0 w1", run.Stopped)
	}
	if n := run.UnexplainedFailures(); n != 0 {
		t.Errorf("%d requests failed other than in flight on a stopped worker: %v", n, run.Summary.Errors)
	}
	if run.Moves != run.MovesByDrain {
		t.Errorf("%d session moves, only %d of them from a worker that left the file", run.Moves, run.MovesByDrain)
	}
	if run.Summary.Requests-run.Summary.Failed == 0 {
		t.Error("no request succeeded")
	}
	t.Logf("moves %d (by drain %d), failed %d (in flight on a stopped worker %d), hit rate %.1f%%",
		run.Moves, run.MovesByDrain, run.Summary.Failed, run.FailedOnStopped, 100*run.Summary.HitRate)
}
