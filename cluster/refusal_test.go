package cluster

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// cut isolates node i: its Raft links to the others and theirs to it, and its peer port.
func (c *testCluster) cut(i int) {
	c.t.Helper()
	c.net.mu.Lock()
	defer c.net.mu.Unlock()
	c.net.down[peerAddr(i)] = true
	c.net.trans[raftAddr(i)].DisconnectAll()
	for addr, other := range c.net.trans {
		if addr != raftAddr(i) {
			other.Disconnect(raft.ServerAddress(raftAddr(i)))
		}
	}
}

// TestAReplicaThatCannotServeRefusesWithoutWaitingAndOneThatMayWaits: a leader cut off from
// its quorum, and a replica that is stopping, refuse a request at once with a routing.Refusal
// (BindWait is a minute: a wait would outlast the request's context), while a follower whose
// leader died waits out the election and serves.
func TestAReplicaThatCannotServeRefusesWithoutWaitingAndOneThatMayWaits(t *testing.T) {
	cases := []struct {
		name string
		// fault breaks the cluster and returns the node the request goes to.
		fault func(t *testing.T, c *testCluster, leader int) *Node
		// want is the refusal's reason, "" for a served request.
		want string
	}{
		{"leader cut off from both followers", func(t *testing.T, c *testCluster, li int) *Node {
			c.cut(li)
			n := c.nodes[li]
			// Raft steps it down once it misses its quorum for LeaderLeaseTimeout.
			poll.Until(t, 10*time.Second, func() error {
				if n.IsLeader() {
					return errors.New("the cut-off leader still leads")
				}
				return nil
			})
			return n
		}, "cut_off"},
		{"stopping follower without a read lease", func(t *testing.T, c *testCluster, li int) *Node {
			fi := (li + 1) % 3
			c.cut(fi)
			n := c.nodes[fi]
			poll.Until(t, 10*time.Second, func() error {
				if n.leaseHolds() == nil {
					return errors.New("the cut-off follower still holds its lease")
				}
				return nil
			})
			n.SetStopping()
			return n
		}, "stopping"},
		{"follower of a killed leader", func(t *testing.T, c *testCluster, li int) *Node {
			c.kill(li)
			return c.nodes[(li+1)%3]
		}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCluster(t, 3, func(cfg *Config) { cfg.BindWait = time.Minute })
			li, _ := c.leader()
			for i := range 3 {
				poll.Until(t, 10*time.Second, func() error {
					if err := c.nodes[i].Ready(); err != nil {
						return fmt.Errorf("node %d: %w", i, err)
					}
					return nil
				})
			}
			n := tc.fault(t, c, li)
			a := NewAffinity(n)
			ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
			defer cancel()
			l, err := a.Acquire(ctx, "s", nil)
			var r *routing.Refusal
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("acquire: %v, want it served once a new leader is elected", err)
			case tc.want == "":
				l.Release()
			case !errors.As(err, &r) || r.Reason != tc.want:
				t.Fatalf("acquire: %v, want a refusal (%s)", err, tc.want)
			case !errors.Is(err, routing.ErrUnavailable) || !errors.Is(err, ErrStale) && !errors.Is(err, ErrNoLeader):
				t.Fatalf("refusal %v does not say why (no read lease, no leader)", err)
			}
		})
	}
}
