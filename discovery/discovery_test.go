package discovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

// memCluster is the real state machine applied in process: what a one-replica cluster's
// leader does, without Raft underneath. It records each command it applied.
type memCluster struct {
	mu      sync.Mutex
	f       *fsm.FSM
	index   uint64
	applied []string
}

func newMemCluster() *memCluster { return &memCluster{f: fsm.New(fsm.Options{})} }

func (c *memCluster) Workers() []fsm.Worker                       { return c.f.Workers() }
func (c *memCluster) AddDuty(_ string, run func(context.Context)) {}

func (c *memCluster) Apply(_ context.Context, cmd fsm.Command) (*fsm.Result, error) {
	b, err := fsm.Encode(cmd)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.index++
	idx := c.index
	switch v := cmd.(type) {
	case *fsm.AddWorker:
		if workers.OwnerOf(v.Spec).Gone {
			c.applied = append(c.applied, "mark "+v.ID)
			break
		}
		if workers.OwnerOf(v.Spec).NotReady {
			c.applied = append(c.applied, "not-ready "+v.ID)
			break
		}
		c.applied = append(c.applied, "add "+v.ID)
	case *fsm.DrainWorker:
		c.applied = append(c.applied, "drain "+v.ID)
	case *fsm.RemoveWorker:
		c.applied = append(c.applied, "remove "+v.ID)
	}
	c.mu.Unlock()
	res := c.f.Apply(&raft.Log{Type: raft.LogCommand, Index: idx, Data: b}).(*fsm.Result)
	return res, res.Err
}

// took returns the commands applied since the last call.
func (c *memCluster) took() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.applied
	c.applied = nil
	return out
}

// fakeSource answers what the test set (or its error).
type fakeSource struct {
	ids []string
	err error
}

func (s *fakeSource) Name() string { return "fake" }
func (s *fakeSource) Kind() string { return "fake" }
func (s *fakeSource) Lookup(context.Context) ([]routing.WorkerSpec, error) {
	if s.err != nil {
		return nil, s.err
	}
	out := []routing.WorkerSpec{}
	for _, id := range s.ids {
		out = append(out, routing.WorkerSpec{ID: id, URL: "http://127.0.0.1:1/" + id, DPSize: 1})
	}
	return out, nil
}

// podsSource is a fakeSource that also sees workers there but not ready, as the Kubernetes
// source does.
type podsSource struct {
	fakeSource
	notReady []string
}

func (s *podsSource) LookupReadiness(ctx context.Context) ([]routing.WorkerSpec, []string, error) {
	specs, err := s.Lookup(ctx)
	return specs, slices.Clone(s.notReady), err
}

func testTerm(t *testing.T, c *memCluster, static ...string) (*term, *metrics) {
	t.Helper()
	m, err := newMetrics(nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Cluster: c, Logger: slog.New(slog.DiscardHandler), Interval: time.Second, DrainFor: 10 * time.Second, SuspectFor: 30 * time.Second,
		Static: func(id string) bool {
			for _, s := range static {
				if s == id {
					return true
				}
			}
			return false
		}}
	return newTerm(cfg, m), m
}

// step is one look: what the source says (or fails with), how far the clock moved, and the
// commands the look must propose, in order.
type step struct {
	ids     []string
	err     error
	advance time.Duration
	want    []string
	// notReady are the ids the source sees but not ready (a podsSource); newTerm makes the
	// look the first of a new leader's term.
	notReady []string
	newTerm  bool
}

