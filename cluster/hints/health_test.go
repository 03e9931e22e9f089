package hints

import (
	"bytes"
	"context"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// healthHarness drives one view (replica "r1", thresholds fail 3 / rise 2, confirm 2) with
// a manual clock and hand-written reports from r2 and r3.
type healthHarness struct {
	t     *testing.T
	v     *HealthView
	mu    sync.Mutex
	now   time.Time
	dead  map[string]bool
	seq   map[string]uint64
	epoch map[string]uint64
	flips []string
}

func newHealthHarness(t *testing.T) *healthHarness {
	h := &healthHarness{t: t, now: time.Unix(1000, 0), dead: map[string]bool{}, seq: map[string]uint64{}, epoch: map[string]uint64{"r2": 1, "r3": 1}}
	h.v = NewHealthView("r1", HealthViewOptions{
		FailThreshold: 3, RiseThreshold: 2, Confirm: 2, StaleAfter: 5 * time.Second,
		Alive: func(id string) bool { h.mu.Lock(); defer h.mu.Unlock(); return !h.dead[id] },
		Now:   func() time.Time { h.mu.Lock(); defer h.mu.Unlock(); return h.now },
	})
	h.v.OnChange(func(w string, routable bool, reason string) {
		if !routable && reason == "" {
			t.Errorf("%s taken out without a reason", w)
		}
		h.flips = append(h.flips, fmt.Sprintf("%s=%v", w, routable))
	})
	return h
}

// hstep is one event in a rule scenario.
type hstep struct {
	own     string // "ok" or "fail": one probe by r1
	mark    bool   // the proxy saw w answer garbage (MarkDown)
	from    string // a report from this replica about w...
	fails   uint32
	oks     uint32
	down    bool
	seq     uint64 // explicit sequence (0: the next one)
	epoch   uint64 // explicit epoch (0: the replica's current one)
	full    bool   // a full report (entries empty when fails == 0 && !down && oks == 0)
	advance time.Duration
	kill    string
	want    bool // w routable after the step
}

func (h *healthHarness) run(steps []hstep) {
	h.t.Helper()
	for i, s := range steps {
		switch {
		case s.mark:
			h.v.MarkDown("w", "bad response: garbage")
		case s.own != "":
			h.v.Observe("w", s.own == "ok")
		case s.from != "":
			if s.epoch != 0 {
				h.epoch[s.from] = s.epoch
			}
			seq := s.seq
			if seq == 0 {
				h.seq[s.from]++
				seq = h.seq[s.from]
			}
			rep := healthReport{epoch: h.epoch[s.from], seq: seq, full: s.full}
			if !s.full || s.fails > 0 || s.down || s.oks > 0 {
				rep.entries = []healthEntry{{worker: "w", fails: s.fails, oks: s.oks, down: s.down}}
			}
			if err := h.v.Merge(s.from, rep.encode()); err != nil {
				h.t.Fatalf("step %d: merge: %v", i, err)
			}
		case s.advance > 0:
			h.mu.Lock()
			h.now = h.now.Add(s.advance)
			h.mu.Unlock()
			h.v.Refresh()
		case s.kill != "":
			h.mu.Lock()
			h.dead[s.kill] = true
			h.mu.Unlock()
			h.v.Refresh()
		}
		if got, reason := h.v.Routable("w"); got != s.want {
			h.t.Fatalf("step %d (%+v): routable = %v (%s), want %v", i, s, got, reason, s.want)
		}
	}
}

func TestHealthRule(t *testing.T) {
	const in, out = true, false
	for _, tc := range []struct {
		name  string
		steps []hstep
		flips int
	}{
		{"a single blip here moves nothing", []hstep{
			{own: "fail", want: in}, {own: "ok", want: in}, {own: "fail", want: in}, {own: "fail", want: in}, {own: "ok", want: in},
		}, 0},
		{"this replica's checker takes it out at the fail threshold", []hstep{
			{own: "fail", want: in}, {own: "fail", want: in}, {own: "fail", want: out},
		}, 1},
		{"suspected here, confirmed by a failure run on another replica", []hstep{
			{from: "r2", fails: 1, want: in}, {own: "fail", want: out},
		}, 1},
		{"suspected there, confirmed here", []hstep{
			{own: "fail", want: in}, {from: "r3", fails: 1, want: out},
		}, 1},
		{"one other replica holding it down is not enough", []hstep{
			{own: "ok", want: in}, {from: "r2", fails: 3, down: true, want: in}, {own: "ok", want: in},
		}, 0},
		{"two other replicas holding it down take it out", []hstep{
			{own: "ok", want: in}, {from: "r2", fails: 3, down: true, want: in}, {from: "r3", fails: 3, down: true, want: out},
		}, 1},
		{"back only after the rise threshold", []hstep{
			{own: "fail", want: in}, {own: "fail", want: in}, {own: "fail", want: out}, {own: "ok", want: out}, {own: "ok", want: in},
		}, 2},
		{"a flapping worker goes out once and stays out until it is stable", []hstep{
			{from: "r2", fails: 1, want: in}, {own: "fail", want: out},
			{own: "ok", want: out}, {own: "fail", want: out}, {own: "ok", want: out}, {own: "fail", want: out},
			{own: "ok", want: out}, {own: "ok", want: in},
		}, 2},
		{"not back while two others hold it down", []hstep{
			{from: "r2", fails: 3, down: true, want: in}, {from: "r3", fails: 3, down: true, want: out},
			{own: "ok", want: out}, {own: "ok", want: out},
			{from: "r3", oks: 1, want: in},
		}, 2},
		{"a replica with a broken path to the worker cannot keep it out elsewhere", []hstep{
			{from: "r2", fails: 3, down: true, want: in}, {own: "fail", want: out},
			{own: "ok", want: out}, {own: "ok", want: in}, {advance: time.Second, want: in},
		}, 2},
		{"stale reports are ignored", []hstep{
			{from: "r2", fails: 1, want: in}, {advance: 6 * time.Second, want: in}, {own: "fail", want: in},
		}, 0},
		{"an out verdict based on reports lapses when they go stale", []hstep{
			{from: "r2", fails: 3, down: true, want: in}, {from: "r3", fails: 3, down: true, want: out},
			{advance: 6 * time.Second, want: in},
		}, 2},
		{"a dead replica's reports are ignored", []hstep{
			{own: "ok", want: in}, {own: "ok", want: in},
			{from: "r2", fails: 3, down: true, want: in}, {from: "r3", fails: 3, down: true, want: out},
			{kill: "r3", want: in},
		}, 2},
		{"a late, older report does not undo a newer one", []hstep{
			{own: "fail", want: in}, {from: "r2", oks: 2, seq: 5, want: in}, {from: "r2", fails: 1, seq: 4, want: in},
		}, 0},
		{"a restarted replica's reports count despite a lower sequence", []hstep{
			{own: "fail", want: in}, {from: "r2", oks: 2, seq: 50, want: in}, {from: "r2", fails: 1, seq: 1, epoch: 2, want: out},
		}, 1},
		{"a report from a previous run is ignored", []hstep{
			{own: "fail", want: in}, {from: "r2", oks: 2, seq: 1, epoch: 3, want: in}, {from: "r2", fails: 1, seq: 9, epoch: 2, want: in},
		}, 0},
		{"a bad response takes it out at once, and probes bring it back", []hstep{
			{own: "ok", want: in}, {mark: true, want: out}, {own: "ok", want: out}, {own: "ok", want: in},
		}, 2},
		{"a bad response while already out changes nothing", []hstep{
			{own: "fail", want: in}, {own: "fail", want: in}, {own: "fail", want: out}, {mark: true, want: out}, {own: "ok", want: out}, {own: "ok", want: in},
		}, 2},
		{"a full report clears what it no longer lists", []hstep{
			{own: "ok", want: in}, {own: "ok", want: in},
			{from: "r2", fails: 3, down: true, want: in}, {from: "r3", fails: 3, down: true, want: out},
			{from: "r3", full: true, want: in},
		}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHealthHarness(t)
			h.run(tc.steps)
			if len(h.flips) != tc.flips {
				t.Errorf("routability changed %d times (%v), want %d", len(h.flips), h.flips, tc.flips)
			}
		})
	}
}

