package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// memNet connects in-process nodes: raft's in-memory transport for Raft, and direct calls
// of each node's peer handler in place of gRPC.
type memNet struct {
	mu        sync.Mutex
	nodes     map[string]*Node // by peer address
	down      map[string]bool
	trans     map[string]*raft.InmemTransport
	forwarded map[string]int // Apply calls served, by peer address
	// noReads makes the read-index calls of the node at a peer address fail, while its
	// Raft traffic (heartbeats included) flows on.
	noReads map[string]bool
	// noTouches makes the touch calls of the node at a peer address fail; refusedTouches
	// counts those calls.
	noTouches      map[string]bool
	refusedTouches int
}

func newMemNet() *memNet {
	return &memNet{nodes: map[string]*Node{}, down: map[string]bool{}, trans: map[string]*raft.InmemTransport{}, forwarded: map[string]int{}, noReads: map[string]bool{}, noTouches: map[string]bool{}}
}

func (m *memNet) handler(addr string) (peer.Handler, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := m.nodes[addr]
	if n == nil || m.down[addr] {
		return nil, fmt.Errorf("peer %s unreachable", addr)
	}
	return n.PeerHandler(), nil
}

// memRemote is one node's view of the others.
type memRemote struct {
	net  *memNet
	addr string // the node's own peer address
	self func() *Node
}

