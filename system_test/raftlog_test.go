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
// within twice its size before the flood (bbolt alone keeps the peak for good), and the
// checkpoints wrote only what changed.
func TestRaftDBReturnsToItsSizeOnceAFloodOfSessionsExpired(t *testing.T) {
	const (
		warm, flood = 2000, 20000
		clients     = 32
		floodWithin = 4 * time.Minute
	)
	fl := startFleet(t, 2)
	c := startCluster(t, 1, fl, "--session-ttl", "2s", "--checkpoint-interval", "1s",
		"--raft-trailing-logs", "2048", "--raft-log-compact-min-bytes", strconv.Itoa(4<<20),
		"--snapshot-interval", "1h", "--snapshot-threshold", "10000000", "--max-sessions", "10000000")
	r := c.replicas[0]
	ctx, cancel := context.WithTimeout(context.Background(), 9*time.Minute)
	defer cancel()
	hcs := sourceClients(clients)

	// send binds count new sessions from the clients, bounded in time; it returns how many
	// were answered 200.
	send := func(prefix string, count int, within time.Duration) int64 {
		sctx, scancel := context.WithTimeout(ctx, within)
		defer scancel()
		var next, ok atomic.Int64
		var wg sync.WaitGroup
		for _, hc := range hcs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := next.Add(1); i <= int64(count) && sctx.Err() == nil; i = next.Add(1) {
					a, err := chatVia(sctx, hc, "http://"+r.Client, fmt.Sprintf("%s-%d", prefix, i), "hi", 1)
					if err == nil && a.status == http.StatusOK {
						ok.Add(1)
					}
				}
			}()
		}
		wg.Wait()
		return ok.Load()
	}
	bindings := func() float64 {
		v, err := metricValue(ctx, r, "kvrouter_fsm_bindings")
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	snapshot := func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.Admin+"/admin/cluster/snapshot", nil)
		resp, err := httpClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("snapshot: %s", resp.Status)
		}
	}
	drain := func(what string) {
		eventually(t, 2*time.Minute, func() error {
			if n := bindings(); n > 0 {
				return fmt.Errorf("%s: %v bindings left", what, n)
			}
			return nil
		})
	}

	// The steady state before the flood: some sessions came and went, a snapshot was taken.
	if n := send("warm", warm, 2*time.Minute); n < warm/2 {
		t.Fatalf("warm-up: %d of %d sessions answered", n, warm)
	}
	drain("warm-up")
	snapshot()
	before := raftDBSize(t, r)

	start := time.Now()
	var peak atomic.Int64
	stopPeak := make(chan struct{})
	peakDone := make(chan struct{})
	go func() { // the file's largest size while the flood runs and expires
		defer close(peakDone)
		for {
			if fi, err := os.Stat(filepath.Join(r.DataDir, "raft.db")); err == nil && fi.Size() > peak.Load() {
				peak.Store(fi.Size())
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
	eventually(t, time.Minute, func() error {
		if after := raftDBSize(t, r); after > 2*before {
			return fmt.Errorf("raft.db is %d bytes after every binding expired and a snapshot, over twice its %d before the flood (peak %d)", after, before, peak.Load())
		}
		return nil
	})
	after := raftDBSize(t, r)
	ckBytes, _ := metricValue(ctx, r, "kvrouter_checkpoint_bytes_total")
	ckEntries, _ := metricValue(ctx, r, "kvrouter_checkpoint_entries_total")
	compactions, _ := metricValue(ctx, r, "kvrouter_raft_log_compactions_total")
	reclaimed, _ := metricValue(ctx, r, "kvrouter_raft_log_reclaimed_bytes_total")
	t.Logf("%d new sessions from %d source addresses in %s (%.0f/s); raft.db %d bytes before, %d at its peak, %d after (%.2fx before); checkpoints wrote %.0f bytes for %.0f entries (%d sessions in all); %.0f compactions reclaimed %.0f bytes",
		sent, clients, took.Round(time.Millisecond), float64(sent)/took.Seconds(), before, peak.Load(), after, float64(after)/float64(before),
		ckBytes, ckEntries, int64(warm)+sent, compactions, reclaimed)
	if peak.Load() < 4*before {
		t.Fatalf("raft.db peaked at %d bytes, under four times its %d before: the flood proved nothing", peak.Load(), before)
	}
}