func TestHealthChangesCarryTransitionsAndRefreshFailures(t *testing.T) {
	now := time.Unix(0, 0)
	clock := func() time.Time { return now }
	a := NewHealthView("a", HealthViewOptions{FailThreshold: 2, Resend: time.Second, Now: clock})
	b := NewHealthView("b", HealthViewOptions{FailThreshold: 2, Now: clock})
	merge := func(ps [][]byte) {
		t.Helper()
		for _, p := range ps {
			if err := b.Merge("a", p); err != nil {
				t.Fatal(err)
			}
		}
	}
	a.Observe("w1", true)
	a.Observe("w2", false)
	ps := a.Changes(1000)
	if len(ps) != 1 {
		t.Fatalf("%d payloads", len(ps))
	}
	merge(ps)
	if got := b.remote["a"].workers["w2"].report; got.fails != 1 || got.down {
		t.Fatalf("b sees a's w2 as %+v", got)
	}
	if ps := a.Changes(1000); len(ps) != 0 {
		t.Fatalf("nothing changed, yet %d payloads", len(ps))
	}
	now = now.Add(time.Second)
	if ps := a.Changes(1000); len(ps) != 1 {
		t.Fatalf("a failing worker is not refreshed after Resend: %d payloads", len(ps))
	} else if rep, _ := decodeHealth(ps[0]); len(rep.entries) != 1 || rep.entries[0].worker != "w2" {
		t.Fatalf("refresh carries %+v, want only the failing w2", rep.entries)
	}
	// Runs are capped at the thresholds: a worker that stays dead stops changing.
	a.Observe("w2", false)
	a.Observe("w2", false)
	ps = a.Changes(1000)
	a.Observe("w2", false)
	if ps := a.Changes(1000); len(ps) != 0 {
		t.Fatalf("a capped run still generates %d payloads", len(ps))
	}
	// Recovery travels at once.
	a.Observe("w2", true)
	merge(a.Changes(1000))
	if got := b.remote["a"].workers["w2"].report; got.fails != 0 || !got.down || got.oks != 1 {
		t.Fatalf("after one good probe b sees %+v", got)
	}
	// The full report lists only failing workers.
	rep, err := decodeHealth(a.Encode())
	if err != nil || !rep.full || len(rep.entries) != 1 {
		t.Fatalf("full report %+v, %v", rep, err)
	}
}

