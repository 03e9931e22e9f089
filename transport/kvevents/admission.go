package kvevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// What a subscriber's socket admits (see guard.go).
const (
	// DefaultMaxPublishers bounds the publisher connections of one bound socket.
	DefaultMaxPublishers = 1024
	// DefaultMaxInFlight bounds the bytes of one socket's messages in flight, from their first
	// header byte to the end of their handling: room for four messages at their limit.
	DefaultMaxInFlight = 4 * maxMessage
	// maxTopic bounds a topic the guard checks; a longer one names no worker.
	maxTopic = 4096
	// resolveEvery is how long a worker host's addresses are trusted before they are looked
	// up again, and resolveTimeout bounds one lookup.
	resolveEvery   = 30 * time.Second
	resolveTimeout = 2 * time.Second
)

// Reasons a connection is refused or failed (the reason label of
// kvrouter_kvevents_refused_connections_total).
const (
	reasonNotAWorker  = "not_a_worker"
	reasonTooMany     = "too_many_connections"
	reasonWrongWorker = "wrong_worker"
	reasonTooLarge    = "too_large"
	reasonHandshake   = "handshake"
	reasonSlow        = "slow_message"
)

// admission is what one subscriber's socket admits: its budget of bytes in flight and, on a
// bound socket, the addresses its workers publish from. It reaches the guard in the socket's
// context.
type admission struct {
	budget *budget
	// On a bound socket (nil hosts: any address).
	hosts    *workerHosts
	topics   func(topic string) (workerID string, ok bool) // nil: topics are not checked
	maxConns int64
	conns    atomic.Int64
	ctx      context.Context // bounds lookups: the socket's

	m   *Metrics
	log *slog.Logger

	mu      sync.Mutex
	logged  map[string]time.Time // reason -> last log
	pending map[string]int       // reason -> refusals since
}

type admissionKey struct{}

// withAdmission returns ctx carrying a, for the guard.
func withAdmission(ctx context.Context, a *admission) context.Context {
	return context.WithValue(ctx, admissionKey{}, a)
}

func admissionOf(ctx context.Context) *admission {
	a, _ := ctx.Value(admissionKey{}).(*admission)
	return a
}

// admit says why a new connection from remote is refused ("" and nil: it is admitted, and
// holds a slot until it closes).
func (a *admission) admit(remote net.Addr) (string, error) {
	if a.hosts != nil {
		ip := addrIP(remote)
		if !a.hosts.any(a.ctx, ip) {
			return reasonNotAWorker, fmt.Errorf("kvevents: publisher connection from %s, which is no worker's address: %w", remote, errRefused)
		}
	}
	if a.conns.Add(1) > a.maxConns {
		a.conns.Add(-1)
		return reasonTooMany, fmt.Errorf("kvevents: publisher connection from %s past the limit of %d: %w", remote, a.maxConns, errRefused)
	}
	return "", nil
}

// checkTopic fails a message whose topic names a worker that does not publish from remote's
// address; a topic that names no worker is the subscriber's to count.
func (a *admission) checkTopic(remote net.Addr, topic string) error {
	if a.topics == nil || a.hosts == nil {
		return nil
	}
	id, ok := a.topics(topic)
	if !ok || a.hosts.of(a.ctx, id, addrIP(remote)) {
		return nil
	}
	return fmt.Errorf("kvevents: message from %s under the topic %.128q of worker %s, which publishes from elsewhere: %w",
		remote, topic, id, errWrongWorker)
}

// refuse counts a refused or failed connection and logs it, once a minute per reason with the
// count since the last line.
func (a *admission) refuse(reason string, remote net.Addr, err error) {
	a.m.refused.WithLabelValues(reason).Inc()
	now := time.Now()
	a.mu.Lock()
	a.pending[reason]++
	if t, ok := a.logged[reason]; ok && now.Sub(t) < logEvery {
		a.mu.Unlock()
		return
	}
	n := a.pending[reason]
	a.pending[reason] = 0
	a.logged[reason] = now
	a.mu.Unlock()
	a.log.Warn("kv events: publisher connection refused", "reason", reason, "remote", remote.String(),
		"refused_since_last_line", n, "err", err)
}

