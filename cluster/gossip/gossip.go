// Package gossip is the replicas' membership and hint channel: a wrapper over
// hashicorp/memberlist that adds replica metadata, typed messages whose header is checked
// on arrival, an outbound byte budget, and a counter for everything it drops.
//
// Gossip carries hints (worker health, load, routing decisions) and never decides a
// binding: under loss, a replica routes on a slightly older picture of the fleet, and the
// Raft-replicated bindings stay exactly as they are. See DESIGN.md in this directory.
package gossip

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
)

// State is a member's liveness as this replica sees it.
type State int

// Member states.
const (
	// Alive: answering probes.
	Alive State = iota
	// Suspect: missed probes, not yet declared Dead. memberlist v0.5.4 keeps suspicion to
	// itself, so this version never reports it: a member goes from Alive to Dead (or Left).
	Suspect
	// Dead: failed; it may come back (a restart) under the same name.
	Dead
	// Left: left on purpose (Leave).
	Left
)

func (s State) String() string {
	switch s {
	case Alive:
		return "alive"
	case Suspect:
		return "suspect"
	case Dead:
		return "dead"
	case Left:
		return "left"
	}
	return "unknown"
}

// Member is one replica in the gossip cluster.
type Member struct {
	// Name is the replica id (memberlist's node name).
	Name string
	// Addr is the member's gossip address (host:port).
	Addr string
	Meta Meta
	// State is its liveness and Since when this replica saw it enter that state.
	State State
	Since time.Time
}

// Timings tune failure detection and dissemination. Zero fields take LANTimings' values.
type Timings struct {
	// ProbeInterval between failure-detector probes, ProbeTimeout for one probe's ack.
	ProbeInterval, ProbeTimeout time.Duration
	// SuspicionMult scales how long a suspect has to refute (mult * log10(N) * interval).
	SuspicionMult int
	// GossipInterval between gossip rounds, each to GossipNodes random members.
	GossipInterval time.Duration
	GossipNodes    int
	// RetransmitMult scales how many times a broadcast is sent (mult * log10(N+1)).
	RetransmitMult int
	// PushPullInterval between full state exchanges with one random member.
	PushPullInterval time.Duration
	// TCPTimeout bounds a join, a push/pull or a reliable send.
	TCPTimeout time.Duration
}

// LANTimings are the defaults: a crashed replica is declared dead in about two seconds on
// a LAN, a broadcast reaches every replica of a small cluster in one gossip round.
func LANTimings() Timings {
	return Timings{
		ProbeInterval:    500 * time.Millisecond,
		ProbeTimeout:     250 * time.Millisecond,
		SuspicionMult:    3,
		GossipInterval:   100 * time.Millisecond,
		GossipNodes:      3,
		RetransmitMult:   3,
		PushPullInterval: 15 * time.Second,
		TCPTimeout:       3 * time.Second,
	}
}

func (t *Timings) defaults() {
	d := LANTimings()
	if t.ProbeInterval <= 0 {
		t.ProbeInterval = d.ProbeInterval
	}
	if t.ProbeTimeout <= 0 {
		t.ProbeTimeout = d.ProbeTimeout
	}
	if t.SuspicionMult <= 0 {
		t.SuspicionMult = d.SuspicionMult
	}
	if t.GossipInterval <= 0 {
		t.GossipInterval = d.GossipInterval
	}
	if t.GossipNodes <= 0 {
		t.GossipNodes = d.GossipNodes
	}
	if t.RetransmitMult <= 0 {
		t.RetransmitMult = d.RetransmitMult
	}
	if t.PushPullInterval <= 0 {
		t.PushPullInterval = d.PushPullInterval
	}
	if t.TCPTimeout <= 0 {
		t.TCPTimeout = d.TCPTimeout
	}
}

// DefaultMaxBytesPerSecond is the outbound message budget when Config leaves it zero.
const DefaultMaxBytesPerSecond = 256 << 10