func TestHealthChangesAreChunkedToFit(t *testing.T) {
	v := NewHealthView("a", HealthViewOptions{})
	for i := range 300 {
		v.Observe(fmt.Sprintf("worker-%03d.example.internal:8000", i), false)
	}
	ps := v.Changes(1300)
	if len(ps) < 2 {
		t.Fatalf("%d payloads for 300 entries", len(ps))
	}
	seen := 0
	for _, p := range ps {
		if len(p) > 1300 {
			t.Fatalf("payload of %d bytes over 1300", len(p))
		}
		rep, err := decodeHealth(p)
		if err != nil {
			t.Fatal(err)
		}
		seen += len(rep.entries)
	}
	if seen != 300 {
		t.Fatalf("%d entries delivered, want 300", seen)
	}
}

func TestHealthDecodeRefusesGarbage(t *testing.T) {
	good := healthReport{epoch: 7, seq: 3, entries: []healthEntry{{worker: "w1", fails: 2, down: true}}}.encode()
	for _, tc := range []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"short", good[:5]},
		{"version", append([]byte{9}, good[1:]...)},
		{"flags", append([]byte{1, 0x80}, good[2:]...)},
		{"truncated entry", good[:len(good)-1]},
		{"trailing", append(bytes.Clone(good), 0)},
		{"huge count", append(bytes.Clone(good[:11]), 0xff, 0xff, 0x03)},
		{"count the bytes cannot hold", append(bytes.Clone(good[:11]), 100, 2, 'w', '1', 0, 0, 0)},
		{"bad id", healthReport{entries: []healthEntry{{worker: "a b"}}}.encode()},
		{"duplicate id", healthReport{entries: []healthEntry{{worker: "w"}, {worker: "w"}}}.encode()},
		{"huge run", append(bytes.Clone(good[:len(good)-3]), 0xff, 0xff, 0xff, 0x0f, 0, 0)},
		{"bad down flag", append(bytes.Clone(good[:len(good)-1]), 2)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := NewHealthView("r1", HealthViewOptions{})
			if err := v.Merge("r2", tc.b); err == nil {
				t.Fatal("accepted")
			}
			if v.Rejected() != 1 || len(v.remote) != 0 {
				t.Fatalf("rejected %d, state %v", v.Rejected(), v.remote)
			}
		})
	}
	if _, err := decodeHealth(good); err != nil {
		t.Fatalf("the good report: %v", err)
	}
}

