package fsm

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/hashicorp/raft"
)

func TestBindAbsentOnlyRaceHasOneWinner(t *testing.T) {
	n := newNode(t)
	// Two replicas proposed a first bind of one session to different workers; the log
	// orders them and the second finds the first's binding.
	first := n.expect(&Bind{Session: "s", Worker: "w1", DPRank: 1, TTL: time.Minute}, Created)
	second := n.expect(&Bind{Session: "s", Worker: "w2"}, Exists)
	if !second.Found || second.Binding.Worker != "w1" || second.Binding.DPRank != 1 || second.Binding.Revision != first.Binding.Revision {
		t.Fatalf("loser got %+v, want the winner's binding %+v", second.Binding, first.Binding)
	}
	if first.Binding.Revision != 1 || first.Binding.TTL != time.Minute {
		t.Fatalf("created %+v: revision must be the log index 1 and ttl kept", first.Binding)
	}
	// A retried forward of the winner's own command changes nothing either.
	again := n.expect(&Bind{Session: "s", Worker: "w1", DPRank: 1}, Exists)
	if again.Binding.Revision != first.Binding.Revision || n.f.Len() != 1 {
		t.Fatalf("retry: %+v, len %d", again.Binding, n.f.Len())
	}
}

func TestBindCompareAndSet(t *testing.T) {
	n := newNode(t)
	b1 := n.expect(&Bind{Session: "s", Worker: "w1"}, Created).Binding
	// Absent session: a CAS conflicts without a binding.
	if r := n.expect(&Bind{Session: "other", Worker: "w1", ExpectRevision: 7}, Conflict); r.Found {
		t.Fatalf("conflict on an absent session reported %+v", r.Binding)
	}
	// Stale revision: conflict with the current binding.
	r := n.expect(&Bind{Session: "s", Worker: "w2", ExpectRevision: b1.Revision + 100}, Conflict)
	if !r.Found || r.Binding != b1 {
		t.Fatalf("stale CAS got %+v, want current %+v", r.Binding, b1)
	}
	// Matching revision: replaced, new revision is the log index.
	r = n.expect(&Bind{Session: "s", Worker: "w2", DPRank: 3, ExpectRevision: b1.Revision}, Created)
	if r.Binding.Worker != "w2" || r.Binding.DPRank != 3 || r.Binding.Revision != n.index {
		t.Fatalf("replaced binding %+v at index %d", r.Binding, n.index)
	}
	// Two racing CAS of the same revision: the second conflicts (no double replace).
	n.expect(&Bind{Session: "s", Worker: "w3", ExpectRevision: b1.Revision}, Conflict)
	if got, _ := n.f.Get("s"); got.Worker != "w2" || n.f.Len() != 1 {
		t.Fatalf("after racing CAS: %+v, len %d", got, n.f.Len())
	}
	last := n.changes[len(n.changes)-1]
	if last.Kind != Bound || last.Reason != Replaced || last.Previous != b1 || last.Binding.Worker != "w2" {
		t.Fatalf("replace change %+v", last)
	}
}

func TestBindLimitsAndDraining(t *testing.T) {
	n := newNode(t)
	n.expect(&Bind{Session: "a", Worker: "w1", MaxBindings: 2}, Created)
	n.expect(&Bind{Session: "b", Worker: "w1", MaxBindings: 2}, Created)
	n.expect(&Bind{Session: "c", Worker: "w1", MaxBindings: 2}, Full)
	// The cap only stops new sessions: an existing one still answers and can be replaced.
	n.expect(&Bind{Session: "a", Worker: "w1", MaxBindings: 2}, Exists)
	b, _ := n.f.Get("a")
	n.expect(&Bind{Session: "a", Worker: "w2", ExpectRevision: b.Revision, MaxBindings: 2}, Created)

	n.expect(&AddWorker{ID: "w9", Spec: []byte(`{}`)}, OK)
	n.expect(&DrainWorker{ID: "w9"}, OK)
	n.expect(&Bind{Session: "d", Worker: "w9"}, Rejected)
	// A bound session still learns its binding even when proposing a draining worker.
	if r := n.expect(&Bind{Session: "b", Worker: "w9"}, Exists); r.Binding.Worker != "w1" {
		t.Fatalf("exists reported %+v", r.Binding)
	}
	n.expect(&AddWorker{ID: "w9", Spec: []byte(`{}`)}, OK) // re-adding clears Draining
	n.expect(&Bind{Session: "d", Worker: "w9"}, Created)
	if n.f.Len() != 3 {
		t.Fatalf("len %d, want 3", n.f.Len())
	}
}