func TestAWorkersLifeThroughLooks(t *testing.T) {
	fail := errors.New("source down")
	cases := []struct {
		name  string
		steps []step
	}{
		{"present is added once, gone is drained once, then removed after the drain period", []step{
			{ids: []string{"a", "b", "c"}, want: []string{"add a", "add b", "add c"}},
			{ids: []string{"a", "b", "c"}},
			{ids: []string{"a", "b"}, want: []string{"mark c", "drain c"}},
			{ids: []string{"a", "b"}, advance: 5 * time.Second},
			{ids: []string{"a", "b"}, advance: 6 * time.Second, want: []string{"remove c"}},
			{ids: []string{"a", "b"}, advance: time.Minute},
		}},
		{"a drained worker that comes back is added again, not removed", []step{
			{ids: []string{"a", "b", "c"}, want: []string{"add a", "add b", "add c"}},
			{ids: []string{"a", "b"}, want: []string{"mark c", "drain c"}},
			{ids: []string{"a", "b", "c"}, advance: time.Second, want: []string{"add c"}},
			{ids: []string{"a", "b", "c"}, advance: time.Minute},
		}},
		{"a failed look keeps the last set and drains nothing", []step{
			{ids: []string{"a", "b", "c"}, want: []string{"add a", "add b", "add c"}},
			{err: fail, advance: time.Minute},
			{err: fail, advance: time.Hour},
			{ids: []string{"a", "b", "c"}},
		}},
		{"a failed look keeps a drain going to its removal", []step{
			{ids: []string{"a", "b", "c"}, want: []string{"add a", "add b", "add c"}},
			{ids: []string{"a", "b"}, want: []string{"mark c", "drain c"}},
			{err: fail, advance: time.Minute, want: []string{"remove c"}},
		}},
		{"a drop of more than half is held for the suspect period, then acted on", []step{
			{ids: []string{"a", "b", "c", "d"}, want: []string{"add a", "add b", "add c", "add d"}},
			{ids: []string{"a"}},
			{ids: []string{"a"}, advance: 20 * time.Second},
			{ids: []string{"a"}, advance: 11 * time.Second, want: []string{"mark b", "drain b", "mark c", "drain c", "mark d", "drain d"}},
		}},
		{"a suspect drop that recovers within the period drains nothing", []step{
			{ids: []string{"a", "b", "c", "d"}, want: []string{"add a", "add b", "add c", "add d"}},
			{ids: []string{}},
			{ids: []string{"a", "b", "c", "d"}, advance: 20 * time.Second},
			{ids: []string{}, advance: 20 * time.Second},
			{ids: []string{}, advance: 20 * time.Second},
			{ids: []string{}, advance: 11 * time.Second, want: []string{"mark a", "drain a", "mark b", "drain b", "mark c", "drain c", "mark d", "drain d"}},
		}},
		{"half at once is not suspect", []step{
			{ids: []string{"a", "b", "c", "d"}, want: []string{"add a", "add b", "add c", "add d"}},
			{ids: []string{"a", "b"}, want: []string{"mark c", "drain c", "mark d", "drain d"}},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newMemCluster()
			tm, _ := testTerm(t, c)
			src := &fakeSource{}
			now := time.Unix(1000, 0)
			for i, st := range tc.steps {
				now = now.Add(st.advance)
				src.ids, src.err = st.ids, st.err
				tm.lookAt(context.Background(), src, now)
				if got := c.took(); fmt.Sprint(sorted(got)) != fmt.Sprint(sorted(st.want)) {
					t.Fatalf("step %d: proposed %v, want %v", i, got, st.want)
				}
			}
		})
	}
}

func TestANewTermResumesFromTheRegistry(t *testing.T) {
	c := newMemCluster()
	src := &fakeSource{ids: []string{"a", "b", "c"}}
	first, _ := testTerm(t, c)
	now := time.Unix(1000, 0)
	first.lookAt(context.Background(), src, now)
	src.ids = []string{"a", "b"}
	first.lookAt(context.Background(), src, now)
	if got := c.took(); len(got) != 5 {
		t.Fatalf("first term proposed %v", got)
	}
	// The leader dies; the next one knows only the registry.
	next, _ := testTerm(t, c)
	next.lookAt(context.Background(), src, now)
	if got := c.took(); len(got) != 0 {
		t.Fatalf("the new term proposed %v at once, want nothing: no worker added twice, none drained twice", got)
	}
	next.lookAt(context.Background(), src, now.Add(11*time.Second))
	if got := c.took(); fmt.Sprint(got) != "[remove c]" {
		t.Fatalf("the new term proposed %v after the drain period, want [remove c]", got)
	}
}

