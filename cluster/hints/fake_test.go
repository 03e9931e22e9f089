package hints

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// fakeNet is an in-memory gossip cluster: messages are delivered at once, on the sender's
// goroutine, unless drop says to lose them.
type fakeNet struct {
	mu     sync.Mutex
	nodes  map[string]*fakeMessenger
	order  []string
	drop   func(from, to string, kind gossip.Kind) bool
	packet int
}

func newFakeNet() *fakeNet { return &fakeNet{nodes: map[string]*fakeMessenger{}, packet: 1300} }

// fakeMessenger is one replica's end of a fakeNet; it implements Messenger.
type fakeMessenger struct {
	net      *fakeNet
	name     string
	peerAddr string
	alive    bool // guarded by net.mu

	mu        sync.Mutex
	handlers  map[gossip.Kind]func(string, []byte)
	listeners []func(gossip.Member)
}

var _ Messenger = (*fakeMessenger)(nil)

// join adds (or brings back) a member and tells the others.
func (n *fakeNet) join(name, peerAddr string) *fakeMessenger {
	n.mu.Lock()
	m := n.nodes[name]
	if m == nil {
		m = &fakeMessenger{net: n, name: name, handlers: map[gossip.Kind]func(string, []byte){}}
		n.nodes[name] = m
		n.order = append(n.order, name)
	} else {
		// A restarted process: new handlers and listeners.
		m.mu.Lock()
		m.handlers, m.listeners = map[gossip.Kind]func(string, []byte){}, nil
		m.mu.Unlock()
	}
	m.peerAddr, m.alive = peerAddr, true
	n.mu.Unlock()
	n.notify(name, gossip.Alive)
	return m
}

// kill marks a member dead (as the failure detector would) and tells the others.
func (n *fakeNet) kill(name string) {
	n.mu.Lock()
	n.nodes[name].alive = false
	n.mu.Unlock()
	n.notify(name, gossip.Dead)
}

func (n *fakeNet) notify(name string, st gossip.State) {
	n.mu.Lock()
	mb := n.member(name, st)
	var ls []func(gossip.Member)
	for _, o := range n.nodes {
		if o.name == name {
			continue
		}
		o.mu.Lock()
		ls = append(ls, o.listeners...)
		o.mu.Unlock()
	}
	n.mu.Unlock()
	for _, fn := range ls {
		fn(mb)
	}
}

func (n *fakeNet) member(name string, st gossip.State) gossip.Member {
	m := n.nodes[name]
	return gossip.Member{Name: name, Addr: name + ":gossip", Meta: gossip.Meta{ID: name, PeerAddr: m.peerAddr}, State: st}
}

func (n *fakeNet) setDrop(fn func(from, to string, kind gossip.Kind) bool) {
	n.mu.Lock()
	n.drop = fn
	n.mu.Unlock()
}

// inject delivers payload to `to` as if `from` had sent it, bypassing every check of the
// network (a forged or corrupted frame that got past the gossip layer).
func (n *fakeNet) inject(from, to string, kind gossip.Kind, payload []byte) {
	n.mu.Lock()
	m := n.nodes[to]
	n.mu.Unlock()
	m.mu.Lock()
	h := m.handlers[kind]
	m.mu.Unlock()
	if h != nil {
		h(from, append([]byte(nil), payload...))
	}
}

func (m *fakeMessenger) Name() string { return m.name }

func (m *fakeMessenger) Members() []gossip.Member {
	m.net.mu.Lock()
	defer m.net.mu.Unlock()
	var out []gossip.Member
	for _, name := range m.net.order {
		st := gossip.Alive
		if !m.net.nodes[name].alive {
			st = gossip.Dead
		}
		out = append(out, m.net.member(name, st))
	}
	return out
}

func (m *fakeMessenger) IsAlive(name string) bool {
	m.net.mu.Lock()
	defer m.net.mu.Unlock()
	o := m.net.nodes[name]
	return o != nil && o.alive
}

func (m *fakeMessenger) OnMemberChange(fn func(gossip.Member)) {
	m.mu.Lock()
	m.listeners = append(m.listeners, fn)
	m.mu.Unlock()
}

func (m *fakeMessenger) Handle(kind gossip.Kind, fn func(string, []byte)) {
	m.mu.Lock()
	m.handlers[kind] = fn
	m.mu.Unlock()
}

func (m *fakeMessenger) MaxBroadcastPayload() int { return m.net.packet }

func (m *fakeMessenger) SendReliable(ctx context.Context, to string, kind gossip.Kind, payload []byte) error {
	if len(payload) > gossip.MaxReliablePayload {
		return gossip.ErrTooLarge
	}
	return m.send(to, kind, payload, true)
}

func (m *fakeMessenger) SendBestEffort(to string, kind gossip.Kind, payload []byte) error {
	if len(payload) > m.net.packet {
		return fmt.Errorf("%w: %d bytes", gossip.ErrTooLarge, len(payload))
	}
	return m.send(to, kind, payload, false)
}

