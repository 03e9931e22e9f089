package fsm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// populated returns a node with bindings, registry, members and checkpoints.
// populated is populatedV1 with what format version 2 added: aliases and bindings that
// record a model.
func populated(t testing.TB, sessions int) *node {
	n := populatedV1(t, sessions)
	n.expect(&SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{{Model: "llama-v2", Weight: 90}, {Model: "llama-v3", Weight: 10}}}}, OK)
	n.expect(&SetAlias{Alias: Alias{Name: "mistral", Targets: []AliasTarget{{Model: "mistral-7b", Weight: 1}}}}, OK)
	for i := range 40 {
		n.expect(&Bind{Session: fmt.Sprintf("modeled-%02d", i), Worker: fmt.Sprintf("w%d", i%2), Model: []string{"llama-v2", "llama-v3", "mistral-7b"}[i%3]}, Created)
	}
	return n
}

// populatedV1 is the state snapshot-v1.bin holds (written by the code before aliases, with
// populatedV1(t, 50)).
func populatedV1(t testing.TB, sessions int) *node {
	n := newNode(t)
	n.expect(&AddWorker{ID: "w0", Spec: []byte(`{"url":"http://w0"}`)}, OK)
	n.expect(&AddWorker{ID: "w1", Spec: []byte(`{"url":"http://w1"}`)}, OK)
	n.expect(&AddWorker{ID: "w2"}, OK)
	n.expect(&DrainWorker{ID: "w2"}, OK)
	n.expect(&SetMember{Member: Member{ID: "r1", RaftAddr: "10.0.0.1:7000", PeerAddr: "10.0.0.1:7001"}}, OK)
	var cp Checkpoint
	for i := range sessions {
		b := n.expect(&Bind{Session: fmt.Sprintf("sess-%05d", i), Worker: fmt.Sprintf("w%d", i%2+3*(i%5/4)), DPRank: uint32(i % 4), TTL: time.Duration(i%3) * time.Minute}, Created).Binding
		if i%3 == 0 {
			cp.Entries = append(cp.Entries, Remaining{Session: b.Session, Revision: b.Revision, Remaining: time.Duration(i+1) * time.Millisecond})
		}
	}
	n.expect(&cp, OK)
	return n
}

func TestSnapshotRestoreRoundTrip(t *testing.T) {
	n := populated(t, 2000)
	want := dumpOf(n.f)
	if want.Len != 2040 || len(want.Aliases) != 2 || want.Bindings[0].Model == "" || want.Bindings[40].Remaining == 0 || len(want.Workers) != 3 || !want.Workers[2].Draining || len(want.Members) != 1 {
		t.Fatalf("fixture is not what the test needs: %d bindings, %+v", want.Len, want.Workers)
	}
	stream := persist(t, n.f)

	var resets []Change
	r := New(Options{OnChange: func(c Change) { resets = append(resets, c) }})
	rn := &node{t: t, f: r} // an FSM with prior state must be wholly replaced
	rn.expect(&Bind{Session: "stale", Worker: "x"}, Created)
	if err := restore(r, stream); err != nil {
		t.Fatal(err)
	}
	requireEqual(t, dumpOf(r), want)
	if len(resets) != 2 || resets[1].Kind != Reset || resets[1].Reason != Restored || resets[1].Index != n.index {
		t.Fatalf("changes after restore: %+v", resets)
	}
	// The restored FSM keeps working: guards, interning and further snapshots.
	rn.index = n.index
	b, _ := r.Get("sess-00007")
	rn.expect(&Invalidate{Session: "sess-00007", Revision: b.Revision}, Removed)
	rn.expect(&Bind{Session: "sess-00007", Worker: "w1"}, Created)
	rn.expect(&Bind{Session: "sess-00008", Worker: "w2"}, Exists)
	r2 := New(Options{})
	if err := restore(r2, persist(t, r)); err != nil {
		t.Fatal(err)
	}
	requireEqual(t, dumpOf(r2), dumpOf(r))
}

