package cluster

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/ratelog"
)

func TestRaftLinesKeepTheirLevelExceptShutdownNoise(t *testing.T) {
	cases := []struct {
		line, want string
	}{
		{"[ERROR] raft: failed to append to logs: error=\"disk full\"", "level=ERROR"},
		{"[WARN]  raft: heartbeat timeout reached, starting election", "level=WARN"},
		{"[INFO]  raft: entering follower state", "level=INFO"},
		{"[DEBUG] raft: something", "level=DEBUG"},
		{"[ERROR] raft-net: failed to decode incoming command: error=\"transport shutdown\"", "level=DEBUG"},
		{"[ERROR] raft-net: failed to decode incoming command: error=\"unknown rpc type 71\"", "level=WARN"},
	}
	for _, c := range cases {
		var out bytes.Buffer
		w := hclogWriter{log: slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})), refused: ratelog.New(time.Hour, 0)}
		if _, err := w.Write([]byte(c.line + "\n")); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out.String(), c.want) {
			t.Errorf("%q logged as %q, want %s", c.line, out.String(), c.want)
		}
	}
}

// TestGarbageOnTheRaftPortIsOneLinePerInterval: a thousand connections raft could not
// decode make one WARN line, not a thousand ERROR lines.
func TestGarbageOnTheRaftPortIsOneLinePerInterval(t *testing.T) {
	var out bytes.Buffer
	lg := newHCLogger(slog.New(slog.NewTextHandler(&out, nil)))
	for i := range 1000 {
		lg.Error("failed to decode incoming command", "error", fmt.Sprintf("unknown rpc type %d", i%256))
	}
	if n := strings.Count(out.String(), "\n"); n != 1 || !strings.Contains(out.String(), "level=WARN") {
		t.Fatalf("%d lines for 1000 refused connections, want one WARN:\n%s", n, out.String())
	}
}
