package ratelog

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestOneLinePerKeyPerIntervalWithTheCountLeftOut(t *testing.T) {
	l := New(10*time.Second, 2)
	t0 := time.Unix(1000, 0)
	steps := []struct {
		key         string
		at          time.Duration
		ok          bool
		wantDropped int
	}{
		{"a", 0, true, 0},
		{"a", time.Second, false, 0},
		{"a", 9 * time.Second, false, 0},
		{"b", 9 * time.Second, true, 0}, // another key has its own interval
		{"a", 10 * time.Second, true, 2},
		{"a", 11 * time.Second, false, 0},
		{"a", 25 * time.Second, true, 1},
		{"c", 26 * time.Second, true, 0}, // a third key: the two known are forgotten
		{"a", 26 * time.Second, true, 0},
	}
	for i, s := range steps {
		ok, dropped := l.Allow(s.key, t0.Add(s.at))
		if ok != s.ok || dropped != s.wantDropped {
			t.Fatalf("step %d (%s at %s): ok %v dropped %d, want %v %d", i, s.key, s.at, ok, dropped, s.ok, s.wantDropped)
		}
	}
}

func TestLogSaysHowManyWereSuppressed(t *testing.T) {
	var out bytes.Buffer
	log := slog.New(slog.NewTextHandler(&out, nil))
	l := New(time.Hour, 0)
	for range 1000 {
		l.Log(log, "garbage", slog.LevelWarn, "refused", "port", "raft")
	}
	if n := strings.Count(out.String(), "\n"); n != 1 {
		t.Fatalf("%d lines for 1000 refusals within the interval, want 1:\n%s", n, out.String())
	}
	l.keys["garbage"].last = time.Now().Add(-2 * time.Hour)
	l.Log(log, "garbage", slog.LevelWarn, "refused", "port", "raft")
	if !strings.Contains(out.String(), "suppressed=999") {
		t.Fatalf("the next line does not count the 999 left out:\n%s", out.String())
	}
}
