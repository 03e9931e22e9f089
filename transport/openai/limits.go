package openai

import (
	"container/list"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Limits per client. A client is its TCP peer's address, or, when the operator names a key
// header (ClientLimits.KeyHeader: X-Forwarded-For behind a load balancer, or an API key
// header), that header's last value, trusted only from a peer in ClientLimits.TrustKeyFrom
// (the load balancers; by default loopback): from any other peer the header is ignored, so
// that a client cannot pick a fresh key for every request. The last value is the one the
// nearest proxy wrote (HAProxy's option forwardfor and Envoy append theirs).
//
// Each client has two token buckets on this replica: new sessions (a request that would
// bind its session afresh: routing asks through Request.AdmitNew, so a request of a bound
// session is never refused by it) and reservations (POST /v1/reserve). Past its rate a
// client gets 429 in the API's shape with Retry-After. The clients are kept in an LRU of
// MaxClients: a client evicted comes back with full buckets, which many source addresses
// buy anyway, and the map cannot grow past its bound however many addresses knock. Open
// reservations are also capped per client (MaxReservations), counted while they are open.
// The limits are per replica: a client spread over n replicas gets n times the rate.

// ClientLimits configures the limits per client. A zero rate or count is no limit.
type ClientLimits struct {
	// SessionRate is the new sessions a client may open per second on this replica, and
	// SessionBurst how many at once (at least 1 when the rate is set).
	SessionRate  float64
	SessionBurst int
	// ReservationRate and ReservationBurst are the same for POST /v1/reserve.
	ReservationRate  float64
	ReservationBurst int
	// MaxReservations caps a client's open reservations (unreleased and unexpired).
	MaxReservations int
	// MaxSessions caps the live bindings this replica made for one client: the replica
	// counts the sessions it bound for the client until the binding ends (Server.BindingEnded).
	MaxSessions int
	// KeyHeader names the header that identifies a client instead of its address ("": the
	// address); its last value counts, and only from a peer in TrustKeyFrom.
	KeyHeader string
	// TrustKeyFrom are the peers whose KeyHeader is believed (default loopback).
	TrustKeyFrom []netip.Prefix
	// MaxClients bounds the clients remembered (65,536); the least recent is forgotten.
	MaxClients int
}

// maxClientKey bounds a client key taken from a header, in bytes.
const maxClientKey = 256

// check validates c and fills its defaults.
func (c *ClientLimits) check() error {
	if c.SessionRate < 0 || c.SessionBurst < 0 || c.ReservationRate < 0 || c.ReservationBurst < 0 ||
		c.MaxReservations < 0 || c.MaxSessions < 0 || c.MaxClients < 0 || math.IsNaN(c.SessionRate) || math.IsNaN(c.ReservationRate) {
		return errors.New("openai: client limits must not be negative")
	}
	if c.KeyHeader != "" && strings.ContainsAny(c.KeyHeader, " \t\r\n:") {
		return fmt.Errorf("openai: client key header %q is not a header name", c.KeyHeader)
	}
	if c.SessionRate > 0 {
		c.SessionBurst = max(c.SessionBurst, 1)
	}
	if c.ReservationRate > 0 {
		c.ReservationBurst = max(c.ReservationBurst, 1)
	}
	if c.MaxClients == 0 {
		c.MaxClients = 1 << 16
	}
	if c.TrustKeyFrom == nil {
		c.TrustKeyFrom = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}
	}
	return nil
}

// limited names what a client was refused: the label of kvrouter_client_limited_total.
type limited string

const (
	limitedSession     limited = "session"
	limitedReservation limited = "reservation"
)

// bucket is a token bucket: tokens refill at a rate up to a burst, one taken per event.
type bucket struct {
	tokens float64
	at     time.Time // when tokens was last brought up to date
}

// take takes a token at now, or says how long until one is there.
func (b *bucket) take(now time.Time, rate float64, burst int) (time.Duration, bool) {
	if b.at.IsZero() {
		b.tokens = float64(burst)
	} else if d := now.Sub(b.at); d > 0 {
		b.tokens = min(float64(burst), b.tokens+d.Seconds()*rate)
	}
	b.at = now
	if b.tokens >= 1 {
		b.tokens--
		return 0, true
	}
	return time.Duration((1 - b.tokens) / rate * float64(time.Second)), false
}

// client is one client's buckets.
type client struct {
	key          string
	sessions     bucket
	reservations bucket
}

// clients are the remembered clients, most recent first, bounded by MaxClients.
type clients struct {
	cfg   ClientLimits
	now   func() time.Time
	mu    sync.Mutex
	order list.List // of *client, most recently seen first
	byKey map[string]*list.Element
}

func newClients(cfg ClientLimits, now func() time.Time) *clients {
	return &clients{cfg: cfg, now: now, byKey: map[string]*list.Element{}}
}

// take takes one event of kind what from client key, or says how long until it may.
func (c *clients) take(key string, what limited) (time.Duration, bool) {
	rate, burst := c.cfg.SessionRate, c.cfg.SessionBurst
	if what == limitedReservation {
		rate, burst = c.cfg.ReservationRate, c.cfg.ReservationBurst
	}
	if rate <= 0 {
		return 0, true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var cl *client
	if e := c.byKey[key]; e != nil {
		c.order.MoveToFront(e)
		cl = e.Value.(*client)
	} else {
		if c.order.Len() >= c.cfg.MaxClients {
			last := c.order.Back()
			delete(c.byKey, last.Value.(*client).key)
			c.order.Remove(last)
		}
		cl = &client{key: key}
		c.byKey[key] = c.order.PushFront(cl)
	}
	b := &cl.sessions
	if what == limitedReservation {
		b = &cl.reservations
	}
	return b.take(c.now(), rate, burst)
}

// len is how many clients are remembered.
func (c *clients) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.order.Len()
}