func (r memRemote) leaderHandler(ctx context.Context) (peer.Handler, string, error) {
	for {
		n := r.self()
		if n != nil {
			if _, addr, ok := n.Leader(); ok && addr != "" {
				h, err := r.net.handler(addr)
				if err == nil {
					return h, addr, nil
				}
			}
		}
		select {
		case <-ctx.Done():
			return nil, "", fmt.Errorf("%w: %w", ErrNoLeader, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func (r memRemote) Apply(ctx context.Context, cmd []byte) ([]byte, uint64, error) {
	for {
		h, addr, err := r.leaderHandler(ctx)
		if err != nil {
			return nil, 0, err
		}
		out, idx, err := h.Apply(ctx, cmd)
		var nl *peer.NotLeaderError
		if errors.As(err, &nl) {
			continue
		}
		if err == nil {
			r.net.mu.Lock()
			r.net.forwarded[addr]++
			r.net.mu.Unlock()
		}
		return out, idx, err
	}
}

func (r memRemote) ReadIndex(ctx context.Context) (uint64, error) {
	r.net.mu.Lock()
	blocked := r.net.noReads[r.addr]
	r.net.mu.Unlock()
	if blocked {
		return 0, fmt.Errorf("read index from %s: blocked by the test", r.addr)
	}
	h, _, err := r.leaderHandler(ctx)
	if err != nil {
		return 0, err
	}
	return h.ReadIndex(ctx)
}

func (r memRemote) Touch(ctx context.Context, ts []peer.Touch) error {
	r.net.mu.Lock()
	blocked := r.net.noTouches[r.addr]
	if blocked {
		r.net.refusedTouches++
	}
	r.net.mu.Unlock()
	if blocked {
		return fmt.Errorf("touch from %s: blocked by the test", r.addr)
	}
	h, _, err := r.leaderHandler(ctx)
	if err != nil {
		return err
	}
	return h.Touch(ctx, ts)
}

func (r memRemote) Leave(ctx context.Context, id string) error {
	h, _, err := r.leaderHandler(ctx)
	if err != nil {
		return err
	}
	return h.Leave(ctx, id)
}

func (r memRemote) StatusOf(ctx context.Context, addr string) (peer.Status, error) {
	h, err := r.net.handler(addr)
	if err != nil {
		return peer.Status{}, err
	}
	return h.Status(ctx)
}

func (r memRemote) JoinAt(ctx context.Context, addr string, req peer.JoinRequest) error {
	h, err := r.net.handler(addr)
	if err != nil {
		return err
	}
	return h.Join(ctx, req)
}

// testCluster is n in-process nodes bootstrapped together.
type testCluster struct {
	t     *testing.T
	net   *memNet
	nodes []*Node
	cfg   func(i int) Config
	// wrap, if set, stands between node i's Raft and its in-memory transport.
	wrap func(i int, tr raft.Transport) raft.Transport
}

func peerAddr(i int) string { return fmt.Sprintf("peer-%d", i) }
func raftAddr(i int) string { return fmt.Sprintf("raft-%d", i) }

// newTestCluster starts size in-process nodes on in-memory transports, bootstrapped together.
func newTestCluster(t *testing.T, size int, tweak func(*Config)) *testCluster {
	t.Helper()
	return newWrappedCluster(t, size, tweak, nil)
}

// newWrappedCluster is newTestCluster with wrap between each node's Raft and its transport.
func newWrappedCluster(t *testing.T, size int, tweak func(*Config), wrap func(i int, tr raft.Transport) raft.Transport) *testCluster {
	t.Helper()
	c := &testCluster{t: t, net: newMemNet(), nodes: make([]*Node, size), wrap: wrap}
	var seeds []string
	for i := range size {
		seeds = append(seeds, peerAddr(i))
	}
	c.cfg = func(i int) Config {
		cfg := Config{
			ID: fmt.Sprintf("r%d", i), RaftBind: raftAddr(i), PeerAddr: peerAddr(i),
			BootstrapExpect: size, Join: seeds, InMemory: true,
			HeartbeatTimeout: 100 * time.Millisecond, ElectionTimeout: 100 * time.Millisecond,
			LeaderLeaseTimeout: 50 * time.Millisecond, StaleBound: 500 * time.Millisecond,
			BindWait: 5 * time.Second, TouchFlush: 5 * time.Millisecond,
		}
		if tweak != nil {
			tweak(&cfg)
		}
		return cfg
	}
	for i := range size {
		c.start(i)
	}
	t.Cleanup(func() {
		for _, n := range c.nodes {
			if n != nil {
				_ = n.Close()
			}
		}
	})
	return c
}

// start opens node i on a fresh in-memory transport connected to the others.
func (c *testCluster) start(i int) *Node {
	c.t.Helper()
	_, tr := raft.NewInmemTransport(raft.ServerAddress(raftAddr(i)))
	c.net.mu.Lock()
	for addr, other := range c.net.trans {
		if addr == raftAddr(i) {
			continue
		}
		tr.Connect(raft.ServerAddress(addr), other)
		other.Connect(raft.ServerAddress(raftAddr(i)), tr)
	}
	c.net.trans[raftAddr(i)] = tr
	c.net.mu.Unlock()
	cfg := c.cfg(i)
	cfg.Transport = tr
	if c.wrap != nil {
		cfg.Transport = c.wrap(i, tr)
	}
	var self *Node
	var smu sync.Mutex
	cfg.Remote = memRemote{net: c.net, addr: peerAddr(i), self: func() *Node { smu.Lock(); defer smu.Unlock(); return self }}
	n, err := Open(context.Background(), cfg)
	if err != nil {
		c.t.Fatalf("open node %d: %v", i, err)
	}
	smu.Lock()
	self = n
	smu.Unlock()
	c.net.mu.Lock()
	c.net.nodes[peerAddr(i)] = n
	c.net.down[peerAddr(i)] = false
	c.net.mu.Unlock()
	c.nodes[i] = n
	return n
}

// kill stops node i abruptly and cuts it off.
func (c *testCluster) kill(i int) {
	c.t.Helper()
	c.net.mu.Lock()
	c.net.down[peerAddr(i)] = true
	tr := c.net.trans[raftAddr(i)]
	delete(c.net.trans, raftAddr(i))
	for _, other := range c.net.trans {
		other.Disconnect(raft.ServerAddress(raftAddr(i)))
	}
	c.net.mu.Unlock()
	tr.DisconnectAll()
	if err := c.nodes[i].Close(); err != nil {
		c.t.Logf("kill node %d: %v", i, err)
	}
	c.nodes[i] = nil
}

// leader waits for a leader among the live nodes that has established its term.
func (c *testCluster) leader() (int, *Node) {
	c.t.Helper()
	return c.leaderWithin(10 * time.Second)
}

// leaderWithin is leader, waiting up to within (a test that runs beside a CPU hog waits longer).
func (c *testCluster) leaderWithin(within time.Duration) (int, *Node) {
	c.t.Helper()
	var idx int
	var ln *Node
	poll.Until(c.t, within, func() error {
		for i, n := range c.nodes {
			if n != nil && n.IsLeader() && n.lead.isEstablished() {
				idx, ln = i, n
				return nil
			}
		}
		return errors.New("no established leader")
	})
	return idx, ln
}

// commandsBetween counts the commands in n's log after index from, up to index to (the
// barriers of read-lease rounds in between are not commands).
func commandsBetween(t *testing.T, n *Node, from, to uint64) int {
	t.Helper()
	count := 0
	for i := from + 1; i <= to; i++ {
		var e raft.Log
		if err := n.logs.GetLog(i, &e); err != nil {
			t.Fatalf("log entry %d: %v", i, err)
		}
		if e.Type == raft.LogCommand {
			count++
		}
	}
	return count
}