func TestPersistWritesStateAsOfSnapshot(t *testing.T) {
	n := populated(t, 3000)
	want := dumpOf(n.f)
	snap, err := n.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Release()
	// Touch every shard after the snapshot: binds, removals, registry, checkpoints.
	g := &gen{r: rand.New(rand.NewPCG(1, 2)), sessions: 500, workers: 4}
	for range 3000 {
		n.apply(g.next(n.f))
	}
	n.expect(&InvalidateWorker{Worker: "w0"}, OK)
	n.apply(&SetMember{Member: Member{ID: "r9"}})
	if equalDumps(dumpOf(n.f), want) {
		t.Fatal("the applies after the snapshot changed nothing; the test proves nothing")
	}
	r := New(Options{})
	if err := restore(r, persistSnap(t, snap)); err != nil {
		t.Fatal(err)
	}
	requireEqual(t, dumpOf(r), want)
}

func TestRestoreRejectsDamagedStreamsAndKeepsState(t *testing.T) {
	stream := persist(t, populated(t, 300).f)
	n := populated(t, 10)
	n.expect(&SetMember{Member: Member{ID: "keep"}}, OK)
	before := dumpOf(n.f)

	check := func(t *testing.T, name string, b []byte) {
		t.Helper()
		err := restore(n.f, b)
		if err == nil {
			t.Fatalf("%s: restore accepted it", name)
		}
		if !errors.Is(err, ErrSnapshot) {
			t.Fatalf("%s: error %v does not wrap ErrSnapshot", name, err)
		}
		requireEqual(t, dumpOf(n.f), before)
	}
	t.Run("truncated", func(t *testing.T) {
		for cut := 0; cut < len(stream); cut += 1 + cut/8 {
			check(t, fmt.Sprintf("cut at %d", cut), stream[:cut])
		}
		check(t, "last byte missing", stream[:len(stream)-1])
		if err := restore(n.f, stream[:40]); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("truncation error %v should wrap io.ErrUnexpectedEOF", err)
		}
	})
	t.Run("corrupt", func(t *testing.T) {
		for pos := 0; pos < len(stream); pos += 1 + pos/16 {
			bad := bytes.Clone(stream)
			bad[pos] ^= 0x20
			check(t, fmt.Sprintf("flip at %d", pos), bad)
		}
	})
	t.Run("trailing garbage", func(t *testing.T) {
		check(t, "extra byte", append(bytes.Clone(stream), 0))
	})
	t.Run("wrong version", func(t *testing.T) {
		bad := bytes.Clone(stream)
		binary.LittleEndian.PutUint32(bad[8:], 99)
		check(t, "version 99", bad)
	})
	t.Run("duplicate session with a valid checksum", func(t *testing.T) {
		f := New(Options{})
		(&node{t: t, f: f}).expect(&Bind{Session: "dup", Worker: "w"}, Created)
		s := persist(t, f)
		// Splice the one binding record in twice and fix the counts and the checksum.
		body := s[:len(s)-12-1] // up to the end marker
		rec := findRecord(t, body, "dup")
		forged := append(append(bytes.Clone(body), rec...), 0)
		forged = binary.LittleEndian.AppendUint64(forged, 2)
		binary.LittleEndian.PutUint64(forged[20:], 2)
		forged = binary.LittleEndian.AppendUint32(forged, crcOf(forged))
		if err := restore(New(Options{}), forged); err == nil || !bytes.Contains([]byte(err.Error()), []byte("listed twice")) {
			t.Fatalf("duplicate accepted or unclear: %v", err)
		}
	})
	// The intact stream still restores over the kept state.
	if err := restore(n.f, stream); err != nil {
		t.Fatal(err)
	}
	if n.f.Len() != 340 {
		t.Fatalf("len %d after a good restore", n.f.Len())
	}
}

