package workers

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// memCluster is the real state machine applied in process: what a one-replica cluster's
// leader does, without Raft underneath.
type memCluster struct {
	mu      sync.Mutex
	f       *fsm.FSM
	index   uint64
	changed chan struct{}
	leader  bool
	applied []fsm.Command
	duties  []func(context.Context)
}

func newMemCluster() *memCluster {
	c := &memCluster{changed: make(chan struct{}, 1), leader: true}
	c.f = fsm.New(fsm.Options{OnChange: func(ch fsm.Change) {
		if ch.Kind == fsm.WorkersChanged {
			select {
			case c.changed <- struct{}{}:
			default:
			}
		}
	}})
	return c
}

func (c *memCluster) Workers() []fsm.Worker           { return c.f.Workers() }
func (c *memCluster) WorkersChanged() <-chan struct{} { return c.changed }
func (c *memCluster) IsLeader() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.leader
}
func (c *memCluster) AddDuty(_ string, run func(context.Context)) { c.duties = append(c.duties, run) }

func (c *memCluster) Apply(_ context.Context, cmd fsm.Command) (*fsm.Result, error) {
	b, err := fsm.Encode(cmd)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.index++
	idx := c.index
	c.applied = append(c.applied, cmd)
	c.mu.Unlock()
	res := c.f.Apply(&raft.Log{Type: raft.LogCommand, Index: idx, Data: b}).(*fsm.Result)
	return res, res.Err
}

func (c *memCluster) invalidations() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, cmd := range c.applied {
		if _, ok := cmd.(*fsm.InvalidateWorker); ok {
			n++
		}
	}
	return n
}

// forgotten is what Forget heard, safe to read while the lifecycle runs.
type forgotten struct {
	mu  sync.Mutex
	ids []string
}

func (f *forgotten) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.ids)
}

// start runs a lifecycle over a registry holding the flag workers, until the test ends.
func start(t *testing.T, c *memCluster, grace time.Duration, flags ...routing.WorkerSpec) (*Lifecycle, *routing.Registry, *forgotten) {
	t.Helper()
	return startWith(t, c, Config{Grace: grace}, flags...)
}

// startWith is start with cfg's Grace and OwnHealthy.
func startWith(t *testing.T, c *memCluster, cfg Config, flags ...routing.WorkerSpec) (*Lifecycle, *routing.Registry, *forgotten) {
	t.Helper()
	reg, err := routing.NewRegistry(flags)
	if err != nil {
		t.Fatal(err)
	}
	forgot := &forgotten{}
	l, err := New(Config{Registry: reg, Cluster: c, Grace: cfg.Grace, OwnHealthy: cfg.OwnHealthy, Forget: func(s routing.WorkerSpec) {
		forgot.mu.Lock()
		forgot.ids = append(forgot.ids, s.ID)
		forgot.mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { l.Run(ctx) })
	for _, d := range c.duties {
		wg.Go(func() { d(ctx) })
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	return l, reg, forgot
}

func spec(id, url string) routing.WorkerSpec { return routing.WorkerSpec{ID: id, URL: url} }

func TestRegistryFollowsTheClusterRegistry(t *testing.T) {
	c := newMemCluster()
	l, reg, forgot := start(t, c, 0)
	ctx := context.Background()
	if _, err := l.Add(ctx, spec("w1", "http://127.0.0.1:1")); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 5*time.Second, "w1 in the routing registry", func() bool { _, ok := reg.Lookup("w1"); return ok })

	if _, err := c.Apply(ctx, &fsm.Bind{Session: "s", Worker: "w1"}); err != nil {
		t.Fatal(err)
	}
	if n, err := l.Drain(ctx, "w1"); err != nil || n != 1 {
		t.Fatalf("drain: %d %v, want 1 binding dropped", n, err)
	}
	poll.Holds(t, 5*time.Second, "w1 drained", func() bool {
		for _, st := range reg.List() {
			if st.Spec.ID == "w1" {
				return st.Drained
			}
		}
		return false
	})

	// Another endpoint under the same id is another cache: its bindings go (the leader
	// proposes it), and the registry holds the new URL.
	if _, err := l.Add(ctx, spec("w1", "http://127.0.0.1:2")); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 5*time.Second, "w1 at its new URL", func() bool { s, _ := reg.Lookup("w1"); return s.URL == "http://127.0.0.1:2" })
	if c.invalidations() != 1 {
		t.Fatalf("%d InvalidateWorker proposals after the URL change, want 1", c.invalidations())
	}

	if _, err := l.Remove(ctx, "w1"); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 5*time.Second, "w1 gone", func() bool { _, ok := reg.Lookup("w1"); return !ok })
	poll.Holds(t, 5*time.Second, "w1 forgotten", func() bool { return forgot.count() >= 2 }) // the URL change, then the removal
}

