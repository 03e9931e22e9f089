package system_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// metricValue reads one unlabelled series from a replica's admin /metrics.
func metricValue(ctx context.Context, r *replica, name string) (float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+r.Admin+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			return strconv.ParseFloat(v, 64)
		}
	}
	return 0, fmt.Errorf("metric %s not found (%v)", name, sc.Err())
}

// raftDBSize is the size of a replica's raft.db on disk.
func raftDBSize(t *testing.T, r *replica) int64 {
	t.Helper()
	fi, err := os.Stat(filepath.Join(r.DataDir, "raft.db"))
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

// sourceClients are HTTP clients whose connections leave from 127.0.0.2 up to 127.0.0.<n+1>:
// so many clients, as a per-client rate limit sees them.
func sourceClients(n int) []*http.Client {
	out := make([]*http.Client, n)
	for i := range out {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(i+2))}, Timeout: 5 * time.Second}
		out[i] = &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: d.DialContext, MaxIdleConnsPerHost: 4}}
	}
	return out
}

// TestRaftDBReturnsToItsSizeOnceAFloodOfSessionsExpired: a flood of new sessions grows
// raft.db; once every binding has expired and a snapshot compacted the log, raft.db is
// within twice its size before the flood on every replica (bbolt alone keeps the peak for
// good), and the checkpoints wrote only what changed.
func TestRaftDBReturnsToItsSizeOnceAFloodOfSessionsExpired(t *testing.T) {
	for _, tc := range []struct {
		name     string
		replicas int
	}{{"one replica", 1}, {"three replicas", 3}} {
		t.Run(tc.name, func(t *testing.T) { floodAndExpire(t, tc.replicas) })
	}
}

// floodAndExpire is TestRaftDBReturnsToItsSizeOnceAFloodOfSessionsExpired on n replicas.
func floodAndExpire(t *testing.T, n int) {
	const (
		warm, flood = 2000, 20000
		clients     = 128 // source addresses 127.0.0.2-129: each well under a per-client new-session limit
		floodWithin = 4 * time.Minute
	)
	fl := startFleet(t, 2)
	c := startCluster(t, n, fl, "--session-ttl", "2s", "--checkpoint-interval", "1s",
		"--raft-trailing-logs", "2048", "--raft-log-compact-min-bytes", strconv.Itoa(4<<20),
		"--snapshot-interval", "1h", "--snapshot-threshold", "10000000", "--max-sessions", "10000000")
	ctx, cancel := context.WithTimeout(context.Background(), 9*time.Minute)
	defer cancel()
	hcs := sourceClients(clients)

	// send sends count new sessions from the clients (client i to replica i mod n), bounded
	// in time, and returns how many were answered 200.
	send := func(prefix string, count int, within time.Duration) int64 {
		sctx, scancel := context.WithTimeout(ctx, within)
		defer scancel()
		var next, ok atomic.Int64
		var wg sync.WaitGroup
		for ci, hc := range hcs {
			base := "http://" + c.replicas[ci%n].Client
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := next.Add(1); i <= int64(count) && sctx.Err() == nil; i = next.Add(1) {
					a, err := chatVia(sctx, hc, base, fmt.Sprintf("%s-%d", prefix, i), "hi", 1)
					if err == nil && a.status == http.StatusOK {
						ok.Add(1)
					}
				}
			}()
		}
		wg.Wait()
		return ok.Load()
	}
	metric := func(r *replica, name string) float64 {
		v, err := metricValue(ctx, r, name)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	// snapshot takes a snapshot on every replica (each compacts its own log).
	snapshot := func() {
		for _, r := range c.replicas {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.Admin+"/admin/cluster/snapshot", nil)
			resp, err := httpClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("snapshot on %s: %s", r.ID, resp.Status)
			}
		}
	}
	drain := func(what string) {
		eventually(t, 2*time.Minute, func() error {
			for _, r := range c.replicas {
				if b := metric(r, "kvrouter_fsm_bindings"); b > 0 {
					return fmt.Errorf("%s: %v bindings left on %s", what, b, r.ID)
				}
			}
			return nil
		})
	}

	// The steady state before the flood: some sessions came and went, a snapshot was taken.
	if got := send("warm", warm, 2*time.Minute); got < warm/2 {
		t.Fatalf("warm-up: %d of %d sessions answered", got, warm)
	}
	drain("warm-up")
	snapshot()
	before := make([]int64, n)
	for i, r := range c.replicas {
		before[i] = raftDBSize(t, r)
	}

	start := time.Now()
	peak := make([]atomic.Int64, n)
	stopPeak := make(chan struct{})
	peakDone := make(chan struct{})
	go func() { // each file's largest size while the flood runs and expires
		defer close(peakDone)
		for {
			for i, r := range c.replicas {
				if fi, err := os.Stat(filepath.Join(r.DataDir, "raft.db")); err == nil && fi.Size() > peak[i].Load() {
					peak[i].Store(fi.Size())
				}
			}
			select {
			case <-stopPeak:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	sent := send("flood", flood, floodWithin)
	took := time.Since(start)
	drain("flood")
	close(stopPeak)
	<-peakDone
	if sent < flood/2 {
		t.Fatalf("flood: only %d of %d new sessions answered within %s", sent, flood, floodWithin)
	}
	snapshot()
	for i, r := range c.replicas {
		eventually(t, time.Minute, func() error {
			if after := raftDBSize(t, r); after > 2*before[i] {
				return fmt.Errorf("%s: raft.db is %d bytes after every binding expired and a snapshot, over twice its %d before the flood (peak %d)",
					r.ID, after, before[i], peak[i].Load())
			}
			// The file is renamed before the compaction is counted and logged.
			if metric(r, "kvrouter_raft_log_compactions_total") < 1 {
				return fmt.Errorf("%s: raft.db shrank but no compaction is counted yet", r.ID)
			}
			return nil
		})
	}
	t.Logf("%d new sessions from %d source addresses in %s (%.0f/s), %d sessions in all", sent, clients, took.Round(time.Millisecond),
		float64(sent)/took.Seconds(), int64(warm)+sent)
	for i, r := range c.replicas {
		after := raftDBSize(t, r)
		t.Logf("%s: raft.db %d bytes before, %d at its peak, %d after (%.2fx before); as leader its checkpoints wrote %.0f bytes for %.0f entries; %.0f compactions reclaimed %.0f bytes",
			r.ID, before[i], peak[i].Load(), after, float64(after)/float64(before[i]),
			metric(r, "kvrouter_checkpoint_bytes_total"), metric(r, "kvrouter_checkpoint_entries_total"),
			metric(r, "kvrouter_raft_log_compactions_total"), metric(r, "kvrouter_raft_log_reclaimed_bytes_total"))
		for _, line := range strings.Split(r.log(), "\n") {
			if strings.Contains(line, "raft log compacted") {
				t.Logf("%s: %s", r.ID, line)
			}
		}
		if peak[i].Load() < 4*before[i] {
			t.Errorf("%s: raft.db peaked at %d bytes, under four times its %d before: the flood proved nothing", r.ID, peak[i].Load(), before[i])
		}
	}
}
