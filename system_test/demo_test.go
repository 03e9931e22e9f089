package system_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestDemoKillsTheLeaderAndNoSessionMoves runs make demo's main job (a short slice): three
// replica processes behind HAProxy when it is installed, the leader killed half-way and
// restarted. No session may change worker, and the killed leader must come back.
func TestDemoKillsTheLeaderAndNoSessionMoves(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	cfg, err := filepath.Abs(filepath.Join("..", "deploy", "haproxy.cfg"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, binary, "demo", "--requests", "300", "--progress=false", "--haproxy-config", cfg)
	out, err := cmd.CombinedOutput()
	t.Logf("demo output:\n%s", out)
	if err != nil {
		t.Fatalf("demo failed: %v", err)
	}
	s := string(out)
	if _, err := exec.LookPath("haproxy"); err == nil && !strings.Contains(s, "behind HAProxy") {
		t.Errorf("haproxy is installed but the demo did not run behind it")
	}
	if !regexp.MustCompile(`leader r\d killed \(SIGKILL\) at [0-9.]+ s, restarted and ready again`).MatchString(s) {
		t.Errorf("the demo did not kill and restart the leader")
	}
	m := regexp.MustCompile(`sessions that changed worker: (\d+) of (\d+)`).FindStringSubmatch(s)
	if m == nil || m[1] != "0" || m[2] == "0" {
		t.Errorf("sessions that changed worker: %v, want 0 of some", m)
	}
	if !regexp.MustCompile(`hit rate\s+\d+\.\d%`).MatchString(s) {
		t.Errorf("no hit rate in the summary")
	}
}
