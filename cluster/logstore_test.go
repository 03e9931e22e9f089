package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// fillLog stores entries [from, to] of size bytes each in s.
func fillLog(t *testing.T, s raft.LogStore, from, to uint64, size int) {
	t.Helper()
	const batch = 256
	for i := from; i <= to; i += batch {
		var logs []*raft.Log
		for j := i; j <= min(i+batch-1, to); j++ {
			logs = append(logs, &raft.Log{Index: j, Term: 1, Type: raft.LogCommand, Data: bytes.Repeat([]byte{byte(j)}, size)})
		}
		if err := s.StoreLogs(logs); err != nil {
			t.Fatalf("store logs %d..: %v", i, err)
		}
	}
}

// checkLog fails t unless s holds exactly the entries [from, to] fillLog wrote.
func checkLog(t *testing.T, s raft.LogStore, from, to uint64, size int) {
	t.Helper()
	first, err := s.FirstIndex()
	if err != nil {
		t.Fatal(err)
	}
	last, err := s.LastIndex()
	if err != nil {
		t.Fatal(err)
	}
	if first != from || last != to {
		t.Fatalf("log holds [%d, %d], want [%d, %d]", first, last, from, to)
	}
	for i := from; i <= to; i++ {
		var l raft.Log
		if err := s.GetLog(i, &l); err != nil {
			t.Fatalf("entry %d: %v", i, err)
		}
		if l.Index != i || !bytes.Equal(l.Data, bytes.Repeat([]byte{byte(i)}, size)) {
			t.Fatalf("entry %d came back as index %d with %d bytes", i, l.Index, len(l.Data))
		}
	}
}

func openTestLogStore(t *testing.T, path string, minBytes int64) *logStore {
	t.Helper()
	s, err := openLogStore(path, minBytes, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatalf("open %s: %v", path, err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// TestRaftDBShrinksOnceASnapshotDeletedMostOfTheLog: bbolt alone keeps raft.db at its peak
// size for good; the store gives the space back after a deletion leaves it mostly free, and
// keeps every entry and stable value across the swap and a reopen.
func TestRaftDBShrinksOnceASnapshotDeletedMostOfTheLog(t *testing.T) {
	const size, total, keep = 1024, 8000, 200
	path := filepath.Join(t.TempDir(), "raft.db")
	s := openTestLogStore(t, path, 1<<20)
	fillLog(t, s, 1, total, size)
	if err := s.SetUint64([]byte("CurrentTerm"), 7); err != nil {
		t.Fatal(err)
	}
	if err := s.Set([]byte("LastVoteCand"), []byte("r2")); err != nil {
		t.Fatal(err)
	}
	peak := s.Stats().FileBytes
	if err := s.DeleteRange(1, total-keep); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 30*time.Second, "a compaction", func() bool { return s.Stats().Compactions == 1 })
	st := s.Stats()
	t.Logf("raft.db: %d bytes at its peak (%d entries of %d bytes), %d after deleting all but %d (reclaimed %d)",
		peak, total, size, st.FileBytes, keep, st.Reclaimed)
	if st.FileBytes*4 > peak {
		t.Fatalf("raft.db is %d bytes after compaction, want under a quarter of its peak %d", st.FileBytes, peak)
	}
	check := func(s *logStore) {
		t.Helper()
		checkLog(t, s, total-keep+1, total, size)
		if v, err := s.GetUint64([]byte("CurrentTerm")); err != nil || v != 7 {
			t.Fatalf("CurrentTerm = %d, %v after compaction; want 7", v, err)
		}
		if v, err := s.Get([]byte("LastVoteCand")); err != nil || string(v) != "r2" {
			t.Fatalf("LastVoteCand = %q, %v after compaction; want r2", v, err)
		}
	}
	check(s)
	fillLog(t, s, total+1, total+10, size) // the swapped store takes writes
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	re := openTestLogStore(t, path, 1<<20)
	checkLog(t, re, total-keep+1, total+10, size)
	if re.Stats().Compactions != 0 {
		t.Fatalf("a compacted file was compacted again at open")
	}
}

// TestRaftDBStaysUsableAfterACrashMidCompaction: a compaction killed before its rename
// leaves its copy beside raft.db, in any state; the next open removes it and serves the old
// file whole.
func TestRaftDBStaysUsableAfterACrashMidCompaction(t *testing.T) {
	const size, total = 512, 2000
	for _, tc := range []struct {
		name string
		copy func(t *testing.T, path string) []byte
	}{
		{"empty copy", func(*testing.T, string) []byte { return nil }},
		{"garbage copy", func(*testing.T, string) []byte { return bytes.Repeat([]byte("not a bolt page "), 4096) }},
		{"half a copy", func(t *testing.T, path string) []byte {
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			return b[:len(b)/2]
		}},
		{"whole copy not yet renamed", func(t *testing.T, path string) []byte {
			if err := writeCompactCopy(path, path+".whole"); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(path + ".whole")
			if err != nil {
				t.Fatal(err)
			}
			return b
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "raft.db")
			s := openTestLogStore(t, path, 1<<40)
			fillLog(t, s, 1, total, size)
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path+compactSuffix, tc.copy(t, path), 0o600); err != nil {
				t.Fatal(err)
			}
			re := openTestLogStore(t, path, 1<<40)
			checkLog(t, re, 1, total, size)
			if _, err := os.Stat(path + compactSuffix); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the interrupted copy is still there: %v", err)
			}
			fillLog(t, re, total+1, total+5, size)
		})
	}
}