func TestUnbindGuards(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cmd    func(s string, rev uint64) Command
		reason Reason
	}{
		{"invalidate", func(s string, rev uint64) Command { return &Invalidate{Session: s, Revision: rev} }, Invalidated},
		{"expire", func(s string, rev uint64) Command { return &Expire{Session: s, Revision: rev} }, Expired},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t)
			b := n.expect(&Bind{Session: "s", Worker: "w"}, Created).Binding
			if r := n.expect(tc.cmd("missing", 1), NotFound); r.Found {
				t.Fatal("not found reported a binding")
			}
			if r := n.expect(tc.cmd("s", b.Revision+1), Conflict); r.Binding != b {
				t.Fatalf("conflict reported %+v", r.Binding)
			}
			r := n.expect(tc.cmd("s", b.Revision), Removed)
			removedAt := n.index
			if r.Binding != b || !r.Found {
				t.Fatalf("removed %+v", r.Binding)
			}
			if _, ok := n.f.Get("s"); ok || n.f.Len() != 0 {
				t.Fatal("binding still there")
			}
			n.expect(tc.cmd("s", b.Revision), NotFound) // a retry is harmless
			c := n.changes[len(n.changes)-1]
			if c.Kind != Unbound || c.Reason != tc.reason || c.Binding != b || c.Index != removedAt {
				t.Fatalf("change %+v", c)
			}
			// A rebind gets a higher revision than the removed one.
			if nb := n.expect(&Bind{Session: "s", Worker: "w"}, Created).Binding; nb.Revision <= b.Revision {
				t.Fatalf("rebind revision %d not above %d", nb.Revision, b.Revision)
			}
		})
	}
}

func TestWorkerCommandsRemoveBindings(t *testing.T) {
	for _, tc := range []struct {
		name       string
		cmd        Command
		status     Status
		reason     Reason
		inRegistry bool
		draining   bool
	}{
		{"invalidate worker", &InvalidateWorker{Worker: "w1"}, OK, WorkerInvalidated, true, false},
		{"drain", &DrainWorker{ID: "w1"}, OK, Drained, true, true},
		{"remove", &RemoveWorker{ID: "w1"}, OK, WorkerRemoved, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t)
			n.expect(&AddWorker{ID: "w1", Spec: []byte(`{"url":"http://a"}`)}, OK)
			for i := range 300 {
				n.expect(&Bind{Session: fmt.Sprintf("s%d", i), Worker: fmt.Sprintf("w%d", i%3), DPRank: uint32(i % 2)}, Created)
			}
			n.changes = nil
			r := n.expect(tc.cmd, tc.status)
			if r.Count != 100 || n.f.Len() != 200 {
				t.Fatalf("removed %d, left %d; want 100, 200", r.Count, n.f.Len())
			}
			n.f.Range(func(b Binding) bool {
				if b.Worker == "w1" {
					t.Fatalf("binding %+v of w1 left", b)
				}
				return true
			})
			// The registry's own change comes as one WorkersChanged, when the registry changed.
			unbound, registry := n.changes[:0:0], 0
			for _, c := range n.changes {
				if c.Kind == WorkersChanged {
					if c.Binding.Worker != "w1" || c.Index != n.index {
						t.Fatalf("registry change %+v", c)
					}
					registry++
					continue
				}
				unbound = append(unbound, c)
			}
			if want := map[bool]int{true: 1, false: 0}[tc.reason != WorkerInvalidated]; registry != want {
				t.Fatalf("%d registry changes, want %d", registry, want)
			}
			if len(unbound) != 100 {
				t.Fatalf("%d changes, want 100", len(unbound))
			}
			for _, c := range unbound {
				if c.Kind != Unbound || c.Reason != tc.reason || c.Binding.Worker != "w1" || c.Index != n.index {
					t.Fatalf("change %+v", c)
				}
			}
			w, ok := n.f.Worker("w1")
			if ok != tc.inRegistry || w.Draining != tc.draining {
				t.Fatalf("registry: %+v present=%v", w, ok)
			}
			// Other workers' sessions still resolve.
			if b, ok := n.f.Get("s0"); !ok || b.Worker != "w0" {
				t.Fatalf("s0: %+v %v", b, ok)
			}
		})
	}
}