// reasonOf is the refusal reason of a guard error.
func reasonOf(err error) string {
	switch {
	case errors.Is(err, errWrongWorker):
		return reasonWrongWorker
	case errors.Is(err, ErrTooLarge):
		return reasonTooLarge
	case errors.Is(err, errSlowMessage):
		return reasonSlow
	default:
		return reasonHandshake
	}
}

// addrIP is the IP of a TCP address (unmapped from IPv6), invalid for anything else.
func addrIP(a net.Addr) netip.Addr {
	if t, ok := a.(*net.TCPAddr); ok {
		ip, _ := netip.AddrFromSlice(t.IP)
		return ip.Unmap()
	}
	if ap, err := netip.ParseAddrPort(a.String()); err == nil {
		return ap.Addr().Unmap()
	}
	return netip.Addr{}
}

// workerHosts maps each worker to the hosts (names or literal addresses) its publishers connect
// from, and resolves names with a cache.
type workerHosts struct {
	lookup func(ctx context.Context, host string) ([]netip.Addr, error)
	now    func() time.Time

	mu       sync.Mutex
	byWorker map[string][]string
	cache    map[string]resolved
}

type resolved struct {
	addrs []netip.Addr
	at    time.Time
}

func newWorkerHosts(byWorker map[string][]string) *workerHosts {
	return &workerHosts{
		byWorker: byWorker,
		lookup: func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		},
		now:   time.Now,
		cache: make(map[string]resolved),
	}
}

// set replaces the workers and their hosts (the resolved names stay cached).
func (h *workerHosts) set(byWorker map[string][]string) {
	h.mu.Lock()
	h.byWorker = byWorker
	h.mu.Unlock()
}

// workers is the map of workers to hosts as it is now (never written after set).
func (h *workerHosts) workers() map[string][]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.byWorker
}

// any reports whether ip is the address of some worker.
func (h *workerHosts) any(ctx context.Context, ip netip.Addr) bool {
	for id := range h.workers() {
		if h.of(ctx, id, ip) {
			return true
		}
	}
	return false
}

// of reports whether ip is an address of worker id.
func (h *workerHosts) of(ctx context.Context, id string, ip netip.Addr) bool {
	if !ip.IsValid() {
		return false
	}
	for _, host := range h.workers()[id] {
		for _, a := range h.addrs(ctx, host) {
			if a == ip {
				return true
			}
		}
	}
	return false
}

// addrs returns host's addresses: a literal address, or what a lookup gave at most
// resolveEvery ago (the last answer stays while a new lookup fails).
func (h *workerHosts) addrs(ctx context.Context, host string) []netip.Addr {
	if a, err := netip.ParseAddr(host); err == nil {
		return []netip.Addr{a.Unmap()}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	r, ok := h.cache[host]
	if ok && h.now().Sub(r.at) < resolveEvery {
		return r.addrs
	}
	ctx, cancel := context.WithTimeout(ctx, resolveTimeout)
	defer cancel()
	got, err := h.lookup(ctx, host)
	r.at = h.now()
	if err == nil {
		r.addrs = r.addrs[:0:0]
		for _, a := range got {
			r.addrs = append(r.addrs, a.Unmap())
		}
	}
	h.cache[host] = r
	return r.addrs
}

// PublisherHosts returns the hosts a worker's publishers may connect from, for Config.Hosts:
// the hosts of its URL and of its KV events endpoint (either may be empty or unparsable, and a
// wildcard endpoint host names nothing).
func PublisherHosts(workerURL, eventsEndpoint string) []string {
	var hosts []string
	add := func(h string) {
		if h == "" || h == "*" || slices.Contains(hosts, h) {
			return
		}
		if a, err := netip.ParseAddr(h); err == nil && a.IsUnspecified() {
			return
		}
		hosts = append(hosts, h)
	}
	if u, err := url.Parse(workerURL); err == nil {
		add(u.Hostname())
	}
	if rest, ok := strings.CutPrefix(eventsEndpoint, "tcp://"); ok {
		if h, _, err := net.SplitHostPort(rest); err == nil {
			add(h)
		}
	}
	return hosts
}
