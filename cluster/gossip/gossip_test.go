package gossip

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// testTimings detect failures fast but tolerate a loaded 2-core machine running -race.
func testTimings() Timings {
	return Timings{
		ProbeInterval: 200 * time.Millisecond, ProbeTimeout: 150 * time.Millisecond, SuspicionMult: 2,
		GossipInterval: 30 * time.Millisecond, PushPullInterval: time.Second, TCPTimeout: 2 * time.Second,
	}
}

func testLogger(t *testing.T) *slog.Logger {
	if os.Getenv("GOSSIP_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
	}
	return slog.New(slog.DiscardHandler)
}

// start runs one replica on 127.0.0.1 with tweak applied to its config.
func start(t *testing.T, name string, tweak func(*Config)) *Gossip {
	t.Helper()
	cfg := Config{
		Name: name, BindAddr: "127.0.0.1:0", Timings: testTimings(), Logger: testLogger(t),
		Meta:       Meta{Version: "test", PeerAddr: name + ":peer", RaftAddr: name + ":raft"},
		Registerer: prometheus.NewRegistry(),
	}
	if tweak != nil {
		tweak(&cfg)
	}
	g, err := New(cfg)
	if err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	t.Cleanup(func() { _ = g.Shutdown() })
	return g
}

func seeds(gs ...*Gossip) func(*Config) {
	return func(c *Config) {
		for _, g := range gs {
			c.Seeds = append(c.Seeds, g.Addr())
		}
	}
}

func join(t *testing.T, g *Gossip) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := g.Join(ctx); err != nil {
		t.Fatalf("%s join: %v", g.Name(), err)
	}
}

// cluster3 starts three replicas: r1 alone, r2 seeded with r1, r3 with r2 (so r3 learns
// of r1 through gossip), and waits until each sees all three alive.
func cluster3(t *testing.T, tweak func(*Config)) []*Gossip {
	t.Helper()
	g1 := start(t, "r1", tweak)
	g2 := start(t, "r2", func(c *Config) {
		if tweak != nil {
			tweak(c)
		}
		seeds(g1)(c)
	})
	join(t, g2)
	g3 := start(t, "r3", func(c *Config) {
		if tweak != nil {
			tweak(c)
		}
		seeds(g2)(c)
	})
	join(t, g3)
	gs := []*Gossip{g1, g2, g3}
	for _, g := range gs {
		waitAlive(t, g, "r1", "r2", "r3")
	}
	return gs
}

func waitAlive(t testing.TB, g *Gossip, names ...string) {
	t.Helper()
	poll.Until(t, 10*time.Second, func() error {
		for _, n := range names {
			if !g.IsAlive(n) {
				return fmt.Errorf("%s does not see %s alive: %v", g.Name(), n, g.Members())
			}
		}
		return nil
	})
}

func waitState(t *testing.T, g *Gossip, name string, want State) Member {
	t.Helper()
	var m Member
	poll.Until(t, 10*time.Second, func() error {
		var ok bool
		m, ok = g.Member(name)
		if !ok || m.State != want {
			return fmt.Errorf("%s sees %s as %v (known %v), want %v", g.Name(), name, m.State, ok, want)
		}
		return nil
	})
	return m
}

// inbox collects the messages of one kind that a replica receives.
type inbox struct {
	mu   sync.Mutex
	msgs []string // "from:payload"
}

func listen(g *Gossip, kind Kind) *inbox {
	in := &inbox{}
	g.Handle(kind, func(from string, p []byte) {
		in.mu.Lock()
		in.msgs = append(in.msgs, from+":"+string(p))
		in.mu.Unlock()
	})
	return in
}

func (in *inbox) has(msg string) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	for _, m := range in.msgs {
		if m == msg {
			return nil
		}
	}
	return fmt.Errorf("%q not received (got %d messages)", msg, len(in.msgs))
}

func TestThreeReplicasFindEachOtherFromSeedsWithMetadata(t *testing.T) {
	gs := cluster3(t, nil)
	for _, g := range gs {
		ms := g.Members()
		if len(ms) != 3 {
			t.Fatalf("%s sees %d members: %v", g.Name(), len(ms), ms)
		}
		for _, m := range ms {
			want := Meta{ID: m.Name, Version: "test", PeerAddr: m.Name + ":peer", RaftAddr: m.Name + ":raft"}
			if m.Meta != want {
				t.Errorf("%s sees %s with meta %+v, want %+v", g.Name(), m.Name, m.Meta, want)
			}
			if m.State != Alive || m.Since.IsZero() || m.Addr == "" {
				t.Errorf("%s sees %s as %+v", g.Name(), m.Name, m)
			}
		}
	}
}

