package fsm

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// node drives one FSM with increasing log indexes.
type node struct {
	t       testing.TB
	f       *FSM
	index   uint64
	changes []Change
}

func newNode(t testing.TB) *node {
	n := &node{t: t}
	n.f = New(Options{OnChange: func(c Change) { n.changes = append(n.changes, c) }})
	return n
}

func (n *node) entry(cmd Command) *raft.Log {
	n.t.Helper()
	b, err := Encode(cmd)
	if err != nil {
		n.t.Fatalf("encode %#v: %v", cmd, err)
	}
	n.index++
	return &raft.Log{Index: n.index, Term: 1, Type: raft.LogCommand, Data: b}
}

func (n *node) apply(cmd Command) *Result {
	n.t.Helper()
	return n.applyRaw(n.entry(cmd))
}

func (n *node) applyRaw(l *raft.Log) *Result {
	n.t.Helper()
	out := n.f.Apply(l)
	if out == nil {
		return nil
	}
	res, ok := out.(*Result)
	if !ok {
		n.t.Fatalf("Apply returned %T", out)
	}
	return res
}

func (n *node) expect(cmd Command, want Status) *Result {
	n.t.Helper()
	res := n.apply(cmd)
	if res.Status != want {
		n.t.Fatalf("%T %+v: status %v (err %v), want %v", cmd, cmd, res.Status, res.Err, want)
	}
	return res
}

// dump is the whole observable state, in a canonical order.
type dump struct {
	Bindings []Binding
	Workers  []Worker
	Members  []Member
	Aliases  []Alias
	Len      int
	Applied  uint64
}

func dumpOf(f *FSM) dump {
	d := dump{Workers: f.Workers(), Members: f.Members(), Aliases: f.Aliases(), Len: f.Len(), Applied: f.AppliedIndex()}
	f.Range(func(b Binding) bool {
		d.Bindings = append(d.Bindings, b)
		return true
	})
	slices.SortFunc(d.Bindings, func(a, b Binding) int { return strings.Compare(a.Session, b.Session) })
	return d
}

func (d dump) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "len=%d applied=%d\n", d.Len, d.Applied)
	for _, b := range d.Bindings {
		fmt.Fprintf(&sb, "  %+v\n", b)
	}
	for _, w := range d.Workers {
		fmt.Fprintf(&sb, "  worker %s draining=%v spec=%q\n", w.ID, w.Draining, w.Spec)
	}
	for _, m := range d.Members {
		fmt.Fprintf(&sb, "  member %+v\n", m)
	}
	for _, a := range d.Aliases {
		fmt.Fprintf(&sb, "  alias %+v\n", a)
	}
	return sb.String()
}

func equalDumps(a, b dump) bool {
	if a.Len != b.Len || a.Applied != b.Applied || !slices.Equal(a.Bindings, b.Bindings) || !slices.Equal(a.Members, b.Members) {
		return false
	}
	if !slices.EqualFunc(a.Aliases, b.Aliases, func(x, y Alias) bool { return x.Name == y.Name && slices.Equal(x.Targets, y.Targets) }) {
		return false
	}
	return slices.EqualFunc(a.Workers, b.Workers, func(x, y Worker) bool {
		return x.ID == y.ID && x.Draining == y.Draining && bytes.Equal(x.Spec, y.Spec)
	})
}

func requireEqual(t testing.TB, got, want dump) {
	t.Helper()
	if !equalDumps(got, want) {
		t.Fatalf("state differs\n got: %v\nwant: %v", got, want)
	}
}

// memSink is a raft.SnapshotSink over a buffer.
type memSink struct {
	bytes.Buffer
	closed, cancelled bool
}

func (s *memSink) ID() string    { return "mem" }
func (s *memSink) Close() error  { s.closed = true; return nil }
func (s *memSink) Cancel() error { s.cancelled = true; return nil }

// persist snapshots f and returns the stream.
func persist(t testing.TB, f *FSM) []byte {
	t.Helper()
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Release()
	return persistSnap(t, snap)
}

func persistSnap(t testing.TB, snap raft.FSMSnapshot) []byte {
	t.Helper()
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		t.Fatal(err)
	}
	if !sink.closed || sink.cancelled {
		t.Fatalf("sink closed=%v cancelled=%v", sink.closed, sink.cancelled)
	}
	return sink.Bytes()
}

func restore(f *FSM, b []byte) error { return f.Restore(io.NopCloser(bytes.NewReader(b))) }

// gen makes random commands against a small key space, so they collide.
type gen struct {
	r        *rand.Rand
	sessions int
	workers  int
}

func (g *gen) session() string { return fmt.Sprintf("session-%03d", g.r.IntN(g.sessions)) }
func (g *gen) worker() string  { return fmt.Sprintf("w%d", g.r.IntN(g.workers)) }

// next picks a command, reading f for revisions so that guards sometimes match.
func (g *gen) next(f *FSM) Command {
	s := g.session()
	rev := uint64(g.r.IntN(50) + 1)
	if b, ok := f.Get(s); ok && g.r.IntN(3) > 0 {
		rev = b.Revision
	}
	switch p := g.r.IntN(100); {
	case p < 40:
		return &Bind{Session: s, Worker: g.worker(), DPRank: uint32(g.r.IntN(4)), TTL: time.Duration(g.r.IntN(5)) * time.Minute,
			MaxBindings: uint64(g.r.IntN(2) * (g.sessions - 5)), Model: []string{"", "m1", "m2"}[g.r.IntN(3)]}
	case p < 50:
		return &Bind{Session: s, Worker: g.worker(), ExpectRevision: rev}
	case p < 62:
		return &Invalidate{Session: s, Revision: rev}
	case p < 72:
		return &Expire{Session: s, Revision: rev}
	case p < 75:
		return &InvalidateWorker{Worker: g.worker()}
	case p < 85:
		c := &Checkpoint{Aged: time.Duration(g.r.IntN(2)*g.r.IntN(500)) * time.Millisecond}
		for range g.r.IntN(6) + 1 {
			s := g.session()
			rev := uint64(g.r.IntN(50) + 1)
			if b, ok := f.Get(s); ok {
				rev = b.Revision
			}
			c.Entries = append(c.Entries, Remaining{Session: s, Revision: rev, Remaining: time.Duration(g.r.IntN(1000)+1) * time.Millisecond})
		}
		return c
	case p < 90:
		return &AddWorker{ID: g.worker(), Spec: []byte(fmt.Sprintf(`{"n":%d}`, g.r.IntN(9)))}
	case p < 93:
		return &DrainWorker{ID: g.worker()}
	case p < 95:
		return &RemoveWorker{ID: g.worker()}
	case p < 96:
		if g.r.IntN(2) == 0 {
			return &DeleteAlias{Name: "a1"}
		}
		return &SetAlias{Alias: Alias{Name: "a1", Targets: []AliasTarget{{Model: "m1", Weight: uint32(g.r.IntN(10) + 1)}, {Model: "m2"}}}}
	case p < 98:
		return &SetMember{Member: Member{ID: fmt.Sprintf("r%d", g.r.IntN(3)), RaftAddr: "10.0.0.1:7000", PeerAddr: fmt.Sprintf("10.0.0.1:%d", 8000+g.r.IntN(3))}}
	default:
		return &RemoveMember{ID: fmt.Sprintf("r%d", g.r.IntN(3))}
	}
}
