package openai

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// TestBucketTakesItsBurstThenItsRate: a client's bucket gives its burst at once, then one
// event per 1/rate, and says how long until the next.
func TestBucketTakesItsBurstThenItsRate(t *testing.T) {
	t0 := time.Unix(1000, 0)
	for _, tc := range []struct {
		name     string
		rate     float64
		burst    int
		at       []time.Duration // offsets from t0 of the takes
		want     []bool
		lastWait time.Duration
	}{
		{"burst then refused", 1, 3, []time.Duration{0, 0, 0, 0}, []bool{true, true, true, false}, time.Second},
		{"refills at the rate", 2, 1, []time.Duration{0, 0, 500 * time.Millisecond}, []bool{true, false, true}, 0},
		{"refill is capped at the burst", 10, 2, []time.Duration{0, 0, time.Hour, time.Hour, time.Hour}, []bool{true, true, true, true, false}, 100 * time.Millisecond},
		{"half a token left", 1, 1, []time.Duration{0, 500 * time.Millisecond}, []bool{true, false}, 500 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b bucket
			var wait time.Duration
			for i, at := range tc.at {
				var ok bool
				wait, ok = b.take(t0.Add(at), tc.rate, tc.burst)
				if ok != tc.want[i] {
					t.Fatalf("take %d at %v: %v, want %v", i, at, ok, tc.want[i])
				}
			}
			if wait != tc.lastWait {
				t.Fatalf("last wait %v, want %v", wait, tc.lastWait)
			}
		})
	}
}

// TestClientsAreBounded: however many clients knock, at most MaxClients are remembered,
// and a forgotten client comes back with a full bucket.
func TestClientsAreBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	c := newClients(ClientLimits{SessionRate: 1, SessionBurst: 1, MaxClients: 3}, func() time.Time { return now })
	for i := range 1000 {
		if _, ok := c.take(fmt.Sprintf("10.0.%d.%d", i/256, i%256), limitedSession); !ok {
			t.Fatalf("client %d refused its first session", i)
		}
	}
	if n := c.len(); n != 3 {
		t.Fatalf("%d clients remembered, want 3", n)
	}
	if _, ok := c.take("10.0.3.231", limitedSession); ok {
		t.Fatal("the most recent client took a second session at once")
	}
	if _, ok := c.take("10.0.0.0", limitedSession); !ok {
		t.Fatal("a forgotten client was refused")
	}
}

// TestClientKey: a client is its peer's address unless the key header names it, and the
// header is believed only from a trusted peer.
func TestClientKey(t *testing.T) {
	long := strings.Repeat("k", 300)
	for _, tc := range []struct {
		name   string
		header string
		trust  []netip.Prefix
		h      http.Header
		remote string
		want   string
	}{
		{"address", "", nil, http.Header{"X-Forwarded-For": {"1.2.3.4"}}, "127.0.0.2:5000", "127.0.0.2"},
		{"address v6", "", nil, nil, "[::1]:5000", "::1"},
		{"trusted header", "X-Forwarded-For", nil, http.Header{"X-Forwarded-For": {"1.2.3.4"}}, "127.0.0.1:1", "h:1.2.3.4"},
		{"last value counts", "X-Forwarded-For", nil, http.Header{"X-Forwarded-For": {"6.6.6.6, 7.7.7.7", "9.9.9.9, 1.2.3.4"}}, "127.0.0.1:1", "h:1.2.3.4"},
		{"untrusted peer", "X-Forwarded-For", nil, http.Header{"X-Forwarded-For": {"1.2.3.4"}}, "10.1.1.1:1", "10.1.1.1"},
		{"trusted network", "X-Api-Key", []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}, http.Header{"X-Api-Key": {"team-a"}}, "10.1.1.1:1", "h:team-a"},
		{"loopback not trusted when networks named", "X-Api-Key", []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}, http.Header{"X-Api-Key": {"team-a"}}, "127.0.0.1:1", "127.0.0.1"},
		{"no header", "X-Api-Key", nil, nil, "127.0.0.1:1", "127.0.0.1"},
		{"empty value", "X-Forwarded-For", nil, http.Header{"X-Forwarded-For": {"1.2.3.4, "}}, "127.0.0.1:1", "127.0.0.1"},
		{"long key cut", "X-Api-Key", nil, http.Header{"X-Api-Key": {long}}, "127.0.0.1:1", "h:" + long[:maxClientKey]},
		{"v4 in v6 peer", "X-Api-Key", nil, http.Header{"X-Api-Key": {"k"}}, "[::ffff:127.0.0.1]:1", "h:k"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{ClientLimits: ClientLimits{KeyHeader: tc.header, TrustKeyFrom: tc.trust}}
			if err := cfg.ClientLimits.check(); err != nil {
				t.Fatal(err)
			}
			s := &Server{cfg: cfg}
			if got := s.clientKey(tc.h, tc.remote); got != tc.want {
				t.Fatalf("client %q, want %q", got, tc.want)
			}
		})
	}
}