func TestJoinThroughADNSName(t *testing.T) {
	g1 := start(t, "r1", nil)
	_, port, _ := net.SplitHostPort(g1.Addr())
	g2 := start(t, "r2", func(c *Config) { c.Seeds = []string{"localhost:" + port} })
	join(t, g2)
	waitAlive(t, g1, "r2")
}

func TestJoinWithoutOtherSeedsIsANoOp(t *testing.T) {
	g1 := start(t, "r1", nil)
	g1.cfg.Seeds = []string{g1.Addr()}
	n, err := g1.Join(context.Background())
	if n != 0 || err != nil {
		t.Fatalf("joining only ourselves: %d, %v", n, err)
	}
}

func TestBroadcastAndSendsReachEveryMember(t *testing.T) {
	gs := cluster3(t, nil)
	inboxes := make([]*inbox, len(gs))
	for i, g := range gs {
		inboxes[i] = listen(g, KindHealth)
	}
	untilBroadcastArrives(t, gs[0], KindHealth, []byte("hello"), func() error {
		return errors.Join(inboxes[1].has("r1:hello"), inboxes[2].has("r1:hello"))
	})
	ctx := context.Background()
	if err := gs[0].SendReliable(ctx, "r2", KindHealth, bytes.Repeat([]byte("x"), 100_000)); err != nil {
		t.Fatal(err)
	}
	if err := gs[0].SendReliable(ctx, "r3", KindHealth, []byte("tcp")); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, func() error {
		// A packet is sent once with no retry: again until one arrives.
		if inboxes[2].has("r2:udp") != nil {
			if err := gs[1].SendBestEffort("r3", KindHealth, []byte("udp")); err != nil {
				t.Fatal(err)
			}
		}
		for _, want := range []struct {
			in  *inbox
			msg string
		}{
			{inboxes[1], "r1:" + strings.Repeat("x", 100_000)},
			{inboxes[2], "r1:tcp"}, {inboxes[2], "r2:udp"},
		} {
			if err := want.in.has(want.msg); err != nil {
				return err
			}
		}
		return nil
	})
	if err := inboxes[0].has("r1:hello"); err == nil {
		t.Error("a replica received its own broadcast")
	}
	if err := gs[0].SendReliable(ctx, "nobody", KindHealth, nil); !errors.Is(err, ErrUnknownMember) {
		t.Errorf("send to a non-member: %v, want ErrUnknownMember", err)
	}
	if err := gs[0].Broadcast(KindHealth, make([]byte, gs[0].MaxBroadcastPayload()+1)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized broadcast: %v, want ErrTooLarge", err)
	}
	if err := gs[0].SendBestEffort("r2", KindHealth, make([]byte, gs[0].MaxBroadcastPayload()+1)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized packet: %v, want ErrTooLarge", err)
	}
	if err := gs[0].Broadcast(0, []byte("x")); err == nil {
		t.Error("kind 0 accepted")
	}
}

// untilBroadcastArrives broadcasts payload from g until arrived holds. A broadcast is a hint
// sent a few times with no guarantee: on a loaded machine every copy can reach a member that
// has just suspected g and drops it, so a copy is queued again once the last one has been
// sent all its times (never while one is queued: a payload that never fits a packet stays
// queued and the wait fails).
func untilBroadcastArrives(t *testing.T, g *Gossip, kind Kind, payload []byte, arrived func() error) {
	t.Helper()
	if err := g.Broadcast(kind, payload); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 20*time.Second, func() error {
		err := arrived()
		if err != nil && g.queue.len() == 0 {
			if berr := g.Broadcast(kind, payload); berr != nil {
				t.Fatal(berr)
			}
		}
		return err
	})
}

func TestLargestBroadcastFitsAPacketWithEncryption(t *testing.T) {
	key := []byte("0123456789abcdef0123456789abcdef")
	gs := cluster3(t, func(c *Config) { c.SecretKey = key })
	in := listen(gs[1], KindLoad)
	payload := bytes.Repeat([]byte("y"), gs[0].MaxBroadcastPayload())
	untilBroadcastArrives(t, gs[0], KindLoad, payload, func() error { return in.has("r1:" + string(payload)) })
}