func TestWorkerCommandsOnUnknownWorker(t *testing.T) {
	n := newNode(t)
	n.expect(&Bind{Session: "s", Worker: "flagged"}, Created)
	// A worker the registry never had (configured by flags): its bindings still go.
	if r := n.expect(&DrainWorker{ID: "flagged"}, NotFound); r.Count != 1 {
		t.Fatalf("drain count %d", r.Count)
	}
	n.expect(&RemoveWorker{ID: "flagged"}, NotFound)
	n.expect(&InvalidateWorker{Worker: "nobody"}, OK)
	if n.f.Len() != 0 {
		t.Fatal("binding survived")
	}
}

func TestRegistryAndMembers(t *testing.T) {
	n := newNode(t)
	if r := n.expect(&AddWorker{ID: "w2", Spec: []byte(`{"a":1}`)}, OK); r.Found {
		t.Fatal("new worker reported found")
	}
	n.expect(&AddWorker{ID: "w1"}, OK)
	if r := n.expect(&AddWorker{ID: "w2", Spec: []byte(`{"a":2}`)}, OK); !r.Found {
		t.Fatal("replace not reported found")
	}
	ws := n.f.Workers()
	if len(ws) != 2 || ws[0].ID != "w1" || ws[1].ID != "w2" || string(ws[1].Spec) != `{"a":2}` {
		t.Fatalf("workers %+v", ws)
	}
	ws[1].Spec[0] = 'X' // callers get copies
	if w, _ := n.f.Worker("w2"); string(w.Spec) != `{"a":2}` {
		t.Fatalf("registry changed through a returned slice: %q", w.Spec)
	}
	n.expect(&RemoveWorker{ID: "w2"}, OK)
	if _, ok := n.f.Worker("w2"); ok {
		t.Fatal("removed worker still there")
	}

	m := Member{ID: "r1", RaftAddr: "10.0.0.1:7000", PeerAddr: "10.0.0.1:7001"}
	n.expect(&SetMember{Member: m}, OK)
	n.expect(&SetMember{Member: Member{ID: "r0", RaftAddr: "x:1"}}, OK)
	if got, ok := n.f.Member("r1"); !ok || got != m {
		t.Fatalf("member %+v %v", got, ok)
	}
	if ms := n.f.Members(); len(ms) != 2 || ms[0].ID != "r0" {
		t.Fatalf("members %+v", ms)
	}
	n.expect(&RemoveMember{ID: "r1"}, OK)
	n.expect(&RemoveMember{ID: "r1"}, NotFound)
}

func TestCheckpointSetsRemainingOnMatchingRevisions(t *testing.T) {
	n := newNode(t)
	a := n.expect(&Bind{Session: "a", Worker: "w", TTL: time.Minute}, Created).Binding
	b := n.expect(&Bind{Session: "b", Worker: "w", TTL: time.Minute}, Created).Binding
	r := n.expect(&Checkpoint{Entries: []Remaining{
		{Session: "a", Revision: a.Revision, Remaining: 30 * time.Second},
		{Session: "b", Revision: b.Revision + 1, Remaining: 10 * time.Second}, // stale
		{Session: "gone", Revision: 1, Remaining: time.Second},
	}}, OK)
	if r.Count != 1 {
		t.Fatalf("count %d, want 1", r.Count)
	}
	if got, _ := n.f.Get("a"); got.Remaining != 30*time.Second || got.Revision != a.Revision {
		t.Fatalf("a: %+v", got)
	}
	if got, _ := n.f.Get("b"); got.Remaining != 0 {
		t.Fatalf("b checkpointed through a stale revision: %+v", got)
	}
	// A replacing bind starts over: never checkpointed.
	n.expect(&Bind{Session: "a", Worker: "w2", ExpectRevision: a.Revision}, Created)
	if got, _ := n.f.Get("a"); got.Remaining != 0 {
		t.Fatalf("replaced binding kept remaining %v", got.Remaining)
	}
}