// TestRaftDBCompactsUnderLoadWithoutLosingABinding: three in-process Raft nodes on real
// raft.db files bind sessions from many goroutines while snapshots compact the log and the
// stores swap their files underneath; every acknowledged binding is on every node, and on a
// node restarted from its compacted files.
func TestRaftDBCompactsUnderLoadWithoutLosingABinding(t *testing.T) {
	dirs := []string{t.TempDir(), t.TempDir(), t.TempDir()}
	c := newTestCluster(t, 3, func(cfg *Config) {
		cfg.InMemory = false
		var i int
		fmt.Sscanf(cfg.ID, "r%d", &i)
		cfg.DataDir = dirs[i]
		cfg.TrailingLogs = 64
		cfg.SnapshotThreshold = 1 << 30 // only the test's snapshots
		cfg.SnapshotInterval = time.Hour
		cfg.CompactMinBytes = 64 << 10
	})
	_, ln := c.leader()
	// Each worker binds at least minPerWorker sessions, and goes on (up to maxPerWorker) until
	// the stores have compacted wantCompactions times: so compactions happen under load
	// however fast or slow the machine is.
	const workers, minPerWorker, maxPerWorker, wantCompactions = 8, 250, 5000, 6
	compactions := func() (n uint64) {
		for _, node := range c.nodes {
			n += node.LogStoreStats().Compactions
		}
		return n
	}
	// acked are the sessions whose Bind was acknowledged; a Bind that failed (a leader lost
	// to a loaded machine) promised nothing, so it only counts.
	var (
		amu    sync.Mutex
		acked  []string
		failed atomic.Int64
	)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A failed Bind (a leader lost to a loaded machine) does not count against the
			// worker's share: only acknowledged ones do, within the context's two minutes.
			for i, ok := 0, 0; ctx.Err() == nil && ok < maxPerWorker && (ok < minPerWorker || compactions() < wantCompactions); i++ {
				cmd := &fsm.Bind{Session: fmt.Sprintf("s-%d-%d", w, i), Worker: "w1", TTL: time.Hour}
				if res, err := ln.Apply(ctx, cmd); err != nil || res.Status != fsm.Created {
					failed.Add(1)
					continue
				}
				ok++
				amu.Lock()
				acked = append(acked, cmd.Session)
				amu.Unlock()
			}
		}()
	}
	// Snapshots (each deleting all but 64 entries, so the stores compact) while the binds run.
	stopSnaps := make(chan struct{})
	snapsDone := make(chan int)
	go func() {
		snaps := 0
		defer func() { snapsDone <- snaps }()
		for {
			select {
			case <-stopSnaps:
				return
			case <-time.After(100 * time.Millisecond):
			}
			for _, n := range c.nodes {
				if err := n.raft.Snapshot().Error(); err == nil {
					snaps++
				}
			}
		}
	}()
	wg.Wait()
	close(stopSnaps)
	snaps := <-snapsDone
	done := compactions()
	t.Logf("%d bindings acknowledged (%d binds failed), %d snapshots, %d compactions during the load", len(acked), failed.Load(), snaps, done)
	if done < wantCompactions || len(acked) < workers*minPerWorker/2 {
		t.Fatalf("%d compactions and %d acknowledged binds during the load, want %d and %d: the test proved little",
			done, len(acked), wantCompactions, workers*minPerWorker/2)
	}
	holdsAll := func(n *Node) error {
		for _, s := range acked {
			if _, ok := n.fsm.Get(s); !ok {
				return fmt.Errorf("%s lost acknowledged binding %s", n.ID(), s)
			}
		}
		return nil
	}
	for _, n := range c.nodes {
		poll.Until(t, 20*time.Second, func() error { return holdsAll(n) })
	}
	// Restart a follower from its compacted files: snapshot plus the log after it.
	follower := 0
	if c.nodes[0] == ln {
		follower = 1
	}
	c.kill(follower)
	n := c.start(follower)
	poll.Until(t, 20*time.Second, func() error { return holdsAll(n) })
}