func TestKeyedBroadcastReplacesTheQueuedOne(t *testing.T) {
	g := start(t, "r1", nil) // alone: nothing leaves the queue
	for i := range 5 {
		if err := g.BroadcastKeyed(KindLoad, "w1", []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := g.BroadcastKeyed(KindLoad, "w2", []byte{9}); err != nil {
		t.Fatal(err)
	}
	if n := g.Stats().QueuedBroadcasts; n != 2 {
		t.Fatalf("%d broadcasts queued, want 2 (one per key)", n)
	}
	if q := g.queue.queuedBytes(); q != 2*(frameHeaderLen(2)+1) {
		t.Fatalf("queued bytes %d after replacement", q)
	}
}

func TestSharedStateTravelsOnJoinAndPushPull(t *testing.T) {
	g1 := start(t, "r1", nil)
	g1.ShareState(KindHealth, func() []byte { return []byte("state-of-r1") })
	g2 := start(t, "r2", seeds(g1))
	in2 := listen(g2, KindHealth)
	g2.ShareState(KindHealth, func() []byte { return []byte("state-of-r2") })
	in1 := listen(g1, KindHealth)
	join(t, g2)
	poll.Until(t, 10*time.Second, func() error {
		if err := in2.has("r1:state-of-r1"); err != nil {
			return err
		}
		return in1.has("r2:state-of-r2")
	})
}

func TestWrongKeyCannotJoinAndSaysSo(t *testing.T) {
	k1 := []byte("0123456789abcdef")
	k2 := []byte("fedcba9876543210")
	for _, tc := range []struct {
		name           string
		seedKey, ourKy []byte
	}{
		{"different keys", k1, k2},
		{"seed has a key, we have none", k1, nil},
		{"we have a key, the seed has none", nil, k1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seed := start(t, "seed", func(c *Config) { c.SecretKey = tc.seedKey })
			g := start(t, "joiner", func(c *Config) {
				c.SecretKey = tc.ourKy
				c.Seeds = []string{seed.Addr()}
			})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err := g.Join(ctx)
			if !errors.Is(err, ErrKeyMismatch) {
				t.Fatalf("join: %v, want ErrKeyMismatch", err)
			}
			if !strings.Contains(err.Error(), "gossip key") || !strings.Contains(err.Error(), seed.Addr()) {
				t.Errorf("the error does not name the key and the seed: %v", err)
			}
			if ctx.Err() != nil {
				t.Error("a key mismatch was retried until the deadline")
			}
			if seed.IsAlive("joiner") || len(seed.Members()) != 1 {
				t.Errorf("the seed let the joiner in: %v", seed.Members())
			}
			poll.Until(t, 5*time.Second, func() error {
				if seed.Stats().Dropped[DropKey] == 0 {
					return errors.New("the seed did not count the undecryptable traffic")
				}
				return nil
			})
		})
	}
}

func TestSameKeyJoins(t *testing.T) {
	key := []byte("0123456789abcdef")
	gs := cluster3(t, func(c *Config) { c.SecretKey = key })
	in := listen(gs[2], KindHealth)
	if err := gs[0].Broadcast(KindHealth, []byte("secret")); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, func() error { return in.has("r1:secret") })
}

