package replica

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// openFiles counts this process's open file descriptors (Linux).
func openFiles(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd to count open files: %v", err)
	}
	return len(ents)
}

// TestFailedStartLeavesNothingBehind makes Start fail at every stage of the assembly: the
// config check, a port already taken, a data directory the Raft node cannot open (with
// gossip's ports up already), and a gossip key the seeds refuse (with the Raft node and the
// peer port running). Each time no goroutine, listener or open file may be left behind: the
// goroutine count and the open files come back to what they were, and every address the
// replica was given can be bound again.
func TestFailedStartLeavesNothingBehind(t *testing.T) {
	fleet := startWorkers(t, 1, simConfig(0))
	// A seed with the cluster's key, for the key-mismatch case.
	seed := startGossipCluster(t, fleet, 1, nil)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	notADir := filepath.Join(t.TempDir(), "a-file")
	if err := os.WriteFile(notADir, []byte("not a data directory"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A data directory whose Raft log is a directory: the node fails to open it, after
	// gossip's ports are up.
	badLog := t.TempDir()
	if err := os.Mkdir(filepath.Join(badLog, "raft.db"), 0o700); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		tune func(*Config)
		want string
	}{
		{"bad tokenizer", func(c *Config) { c.Tokenizer = "gpt" }, "--tokenizer"},
		{"admin port taken", func(c *Config) { c.AdminListen = taken.Addr().String() }, "admin listener"},
		{"data directory under a file", func(c *Config) { c.Cluster.DataDir = filepath.Join(notADir, "raft") }, "cluster id"},
		{"raft log cannot open", func(c *Config) { c.Cluster.DataDir = badLog }, "raft log"},
		{"gossip key refused by the seeds", func(c *Config) {
			c.Cluster.Gossip.Key = []byte("not the cluster's gossip key 032")
			c.Cluster.Gossip.Join = []string{seed.cfgs[0].Cluster.Gossip.Listen}
			c.Cluster.Join = []string{seed.cfgs[0].Cluster.PeerListen}
			c.Cluster.BootstrapExpect = 2
			c.Cluster.Gossip.JoinWait = 5 * time.Second
		}, "gossip-key"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := seed.cfgs[0]
			cfg.ID = "doomed"
			cfg.Listen, cfg.AdminListen = loopbacktest.Addr(t), loopbacktest.Addr(t)
			cfg.Cluster.DataDir = t.TempDir()
			cfg.Cluster.RaftListen, cfg.Cluster.PeerListen, cfg.Cluster.Gossip.Listen = loopbacktest.Addr(t), loopbacktest.Addr(t), loopbacktest.Addr(t)
			cfg.Cluster.Join, cfg.Cluster.Gossip.Join, cfg.Cluster.BootstrapExpect = nil, nil, 1
			tc.tune(&cfg)
			// The runtime closes a leaked descriptor when it collects its owner: with the
			// collector off, waiting for connections that close on their own cannot hide one.
			defer debug.SetGCPercent(debug.SetGCPercent(-1))
			goroutines, files := runtime.NumGoroutine(), openFiles(t)
			rep, err := Start(context.Background(), cfg)
			if err == nil {
				rep.Close()
				t.Fatal("Start succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Start: %v, want an error about %q", err, tc.want)
			}
			t.Logf("refused: %v", err)

			poll.Until(t, 10*time.Second, func() error {
				if n := openFiles(t); n > files {
					return fmt.Errorf("%d open files, %d before the start", n, files)
				}
				return nil
			})
			addrs := []string{cfg.Listen, cfg.Cluster.RaftListen, cfg.Cluster.PeerListen, cfg.Cluster.Gossip.Listen}
			if cfg.AdminListen != taken.Addr().String() {
				addrs = append(addrs, cfg.AdminListen)
			}
			for _, addr := range addrs {
				ln, err := net.Listen("tcp", addr)
				if err != nil {
					t.Errorf("%s is still bound after the failed start: %v", addr, err)
					continue
				}
				ln.Close()
			}
			// Goroutines end on their own schedule once told to.
			poll.Until(t, 10*time.Second, func() error {
				if n := runtime.NumGoroutine(); n > goroutines {
					buf := make([]byte, 1<<20)
					return fmt.Errorf("%d goroutines, %d before the start:\n%s", n, goroutines, buf[:runtime.Stack(buf, true)])
				}
				return nil
			})
			udp, err := net.ListenPacket("udp", cfg.Cluster.Gossip.Listen)
			if err != nil {
				t.Errorf("gossip's UDP port is still bound: %v", err)
			} else {
				udp.Close()
			}
		})
	}
}
