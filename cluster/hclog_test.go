package cluster

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
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
	}
	for _, c := range cases {
		var out bytes.Buffer
		w := hclogWriter{slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}))}
		if _, err := w.Write([]byte(c.line + "\n")); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out.String(), c.want) {
			t.Errorf("%q logged as %q, want %s", c.line, out.String(), c.want)
		}
	}
}