// TestCheckpointAgesWhatItDoesNotList: a checkpoint lists only the bindings touched since the
// last one; its Aged takes the time since then off every other checkpointed binding, so a
// new leader re-arms an idle binding at what it really has left.
func TestCheckpointAgesWhatItDoesNotList(t *testing.T) {
	for _, tc := range []struct {
		name          string
		aged          time.Duration
		idle, touched time.Duration // remaining afterwards
		fresh         time.Duration // never checkpointed: stays 0 (its whole TTL)
	}{
		{"not aged (a log from before Aged)", 0, 40 * time.Second, 50 * time.Second, 0},
		{"aged by the interval", 30 * time.Second, 10 * time.Second, 50 * time.Second, 0},
		{"aged past what was left", time.Minute, time.Millisecond, 50 * time.Second, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t)
			idle := n.expect(&Bind{Session: "idle", Worker: "w", TTL: time.Minute}, Created).Binding
			touched := n.expect(&Bind{Session: "touched", Worker: "w", TTL: time.Minute}, Created).Binding
			n.expect(&Bind{Session: "fresh", Worker: "w", TTL: time.Minute}, Created)
			n.expect(&Checkpoint{Entries: []Remaining{
				{Session: "idle", Revision: idle.Revision, Remaining: 40 * time.Second},
				{Session: "touched", Revision: touched.Revision, Remaining: 40 * time.Second},
			}}, OK)
			n.expect(&Checkpoint{Aged: tc.aged, Entries: []Remaining{
				{Session: "touched", Revision: touched.Revision, Remaining: 50 * time.Second},
			}}, OK)
			for s, want := range map[string]time.Duration{"idle": tc.idle, "touched": tc.touched, "fresh": tc.fresh} {
				if got, _ := n.f.Get(s); got.Remaining != want {
					t.Errorf("%s: remaining %v, want %v", s, got.Remaining, want)
				}
			}
		})
	}
}

func TestApplyRejectsBadBodiesAlikeOnEveryReplica(t *testing.T) {
	long := strings.Repeat("x", MaxKeyLen+1)
	for _, tc := range []struct {
		name string
		data []byte
		want error
	}{
		{"empty entry", nil, ErrMalformed},
		{"truncated body", []byte{typeBind, 0x0a, 0x05, 'a'}, ErrMalformed},
		{"long session", mustMarshal(t, typeBind, &Bind{Session: long, Worker: "w"}), ErrInvalid},
		{"control byte", mustMarshal(t, typeInvalidate, &Invalidate{Session: "a\x01", Revision: 1}), ErrInvalid},
		{"zero revision", mustMarshal(t, typeExpire, &Expire{Session: "a", Revision: 0}), ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := newNode(t), newNode(t)
			ra := a.applyRaw(&raft.Log{Index: 1, Type: raft.LogCommand, Data: tc.data})
			rb := b.applyRaw(&raft.Log{Index: 1, Type: raft.LogCommand, Data: tc.data})
			if ra.Status != Invalid || !errors.Is(ra.Err, tc.want) {
				t.Fatalf("status %v err %v, want Invalid wrapping %v", ra.Status, ra.Err, tc.want)
			}
			if ra.Err.Error() != rb.Err.Error() {
				t.Fatalf("replicas disagree: %q vs %q", ra.Err, rb.Err)
			}
			if a.f.Len() != 0 || a.f.AppliedIndex() != 1 {
				t.Fatalf("len %d applied %d", a.f.Len(), a.f.AppliedIndex())
			}
		})
	}
}