// Config is one replica's gossip settings.
type Config struct {
	// Name is the replica id; every member's must differ.
	Name string
	// BindAddr is the TCP+UDP listen address, host:port (port 0 picks one).
	BindAddr string
	// AdvertiseAddr is what other replicas dial (host:port; default: the bound address).
	AdvertiseAddr string
	// Seeds are other replicas' gossip addresses: host:port, or a DNS name that resolves to
	// several (each address is tried). A port-less seed uses our own port.
	Seeds []string
	// SecretKey encrypts and authenticates all gossip (16, 24 or 32 bytes; nil: none).
	// Replicas with different keys cannot talk, and say so in their logs.
	SecretKey []byte
	// Meta is what this replica tells the others about itself.
	Meta Meta
	// MaxBytesPerSecond is the outbound budget for messages (broadcast transmissions,
	// reliable and best-effort sends, push/pull state); 0 takes DefaultMaxBytesPerSecond.
	// Over it, messages are dropped and counted, never queued behind the caller.
	MaxBytesPerSecond int
	// Timings tune failure detection (zero: LANTimings).
	Timings Timings
	// ForgetAfter is how long a dead or departed member stays listed (default 24h).
	ForgetAfter time.Duration
	// Logger receives membership changes and memberlist's messages (nil: discarded).
	Logger *slog.Logger
	// Registerer receives the kvrouter_gossip_* metrics (nil: not registered).
	Registerer prometheus.Registerer

	// now is the budget's and the member table's clock (tests; nil: time.Now).
	now func() time.Time
}

// Errors callers can test for.
var (
	// ErrOverBudget: the message would exceed the outbound byte budget; it was dropped.
	ErrOverBudget = errors.New("gossip: over the outbound byte budget, message dropped")
	// ErrTooLarge: the payload exceeds what this way of sending can carry.
	ErrTooLarge = errors.New("gossip: payload too large")
	// ErrKeyMismatch: a seed refused our traffic because its gossip key differs from ours.
	ErrKeyMismatch = errors.New("gossip: encryption key mismatch")
	// ErrUnknownMember: no alive member has that name.
	ErrUnknownMember = errors.New("gossip: no such alive member")
	// ErrClosed: the gossip layer was shut down.
	ErrClosed = errors.New("gossip: shut down")
)

// Gossip is one replica's membership in the gossip cluster.
type Gossip struct {
	cfg    Config
	log    *slog.Logger
	ml     *memberlist.Memberlist
	trans  *transport
	queue  *queue
	budget *bucket
	stats  counters
	now    func() time.Time
	// collector is registered with cfg.Registerer, if any.
	collector *collector

	// metaMu guards cfg.Meta, which Leave changes.
	metaMu sync.Mutex

	hmu      sync.RWMutex
	handlers map[Kind]func(from string, payload []byte)
	states   map[Kind]func() []byte

	mu        sync.Mutex
	members   map[string]*Member
	listeners []func(Member)
	// alive counts members Alive or Suspect (the broadcast queue's retransmit limit).
	alive atomic.Int32

	// events queue membership changes for the listeners, delivered on their own goroutine
	// because memberlist calls its event delegate with its node lock held.
	emu    sync.Mutex
	events []Member
	wake   chan struct{}

	done     chan struct{}
	wg       sync.WaitGroup
	stopOnce sync.Once
	closed   atomic.Bool
}

