package cluster

import (
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
)

// checkpointLeader is a leader over an FSM holding n bindings (the probe's 63,000 by
// default), its timers armed as at the start of a term.
func checkpointLeader(t testing.TB, n int) (*leader, *fsm.FSM) {
	t.Helper()
	f := fsm.New(fsm.Options{})
	for i := range n {
		b, err := fsm.Encode(&fsm.Bind{Session: fmt.Sprintf("session-%08d", i), Worker: "w1", TTL: 10 * time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		f.Apply(&raft.Log{Index: uint64(i + 1), Type: raft.LogCommand, Data: b})
	}
	l := newLeader(&Node{cfg: Config{ElectionTimeout: 500 * time.Millisecond, SessionTTL: 10 * time.Minute}, fsm: f})
	l.mu.Lock()
	l.active = true
	l.rearmAllLocked()
	l.mu.Unlock()
	return l, f
}

// runCheckpoint applies a round planned at `at` to f as Raft would, and returns the bytes
// it wrote and the bindings it listed.
func runCheckpoint(t testing.TB, l *leader, f *fsm.FSM, at time.Time) (bytes, entries int) {
	t.Helper()
	r := l.planCheckpoint(at)
	for _, c := range r.cmds {
		b, err := fsm.Encode(c)
		if err != nil {
			t.Fatal(err)
		}
		bytes += len(b)
		entries += len(c.Entries)
		f.Apply(&raft.Log{Index: f.AppliedIndex() + 1, Type: raft.LogCommand, Data: b})
	}
	l.checkpointed(r, len(r.cmds))
	return bytes, entries
}

// touchEvery moves the deadline of every k-th binding (k 0: none) by d, as requests would.
func touchEvery(l *leader, k int, d time.Duration) int {
	if k == 0 {
		return 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for i := 0; i < len(l.timers); i += k {
		if t := l.timers[fmt.Sprintf("session-%08d", i)]; t != nil {
			t.deadline = t.deadline.Add(d)
			n++
		}
	}
	return n
}

// TestCheckpointsWriteOnlyWhatChanged: after the first round, a round lists only the
// bindings touched since, and the FSM still holds every binding's remaining TTL as the
// leader knows it, never less, and never more than an election timeout above it (so a new
// leader's re-arming keeps a TTL a lower bound and adds at most one election timeout).
func TestCheckpointsWriteOnlyWhatChanged(t *testing.T) {
	const bindings, interval = 63000, 30 * time.Second
	l, f := checkpointLeader(t, bindings)
	t0 := time.Now()
	first, n := runCheckpoint(t, l, f, t0.Add(interval))
	if n != bindings {
		t.Fatalf("first round listed %d bindings, want every one of %d (none was checkpointed)", n, bindings)
	}
	t.Logf("first round (or every round before issue 26): %d bindings, %d bytes", n, first)
	for round, tc := range []struct {
		name      string
		every     int // touch every k-th binding; 0: none
		maxBytes  int
		wantLists int
	}{
		{"idle", 0, 64, 0},
		{"1% touched", 100, first/50 + 64, bindings / 100},
		{"10% touched", 10, first/5 + 64, bindings / 10},
		{"idle again", 0, 64, 0},
	} {
		at := t0.Add(time.Duration(round+2) * interval)
		touched := touchEvery(l, tc.every, interval)
		bytes, listed := runCheckpoint(t, l, f, at)
		t.Logf("%s: %d touched, %d listed, %d bytes (%.2f%% of a full round)", tc.name, touched, listed, bytes, 100*float64(bytes)/float64(first))
		if listed != touched || bytes > tc.maxBytes {
			t.Errorf("%s: listed %d bindings in %d bytes; want the %d touched in at most %d", tc.name, listed, bytes, touched, tc.maxBytes)
		}
		l.mu.Lock()
		for s, tm := range l.timers {
			b, _ := f.Get(s)
			left := tm.deadline.Sub(at)
			if b.Remaining+l.n.cfg.ElectionTimeout < left || b.Remaining > left+l.n.cfg.ElectionTimeout {
				l.mu.Unlock()
				t.Fatalf("%s: %s has %v left on the leader, the FSM says %v", tc.name, s, left, b.Remaining)
			}
		}
		l.mu.Unlock()
	}
}

// BenchmarkCheckpointRound measures one round's log bytes at 63,000 bindings with 1% of
// them touched since the last round.
func BenchmarkCheckpointRound(b *testing.B) {
	l, f := checkpointLeader(b, 63000)
	at := time.Now()
	runCheckpoint(b, l, f, at)
	b.ResetTimer()
	var bytes int
	for b.Loop() {
		at = at.Add(30 * time.Second)
		touchEvery(l, 100, 30*time.Second)
		n, _ := runCheckpoint(b, l, f, at)
		bytes += n
	}
	b.ReportMetric(float64(bytes)/float64(b.N), "log-bytes/round")
}