// TestClientLimitsRefuseBadConfig: negative limits and a key header that is no header name
// are refused.
func TestClientLimitsRefuseBadConfig(t *testing.T) {
	for _, c := range []ClientLimits{{SessionRate: -1}, {MaxReservations: -1}, {KeyHeader: "X Bad"}, {MaxClients: -5}} {
		if err := c.check(); err == nil {
			t.Fatalf("%+v accepted", c)
		}
	}
}

// TestNewSessionsPastTheClientRateAre429: a client past its burst of new sessions gets 429
// in the API's shape with Retry-After, counted, and the refused session stays unbound with
// nothing recorded, loaded or dispatched; the client's bound session and its requests
// without a session still pass, and another client is not limited.
func TestNewSessionsPastTheClientRateAre429(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, specsOf(w0), rigOptions{server: server, front: func(c *Config) {
			c.ClientLimits = ClientLimits{SessionRate: 0.001, SessionBurst: 2, KeyHeader: "X-Api-Key"}
		}})
		for i := range 2 {
			if resp, body := rg.post("/v1/completions", completionBody, map[string]string{"X-Session-ID": fmt.Sprint("s", i)}); resp.StatusCode != http.StatusOK {
				t.Fatalf("session %d: %d %s", i, resp.StatusCode, body)
			}
		}
		dispatched, held := w0.requests(), rg.index.held(indexer.Worker{ID: "w0"})
		refused := `{"model":"m","prompt":"a prompt nobody else sent, refused"}`
		resp, body := rg.post("/v1/completions", refused, map[string]string{"X-Session-ID": "s2"})
		if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
			t.Fatalf("third new session: %d (Retry-After %q) %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
		}
		if e := errorOf(t, body); e.Type != TypeRateLimit || e.Code != "client_rate_limited" {
			t.Fatalf("third new session's error: %+v", e)
		}
		if _, ok, _ := rg.affinity.Peek(t.Context(), "s2"); ok {
			t.Fatal("a refused session was bound")
		}
		if w0.requests() != dispatched || rg.index.held(indexer.Worker{ID: "w0"}) != held || !rg.idle() {
			t.Fatal("a refused session was dispatched, recorded or left load")
		}
		resp, body = rg.post("/v1/messages", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"q"}]}`, map[string]string{"X-Session-ID": "s3"})
		var anth struct {
			Type  string `json:"type"`
			Error struct {
				Type string `json:"type"`
			} `json:"error"`
		}
		if resp.StatusCode != http.StatusTooManyRequests || json.Unmarshal([]byte(body), &anth) != nil || anth.Type != "error" || anth.Error.Type != "rate_limit_error" {
			t.Fatalf("new Messages session: %d %s, want Anthropic's rate_limit_error", resp.StatusCode, body)
		}
		for _, hdr := range []map[string]string{{"X-Session-ID": "s0"}, nil, {"X-Session-ID": "other", "X-Api-Key": "team-b"}} {
			if resp, body := rg.post("/v1/completions", completionBody, hdr); resp.StatusCode != http.StatusOK {
				t.Fatalf("request %v: %d %s", hdr, resp.StatusCode, body)
			}
		}
		if got := rg.metric("kvrouter_client_limited_total", map[string]string{"what": "session"}); got != 2 {
			t.Fatalf("limited sessions counted %v, want 2", got)
		}
	})
}

// TestReservationsPerClientAreLimited: a client past its open reservations, or past its
// rate of reservations, gets 429; releasing one lets it reserve again, and another client
// is not limited by it.
func TestReservationsPerClientAreLimited(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		rg := newRig(t, specsOf(newFakeWorker(t, okJSON)), rigOptions{server: server, front: func(c *Config) {
			c.ClientLimits = ClientLimits{MaxReservations: 2, KeyHeader: "X-Api-Key"}
		}})
		a := map[string]string{"X-Api-Key": "a"}
		var first reserveAnswer
		for i := range 2 {
			resp, ans := rg.reserve(completionBody, a)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("reservation %d: %d", i, resp.StatusCode)
			}
			first = ans
		}
		before := fmt.Sprint(rg.tracker.Snapshot())
		resp, body := rg.post("/v1/reserve", completionBody, a)
		if resp.StatusCode != http.StatusTooManyRequests || errorOf(t, body).Code != "client_reservations_full" || resp.Header.Get("Retry-After") == "" {
			t.Fatalf("third open reservation: %d %s", resp.StatusCode, body)
		}
		if after := fmt.Sprint(rg.tracker.Snapshot()); after != before {
			t.Fatalf("a refused reservation changed the load: %s -> %s", before, after)
		}
		if resp, _ := rg.reserve(completionBody, map[string]string{"X-Api-Key": "b"}); resp.StatusCode != http.StatusOK {
			t.Fatalf("another client's reservation: %d", resp.StatusCode)
		}
		if resp, _ := rg.do(t.Context(), http.MethodDelete, "/v1/reservations/"+first.Reservation, "", nil); resp.StatusCode != http.StatusNoContent {
			t.Fatalf("release: %d", resp.StatusCode)
		}
		if resp, _ := rg.reserve(completionBody, a); resp.StatusCode != http.StatusOK {
			t.Fatalf("reservation after a release: %d", resp.StatusCode)
		}
		if got := rg.metric("kvrouter_client_limited_total", map[string]string{"what": "open_reservations"}); got != 1 {
			t.Fatalf("limited reservations counted %v, want 1", got)
		}

		rated := newRig(t, specsOf(newFakeWorker(t, okJSON)), rigOptions{server: server, front: func(c *Config) {
			c.ClientLimits = ClientLimits{ReservationRate: 0.001, ReservationBurst: 1}
		}})
		if resp, _ := rated.reserve(completionBody, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("first reservation: %d", resp.StatusCode)
		}
		resp, body = rated.post("/v1/reserve", completionBody, nil)
		if resp.StatusCode != http.StatusTooManyRequests || errorOf(t, body).Code != "client_rate_limited" {
			t.Fatalf("reservation past the rate: %d %s", resp.StatusCode, body)
		}
		if got := rated.metric("kvrouter_client_limited_total", map[string]string{"what": "reservation"}); got != 1 {
			t.Fatalf("limited reservations counted %v, want 1", got)
		}
	})
}

// FuzzClientKey: whatever a client sends in the key header, from a trusted peer or not, the
// key is the peer's address or a bounded key of the header's, and never one of the other.
func FuzzClientKey(f *testing.F) {
	f.Add("1.2.3.4", "127.0.0.1:5")
	f.Add("a, b,, c ,", "[::1]:1")
	f.Add(" ", "10.0.0.1:1")
	f.Add(strings.Repeat("x,", 200), "127.0.0.1")
	f.Add("k", "not an address")
	s := &Server{cfg: Config{ClientLimits: ClientLimits{KeyHeader: "X-Api-Key"}}}
	if err := s.cfg.ClientLimits.check(); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, value, remote string) {
		key := s.clientKey(http.Header{"X-Api-Key": {value}}, remote)
		host := remote
		if hp, _, err := net.SplitHostPort(remote); err == nil {
			host = hp
		}
		if v, fromHeader := strings.CutPrefix(key, "h:"); fromHeader && key != host {
			addr, err := netip.ParseAddr(host)
			if err != nil || !addr.Unmap().IsLoopback() {
				t.Fatalf("key %q from the header of an untrusted peer %q", key, remote)
			}
			if v == "" || len(v) > maxClientKey || strings.Contains(v, ",") {
				t.Fatalf("header key %q of %q", v, value)
			}
		} else if key != host {
			t.Fatalf("key %q, want the peer %q", key, host)
		}
	})
}

// TestLiveSessionsPerClientAreCapped: a client with MaxSessions live bindings made here gets
// 429 for a new session, and may open one again once one of them ends; a replaced binding
// still counts, and another client is not limited by it.
func TestLiveSessionsPerClientAreCapped(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		rg := newRig(t, specsOf(newFakeWorker(t, okJSON)), rigOptions{server: server, front: func(c *Config) {
			c.ClientLimits = ClientLimits{MaxSessions: 2, KeyHeader: "X-Api-Key"}
		}})
		a := map[string]string{"X-Api-Key": "a"}
		session := func(s string, hdr map[string]string) (*http.Response, string) {
			h := map[string]string{"X-Session-ID": s}
			for k, v := range hdr {
				h[k] = v
			}
			return rg.post("/v1/completions", completionBody, h)
		}
		for _, s := range []string{"s0", "s1"} {
			if resp, body := session(s, a); resp.StatusCode != http.StatusOK {
				t.Fatalf("%s: %d %s", s, resp.StatusCode, body)
			}
		}
		refused := func(what string) {
			t.Helper()
			resp, body := session("s9", a)
			if resp.StatusCode != http.StatusTooManyRequests || errorOf(t, body).Code != "client_sessions_full" {
				t.Fatalf("%s: %d %s", what, resp.StatusCode, body)
			}
		}
		refused("a third live session")
		if resp, _ := session("s0", a); resp.StatusCode != http.StatusOK {
			t.Fatalf("a live session's next request: %d", resp.StatusCode)
		}
		if resp, _ := session("b0", map[string]string{"X-Api-Key": "b"}); resp.StatusCode != http.StatusOK {
			t.Fatalf("another client's session: %d", resp.StatusCode)
		}
		b0, _, _ := rg.affinity.Peek(t.Context(), "s0")
		b1, _, _ := rg.affinity.Peek(t.Context(), "s1")
		rg.srv.BindingEnded("s1", b1.Revision, b1.Revision+100) // replaced: still the client's
		rg.srv.BindingEnded("s0", b0.Revision+1, 0)             // another revision's end
		refused("after a replacement and a stale end")
		rg.srv.BindingEnded("s0", b0.Revision, 0)
		if err := rg.affinity.Invalidate(t.Context(), "s0", b0.Revision); err != nil {
			t.Fatal(err)
		}
		if resp, body := session("s2", a); resp.StatusCode != http.StatusOK {
			t.Fatalf("a new session after one ended: %d %s", resp.StatusCode, body)
		}
		refused("at the cap again")
		rg.srv.BindingsReset()
		if resp, body := session("s3", a); resp.StatusCode != http.StatusOK {
			t.Fatalf("a new session after a reset: %d %s", resp.StatusCode, body)
		}
		if got := rg.metric("kvrouter_client_limited_total", map[string]string{"what": "live_sessions"}); got != 3 {
			t.Fatalf("limited live sessions counted %v, want 3", got)
		}
	})
}

// TestMadeBindingsKeepTheirOwnCopies: the session and client a binding is counted under are
// not the caller's strings (slices of a request's head, kept alive as long as the binding).
func TestMadeBindingsKeepTheirOwnCopies(t *testing.T) {
	head := "x-session-id: s1\r\nx-client: c1\r\n" + strings.Repeat("x", 4096)
	session, client := head[14:16], head[28:30]
	var m made
	m.add(client, session, 1)
	for k, b := range m.bySession {
		if k != session || b.client != client {
			t.Fatalf("counted %q for %q, want %q for %q", k, b.client, session, client)
		}
		if unsafe.StringData(k) == unsafe.StringData(session) || unsafe.StringData(b.client) == unsafe.StringData(client) {
			t.Fatal("a made binding keeps the caller's strings, and with them the whole head")
		}
	}
	for k := range m.byClient {
		if unsafe.StringData(k) == unsafe.StringData(client) {
			t.Fatal("the client count keeps the caller's string")
		}
	}
}