func FuzzHealthDecode(f *testing.F) {
	f.Add(healthReport{epoch: 1, seq: 2, full: true, entries: []healthEntry{{worker: "w1", fails: 3, oks: 0, down: true}, {worker: "w2", oks: 2}}}.encode())
	f.Add([]byte{1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		rep, err := decodeHealth(b)
		v := NewHealthView("r1", HealthViewOptions{})
		if merr := v.Merge("r2", b); (merr == nil) != (err == nil) {
			t.Fatalf("decode says %v, merge says %v", err, merr)
		}
		if err != nil {
			return
		}
		again, err := decodeHealth(rep.encode())
		if err != nil {
			t.Fatalf("re-encoded report does not decode: %v", err)
		}
		if !reflect.DeepEqual(again, rep) {
			t.Fatalf("round trip changed the report: %+v -> %+v", rep, again)
		}
	})
}

// TestDeadWorkerLeavesEveryReplica runs three views over real gossip on loopback: one
// failed probe on each replica takes the worker out everywhere (suspected here, confirmed
// by another), and it comes back everywhere after the rise threshold.
func TestDeadWorkerLeavesEveryReplica(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var gs []*gossip.Gossip
	for i := range 3 {
		cfg := gossip.Config{
			Name: fmt.Sprintf("r%d", i+1), BindAddr: "127.0.0.1:0",
			Timings: gossip.Timings{ProbeInterval: 200 * time.Millisecond, ProbeTimeout: 150 * time.Millisecond, GossipInterval: 30 * time.Millisecond, PushPullInterval: time.Second},
		}
		if i > 0 {
			cfg.Seeds = []string{gs[0].Addr()}
		}
		g, err := gossip.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = g.Shutdown() })
		if i > 0 {
			jctx, jcancel := context.WithTimeout(ctx, 10*time.Second)
			_, err := g.Join(jctx)
			jcancel()
			if err != nil {
				t.Fatal(err)
			}
		}
		gs = append(gs, g)
	}
	views := make([]*HealthView, len(gs))
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for i, g := range gs {
		poll.Until(t, 10*time.Second, func() error {
			if n := len(g.Members()); n != 3 {
				return fmt.Errorf("%s sees %d members", g.Name(), n)
			}
			return nil
		})
		views[i] = NewHealthView(g.Name(), HealthViewOptions{FailThreshold: 3, RiseThreshold: 2, Alive: g.IsAlive})
		wg.Add(1)
		go func() { defer wg.Done(); views[i].Run(ctx, g, 20*time.Millisecond) }()
	}
	for _, v := range views {
		v.Observe("w", true)
		v.Observe("w", false) // one failure each: below every replica's own threshold
	}
	poll.Until(t, 10*time.Second, func() error {
		for i, v := range views {
			if ok, _ := v.Routable("w"); ok {
				return fmt.Errorf("r%d still routes to the dead worker", i+1)
			}
		}
		return nil
	})
	_, reason := views[0].Routable("w")
	if !strings.Contains(reason, "failing on r1 and on r") {
		t.Errorf("reason %q does not name the confirming replica", reason)
	}
	for _, v := range views {
		v.Observe("w", true)
		v.Observe("w", true)
	}
	poll.Until(t, 10*time.Second, func() error {
		for i, v := range views {
			if ok, why := v.Routable("w"); !ok {
				return fmt.Errorf("r%d keeps the recovered worker out: %s", i+1, why)
			}
		}
		return nil
	})
}