// New validates cfg, binds the gossip port and starts memberlist; Join then contacts the
// seeds.
func New(cfg Config) (*Gossip, error) {
	if err := checkName(cfg.Name); err != nil {
		return nil, fmt.Errorf("gossip: replica name: %w", err)
	}
	switch len(cfg.SecretKey) {
	case 0, 16, 24, 32:
	default:
		return nil, fmt.Errorf("gossip: the key is %d bytes; it must be 16, 24 or 32 bytes (AES-128/192/256)", len(cfg.SecretKey))
	}
	if cfg.Meta.ID == "" {
		cfg.Meta.ID = cfg.Name
	}
	if meta := cfg.Meta.encode(); len(meta) > maxMetaLen {
		return nil, fmt.Errorf("gossip: metadata is %d bytes, limit %d", len(meta), maxMetaLen)
	}
	if cfg.MaxBytesPerSecond < 0 {
		return nil, fmt.Errorf("gossip: negative byte budget %d", cfg.MaxBytesPerSecond)
	}
	if cfg.MaxBytesPerSecond == 0 {
		cfg.MaxBytesPerSecond = DefaultMaxBytesPerSecond
	}
	if cfg.MaxBytesPerSecond < 2*maxPacketFrame {
		return nil, fmt.Errorf("gossip: a byte budget of %d/s cannot carry one packet; use at least %d", cfg.MaxBytesPerSecond, 2*maxPacketFrame)
	}
	if cfg.ForgetAfter <= 0 {
		cfg.ForgetAfter = 24 * time.Hour
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	cfg.Timings.defaults()
	host, portStr, err := net.SplitHostPort(cfg.BindAddr)
	if err != nil {
		return nil, fmt.Errorf("gossip: bind address %q: %w", cfg.BindAddr, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		return nil, fmt.Errorf("gossip: bind address %q: bad port", cfg.BindAddr)
	}
	if host == "" {
		host = "0.0.0.0"
	}
	if net.ParseIP(host) == nil {
		return nil, fmt.Errorf("gossip: bind address %q: the host must be an IP address", cfg.BindAddr)
	}

	g := &Gossip{
		cfg:      cfg,
		log:      cfg.Logger.With("replica", cfg.Name),
		now:      cfg.now,
		handlers: map[Kind]func(string, []byte){},
		states:   map[Kind]func() []byte{},
		members:  map[string]*Member{},
		wake:     make(chan struct{}, 1),
		done:     make(chan struct{}),
	}
	if g.now == nil {
		g.now = time.Now
	}
	g.budget = newBucket(cfg.MaxBytesPerSecond, g.now)
	stdlog := newStdLogger(g.log, &g.stats)
	encrypted := len(cfg.SecretKey) > 0
	if g.trans, err = newTransport(host, port, stdlog, &g.stats, !encrypted); err != nil {
		return nil, err
	}
	port = g.trans.port()

	mc := memberlist.DefaultLANConfig()
	mc.Name = cfg.Name
	mc.Transport = g.trans
	mc.BindAddr, mc.BindPort = host, port
	mc.AdvertisePort = port
	if cfg.AdvertiseAddr != "" {
		ip, aport, err := resolveAdvertise(cfg.AdvertiseAddr)
		if err != nil {
			_ = g.trans.Shutdown()
			return nil, err
		}
		mc.AdvertiseAddr, mc.AdvertisePort = ip, aport
	}
	t := cfg.Timings
	mc.ProbeInterval, mc.ProbeTimeout = t.ProbeInterval, t.ProbeTimeout
	mc.SuspicionMult = t.SuspicionMult
	mc.GossipInterval, mc.GossipNodes = t.GossipInterval, t.GossipNodes
	mc.RetransmitMult = t.RetransmitMult
	mc.PushPullInterval = t.PushPullInterval
	mc.TCPTimeout = t.TCPTimeout
	mc.GossipToTheDeadTime = max(15*time.Second, 10*t.ProbeInterval)
	// A replica restarted under its name with a new address (a rescheduled pod) may take
	// the name back once the old incarnation has been dead this long.
	mc.DeadNodeReclaimTime = max(5*time.Second, 4*t.ProbeInterval)
	mc.SecretKey = cfg.SecretKey
	// In the clear, the stream guard must see memberlist's headers, so nothing is
	// compressed; with a key, compression happens inside the authenticated envelope.
	mc.EnableCompression = encrypted
	mc.Logger = stdlog
	mc.Delegate = (*delegate)(g)
	mc.Events = (*events)(g)

	g.queue = newQueue(t.RetransmitMult, func() int { return int(g.alive.Load()) })
	ml, err := memberlist.Create(mc)
	if err != nil {
		_ = g.trans.Shutdown()
		return nil, fmt.Errorf("gossip: start memberlist: %w", err)
	}
	g.ml = ml
	if cfg.Registerer != nil {
		g.collector = newCollector(g)
		if err := cfg.Registerer.Register(g.collector); err != nil {
			_ = ml.Shutdown()
			return nil, fmt.Errorf("gossip: register metrics: %w", err)
		}
	}
	g.wg.Add(2)
	go g.dispatch()
	go g.watch()
	g.log.Info("gossip started", "addr", g.Addr(), "encrypted", encrypted, "budget_bytes_per_second", cfg.MaxBytesPerSecond)
	return g, nil
}

// resolveAdvertise turns host:port into the IP memberlist needs.
func resolveAdvertise(addr string) (string, int, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("gossip: advertise address %q: %w", addr, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port <= 0 || port > 65535 {
		return "", 0, fmt.Errorf("gossip: advertise address %q: bad port", addr)
	}
	if net.ParseIP(host) != nil {
		return host, port, nil
	}
	ips, err := net.LookupHost(host)
	if err != nil || len(ips) == 0 {
		return "", 0, fmt.Errorf("gossip: advertise address %q does not resolve: %w", addr, err)
	}
	return ips[0], port, nil
}

// Name is this replica's name.
func (g *Gossip) Name() string { return g.cfg.Name }

// Addr is this replica's advertised gossip address (host:port).
func (g *Gossip) Addr() string { return g.ml.LocalNode().Address() }

// Join contacts the seeds until at least one other replica answers or ctx ends; it returns
// how many answered. A seed that refuses us for a key mismatch ends the attempt at once
// with an error wrapping ErrKeyMismatch: retrying would not change the key. No seeds, or
// only our own address: nothing to join, nil.
func (g *Gossip) Join(ctx context.Context) (int, error) {
	if g.closed.Load() {
		return 0, ErrClosed
	}
	backoff := 100 * time.Millisecond
	for {
		addrs := g.seedAddrs(ctx)
		if len(addrs) == 0 && ctx.Err() == nil && !g.seedsNeedDNS() {
			return 0, nil
		}
		n, err := g.joinOnce(addrs)
		if n > 0 {
			g.log.Info("joined the gossip cluster", "seeds_answered", n, "members", len(g.Members()))
			return n, nil
		}
		if errors.Is(err, ErrKeyMismatch) {
			g.log.Error("cannot join the gossip cluster", "err", err)
			return 0, err
		}
		if err == nil {
			err = errors.New("no seed address resolved")
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("gossip: join: no seed answered before %w (last: %w)", ctx.Err(), err)
		case <-g.done:
			return 0, ErrClosed
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

// seedsNeedDNS reports whether some seed is a name (whose addresses may appear later).
func (g *Gossip) seedsNeedDNS() bool {
	for _, s := range g.cfg.Seeds {
		host, _, err := net.SplitHostPort(s)
		if err != nil {
			host = s
		}
		if net.ParseIP(host) == nil {
			return true
		}
	}
	return false
}

// seedAddrs resolves the seeds to ip:port, without our own address.
func (g *Gossip) seedAddrs(ctx context.Context) []string {
	self := g.Addr()
	port := strconv.Itoa(int(g.ml.LocalNode().Port))
	var out []string
	for _, s := range g.cfg.Seeds {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		host, p, err := net.SplitHostPort(s)
		if err != nil {
			host, p = s, port
		}
		ips := []string{host}
		if net.ParseIP(host) == nil {
			rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			ips, err = net.DefaultResolver.LookupHost(rctx, host)
			cancel()
			if err != nil {
				g.log.Debug("gossip seed does not resolve", "seed", s, "err", err)
				continue
			}
		}
		for _, ip := range ips {
			a := net.JoinHostPort(ip, p)
			if a != self && !slices.Contains(out, a) {
				out = append(out, a)
			}
		}
	}
	return out
}

// joinOnce tries each address once; a key mismatch is reported only if no seed took us.
func (g *Gossip) joinOnce(addrs []string) (int, error) {
	var (
		n               int
		lastErr, keyErr error
	)
	for _, a := range addrs {
		if _, err := g.ml.Join([]string{a}); err != nil {
			if isKeyError(err) {
				keyErr = fmt.Errorf("%w: seed %s refused our traffic (%v): every replica needs the same gossip key (or none)", ErrKeyMismatch, a, unwrapJoinErr(err))
			} else {
				lastErr = fmt.Errorf("seed %s: %v", a, unwrapJoinErr(err))
			}
			continue
		}
		n++
	}
	if n > 0 {
		return n, nil
	}
	if keyErr != nil {
		return 0, keyErr
	}
	return 0, lastErr
}

func isKeyError(err error) bool {
	s := strings.ToLower(err.Error())
	for _, k := range keyErrors {
		if strings.Contains(s, k) {
			return true
		}
	}
	return false
}

// unwrapJoinErr flattens memberlist's multierror text to one line.
func unwrapJoinErr(err error) string {
	s := strings.TrimSpace(err.Error())
	if i := strings.LastIndex(s, "* "); i >= 0 {
		s = s[i+2:]
	}
	return strings.Join(strings.Fields(s), " ")
}

// Leave tells the other replicas this one is leaving on purpose (they see it Left, and the
// leader removes it from Raft at once) and waits up to timeout for the news to go out.
// Call Shutdown afterwards.
func (g *Gossip) Leave(timeout time.Duration) error {
	if g.closed.Load() {
		return ErrClosed
	}
	deadline := time.Now().Add(timeout)
	// First the flag in our metadata, which is how the others tell a departure from a
	// death; then memberlist's goodbye.
	g.metaMu.Lock()
	g.cfg.Meta.leaving = true
	g.metaMu.Unlock()
	if err := g.ml.UpdateNode(time.Until(deadline)); err != nil {
		g.log.Warn("gossip: announcing the departure", "err", err)
	}
	if err := g.ml.Leave(max(time.Until(deadline), time.Millisecond)); err != nil {
		return fmt.Errorf("gossip: leave: %w", err)
	}
	return nil
}

// Shutdown stops gossiping without a goodbye (the others will see this replica Dead).
func (g *Gossip) Shutdown() error {
	var err error
	g.stopOnce.Do(func() {
		g.closed.Store(true)
		err = g.ml.Shutdown()
		close(g.done)
		g.wg.Wait()
		g.queue.reset()
		if g.collector != nil {
			g.cfg.Registerer.Unregister(g.collector)
		}
	})
	return err
}

// Members lists every member known to this replica, itself included, sorted by name.
// Dead and departed members stay listed for Config.ForgetAfter.
func (g *Gossip) Members() []Member {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]Member, 0, len(g.members))
	for _, m := range g.members {
		out = append(out, *m)
	}
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Member returns one member by name.
func (g *Gossip) Member(name string) (Member, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	m, ok := g.members[name]
	if !ok {
		return Member{}, false
	}
	return *m, true
}

// IsAlive reports whether name is a member that is Alive or Suspect.
func (g *Gossip) IsAlive(name string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	m, ok := g.members[name]
	return ok && (m.State == Alive || m.State == Suspect)
}

// OnMemberChange registers fn to run after a member joins, changes its metadata or state
// (alive, suspect, dead, left). Calls are in order, one at a time, on a goroutine of their
// own (fn may call any method of g).
func (g *Gossip) OnMemberChange(fn func(Member)) {
	g.mu.Lock()
	g.listeners = append(g.listeners, fn)
	g.mu.Unlock()
}

// maxQueuedEvents bounds the membership events waiting for the listeners.
const maxQueuedEvents = 4096

// setMember records a membership event (called by memberlist's event delegate). A member
// that goes away after announcing its departure Left; otherwise it is Dead.
func (g *Gossip) setMember(n *memberlist.Node, gone bool) {
	meta, err := decodeMeta(n.Meta)
	if err != nil && len(n.Meta) > 0 {
		g.stats.drop(DropDecode)
		g.log.Warn("gossip member with undecodable metadata", "member", n.Name, "err", err)
	}
	now := g.now()
	g.mu.Lock()
	m := g.members[n.Name]
	if m == nil {
		m = &Member{Name: n.Name}
		g.members[n.Name] = m
	}
	st := Alive
	if gone {
		st = Dead
		if meta.leaving || m.Meta.leaving {
			st = Left
		}
	}
	if m.State != st || m.Since.IsZero() {
		m.Since = now
	}
	m.State, m.Addr, m.Meta = st, n.Address(), meta
	ev := *m
	g.countAliveLocked()
	g.mu.Unlock()
	g.log.Info("gossip member", "member", ev.Name, "state", ev.State.String(), "addr", ev.Addr)
	g.emit(ev)
}

func (g *Gossip) emit(m Member) {
	g.emu.Lock()
	if len(g.events) >= maxQueuedEvents {
		g.events = g.events[1:]
		g.log.Warn("gossip: membership listeners lag; dropped the oldest event")
	}
	g.events = append(g.events, m)
	g.emu.Unlock()
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

// dispatch delivers membership events to the listeners.
func (g *Gossip) dispatch() {
	defer g.wg.Done()
	for {
		select {
		case <-g.done:
			return
		case <-g.wake:
		}
		for {
			g.emu.Lock()
			evs := g.events
			g.events = nil
			g.emu.Unlock()
			if len(evs) == 0 {
				break
			}
			g.mu.Lock()
			fns := slices.Clone(g.listeners)
			g.mu.Unlock()
			for _, ev := range evs {
				for _, fn := range fns {
					fn(ev)
				}
			}
		}
	}
}

// watch forgets members dead or departed for longer than ForgetAfter.
func (g *Gossip) watch() {
	defer g.wg.Done()
	t := time.NewTicker(max(g.cfg.ForgetAfter/16, time.Second))
	defer t.Stop()
	for {
		select {
		case <-g.done:
			return
		case <-t.C:
		}
		now := g.now()
		g.mu.Lock()
		for name, m := range g.members {
			if (m.State == Dead || m.State == Left) && now.Sub(m.Since) > g.cfg.ForgetAfter {
				delete(g.members, name)
			}
		}
		g.countAliveLocked()
		g.mu.Unlock()
	}
}

func (g *Gossip) countAliveLocked() {
	var n int32
	for _, m := range g.members {
		if m.State == Alive || m.State == Suspect {
			n++
		}
	}
	g.alive.Store(n)
}

// Stats returns the counters.
func (g *Gossip) Stats() Stats {
	s := Stats{
		BytesIn:          g.stats.bytesIn.Load(),
		BytesOut:         g.stats.bytesOut.Load(),
		PayloadBytesOut:  g.stats.payloadOut.Load(),
		MessagesIn:       g.stats.msgsIn.Load(),
		MessagesOut:      g.stats.msgsOut.Load(),
		Dropped:          make(map[string]uint64, len(dropReasons)),
		QueuedBroadcasts: g.queue.len(),
	}
	for i, r := range dropReasons {
		s.Dropped[r] = g.stats.dropped[i].Load()
	}
	return s
}