func findRecord(t *testing.T, body []byte, session string) []byte {
	t.Helper()
	i := bytes.LastIndex(body, append([]byte{byte(len(session))}, session...))
	if i < 0 {
		t.Fatal("record not found")
	}
	return body[i:]
}

func crcOf(b []byte) uint32 { return crc32.Update(0, castagnoli, b) }

func TestSnapshotStreamsAreDeterministic(t *testing.T) {
	// Two replicas fed one random log, one entry at a time and one in batches, with
	// snapshots taken at different moments, end identical: through the read API and byte
	// for byte in the snapshot stream.
	const entries = 6000
	a, b := newNode(t), newNode(t)
	g := &gen{r: rand.New(rand.NewPCG(7, 11)), sessions: 400, workers: 6}
	var batch []*raft.Log
	flush := func() {
		out := b.f.ApplyBatch(batch)
		for i, l := range batch {
			ra := a.f.Apply(l).(*Result)
			rb := out[i].(*Result)
			if ra.Status != rb.Status || ra.Binding != rb.Binding || ra.Count != rb.Count {
				t.Fatalf("entry %d: results differ: %+v vs %+v", l.Index, ra, rb)
			}
		}
		batch = batch[:0]
	}
	for i := range entries {
		batch = append(batch, a.entry(g.next(a.f)))
		if i%3 == 0 || len(batch) > 20 {
			flush()
			a.index++
			conf := &raft.Log{Index: a.index, Type: raft.LogConfiguration}
			if a.f.Apply(conf) != nil || b.f.ApplyBatch([]*raft.Log{conf})[0] != nil {
				t.Fatal("a configuration entry got a response")
			}
		}
		if i%500 == 0 {
			snap, _ := b.f.Snapshot()
			snap.Release()
		}
	}
	flush()
	requireEqual(t, dumpOf(b.f), dumpOf(a.f))
	if !bytes.Equal(persist(t, a.f), persist(t, b.f)) {
		t.Fatal("snapshot streams differ")
	}
	if len(a.changes) != len(b.changes) {
		t.Fatalf("%d vs %d changes", len(a.changes), len(b.changes))
	}
	for i := range a.changes {
		if a.changes[i] != b.changes[i] {
			t.Fatalf("change %d: %+v vs %+v", i, a.changes[i], b.changes[i])
		}
	}
	if a.f.Len() == 0 || len(a.changes) < entries/10 {
		t.Fatalf("the log did too little to prove anything: len %d, %d changes", a.f.Len(), len(a.changes))
	}
}

func TestReadsDuringApplyAndPersist(t *testing.T) {
	n := populated(t, 2000)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	errs := make(chan error, 8)
	for r := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				s := fmt.Sprintf("sess-%05d", (i*31+r)%2500)
				if b, ok := n.f.Get(s); ok && (b.Session != s || b.Revision == 0 || b.Worker == "") {
					errs <- fmt.Errorf("Get(%s) = %+v", s, b)
					return
				}
				switch i % 200 {
				case 0:
					n.f.Range(func(b Binding) bool { return b.Worker != "" })
				case 1:
					_ = n.f.Workers()
					_ = n.f.Members()
					_ = n.f.Len()
					_ = n.f.AppliedIndex()
				}
			}
		}()
	}
	// The applier: binds, removals, worker sweeps and snapshots persisted concurrently.
	g := &gen{r: rand.New(rand.NewPCG(3, 4)), sessions: 2500, workers: 4}
	var pwg sync.WaitGroup
	for i := range 4000 {
		n.apply(g.next(n.f))
		if i%1000 == 0 {
			snap, err := n.f.Snapshot()
			if err != nil {
				t.Fatal(err)
			}
			want := dumpOf(n.f) // nothing applies between Snapshot and here
			pwg.Add(1)
			go func() {
				defer pwg.Done()
				defer snap.Release()
				var sink memSink
				if err := snap.Persist(&sink); err != nil {
					errs <- err
					return
				}
				r := New(Options{})
				if err := restore(r, sink.Bytes()); err != nil {
					errs <- err
					return
				}
				if got := dumpOf(r); !equalDumps(got, want) {
					errs <- fmt.Errorf("persisted state differs from the state at the snapshot")
				}
			}()
		}
	}
	pwg.Wait()
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestPersistCancelsTheSinkOnError(t *testing.T) {
	n := populated(t, 100)
	snap, _ := n.f.Snapshot()
	defer snap.Release()
	sink := &failingSink{}
	if err := snap.Persist(sink); err == nil || !sink.cancelled {
		t.Fatalf("err %v, cancelled %v", err, sink.cancelled)
	}
}

