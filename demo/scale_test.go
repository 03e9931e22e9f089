package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
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
		CapacityBlocks: 32768, Start: 2500, Limit: 300, Speedup: 10, Concurrency: 32, MaxOutput: 32,
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
	// A request whose worker drained between its choice and its binding goes to its next
	// choice (routing.ErrWorkerDraining): in flight on a draining worker is no failure. A
	// binding Raft did not commit within --bind-wait (a machine too loaded to keep its
	// leader) is no drain's doing; the report lists it.
	if run.FailedDraining != 0 {
		t.Errorf("%d requests failed naming a draining worker: %v", run.FailedDraining, run.FailureSamples)
	}
	if n := run.UnexplainedFailures(); n != 0 {
		t.Errorf("%d requests failed other than in flight on a stopped worker: %v", n, run.Summary.Errors)
	}
	// A move no drain explains needs a worker that failed the session's request (retried on
	// another worker, which rebinds it): on a loaded machine a simulated worker can time out.
	if other := run.Moves - run.MovesByDrain; other > run.WorkerFaults {
		t.Errorf("%d session moves, only %d of them from a worker that left the file, and %d dispatches a worker failed: %v",
			run.Moves, run.MovesByDrain, run.WorkerFaults, run.OtherMoves)
	}
	if run.Summary.Requests-run.Summary.Failed == 0 {
		t.Error("no request succeeded")
	}
	t.Logf("moves %d (by drain %d), failed %d (in flight on a stopped worker %d), hit rate %.1f%%",
		run.Moves, run.MovesByDrain, run.Summary.Failed, run.FailedOnStopped, 100*run.Summary.HitRate)
}

// TestExplainCountsOnlyDrainsAndStops reads request logs: a move is a drain's only when its
// session's previous worker left the file before the request was sent, a failure is
// expected only when it was in flight on a stopped worker, and one naming a draining worker
// is counted apart.
func TestExplainCountsOnlyDrainsAndStops(t *testing.T) {
	rec := func(i int, session, worker string, sentMs float64, ok bool) replay.RequestRecord {
		return replay.RequestRecord{Index: i, Session: session, Worker: worker, SentMs: sentMs, OK: ok}
	}
	failed := func(i int, worker, msg string) replay.RequestRecord {
		return replay.RequestRecord{Index: i, Session: "a", Worker: worker, SentMs: 1200, Cause: "http_503", Error: msg}
	}
	cases := []struct {
		name                                string
		recs                                []replay.RequestRecord
		moves, byDrain, onStopped, draining int
	}{
		{"no move", []replay.RequestRecord{rec(1, "a", "w0", 10, true), rec(2, "a", "w0", 20, true)}, 0, 0, 0, 0},
		{"moved after its worker left", []replay.RequestRecord{rec(1, "a", "w0", 10, true), rec(2, "a", "w2", 600, true)}, 1, 1, 0, 0},
		{"moved before its worker left", []replay.RequestRecord{rec(1, "a", "w0", 10, true), rec(2, "a", "w2", 400, true)}, 1, 0, 0, 0},
		{"moved off a worker that stayed", []replay.RequestRecord{rec(1, "a", "w2", 10, true), rec(2, "a", "w3", 600, true)}, 1, 0, 0, 0},
		{"sent order, not log order", []replay.RequestRecord{rec(2, "a", "w2", 600, true), rec(1, "a", "w0", 10, true)}, 1, 1, 0, 0},
		{"in flight on a stopped worker", []replay.RequestRecord{rec(1, "a", "w0", 900, false)}, 0, 0, 1, 0},
		{"sent to a stopped worker after it stopped", []replay.RequestRecord{rec(1, "a", "w0", 1100, false)}, 0, 0, 0, 0},
		{"failed elsewhere", []replay.RequestRecord{rec(1, "a", "w2", 900, false)}, 0, 0, 0, 0},
		{"failed naming a draining worker", []replay.RequestRecord{failed(1, "", `503 Service Unavailable: {"error":{"message":"could not bind the session: bind session \"a\" to w0: the chosen worker is draining"}}`)}, 0, 0, 0, 1},
		{"binding not committed in time", []replay.RequestRecord{failed(1, "", `503 Service Unavailable: {"error":{"message":"could not bind the session: bind session \"a\": context deadline exceeded"}}`)}, 0, 0, 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var log bytes.Buffer
			enc := json.NewEncoder(&log)
			for _, r := range tc.recs {
				if err := enc.Encode(r); err != nil {
					t.Fatal(err)
				}
			}
			run := &ScaleRun{Stopped: []string{"w0", "w1"}, StoppedAt: time.Second}
			if err := run.explain(&log, 500*time.Millisecond); err != nil {
				t.Fatal(err)
			}
			if run.Moves != tc.moves || run.MovesByDrain != tc.byDrain || run.FailedOnStopped != tc.onStopped || run.FailedDraining != tc.draining {
				t.Errorf("moves %d by drain %d, failed on stopped %d, naming a draining worker %d; want %d, %d, %d, %d",
					run.Moves, run.MovesByDrain, run.FailedOnStopped, run.FailedDraining, tc.moves, tc.byDrain, tc.onStopped, tc.draining)
			}
		})
	}
	if err := (&ScaleRun{}).explain(strings.NewReader("{not json"), 0); err == nil {
		t.Error("a broken request log was read without an error")
	}
}

func TestScalePlanAverage(t *testing.T) {
	cases := []struct {
		plan scalePlan
		want int
	}{
		{scalePlan{start: 8, up: 4, down: 4}, 9},
		{scalePlan{start: 2, up: 2, down: 2}, 3},
		{scalePlan{start: 5}, 5},
	}
	for _, tc := range cases {
		if got := tc.plan.average(); got != tc.want {
			t.Errorf("%+v.average() = %d, want %d", tc.plan, got, tc.want)
		}
	}
}