// mustMarshal encodes cmd's body without validation, as a buggy or hostile proposer might.
func mustMarshal(t *testing.T, typ byte, cmd Command) []byte {
	t.Helper()
	b, err := marshalOpts.MarshalAppend([]byte{typ}, toProto(cmd))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestUnknownTypePanicsUnlessIgnorable(t *testing.T) {
	n := newNode(t)
	n.expect(&Bind{Session: "s", Worker: "w"}, Created)
	before := dumpOf(n.f)

	res := n.applyRaw(&raft.Log{Index: 2, Type: raft.LogCommand, Data: []byte{0x7e | flagIgnorable, 1, 2, 3}})
	if res.Status != Ignored || res.Err != nil {
		t.Fatalf("ignorable entry: %+v", res)
	}
	if n.f.AppliedIndex() != 2 {
		t.Fatalf("applied %d after a skipped entry", n.f.AppliedIndex())
	}
	before.Applied = 2
	requireEqual(t, dumpOf(n.f), before)

	func() {
		defer func() {
			r := recover()
			if r == nil || !strings.Contains(fmt.Sprint(r), "unknown command type 0x7e") {
				t.Fatalf("recovered %v, want a panic naming the type", r)
			}
		}()
		n.f.Apply(&raft.Log{Index: 3, Type: raft.LogCommand, Data: []byte{0x7e, 1, 2, 3}})
	}()
	// Decode (the leader's check) reports both as errors, never panics.
	for _, b := range [][]byte{{0x7e}, {0xfe}} {
		if _, err := Decode(b); !errors.Is(err, ErrUnknownType) {
			t.Fatalf("decode %x: %v", b, err)
		}
	}
}

func TestApplyBatchAnswersNilForNonCommands(t *testing.T) {
	n := newNode(t)
	var applied []uint64
	n.f = New(Options{OnApplied: func(i uint64) { applied = append(applied, i) }})
	logs := []*raft.Log{
		n.entry(&Bind{Session: "a", Worker: "w"}),
		{Index: 2, Type: raft.LogConfiguration, Data: []byte("conf")},
	}
	n.index = 2
	logs = append(logs, n.entry(&Bind{Session: "a", Worker: "w2"}))
	out := n.f.ApplyBatch(logs)
	if len(out) != 3 || out[1] != nil {
		t.Fatalf("responses %#v", out)
	}
	if r := out[0].(*Result); r.Status != Created {
		t.Fatalf("first %+v", r)
	}
	if r := out[2].(*Result); r.Status != Exists || r.Binding.Worker != "w" {
		t.Fatalf("third %+v", r)
	}
	if n.f.AppliedIndex() != 3 || !slices.Equal(applied, []uint64{3}) {
		t.Fatalf("applied %d, OnApplied %v", n.f.AppliedIndex(), applied)
	}
	if got := n.f.Apply(&raft.Log{Index: 4, Type: raft.LogConfiguration}); got != nil {
		t.Fatalf("Apply of a configuration entry returned %#v", got)
	}
	if n.f.AppliedIndex() != 4 {
		t.Fatalf("applied %d", n.f.AppliedIndex())
	}
}

func TestChangesSeeTheirEntryApplied(t *testing.T) {
	var f *FSM
	var seen []string
	f = New(Options{OnChange: func(c Change) {
		// The entry must already be visible: waiters woken here read it.
		b, ok := f.Get(c.Binding.Session)
		seen = append(seen, fmt.Sprintf("%v/%v idx=%d applied=%d visible=%v", c.Kind, c.Reason, c.Index, f.AppliedIndex(), ok && b == c.Binding))
	}})
	n := &node{t: t, f: f}
	n.expect(&Bind{Session: "s", Worker: "w"}, Created)
	n.expect(&Invalidate{Session: "s", Revision: 1}, Removed)
	want := []string{"bound/new idx=1 applied=1 visible=true", "unbound/invalidated idx=2 applied=2 visible=false"}
	if !slices.Equal(seen, want) {
		t.Fatalf("changes\n got %q\nwant %q", seen, want)
	}
}

func TestWorkerIDReuseKeepsFrozenSnapshotsRight(t *testing.T) {
	n := newNode(t)
	n.expect(&Bind{Session: "a", Worker: "old-worker"}, Created)
	snap, err := n.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Release()
	// Free the interned id of old-worker, then reuse it for another name.
	n.expect(&Invalidate{Session: "a", Revision: 1}, Removed)
	n.expect(&Bind{Session: "b", Worker: "new-worker"}, Created)
	if b, _ := n.f.Get("b"); b.Worker != "new-worker" {
		t.Fatalf("b: %+v", b)
	}
	r := New(Options{})
	if err := restore(r, persistSnap(t, snap)); err != nil {
		t.Fatal(err)
	}
	if b, ok := r.Get("a"); !ok || b.Worker != "old-worker" {
		t.Fatalf("snapshot resolved a to %+v %v", b, ok)
	}
	if _, ok := r.Get("b"); ok {
		t.Fatal("snapshot saw a later bind")
	}
}

func TestStoreMatchesAModel(t *testing.T) {
	// Many inserts and removals in few shards' worth of keys exercise growth, shrinking,
	// backward-shift deletion, arena compaction and copy-on-write clones.
	n := newNode(t)
	model := map[string]Binding{}
	for round := range 40 {
		for i := range 500 {
			s := fmt.Sprintf("key-%d-%d", i%97, (i*7+round)%13)
			if b, ok := model[s]; ok && (i+round)%3 != 0 {
				n.expect(&Invalidate{Session: s, Revision: b.Revision}, Removed)
				delete(model, s)
				continue
			}
			r := n.apply(&Bind{Session: s, Worker: fmt.Sprintf("w%d", i%5), DPRank: uint32(round)})
			if r.Status == Created {
				model[s] = r.Binding
			}
		}
		if round%7 == 0 {
			snap, _ := n.f.Snapshot()
			snap.Release()
		}
		if round%11 == 5 {
			r := n.apply(&InvalidateWorker{Worker: "w3"})
			for s, b := range model {
				if b.Worker == "w3" {
					delete(model, s)
				}
			}
			if r.Count == 0 && round > 0 {
				t.Fatalf("round %d: invalidate worker removed nothing", round)
			}
		}
		if n.f.Len() != len(model) {
			t.Fatalf("round %d: len %d, model %d", round, n.f.Len(), len(model))
		}
		for s, want := range model {
			if got, ok := n.f.Get(s); !ok || got != want {
				t.Fatalf("round %d: %s = %+v %v, want %+v", round, s, got, ok, want)
			}
		}
		count := 0
		n.f.Range(func(b Binding) bool {
			if model[b.Session] != b {
				t.Fatalf("range yielded %+v, model has %+v", b, model[b.Session])
			}
			count++
			return true
		})
		if count != len(model) {
			t.Fatalf("range yielded %d of %d", count, len(model))
		}
	}
}

func TestStatusStrings(t *testing.T) {
	for s := OK; s <= Ignored; s++ {
		if strings.HasPrefix(s.String(), "status(") {
			t.Fatalf("status %d has no name", s)
		}
	}
	for r := NewBinding; r <= Restored; r++ {
		if strings.HasPrefix(r.String(), "reason(") {
			t.Fatalf("reason %d has no name", r)
		}
	}
	if Status(0).String() != "status(0)" || Reset.String() != "reset" {
		t.Fatal("fallback names")
	}
}

func TestAliasCommands(t *testing.T) {
	tg := func(m string, w uint32) AliasTarget { return AliasTarget{Model: m, Weight: w} }
	many := make([]AliasTarget, MaxAliasTargets+1)
	for i := range many {
		many[i] = tg(fmt.Sprintf("m%d", i), 1)
	}
	// Refused by Encode (the leader's check) and by Apply alike, changing nothing.
	for _, tc := range []struct {
		name string
		cmd  Command
		want string
	}{
		{"empty name", &SetAlias{Alias: Alias{Targets: []AliasTarget{tg("a", 1)}}}, "model name is empty"},
		{"space in name", &SetAlias{Alias: Alias{Name: "ll ama", Targets: []AliasTarget{tg("a", 1)}}}, "space"},
		{"no targets", &SetAlias{Alias: Alias{Name: "llama"}}, "no targets"},
		{"too many targets", &SetAlias{Alias: Alias{Name: "llama", Targets: many}}, "over 16"},
		{"weight over 1000", &SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{tg("a", 1001)}}}, "weight 1001 over 1000"},
		{"all weights zero", &SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{tg("a", 0), tg("b", 0)}}}, "at least one must be positive"},
		{"target twice", &SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{tg("a", 1), tg("a", 2)}}}, "twice"},
		{"itself", &SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{tg("llama", 1)}}}, "names itself"},
		{"bad target", &SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{tg("a\x01", 1)}}}, "non-printable"},
		{"delete empty", &DeleteAlias{}, "model name is empty"},
		{"bind bad model", &Bind{Session: "s", Worker: "w", Model: "a b"}, "space"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Encode(tc.cmd); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("encode: %v, want ErrInvalid saying %q", err, tc.want)
			}
			n := newNode(t)
			n.expect(&SetAlias{Alias: Alias{Name: "keep", Targets: []AliasTarget{tg("k", 1)}}}, OK)
			before := dumpOf(n.f)
			body := toProto(tc.cmd)
			raw, err := marshalOpts.MarshalAppend([]byte{tc.cmd.kind() | flagIgnorable}, body)
			if err != nil {
				t.Fatal(err)
			}
			if res := n.applyRaw(&raft.Log{Index: 2, Type: raft.LogCommand, Data: raw}); res.Status != Invalid {
				t.Fatalf("apply: %+v, want Invalid", res)
			}
			before.Applied = 2
			requireEqual(t, dumpOf(n.f), before)
		})
	}

	// No alias of an alias, in either order; the state decides, the same on every replica.
	n := newNode(t)
	n.expect(&SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{tg("llama-v2", 90), tg("llama-v3", 10)}}}, OK)
	before := dumpOf(n.f)
	if res := n.expect(&SetAlias{Alias: Alias{Name: "meta", Targets: []AliasTarget{tg("llama", 1)}}}, Invalid); !strings.Contains(res.Err.Error(), "is an alias") {
		t.Fatalf("alias of an alias: %v", res.Err)
	}
	if res := n.expect(&SetAlias{Alias: Alias{Name: "llama-v2", Targets: []AliasTarget{tg("x", 1)}}}, Invalid); !strings.Contains(res.Err.Error(), "is a target of alias") {
		t.Fatalf("alias named as another's target: %v", res.Err)
	}
	before.Applied = n.index
	requireEqual(t, dumpOf(n.f), before)

	// Replace, read, delete.
	if res := n.expect(&SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{tg("llama-v2", 50), tg("llama-v3", 50)}}}, OK); !res.Found {
		t.Fatal("replacing an alias did not report it found")
	}
	if a, ok := n.f.Alias("llama"); !ok || a.Targets[0].Weight != 50 || a.Targets[1].Weight != 50 {
		t.Fatalf("alias after replace: %+v %v", a, ok)
	}
	n.expect(&DeleteAlias{Name: "llama"}, OK)
	n.expect(&DeleteAlias{Name: "llama"}, NotFound)
	if len(n.f.Aliases()) != 0 {
		t.Fatalf("aliases after delete: %+v", n.f.Aliases())
	}
}