func TestKilledReplicaBecomesDeadAndLeaverLeft(t *testing.T) {
	gs := cluster3(t, nil)
	var (
		mu  sync.Mutex
		evs []Member
	)
	gs[0].OnMemberChange(func(m Member) {
		// A listener may call back into the Gossip (events run outside memberlist's lock).
		_ = gs[0].Members()
		mu.Lock()
		evs = append(evs, m)
		mu.Unlock()
	})
	before := time.Now()
	if err := gs[2].Shutdown(); err != nil {
		t.Fatal(err)
	}
	for _, g := range gs[:2] {
		m := waitState(t, g, "r3", Dead)
		if m.Since.Before(before) {
			t.Errorf("dead since %v, before the kill at %v", m.Since, before)
		}
	}
	if err := gs[1].Leave(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	waitState(t, gs[0], "r2", Left)
	poll.Until(t, 5*time.Second, func() error {
		mu.Lock()
		defer mu.Unlock()
		var dead, left bool
		for _, e := range evs {
			dead = dead || e.Name == "r3" && e.State == Dead
			left = left || e.Name == "r2" && e.State == Left
		}
		if !dead || !left {
			return fmt.Errorf("events %v: want r3 dead and r2 left", evs)
		}
		return nil
	})
	if err := gs[2].SendReliable(context.Background(), "r1", KindHealth, nil); !errors.Is(err, ErrClosed) {
		t.Errorf("send after shutdown: %v", err)
	}
	if err := gs[2].Leave(time.Second); !errors.Is(err, ErrClosed) {
		t.Errorf("leave after shutdown: %v (memberlist would panic)", err)
	}
}

// rawSend delivers bytes to g's port over UDP and TCP.
func rawSend(t *testing.T, addr string, udp bool, b []byte) {
	t.Helper()
	network := "tcp"
	if udp {
		network = "udp"
	}
	c, err := net.DialTimeout(network, addr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	_, _ = c.Write(b)
	if !udp {
		// Wait for the replica to close the stream (or the deadline).
		_, _ = c.Read(make([]byte, 512))
	}
}

// craftedStream is a memberlist stream message whose header claims the given sizes.
func craftedStream(msgType byte, header map[string]any) []byte {
	enc, err := msgpack.Marshal(header)
	if err != nil {
		panic(err)
	}
	return append([]byte{msgType}, enc...)
}

func TestGarbageOnThePortIsDroppedAndCounted(t *testing.T) {
	gs := cluster3(t, nil)
	g := gs[0]
	rng := rand.New(rand.NewPCG(1, 2))
	for range 50 {
		b := make([]byte, 1+rng.IntN(600))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		rawSend(t, g.Addr(), true, b)
	}
	for range 10 {
		b := make([]byte, 1+rng.IntN(600))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		rawSend(t, g.Addr(), false, b)
	}
	// Headers that would make memberlist allocate terabytes.
	for _, b := range [][]byte{
		craftedStream(mlPushPull, map[string]any{"Nodes": 1 << 40, "UserStateLen": 0, "Join": false}),
		craftedStream(mlPushPull, map[string]any{"Nodes": 1, "UserStateLen": 1 << 40, "Join": true}),
		craftedStream(mlPushPull, map[string]any{"Nodes": -5}),
		craftedStream(mlUser, map[string]any{"UserMsgLen": 1 << 40}),
		{mlCompress, 0x82, 0xa4, 'A', 'l', 'g', 'o', 0, 0xa3, 'B', 'u', 'f', 0xc6, 0x7f, 0xff, 0xff, 0xff},
		{mlPushPull, 0xc1},
	} {
		rawSend(t, g.Addr(), false, b)
	}
	before := g.Stats()
	// Frames that memberlist delivers but our header check refuses.
	huge := appendFrame(nil, KindHealth, "r2", nil)
	huge[len(huge)-4] = 0xff // claims 4 GiB
	for _, b := range [][]byte{
		{9, 1, 2, 'r', '2', 0, 0, 0, 0},                       // unknown version
		{wireVersion, 0, 2, 'r', '2', 0, 0, 0, 0},             // kind 0
		{wireVersion, 1, 0, 0, 0, 0, 0},                       // empty name
		{wireVersion, 1, 5, 'r'},                              // truncated
		append(appendFrame(nil, KindHealth, "r2", nil), 'x'),  // trailing bytes
		appendFrame(nil, KindHealth, "r 2", nil),              // bad name
		huge,                                                  // impossible size
		appendFrame(nil, KindHealth, "ghost", []byte("boo")),  // not a member
		appendFrame(nil, KindHealth, "r1", []byte("me")),      // claims to be the receiver
		appendFrame(nil, KindDecisions, "r2", []byte("what")), // nobody handles it
	} {
		node, err := gs[1].target("r1")
		if err != nil {
			t.Fatal(err)
		}
		if err := gs[1].ml.SendReliable(node, b); err != nil {
			t.Fatal(err)
		}
	}
	poll.Until(t, 10*time.Second, func() error {
		s := g.Stats()
		want := map[string]uint64{DropDecode: 6, DropSize: 1, DropNonMember: 2, DropUnknownKind: 1}
		for r, n := range want {
			if got := s.Dropped[r] - before.Dropped[r]; got < n {
				return fmt.Errorf("dropped[%s] rose by %d, want %d (stats %+v)", r, got, n, s.Dropped)
			}
		}
		if s.Dropped[DropProtocol] == 0 {
			return fmt.Errorf("memberlist-level garbage not counted: %+v", s.Dropped)
		}
		return nil
	})
	// Still a working member.
	in := listen(gs[1], KindHealth)
	if err := g.Broadcast(KindHealth, []byte("still here")); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, func() error { return in.has("r1:still here") })
	for _, o := range gs[1:] {
		if !o.IsAlive("r1") {
			t.Errorf("%s lost r1 after the garbage", o.Name())
		}
	}
}

func TestBudgetDropsMessagesOverIt(t *testing.T) {
	var (
		mu    sync.Mutex
		clock = time.Unix(1000, 0)
	)
	now := func() time.Time { mu.Lock(); defer mu.Unlock(); return clock }
	const budget = 4000
	tweak := func(c *Config) { c.MaxBytesPerSecond = budget; c.now = now }
	g1 := start(t, "r1", tweak)
	g2 := start(t, "r2", func(c *Config) { tweak(c); seeds(g1)(c) })
	join(t, g2)
	waitAlive(t, g1, "r2")
	in := listen(g2, KindLoad)
	payload := bytes.Repeat([]byte("z"), 900)
	sent, dropped := 0, 0
	for i := range 10 {
		err := g1.SendBestEffort("r2", KindLoad, append(payload, byte('0'+i)))
		switch {
		case err == nil:
			sent++
		case errors.Is(err, ErrOverBudget):
			dropped++
		default:
			t.Fatal(err)
		}
	}
	// The clock stands still: only the first second's worth went out.
	if sent != budget/(900+1+frameHeaderLen(2)) || dropped != 10-sent {
		t.Fatalf("sent %d, dropped %d of 10 messages of ~910 bytes under a %d-byte budget", sent, dropped, budget)
	}
	if got := g1.Stats().Dropped[DropBudget]; got != uint64(dropped) {
		t.Errorf("dropped[budget] = %d, want %d", got, dropped)
	}
	poll.Until(t, 10*time.Second, func() error { return in.has("r1:" + string(payload) + "0") })
	// Broadcasts queue up to a second's worth, then drop.
	var bdrop int
	for range 10 {
		if err := g1.Broadcast(KindLoad, payload); errors.Is(err, ErrOverBudget) {
			bdrop++
		}
	}
	if bdrop == 0 {
		t.Error("broadcasts beyond the budget were all queued")
	}
	// A second later the budget is back.
	mu.Lock()
	clock = clock.Add(time.Second)
	mu.Unlock()
	if err := g1.SendBestEffort("r2", KindLoad, payload); err != nil {
		t.Errorf("after the budget refilled: %v", err)
	}
	if _, err := New(Config{Name: "x", BindAddr: "127.0.0.1:0", MaxBytesPerSecond: 100}); err == nil {
		t.Error("a budget smaller than a packet was accepted")
	}
}

func TestMetricsAreExported(t *testing.T) {
	reg := prometheus.NewRegistry()
	g := start(t, "r1", func(c *Config) { c.Registerer = reg })
	rawSend(t, g.Addr(), true, []byte{0xff, 1, 2, 3})
	poll.Until(t, 5*time.Second, func() error {
		mfs, err := reg.Gather()
		if err != nil {
			return err
		}
		seen := map[string]bool{}
		for _, mf := range mfs {
			seen[mf.GetName()] = true
		}
		for _, n := range []string{"kvrouter_gossip_bytes_total", "kvrouter_gossip_dropped_total", "kvrouter_gossip_members", "kvrouter_gossip_budget_bytes_per_second"} {
			if !seen[n] {
				return fmt.Errorf("metric %s missing", n)
			}
		}
		if g.Stats().BytesIn == 0 {
			return errors.New("inbound bytes not counted")
		}
		return nil
	})
}

func TestConfigIsValidated(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"no name", Config{BindAddr: "127.0.0.1:0"}},
		{"name with a space", Config{Name: "a b", BindAddr: "127.0.0.1:0"}},
		{"short key", Config{Name: "a", BindAddr: "127.0.0.1:0", SecretKey: []byte("short")}},
		{"bind without port", Config{Name: "a", BindAddr: "127.0.0.1"}},
		{"bind on a name", Config{Name: "a", BindAddr: "localhost:0"}},
		{"huge metadata", Config{Name: "a", BindAddr: "127.0.0.1:0", Meta: Meta{Version: strings.Repeat("v", 600)}}},
		{"negative budget", Config{Name: "a", BindAddr: "127.0.0.1:0", MaxBytesPerSecond: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, err := New(tc.cfg)
			if err == nil {
				_ = g.Shutdown()
				t.Fatal("accepted")
			}
		})
	}
}