func TestAFailedFirstLookLeavesTheSourcesWorkersAlone(t *testing.T) {
	c := newMemCluster()
	src := &fakeSource{ids: []string{"a", "b"}}
	first, _ := testTerm(t, c)
	first.lookAt(context.Background(), src, time.Unix(1000, 0))
	c.took()
	next, m := testTerm(t, c)
	src.err = errors.New("DNS timeout")
	next.lookAt(context.Background(), src, time.Unix(5000, 0))
	if got := c.took(); len(got) != 0 {
		t.Fatalf("a failed look proposed %v", got)
	}
	if n := testutil.ToFloat64(m.errors.WithLabelValues("fake")); n != 1 {
		t.Fatalf("kvrouter_discovery_errors_total{source=fake} = %v, want 1", n)
	}
	if len(c.Workers()) != 2 {
		t.Fatalf("registry holds %d workers, want 2", len(c.Workers()))
	}
}

func TestWorkersDiscoveryDoesNotOwnAreLeftAlone(t *testing.T) {
	c := newMemCluster()
	raw, err := workers.EncodeSpec(routing.WorkerSpec{ID: "admin", URL: "http://127.0.0.1:2"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Apply(context.Background(), &fsm.AddWorker{ID: "admin", Spec: raw}); err != nil {
		t.Fatal(err)
	}
	c.took()
	tm, _ := testTerm(t, c, "flag")
	src := &fakeSource{ids: []string{"admin", "flag", "mine"}}
	now := time.Unix(1000, 0)
	tm.lookAt(context.Background(), src, now)
	if got := c.took(); fmt.Sprint(got) != "[add mine]" {
		t.Fatalf("proposed %v, want [add mine]: ids from the admin API or flags are not taken over", got)
	}
	src.ids = []string{"mine"}
	tm.lookAt(context.Background(), src, now.Add(time.Hour))
	if got := c.took(); len(got) != 0 {
		t.Fatalf("proposed %v when the source dropped workers it does not own", got)
	}
	if _, ok := c.f.Worker("admin"); !ok {
		t.Fatal("the admin API's worker is gone")
	}
}

func sorted(s []string) []string {
	out := slices.Clone(s)
	slices.Sort(out)
	return out
}

// bigSource offers one worker whose spec is over the registry's limit, beside a good one.
type bigSource struct{ fakeSource }

func (s *bigSource) Lookup(ctx context.Context) ([]routing.WorkerSpec, error) {
	specs, _ := s.fakeSource.Lookup(ctx)
	big := routing.WorkerSpec{ID: "big", URL: "http://127.0.0.1:1", DPSize: 1}
	for range fsm.MaxSpecLen / 8 {
		big.LoRAs = append(big.LoRAs, "adapter")
	}
	return append(specs, big), nil
}

func TestASpecTheRegistryRefusesDoesNotHoldUpTheRest(t *testing.T) {
	c := newMemCluster()
	tm, _ := testTerm(t, c)
	// Ids after "big": a look that stopped at the refused spec would add none of them.
	src := &bigSource{fakeSource{ids: []string{"x", "y"}}}
	tm.lookAt(context.Background(), src, time.Unix(1000, 0))
	if got := c.took(); fmt.Sprint(got) != "[add x add y]" {
		t.Fatalf("proposed %v, want [add x add y]", got)
	}
}

func TestAnOperatorsDrainStandsWhileTheSourceListsTheWorker(t *testing.T) {
	c := newMemCluster()
	tm, _ := testTerm(t, c)
	src := &fakeSource{ids: []string{"a", "b", "c"}}
	now := time.Unix(1000, 0)
	tm.lookAt(context.Background(), src, now)
	c.took()
	// ctl workers drain c
	if _, err := c.Apply(context.Background(), &fsm.DrainWorker{ID: "c"}); err != nil {
		t.Fatal(err)
	}
	c.took()
	tm.lookAt(context.Background(), src, now.Add(time.Hour))
	if got := c.took(); len(got) != 0 {
		t.Fatalf("proposed %v: the operator's drain was undone", got)
	}
	src.ids = []string{"a", "b"}
	tm.lookAt(context.Background(), src, now.Add(time.Hour))
	tm.lookAt(context.Background(), src, now.Add(2*time.Hour))
	if got := c.took(); fmt.Sprint(got) != "[remove c]" {
		t.Fatalf("proposed %v once the source dropped the drained worker, want [remove c]", got)
	}
}

func TestALeaderLostBetweenTheMarkAndTheDrainLeavesNothingHalfDone(t *testing.T) {
	for _, back := range []bool{false, true} {
		t.Run(fmt.Sprintf("back=%v", back), func(t *testing.T) {
			c := newMemCluster()
			first, _ := testTerm(t, c)
			src := &fakeSource{ids: []string{"a", "b", "c"}}
			now := time.Unix(1000, 0)
			first.lookAt(context.Background(), src, now)
			c.took()
			// The mark went through; the leader died before the drain.
			raw, err := workers.EncodeOwned(routing.WorkerSpec{ID: "c", URL: "http://127.0.0.1:1/c", DPSize: 1}, workers.Owned{Source: Owner(src), Gone: true})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c.Apply(context.Background(), &fsm.AddWorker{ID: "c", Spec: raw}); err != nil {
				t.Fatal(err)
			}
			c.took()
			next, _ := testTerm(t, c)
			want := "[drain c]"
			if back {
				want = "[add c]"
			} else {
				src.ids = []string{"a", "b"}
			}
			next.lookAt(context.Background(), src, now)
			if got := c.took(); fmt.Sprint(got) != want {
				t.Fatalf("the next term proposed %v, want %s", got, want)
			}
		})
	}
}

func TestANotReadyWorkerKeepsItsBindingsForTheGraceThenDrainsAsAGoneOne(t *testing.T) {
	const grace = 20 * time.Second // drain 10 s, suspect 30 s (testTerm)
	abc := []string{"a", "b", "c"}
	added := []string{"add a", "add b", "add c"}
	cases := []struct {
		name  string
		grace time.Duration
		steps []step
		kept  bool // the binding to c made after the first step is there at the end
	}{
		{name: "ready again within the grace: routable again, its binding kept", grace: grace, kept: true, steps: []step{
			{ids: abc, want: added},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, want: []string{"not-ready c"}},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, advance: 19 * time.Second},
			{ids: abc, advance: 500 * time.Millisecond, want: []string{"add c"}},
			{ids: abc, advance: time.Hour},
		}},
		{name: "not ready past the grace: drained as a gone worker, then removed", grace: grace, steps: []step{
			{ids: abc, want: added},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, want: []string{"not-ready c"}},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, advance: 19 * time.Second},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, advance: time.Second, want: []string{"mark c", "drain c"}},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, advance: 5 * time.Second},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, advance: 5 * time.Second, want: []string{"remove c"}},
		}},
		{name: "ready after its drain: the same worker back, its bindings gone", grace: grace, steps: []step{
			{ids: abc, want: added},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, want: []string{"not-ready c"}},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, advance: grace, want: []string{"mark c", "drain c"}},
			{ids: abc, advance: time.Second, want: []string{"add c"}},
		}},
		{name: "a failed look drains no worker for being not ready", grace: grace, kept: true, steps: []step{
			{ids: abc, want: added},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, want: []string{"not-ready c"}},
			{err: errors.New("API server away"), advance: time.Hour},
			{ids: abc, want: []string{"add c"}},
		}},
		{name: "a grace of 0 drains at once, as a gone worker", steps: []step{
			{ids: abc, want: added},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, want: []string{"mark c", "drain c"}},
		}},
		{name: "terminating or deleted while not ready: drained at once", grace: grace, steps: []step{
			{ids: abc, want: added},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, want: []string{"not-ready c"}},
			{ids: []string{"a", "b"}, advance: time.Second, want: []string{"mark c", "drain c"}},
		}},
		{name: "a worker never ready is not added until it is", grace: grace, kept: true, steps: []step{
			{ids: []string{"a", "b", "c"}, notReady: []string{"d"}, want: added},
			{ids: []string{"a", "b", "c"}, notReady: []string{"d"}, advance: time.Hour},
			{ids: []string{"a", "b", "c", "d"}, want: []string{"add d"}},
		}},
		{name: "a new leader resumes from the mark and starts the grace afresh", grace: grace, steps: []step{
			{ids: abc, want: added},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, want: []string{"not-ready c"}},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, advance: 15 * time.Second, newTerm: true},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, advance: 19 * time.Second},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, advance: time.Second, want: []string{"mark c", "drain c"}},
		}},
		{name: "a new leader clears the mark of a worker ready again", grace: grace, kept: true, steps: []step{
			{ids: abc, want: added},
			{ids: []string{"a", "b"}, notReady: []string{"c"}, want: []string{"not-ready c"}},
			{ids: abc, advance: time.Second, newTerm: true, want: []string{"add c"}},
		}},
		{name: "more than half not ready at once is held as suspect, then acted on as the source says", grace: grace, steps: []step{
			{ids: []string{"a", "b", "c", "d"}, want: []string{"add a", "add b", "add c", "add d"}},
			{ids: []string{"a"}, notReady: []string{"b", "c", "d"}},
			{ids: []string{"a"}, notReady: []string{"b", "c", "d"}, advance: 29 * time.Second},
			{ids: []string{"a"}, notReady: []string{"b", "c", "d"}, advance: time.Second, want: []string{"mark b", "drain b", "mark c", "drain c", "mark d", "drain d"}},
		}},
		{name: "more than half reaching the grace at once is held as suspect", grace: grace, kept: true, steps: []step{
			{ids: []string{"a", "b", "c", "d", "e"}, want: []string{"add a", "add b", "add c", "add d", "add e"}},
			{ids: []string{"a", "b", "d", "e"}, notReady: []string{"c"}, want: []string{"not-ready c"}},
			{ids: []string{"a", "b", "c"}, notReady: []string{"d", "e"}, want: []string{"add c", "not-ready d", "not-ready e"}},
			{ids: []string{"a"}, notReady: []string{"b", "c", "d", "e"}, advance: time.Second, want: []string{"not-ready b", "not-ready c"}},
			{ids: []string{"a"}, notReady: []string{"b", "c", "d", "e"}, advance: grace},
			{ids: []string{"a"}, notReady: []string{"b", "c", "d", "e"}, advance: 29 * time.Second},
			{ids: []string{"a", "c"}, notReady: []string{"b", "d", "e"}, advance: time.Second, want: []string{"add c", "mark b", "drain b", "mark d", "drain d", "mark e", "drain e"}},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := newMemCluster()
			tm, _ := testTerm(t, c)
			tm.cfg.NotReadyGrace = tc.grace
			src := &podsSource{}
			now := time.Unix(1000, 0)
			for i, st := range tc.steps {
				now = now.Add(st.advance)
				if st.newTerm {
					tm, _ = testTerm(t, c)
					tm.cfg.NotReadyGrace = tc.grace
				}
				src.ids, src.err, src.notReady = st.ids, st.err, st.notReady
				tm.lookAt(context.Background(), src, now)
				if got := c.took(); fmt.Sprint(sorted(got)) != fmt.Sprint(sorted(st.want)) {
					t.Fatalf("step %d: proposed %v, want %v", i, got, st.want)
				}
				if i == 0 {
					if _, err := c.Apply(context.Background(), &fsm.Bind{Session: "s", Worker: "c"}); err != nil {
						t.Fatal(err)
					}
					c.took()
				}
			}
			if _, ok := c.f.Get("s"); ok != tc.kept {
				t.Fatalf("the binding to c is there: %v, want %v", ok, tc.kept)
			}
		})
	}
}