func (m *fakeMessenger) send(to string, kind gossip.Kind, payload []byte, reliable bool) error {
	n := m.net
	n.mu.Lock()
	target := n.nodes[to]
	if !m.alive || target == nil || !target.alive {
		n.mu.Unlock()
		return gossip.ErrUnknownMember
	}
	lost := n.drop != nil && n.drop(m.name, to, kind)
	n.mu.Unlock()
	if lost {
		if reliable {
			return fmt.Errorf("connection to %s reset", to)
		}
		return nil // a lost packet is not noticed
	}
	n.inject(m.name, to, kind, payload)
	return nil
}

// shareWorkers are the fleet of the sharing tests.
var shareWorkers = []routing.WorkerSpec{
	{ID: "w0", URL: "http://127.0.0.1:9100"},
	{ID: "w1", URL: "http://127.0.0.1:9101"},
	{ID: "w2", URL: "http://127.0.0.1:9102"},
}

// shareReplica is one replica's routing state and sharing components, without Raft.
type shareReplica struct {
	name      string
	msgr      *fakeMessenger
	index     *indexer.Index
	tracker   *routing.Tracker
	remote    *routing.RemoteLoad
	decisions *Decisions
	load      *LoadShare
	metrics   *Metrics
	router    *routing.Router
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

type shareOptions struct {
	loadTTL   time.Duration
	fullAfter time.Duration
	known     func(indexer.Worker) bool
}

// newShareReplica starts a replica on fn: its decision and load loops run until stop (or
// the end of the test).
func newShareReplica(t testing.TB, fn *fakeNet, name string, opts shareOptions) *shareReplica {
	t.Helper()
	if opts.loadTTL == 0 {
		opts.loadTTL = 300 * time.Millisecond
	}
	r := &shareReplica{name: name, msgr: fn.join(name, ""), tracker: routing.NewTracker()}
	r.metrics, _ = NewMetrics(nil)
	r.index = indexer.New(indexer.Options{TTL: time.Minute})
	r.remote = routing.NewRemoteLoad(r.tracker, opts.loadTTL)
	var err error
	r.decisions, err = NewDecisions(DecisionsConfig{
		Messenger: r.msgr, Index: r.index, TTL: time.Minute, FlushInterval: 10 * time.Millisecond,
		FullAfter: opts.fullAfter, Known: opts.known, Metrics: r.metrics,
	})
	if err != nil {
		t.Fatal(err)
	}
	r.load, err = NewLoadShare(LoadShareConfig{
		Messenger: r.msgr, Local: r.tracker, Remote: r.remote, Interval: 20 * time.Millisecond,
		Known: opts.known, Metrics: r.metrics,
	})
	if err != nil {
		t.Fatal(err)
	}
	reg, err := routing.NewRegistry(shareWorkers)
	if err != nil {
		t.Fatal(err)
	}
	r.router, err = routing.New(routing.Config{Policy: "kv"}, routing.Deps{
		Index: r.index, Recorder: r.decisions, Workers: reg, Tracker: r.tracker, Load: r.remote,
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	r.wg.Add(2)
	go func() { defer r.wg.Done(); r.decisions.Run(ctx) }()
	go func() { defer r.wg.Done(); r.load.Run(ctx) }()
	t.Cleanup(r.stop)
	return r
}

// stop ends the replica's loops (a process that died, as far as its sending goes).
func (r *shareReplica) stop() {
	r.cancel()
	r.wg.Wait()
}

// overlap is the blocks of seq the replica's index credits w with.
func (r *shareReplica) overlap(seq []uint64, w indexer.Worker) int {
	for _, m := range r.index.FindMatches(seq, nil) {
		if m.Worker == w {
			return m.Blocks
		}
	}
	return 0
}

// sharePrompt returns n pseudo-random sequence hashes; prompts with the same tag share
// their blocks.
func sharePrompt(tag uint64, n int) []uint64 {
	seq := make([]uint64, n)
	x := tag*0x9e3779b97f4a7c15 + 1
	for i := range seq {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		seq[i] = x
	}
	return seq
}

// noPeerCalls is a peer.Handler for servers that only serve snapshots in these tests.
type noPeerCalls struct{}

func (noPeerCalls) Apply(context.Context, []byte) ([]byte, uint64, error) {
	return nil, 0, peer.ErrUnavailable
}
func (noPeerCalls) ReadIndex(context.Context) (uint64, error)    { return 0, peer.ErrUnavailable }
func (noPeerCalls) Touch(context.Context, []peer.Touch) error    { return peer.ErrUnavailable }
func (noPeerCalls) Status(context.Context) (peer.Status, error)  { return peer.Status{}, nil }
func (noPeerCalls) Join(context.Context, peer.JoinRequest) error { return peer.ErrUnavailable }
func (noPeerCalls) Leave(context.Context, string) error          { return peer.ErrUnavailable }

// servePeer serves src's snapshots on 127.0.0.1:0 until the test ends.
func servePeer(t testing.TB, src peer.SnapshotSource) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := peer.NewServer(noPeerCalls{}, peer.ServerOptions{Snapshots: src, StopTimeout: time.Second})
	go s.Serve(l)
	t.Cleanup(s.Stop)
	return l.Addr().String()
}