func TestASpecChangeOnTheSameEndpointAppliesAndKeepsTheSessions(t *testing.T) {
	c := newMemCluster()
	l, reg, _ := start(t, c, 0)
	ctx := context.Background()
	if _, err := l.Add(ctx, spec("w1", "http://127.0.0.1:1")); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 5*time.Second, "w1 in the routing registry", func() bool { _, ok := reg.Lookup("w1"); return ok })
	if _, err := c.Apply(ctx, &fsm.Bind{Session: "s", Worker: "w1"}); err != nil {
		t.Fatal(err)
	}
	changed := spec("w1", "http://127.0.0.1:1")
	changed.Models, changed.DPSize = []string{"llama-70b"}, 2
	if _, err := l.Add(ctx, changed); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 5*time.Second, "w1 serving llama-70b on 2 ranks", func() bool {
		s, _ := reg.Lookup("w1")
		return slices.Equal(s.Models, []string{"llama-70b"}) && s.DPSize == 2 && len(reg.Routable()) == 2
	})
	if c.invalidations() != 0 {
		t.Fatalf("%d InvalidateWorker proposals after a spec change on the same URL, want 0", c.invalidations())
	}
}

func TestANotReadyMarkTakesTheWorkerOutOfRotationAndKeepsItsBindings(t *testing.T) {
	c := newMemCluster()
	_, reg, _ := start(t, c, 0)
	ctx := context.Background()
	routable := func() bool {
		for _, tg := range reg.Routable() {
			if tg.Worker.ID == "w1" {
				return true
			}
		}
		return false
	}
	bindings := func() int {
		n := 0
		c.f.Range(func(b fsm.Binding) bool {
			if b.Worker == "w1" {
				n++
			}
			return true
		})
		return n
	}
	for i, step := range []struct {
		name  string
		owned Owned
		want  bool // routable
	}{
		{name: "added", owned: Owned{Source: "discovery:x"}, want: true},
		{name: "marked not ready", owned: Owned{Source: "discovery:x", NotReady: true}, want: false},
		{name: "ready again", owned: Owned{Source: "discovery:x"}, want: true},
	} {
		raw, err := EncodeOwned(spec("w1", "http://127.0.0.1:1"), step.owned)
		if err != nil {
			t.Fatal(err)
		}
		if OwnerOf(raw) != step.owned {
			t.Fatalf("%s: stored spec says %+v, want %+v", step.name, OwnerOf(raw), step.owned)
		}
		if _, err := c.Apply(ctx, &fsm.AddWorker{ID: "w1", Spec: raw}); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			if _, err := c.Apply(ctx, &fsm.Bind{Session: "s", Worker: "w1"}); err != nil {
				t.Fatal(err)
			}
		}
		poll.Holds(t, 5*time.Second, fmt.Sprintf("%s: w1 routable %v, not ready %v", step.name, step.want, !step.want), func() bool {
			return routable() == step.want && reg.NotReady("w1") == !step.want
		})
		if n := bindings(); n != 1 || c.invalidations() != 0 {
			t.Fatalf("%s: %d bindings of w1 and %d invalidations, want the binding kept", step.name, n, c.invalidations())
		}
	}
}

func TestFlagWorkersDrainThroughTheClusterAndLeaveOnRemove(t *testing.T) {
	c := newMemCluster()
	l, reg, _ := start(t, c, 0, spec("flagged", "http://127.0.0.1:3"))
	ctx := context.Background()
	if l.InCluster("flagged") {
		t.Fatal("a flag worker is in the cluster registry before any order")
	}
	if _, err := l.Drain(ctx, "flagged"); err != nil {
		t.Fatal(err)
	}
	if !l.InCluster("flagged") {
		t.Fatal("a drained flag worker was not registered in the cluster first")
	}
	if _, err := l.Remove(ctx, "nobody"); !errors.Is(err, ErrUnknown) {
		t.Fatalf("remove of an unknown worker: %v, want ErrUnknown", err)
	}
	if _, err := l.Drain(ctx, "nobody"); !errors.Is(err, ErrUnknown) {
		t.Fatalf("drain of an unknown worker: %v, want ErrUnknown", err)
	}
	c2 := newMemCluster()
	l2, reg2, _ := start(t, c2, 0, spec("flagged", "http://127.0.0.1:3"))
	if _, err := l2.Remove(ctx, "flagged"); err != nil {
		t.Fatal(err)
	}
	if _, ok := reg2.Lookup("flagged"); ok {
		t.Fatal("a removed flag worker is still routable")
	}
	if _, ok := reg.Lookup("flagged"); !ok {
		t.Fatal("a drained flag worker left the registry")
	}
}

