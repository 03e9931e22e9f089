package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

func TestGarbageOnRaftPortDoesNotHurtTheCluster(t *testing.T) {
	nodes := startRealCluster(t, 3)
	li := waitLeader(t, nodes)
	for i, n := range nodes {
		poll.Until(t, 10*time.Second, func() error {
			if err := n.node.Ready(); err != nil {
				return fmt.Errorf("node %d before the garbage: %w", i, err)
			}
			return nil
		})
	}
	payloads := [][]byte{
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
		{0x00, 0xff, 0xfe, 0x01, 0x02, 0x03},
		append([]byte{0x00}, make([]byte, 1<<16)...), // an AppendEntries type byte, then junk
		{0x01, 0x85, 0xa3},                           // a truncated msgpack map
	}
	for _, n := range nodes {
		for _, p := range payloads {
			c, err := net.Dial("tcp", n.cfg.RaftBind)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = c.Write(p)
			_ = c.Close()
		}
	}
	// Every node still serves, and a bind goes through a follower.
	if _, err := bindOnce(context.Background(), nodes[(li+1)%3].aff, "after-garbage"); err != nil {
		t.Fatalf("bind after garbage on the raft ports: %v", err)
	}
	for i, n := range nodes {
		if err := n.node.Ready(); err != nil {
			t.Errorf("node %d unready after garbage: %v", i, err)
		}
	}
}

func TestCorruptSnapshotRefusesToStart(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, path string)
	}{
		{"truncated", func(t *testing.T, path string) {
			st, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(path, st.Size()/2); err != nil {
				t.Fatal(err)
			}
		}},
		{"bit flipped", func(t *testing.T, path string) {
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			b[len(b)/2] ^= 0x40
			if err := os.WriteFile(path, b, 0o600); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			cfg := Config{ID: "solo", DataDir: dir, RaftBind: loopbacktest.Addr(t), PeerAddr: loopbacktest.Addr(t)}
			n := startRealNode(t, cfg)
			waitLeader(t, []*realNode{n})
			for s := range 100 {
				if _, err := bindOnce(context.Background(), n.aff, fmt.Sprintf("s%d", s)); err != nil {
					t.Fatal(err)
				}
			}
			if err := n.node.raft.Snapshot().Error(); err != nil {
				t.Fatal(err)
			}
			n.stop()
			states, err := filepath.Glob(filepath.Join(dir, "snapshots", "*", "state.bin"))
			if err != nil || len(states) != 1 {
				t.Fatalf("snapshot files %v %v", states, err)
			}
			tc.damage(t, states[0])
			_, err = Open(context.Background(), cfg)
			if err == nil {
				t.Fatal("a node with a damaged snapshot started")
			}
			if !strings.Contains(err.Error(), "snapshot") {
				t.Fatalf("the refusal does not say what is wrong: %v", err)
			}
			t.Logf("refused: %v", err)
		})
	}
}

func TestDataDirectoryOfAnotherClusterRefusesToJoin(t *testing.T) {
	nodes := startRealCluster(t, 3)
	// A node whose data directory names another cluster, and no Raft state.
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, clusterIDFile), []byte("some-other-cluster\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var seeds []string
	for _, n := range nodes {
		seeds = append(seeds, n.cfg.PeerAddr)
	}
	stray := startRealNode(t, Config{ID: "stray", DataDir: dir, RaftBind: loopbacktest.Addr(t), PeerAddr: loopbacktest.Addr(t),
		BootstrapExpect: 3, Join: seeds})
	defer stray.stop()
	// It must not become a member: it gave up (the background joiner stopped) and the
	// leader's configuration never lists it.
	li := waitLeader(t, nodes)
	poll.Until(t, 10*time.Second, func() error {
		if stray.node.ClusterID() != "some-other-cluster" {
			return fmt.Errorf("stray node adopted cluster %q", stray.node.ClusterID())
		}
		st := nodes[li].node.Status()
		if st.ClusterID == "" {
			return errors.New("leader has no cluster id")
		}
		return nil
	})
	f := nodes[li].node.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		t.Fatal(err)
	}
	for _, s := range f.Configuration().Servers {
		if s.ID == "stray" {
			t.Fatal("a node of another cluster was added")
		}
	}
	// The leader refuses such a join outright, too.
	err := nodes[li].node.PeerHandler().Join(context.Background(), peer.JoinRequest{
		ID: "stray2", RaftAddr: "127.0.0.1:1", ClusterID: "some-other-cluster", Voter: true})
	if !errors.Is(err, peer.ErrInvalid) {
		t.Fatalf("join from another cluster: %v, want ErrInvalid", err)
	}
}

func TestCommandToFollowerIsNeverAppliedThere(t *testing.T) {
	nodes := startRealCluster(t, 3)
	li := waitLeader(t, nodes)
	f := nodes[(li+1)%3]
	before := f.node.FSM().AppliedIndex()
	_, _, err := f.node.PeerHandler().Apply(context.Background(), mustEncodeBind(t, "direct", "w1"))
	var nl *peer.NotLeaderError
	if !errors.As(err, &nl) || nl.LeaderID != fmt.Sprintf("r%d", li) {
		t.Fatalf("a follower answered %v, want a not-leader redirect naming r%d", err, li)
	}
	if got := f.node.FSM().AppliedIndex(); got != before {
		t.Fatalf("the follower applied something: index %d -> %d", before, got)
	}
	if _, ok := f.node.FSM().Get("direct"); ok {
		t.Fatal("the follower bound the session")
	}
}

func mustEncodeBind(t *testing.T, session, worker string) []byte {
	t.Helper()
	b, err := fsm.Encode(&fsm.Bind{Session: session, Worker: worker})
	if err != nil {
		t.Fatal(err)
	}
	return b
}