// clientKey names the client of a request with headers h from the TCP peer remote
// (host:port, or a bare host).
func (s *Server) clientKey(h http.Header, remote string) string {
	host := remote
	if hp, _, err := net.SplitHostPort(remote); err == nil {
		host = hp
	}
	name := s.cfg.ClientLimits.KeyHeader
	if name == "" {
		return host
	}
	vals := h.Values(name)
	if len(vals) == 0 {
		return host
	}
	addr, err := netip.ParseAddr(host)
	if err != nil || !s.trustsKeyFrom(addr.Unmap()) {
		return host
	}
	v := vals[len(vals)-1]
	if i := strings.LastIndexByte(v, ','); i >= 0 {
		v = v[i+1:]
	}
	v = strings.TrimSpace(v)
	if v == "" {
		return host
	}
	if len(v) > maxClientKey {
		v = v[:maxClientKey]
	}
	// A header's key lives apart from the addresses, so that one cannot name another's.
	return "h:" + v
}

// trustsKeyFrom reports whether the key header is believed from peer addr.
func (s *Server) trustsKeyFrom(addr netip.Addr) bool {
	for _, p := range s.cfg.ClientLimits.TrustKeyFrom {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}

// admit takes one event of kind what for client key, answering 429 past its rate.
func (s *Server) admit(key string, what limited) *Error {
	wait, ok := s.clients.take(key, what)
	if ok {
		return nil
	}
	s.metrics.clientLimited.WithLabelValues(string(what)).Inc()
	rate := s.cfg.ClientLimits.SessionRate
	msg := "new sessions"
	if what == limitedReservation {
		rate, msg = s.cfg.ClientLimits.ReservationRate, "reservations"
	}
	return &Error{Status: http.StatusTooManyRequests, Type: TypeRateLimit, Code: "client_rate_limited",
		Message: fmt.Sprintf("this client opens %s faster than %s per second on this replica; retry later", msg,
			strconv.FormatFloat(rate, 'g', -1, 64)),
		RetryAfter: strconv.Itoa(max(1, int(math.Ceil(wait.Seconds())))), Cause: "client_limited"}
}

// admitNew is routing's Request.AdmitNew for client key: nil when new sessions are not
// limited.
func (s *Server) admitNew(key string) func() error {
	lim := &s.cfg.ClientLimits
	if lim.SessionRate <= 0 && lim.MaxSessions <= 0 {
		return nil
	}
	return func() error {
		if lim.MaxSessions > 0 && s.made.count(key) >= lim.MaxSessions {
			s.metrics.clientLimited.WithLabelValues("live_sessions").Inc()
			return &Error{Status: http.StatusTooManyRequests, Type: TypeRateLimit, Code: "client_sessions_full",
				Message: "this client has " + strconv.Itoa(lim.MaxSessions) + " live sessions made on this replica; " +
					"new ones are refused until some expire", Param: headerSession, RetryAfter: "60", Cause: "client_limited"}
		}
		if apiErr := s.admit(key, limitedSession); apiErr != nil {
			return apiErr
		}
		return nil
	}
}

// made are the live bindings this replica made, by session, and their count by client,
// for ClientLimits.MaxSessions. They are bounded by the bindings themselves: an entry goes
// when its binding ends, and all of them when the state is restored from a snapshot (the
// count errs low then, never keeping a client out).
type made struct {
	mu        sync.Mutex
	bySession map[string]madeBinding
	byClient  map[string]int
}

// madeBinding is a binding this replica made for client.
type madeBinding struct {
	client   string
	revision uint64
}

// add counts session's binding of revision as made for client.
func (m *made) add(client, session string, revision uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.bySession == nil {
		m.bySession, m.byClient = map[string]madeBinding{}, map[string]int{}
	}
	if old, ok := m.bySession[session]; ok {
		m.dropLocked(session, old)
	} else {
		// Both outlive the request: their own copies, not slices of the request's head.
		session, client = strings.Clone(session), strings.Clone(client)
	}
	m.bySession[session] = madeBinding{client: client, revision: revision}
	m.byClient[client]++
}

// count is how many live bindings this replica made for client.
func (m *made) count(client string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.byClient[client]
}

func (m *made) dropLocked(session string, b madeBinding) {
	delete(m.bySession, session)
	if n := m.byClient[b.client] - 1; n > 0 {
		m.byClient[b.client] = n
	} else {
		delete(m.byClient, b.client)
	}
}

// BindingEnded tells the front that session's binding of revision ended (expired,
// invalidated, its worker gone) or, with next > 0, was replaced by the binding of revision
// next, which still counts for the client that made the first. It does not block.
func (s *Server) BindingEnded(session string, revision, next uint64) {
	m := &s.made
	m.mu.Lock()
	defer m.mu.Unlock()
	b, ok := m.bySession[session]
	if !ok || b.revision != revision {
		return
	}
	if next > 0 {
		m.bySession[session] = madeBinding{client: b.client, revision: next}
		return
	}
	m.dropLocked(session, b)
}

// BindingsReset tells the front that the bindings were replaced wholesale (a snapshot
// restored): the bindings it made are forgotten.
func (s *Server) BindingsReset() {
	m := &s.made
	m.mu.Lock()
	defer m.mu.Unlock()
	m.bySession, m.byClient = nil, nil
}

// madeSession counts a binding the request of client made, when live sessions are capped.
func (s *Server) madeSession(client string, wasBound bool, b routing.Binding) {
	if s.cfg.ClientLimits.MaxSessions > 0 && !wasBound && b.Revision != 0 && b.Session != "" {
		s.made.add(client, b.Session, b.Revision)
	}
}