func TestBadSpecsAreRefusedAndChangeNothing(t *testing.T) {
	c := newMemCluster()
	l, reg, _ := start(t, c, 0)
	for _, s := range []routing.WorkerSpec{{ID: "", URL: "http://127.0.0.1:1"}, {ID: "w", URL: "not a url"}, {ID: "w", URL: "ftp://x"}} {
		if _, err := l.Add(context.Background(), s); !errors.Is(err, ErrInvalid) {
			t.Errorf("Add(%+v): %v, want ErrInvalid", s, err)
		}
	}
	if len(c.Workers()) != 0 || len(reg.List()) != 0 {
		t.Fatalf("bad specs changed state: cluster %v, registry %v", c.Workers(), reg.List())
	}
	if _, err := DecodeSpec("w", []byte("{")); err == nil {
		t.Fatal("a truncated spec decoded")
	}
}

func TestUnhealthyWorkerPastTheGraceLosesItsBindingsOncePerSpell(t *testing.T) {
	c := newMemCluster()
	const grace = 200 * time.Millisecond
	_, reg, _ := start(t, c, grace, spec("w1", "http://127.0.0.1:1"), spec("w2", "http://127.0.0.1:2"))
	for i := range 4 {
		if _, err := c.Apply(context.Background(), &fsm.Bind{Session: fmt.Sprint("s", i), Worker: fmt.Sprint("w", 1+i%2)}); err != nil {
			t.Fatal(err)
		}
	}
	reg.SetHealthy("w1", false, "test")
	poll.Holds(t, 5*time.Second, "w1's bindings invalidated", func() bool { return c.invalidations() == 1 })
	if c.f.Len() != 2 {
		t.Fatalf("%d bindings left, want w2's 2", c.f.Len())
	}
	// Still unhealthy: no second proposal in this spell. (Waiting several grace periods is
	// the assertion here, not a stand-in for a condition.)
	time.Sleep(3 * grace)
	if n := c.invalidations(); n != 1 {
		t.Fatalf("%d proposals in one unhealthy spell, want 1", n)
	}
	// A new spell after recovery invalidates again.
	reg.SetHealthy("w1", true, "")
	time.Sleep(2 * grace)
	reg.SetHealthy("w1", false, "again")
	poll.Holds(t, 5*time.Second, "a second spell's invalidation", func() bool { return c.invalidations() == 2 })
}

func TestGraceActsOnTheLeadersOwnProbesNotOnWhatOthersSay(t *testing.T) {
	c := newMemCluster()
	const grace = 200 * time.Millisecond
	var ownDown sync.Map // worker id -> true while the leader's own probes hold it down
	own := func(id string) bool { _, down := ownDown.Load(id); return !down }
	_, reg, _ := startWith(t, c, Config{Grace: grace, OwnHealthy: own}, spec("w1", "http://127.0.0.1:1"), spec("w2", "http://127.0.0.1:2"))
	for i := range 4 {
		if _, err := c.Apply(context.Background(), &fsm.Bind{Session: fmt.Sprint("s", i), Worker: fmt.Sprint("w", 1+i%2)}); err != nil {
			t.Fatal(err)
		}
	}
	// w1 is out of rotation on gossip's word (the merged view), yet the leader's own probes
	// pass; w2 is down by the leader's own probes, though the merged view still routes to it.
	reg.SetHealthy("w1", false, "two other replicas say so")
	ownDown.Store("w2", true)
	poll.Holds(t, 5*time.Second, "w2's bindings invalidated", func() bool { return c.invalidations() == 1 })
	// Several graces more are the assertion here, not a stand-in for a condition.
	time.Sleep(3 * grace)
	if n := c.invalidations(); n != 1 {
		t.Fatalf("%d invalidations, want only w2's: w1 was down on others' word alone", n)
	}
	if c.f.Len() != 2 {
		t.Fatalf("%d bindings left, want w1's 2", c.f.Len())
	}
}

func TestOnlyTheLeaderProposesAURLChangeInvalidation(t *testing.T) {
	c := newMemCluster()
	c.leader = false
	l, reg, _ := start(t, c, 0)
	ctx := context.Background()
	if _, err := l.Add(ctx, spec("w1", "http://127.0.0.1:1")); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 5*time.Second, "w1 routable", func() bool { _, ok := reg.Lookup("w1"); return ok })
	if _, err := l.Add(ctx, spec("w1", "http://127.0.0.1:2")); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 5*time.Second, "w1 at its new URL", func() bool { s, _ := reg.Lookup("w1"); return s.URL == "http://127.0.0.1:2" })
	if n := c.invalidations(); n != 0 {
		t.Fatalf("a follower proposed %d invalidations", n)
	}
}