func TestAliasCommandsAreSkippedByAnOlderRelease(t *testing.T) {
	// An older release knows types up to RemoveMember: what it does with an alias command
	// is what it does with any unknown type, so the command must carry the flag.
	for _, cmd := range []Command{
		&SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{{Model: "llama-v2", Weight: 1}}}},
		&DeleteAlias{Name: "llama"},
	} {
		b, err := Encode(cmd)
		if err != nil {
			t.Fatal(err)
		}
		if b[0]&flagIgnorable == 0 || b[0]&^flagIgnorable <= typeRemoveMember {
			t.Fatalf("%T encodes with type byte 0x%02x: an older replica would panic on it", cmd, b[0])
		}
	}
	// A Bind's model is a new field: an older release decodes the Bind without it.
	b, err := Encode(&Bind{Session: "s", Worker: "w", Model: "llama-v3"})
	if err != nil {
		t.Fatal(err)
	}
	if b[0] != typeBind {
		t.Fatalf("a Bind with a model has type byte 0x%02x", b[0])
	}
}

func TestBindingKeepsItsModel(t *testing.T) {
	n := newNode(t)
	b := n.expect(&Bind{Session: "s", Worker: "w1", Model: "llama-v3"}, Created).Binding
	if got, _ := n.f.Get("s"); got.Model != "llama-v3" || b.Model != "llama-v3" {
		t.Fatalf("binding %+v, result %+v: want model llama-v3", got, b)
	}
	// A compare-and-set rebind records the model it carries; the old one's reference goes.
	n.expect(&Bind{Session: "s", Worker: "w2", ExpectRevision: b.Revision, Model: "llama-v2"}, Created)
	if got, _ := n.f.Get("s"); got.Model != "llama-v2" || got.Worker != "w2" {
		t.Fatalf("rebound %+v", got)
	}
	if _, ok := n.f.models.lookup("llama-v3"); ok {
		t.Fatal("a model no binding records is still interned")
	}
	n.expect(&InvalidateWorker{Worker: "w2"}, OK)
	if len(n.f.models.ids) != 0 {
		t.Fatalf("models interned after every binding went: %v", n.f.models.ids)
	}
}

func TestSlotStaysFortyBytes(t *testing.T) {
	if n := unsafe.Sizeof(slot{}); n != 40 {
		t.Fatalf("slot is %d bytes: the binding model must fit in the padding", n)
	}
}