func TestDutyStatusTellsFailingLooksAndHeldDrainsWhileTheTermRuns(t *testing.T) {
	c := newMemCluster()
	tm, _ := testTerm(t, c)
	src := &fakeSource{ids: []string{"a", "b", "c"}}
	d := newDuty([]Source{src})
	tm.duty = d
	if running, _ := d.Status(); running {
		t.Fatal("running before the term began")
	}
	d.begin()
	start := time.Unix(1000, 0)
	tm.lookAt(context.Background(), src, start)
	src.err = errors.New("source down")
	tm.lookAt(context.Background(), src, start.Add(time.Second))
	tm.lookAt(context.Background(), src, start.Add(2*time.Second))
	_, got := d.Status()
	want := []SourceStatus{{Source: "fake", LastGood: start, FailingSince: start.Add(time.Second), Failures: 2, LastError: "source down"}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after two failed looks: %+v, want %+v", got, want)
	}
	src.err, src.ids = nil, []string{"a"}
	tm.lookAt(context.Background(), src, start.Add(3*time.Second))
	_, got = d.Status()
	want = []SourceStatus{{Source: "fake", LastGood: start.Add(3 * time.Second), SuspectDrains: 2}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after a good look dropping two of three: %+v, want %+v", got, want)
	}
	d.end()
	if running, got := d.Status(); running || got != nil {
		t.Fatalf("after the term: %v %+v, want nothing", running, got)
	}
}