type failingSink struct{ cancelled bool }

func (s *failingSink) Write([]byte) (int, error) { return 0, errors.New("disk full") }
func (s *failingSink) ID() string                { return "failing" }
func (s *failingSink) Close() error              { return nil }
func (s *failingSink) Cancel() error             { s.cancelled = true; return nil }

func TestSnapshotClonesOnlyTheShardsWrittenAfterIt(t *testing.T) {
	n := populated(t, 5000)
	frozen := n.f.st.Load()
	snap, _ := n.f.Snapshot()
	defer snap.Release()
	if n.f.st.Load() != frozen {
		t.Fatal("Snapshot copied the state")
	}
	n.expect(&Bind{Session: "one-more", Worker: "w0"}, Created)
	n.expect(&Bind{Session: "one-more-2", Worker: "w0"}, Created)
	live := n.f.st.Load()
	changed := 0
	for i := range live.shards {
		if live.shards[i] != frozen.shards[i] {
			changed++
		}
	}
	if want := 1 + btoi(shardOf(hashKey("one-more")) != shardOf(hashKey("one-more-2"))); changed != want {
		t.Fatalf("%d shards cloned, want %d", changed, want)
	}
	if _, ok := frozen.shards[shardOf(hashKey("one-more"))].find("one-more", hashKey("one-more")); ok >= 0 {
		t.Fatal("the frozen shard was written")
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func TestSnapshotOfTheReleaseBeforeAliasesRestores(t *testing.T) {
	stream, err := os.ReadFile("testdata/snapshot-v1.bin")
	if err != nil {
		t.Fatal(err)
	}
	want := dumpOf(populatedV1(t, 50).f)
	f := New(Options{})
	if err := restore(f, stream); err != nil {
		t.Fatal(err)
	}
	requireEqual(t, dumpOf(f), want)
	// It keeps working, and its next snapshot (version 2) carries what it gained since.
	n := &node{t: t, f: f, index: want.Applied}
	n.expect(&SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{{Model: "llama-v2", Weight: 1}}}}, OK)
	n.expect(&Bind{Session: "new", Worker: "w1", Model: "llama-v2"}, Created)
	again := New(Options{})
	if err := restore(again, persist(t, f)); err != nil {
		t.Fatal(err)
	}
	requireEqual(t, dumpOf(again), dumpOf(f))
	if b, _ := again.Get("new"); b.Model != "llama-v2" {
		t.Fatalf("restored binding %+v lost its model", b)
	}
}

// TestStateWithoutAliasesSnapshotsAsTheReleaseBeforeThem: until aliases are used, a snapshot
// is byte for byte what the release before aliases wrote for the same state
// (testdata/snapshot-v1.bin), so replicas of both releases can send each other snapshots
// during a rolling upgrade.
func TestStateWithoutAliasesSnapshotsAsTheReleaseBeforeThem(t *testing.T) {
	want, err := os.ReadFile("testdata/snapshot-v1.bin")
	if err != nil {
		t.Fatal(err)
	}
	if got := persist(t, populatedV1(t, 50).f); !bytes.Equal(got, want) {
		t.Fatalf("snapshot of a state without aliases: %d bytes, format %d; want the %d bytes of format 1",
			len(got), binary.LittleEndian.Uint32(got[8:]), len(want))
	}
}
