package hints

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// shareClock is a settable clock for the sharing components.
type shareClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *shareClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *shareClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// captured is what a capturing peer received: each message's entries.
type captured struct {
	mu   sync.Mutex
	msgs []decisionMessage
}

func (c *captured) handler(t *testing.T) func(string, []byte) {
	return func(_ string, p []byte) {
		m, err := decodeDecisions(p)
		if err != nil {
			t.Errorf("peer received an undecodable message: %v", err)
			return
		}
		c.mu.Lock()
		c.msgs = append(c.msgs, m)
		c.mu.Unlock()
	}
}

// take returns the entries received since the last take, as "worker:cont:n" strings.
func (c *captured) take() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, m := range c.msgs {
		for _, e := range m.entries {
			out = append(out, fmt.Sprintf("%s:%v:%d", m.workers[e.worker], e.cont, len(e.raw)/8))
		}
	}
	c.msgs = nil
	return out
}

// failingMessenger fails every send while fail is set.
type failingMessenger struct {
	Messenger
	fail     atomic.Bool
	reliable atomic.Int32
}

func (f *failingMessenger) SendBestEffort(to string, kind gossip.Kind, p []byte) error {
	if f.fail.Load() {
		return gossip.ErrOverBudget
	}
	return f.Messenger.SendBestEffort(to, kind, p)
}

func (f *failingMessenger) SendReliable(ctx context.Context, to string, kind gossip.Kind, p []byte) error {
	f.reliable.Add(1)
	if f.fail.Load() {
		return gossip.ErrOverBudget
	}
	return f.Messenger.SendReliable(ctx, to, kind, p)
}

// TestDecisionsSendOnlyWhatPeersLack walks the sender through the cases of its suffix
// rule: new chains go whole, extensions as their new blocks, repeats not at all; and the
// repairs: whole chains again after two rotations, every FullEvery-th decision, to a
// newcomer, and after a failed send.
func TestDecisionsSendOnlyWhatPeersLack(t *testing.T) {
	fn := newFakeNet()
	clock := &shareClock{t: time.Unix(1000, 0)}
	fm := &failingMessenger{Messenger: fn.join("a", "")}
	var got captured
	fn.join("b", "").Handle(gossip.KindDecisions, got.handler(t))
	idx := indexer.New(indexer.Options{TTL: time.Minute})
	d, err := NewDecisions(DecisionsConfig{Messenger: fm, Index: idx, FullEvery: 5, FullAfter: 10 * time.Second, now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	p := sharePrompt(1, 40)
	w, v := indexer.Worker{ID: "w"}, indexer.Worker{ID: "v", DPRank: 3}
	steps := []struct {
		name   string
		do     func()
		record []uint64
		worker indexer.Worker
		want   []string
	}{
		{name: "new chain goes whole", record: p[:10], worker: w, want: []string{"w:false:10"}},
		{name: "a repeat sends its last block, anchored", record: p[:10], worker: w, want: []string{"w:true:1"}},
		{name: "an extension sends its new blocks", record: p[:15], worker: w, want: []string{"w:true:5"}},
		{name: "another worker has its own sent set", record: p[:15], worker: v, want: []string{"v/3:false:15"}},
		{name: "one rotation: still sent", do: func() { clock.advance(10 * time.Second); d.Flush(context.Background()) },
			record: p[:16], worker: w, want: []string{"w:true:1"}},
		{name: "every 5th decision of a worker goes whole", record: p[:17], worker: w, want: []string{"w:false:17"}},
		{name: "two rotations: the chain goes whole again", do: func() {
			for range 2 {
				clock.advance(10 * time.Second)
				d.Flush(context.Background())
			}
		}, record: p[:17], worker: w, want: []string{"w:false:17"}},
		{name: "a failed send is forgotten", do: func() {
			fm.fail.Store(true)
			d.Record(w, p[:20])
			d.Flush(context.Background())
			fm.fail.Store(false)
		}, record: p[:21], worker: w, want: []string{"w:true:4"}},
		{name: "a newcomer gets whole chains", do: func() { fn.join("c", "") }, record: p[:22], worker: w, want: []string{"w:false:22"}},
	}
	for _, st := range steps {
		if st.do != nil {
			st.do()
			got.take()
		}
		d.Record(st.worker, st.record)
		d.Flush(context.Background())
		if g := got.take(); !slices.Equal(g, st.want) {
			t.Fatalf("%s: peer got %v, want %v", st.name, g, st.want)
		}
	}
	if dropped := d.m.Stats().Dropped["decisions"][DropShareSend]; dropped != 1 {
		t.Errorf("failed sends counted: %d, want 1", dropped)
	}
}

// TestBigBatchesAreSplitAndSentReliably: a batch too big for a few packets goes over TCP
// in bounded messages, and the receiver reassembles every chain.
func TestBigBatchesAreSplitAndSentReliably(t *testing.T) {
	fn := newFakeNet()
	fa := &failingMessenger{Messenger: fn.join("a", "")}
	mb := fn.join("b", "")
	var sizes []int
	var mu sync.Mutex
	idxB := indexer.New(indexer.Options{TTL: time.Minute})
	db, err := NewDecisions(DecisionsConfig{Messenger: mb, Index: idxB})
	if err != nil {
		t.Fatal(err)
	}
	inner := func(from string, p []byte) {
		mu.Lock()
		sizes = append(sizes, len(p))
		mu.Unlock()
		db.receive(from, p)
	}
	mb.Handle(gossip.KindDecisions, inner)
	da, err := NewDecisions(DecisionsConfig{Messenger: fa, Index: indexer.New(indexer.Options{TTL: time.Minute}), MaxMessageBytes: 8 << 10})
	if err != nil {
		t.Fatal(err)
	}
	prompts := [][]uint64{sharePrompt(1, 5000), sharePrompt(2, 700), sharePrompt(3, 3)}
	for i, p := range prompts {
		da.Record(indexer.Worker{ID: fmt.Sprintf("w%d", i)}, p)
	}
	da.Flush(context.Background())
	if fa.reliable.Load() == 0 {
		t.Fatal("a 45 KB batch went as packets")
	}
	for _, n := range sizes {
		if n > 8<<10 {
			t.Fatalf("a message of %d bytes, over the 8 KiB bound", n)
		}
	}
	for i, p := range prompts {
		var blocks int
		for _, m := range idxB.FindMatches(p, nil) {
			if m.Worker.ID == fmt.Sprintf("w%d", i) {
				blocks = m.Blocks
			}
		}
		if blocks != len(p) {
			t.Errorf("prompt %d: receiver holds %d of %d blocks", i, blocks, len(p))
		}
	}
	if gaps := db.m.Stats().DecisionGaps; gaps != 0 {
		t.Errorf("%d gaps counted without loss", gaps)
	}
}

// TestLossLeavesAHoleThatRotationRepairs shows the documented loss behaviour: a lost
// message leaves a hole that later suffixes do not fill (the receiver sees the worker's
// run end at the hole), and the chain is whole again at the receiver once the sender's
// sent set has rotated twice.
func TestLossLeavesAHoleThatRotationRepairs(t *testing.T) {
	fn := newFakeNet()
	clock := &shareClock{t: time.Unix(1000, 0)}
	ma, mb := fn.join("a", ""), fn.join("b", "")
	idxB := indexer.New(indexer.Options{TTL: time.Hour})
	db, err := NewDecisions(DecisionsConfig{Messenger: mb, Index: idxB})
	if err != nil {
		t.Fatal(err)
	}
	da, err := NewDecisions(DecisionsConfig{Messenger: ma, Index: indexer.New(indexer.Options{TTL: time.Hour}), FullAfter: 10 * time.Second, now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	w, p := indexer.Worker{ID: "w"}, sharePrompt(5, 30)
	held := func() int {
		for _, m := range idxB.FindMatches(p, nil) {
			if m.Worker == w {
				return m.Blocks
			}
		}
		return 0
	}
	var lose atomic.Bool
	fn.setDrop(func(_, _ string, _ gossip.Kind) bool { return lose.Load() })
	da.Record(indexer.Worker{ID: "v"}, sharePrompt(6, 3)) // a first message arrives
	da.Flush(context.Background())
	lose.Store(true)
	da.Record(w, p[:10])
	da.Flush(context.Background())
	lose.Store(false)
	da.Record(w, p)
	da.Flush(context.Background())
	if got := held(); got != 0 {
		t.Fatalf("with blocks 0..9 lost the receiver should see no run, sees %d", got)
	}
	if gaps := db.m.Stats().DecisionGaps; gaps != 1 {
		t.Errorf("gaps counted: %d, want 1", gaps)
	}
	for range 2 {
		clock.advance(10 * time.Second)
		da.Flush(context.Background())
	}
	da.Record(w, p)
	da.Flush(context.Background())
	if got := held(); got != len(p) {
		t.Fatalf("after two rotations the receiver holds %d of %d", got, len(p))
	}
}

func TestOverBudgetDecisionsAreDroppedAndCounted(t *testing.T) {
	fn := newFakeNet()
	ma := fn.join("a", "")
	var got captured
	fn.join("b", "").Handle(gossip.KindDecisions, got.handler(t))
	clock := &shareClock{t: time.Unix(1000, 0)} // the budget does not refill during the test
	d, err := NewDecisions(DecisionsConfig{Messenger: ma, Index: indexer.New(indexer.Options{TTL: time.Minute}), MaxBytesPerSecond: 2000, now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		d.Record(indexer.Worker{ID: "w"}, sharePrompt(uint64(i), 100)) // 800+ bytes each
	}
	d.Flush(context.Background())
	sent := got.take()
	if len(sent) == 0 || len(sent) >= 10 {
		t.Fatalf("%d of 10 decisions sent under a 2000 B/s budget", len(sent))
	}
	if n := d.m.Stats().Dropped["decisions"][DropShareBudget]; n == 0 {
		t.Fatal("budget drops not counted")
	}
	if out := d.m.Stats().BytesOut["decisions"]; out > 2000 {
		t.Fatalf("%d bytes sent under a 2000 B/s budget", out)
	}
}

// validDecision encodes one decision of "w0" from sender.
func validDecision(sender string, n int) []byte {
	b, _ := encodeDecisions(sender, 1, 1, time.Minute, []queuedDecision{{w: indexer.Worker{ID: "w0"}, hashes: sharePrompt(9, n)}})
	return b
}

func TestBadDecisionMessagesAreDroppedAndCounted(t *testing.T) {
	good := validDecision("r1", 4)
	header := appendHeader(nil, "r1") // version 1
	header = binary.AppendUvarint(binary.AppendUvarint(binary.AppendUvarint(header, 1), 1), 60000)
	withWorker := appendWorker(binary.AppendUvarint(slices.Clone(header), 1), indexer.Worker{ID: "w0"})
	header2 := appendVersionedHeader(nil, decisionWireVersion, "r1")
	header2 = binary.AppendUvarint(binary.AppendUvarint(binary.AppendUvarint(binary.AppendUvarint(header2, 1), 1), 60000), 1)
	withWorker2 := appendWorker(binary.AppendUvarint(slices.Clone(header2), 1), indexer.Worker{ID: "w0"})
	// entry2 is a version-2 message of one entry of worker 0 with flags, then rest.
	entry2 := func(flags byte, rest ...byte) []byte {
		return append(append(binary.AppendUvarint(binary.AppendUvarint(slices.Clone(withWorker2), 1), 0), flags), rest...)
	}
	oneHash := append([]byte{1}, make([]byte, 8)...)
	anchor := make([]byte, 8)
	tests := []struct {
		name    string
		from    string
		payload []byte
		reason  string
	}{
		{"garbage", "r1", []byte("\x01\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"), DropShareDecode},
		{"empty", "r1", nil, DropShareDecode},
		{"version 3", "r1", append([]byte{3}, good[1:]...), DropShareVersion},
		{"version 0", "r1", append([]byte{0}, good[1:]...), DropShareVersion},
		{"truncated", "r1", good[:len(good)-3], DropShareSize},
		{"trailing bytes", "r1", append(slices.Clone(good), 0), DropShareDecode},
		{"claims a million entries", "r1", binary.AppendUvarint(slices.Clone(withWorker), 1e6), DropShareSize},
		{"claims a huge chain", "r1", binary.AppendUvarint(append(binary.AppendUvarint(binary.AppendUvarint(slices.Clone(withWorker), 1), 0), 0), 1<<40), DropShareSize},
		{"worker index out of range", "r1", append(binary.AppendUvarint(append(binary.AppendUvarint(binary.AppendUvarint(slices.Clone(withWorker), 1), 7), 0), 1), make([]byte, 8)...), DropShareDecode},
		{"unknown flags", "r1", append(binary.AppendUvarint(append(binary.AppendUvarint(binary.AppendUvarint(slices.Clone(withWorker), 1), 0), 6), 1), make([]byte, 8)...), DropShareDecode},
		{"version 1 with an anchor", "r1", append(binary.AppendUvarint(append(binary.AppendUvarint(binary.AppendUvarint(slices.Clone(withWorker), 1), 0), 3), 1), make([]byte, 8)...), DropShareDecode},
		{"anchored, continuing nothing", "r1", entry2(2, append(append(slices.Clone(anchor), 1), oneHash...)...), DropShareDecode},
		{"anchored, prefix 0", "r1", entry2(3, append(append(slices.Clone(anchor), 0), oneHash...)...), DropShareSize},
		{"anchored, prefix too long", "r1", entry2(3, append(binary.AppendUvarint(slices.Clone(anchor), maxAnchoredPrefix+1), oneHash...)...), DropShareSize},
		{"anchored, anchor cut short", "r1", entry2(3, 0, 0, 0), DropShareSize},
		{"decision time past int64", "r1", binary.AppendUvarint(binary.AppendUvarint(binary.AppendUvarint(binary.AppendUvarint(
			appendVersionedHeader(nil, decisionWireVersion, "r1"), 1), 1), 60000), 1<<63), DropShareSize},
		{"over 4 MiB", "r1", append(slices.Clone(good), make([]byte, 4<<20)...), DropShareSize},
		{"from a non-member", "stranger", validDecision("stranger", 4), DropShareNonMember},
		{"from itself", "r0", validDecision("r0", 4), DropShareNonMember},
		{"names another sender", "r1", validDecision("r2", 4), DropShareSender},
		{"about an unknown worker", "r1", func() []byte {
			b, _ := encodeDecisions("r1", 1, 1, 0, []queuedDecision{{w: indexer.Worker{ID: "nobody"}, hashes: sharePrompt(9, 4)}})
			return b
		}(), DropShareUnknownWorker},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fn := newFakeNet()
			m0 := fn.join("r0", "")
			fn.join("r1", "")
			fn.join("r2", "")
			idx := indexer.New(indexer.Options{TTL: time.Minute})
			d, err := NewDecisions(DecisionsConfig{Messenger: m0, Index: idx, Known: func(w indexer.Worker) bool { return w.ID == "w0" }})
			if err != nil {
				t.Fatal(err)
			}
			fn.inject(tc.from, "r0", gossip.KindDecisions, tc.payload)
			st := d.m.Stats()
			if n := st.Dropped["decisions"][tc.reason]; n != 1 {
				t.Fatalf("dropped %v, want one %q", st.Dropped["decisions"], tc.reason)
			}
			if idx.Len() != 0 {
				t.Fatalf("a dropped message stored %d entries", idx.Len())
			}
		})
	}
	v1 := append(binary.AppendUvarint(append(binary.AppendUvarint(binary.AppendUvarint(slices.Clone(withWorker), 1), 0), 1), 2), make([]byte, 16)...)
	v1[len(v1)-16], v1[len(v1)-8] = 5, 6
	for _, tc := range []struct {
		name    string
		payload []byte
		want    int
	}{{"the good one is applied", good, 4}, {"a version-1 message is applied", v1, 2}} {
		t.Run(tc.name, func(t *testing.T) {
			fn := newFakeNet()
			m0 := fn.join("r0", "")
			fn.join("r1", "")
			idx := indexer.New(indexer.Options{TTL: time.Minute})
			if _, err := NewDecisions(DecisionsConfig{Messenger: m0, Index: idx}); err != nil {
				t.Fatal(err)
			}
			fn.inject("r1", "r0", gossip.KindDecisions, tc.payload)
			if idx.Len() != tc.want {
				t.Fatalf("stored %d entries, want %d", idx.Len(), tc.want)
			}
		})
	}
}

func FuzzDecisionDecode(f *testing.F) {
	f.Add(validDecision("r1", 3))
	b, _ := encodeDecisions("r1", 7, 9, time.Second, []queuedDecision{
		{w: indexer.Worker{ID: "a", DPRank: 2}, cont: true, hashes: []uint64{1, 2}},
		{w: indexer.Worker{ID: "b"}, hashes: []uint64{3}},
	})
	f.Add(b)
	b, _ = encodeDecisions("r1", 7, 9, time.Second, []queuedDecision{
		{w: indexer.Worker{ID: "a"}, cont: true, prefix: 12, anchor: 99, hashes: []uint64{1, 2}, at: 1234},
	})
	f.Add(b)
	f.Add([]byte{1, 2, 'r', '1', 0, 0, 0, 0, 0})
	f.Add([]byte{2, 2, 'r', '1', 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeDecisions(b)
		if err != nil {
			return
		}
		// Whatever decodes re-encodes to what it decoded: nothing was skipped or invented.
		parts := make([]queuedDecision, len(m.entries))
		for i, e := range m.entries {
			parts[i] = queuedDecision{w: m.workers[e.worker], cont: e.cont, prefix: e.prefix, anchor: e.anchor, hashes: e.hashes(nil), at: m.decidedUS}
		}
		again, _ := encodeDecisions(m.replica, m.epoch, m.seq, m.ttl, parts)
		m2, err := decodeDecisions(again)
		if err != nil || len(m2.entries) != len(m.entries) || (len(parts) > 0 && m2.decidedUS != m.decidedUS) || m2.replica != m.replica {
			t.Fatalf("re-encoded message: %v, %d entries of %d", err, len(m2.entries), len(m.entries))
		}
		for i, e := range m2.entries {
			o := m.entries[i]
			if m2.workers[e.worker] != m.workers[o.worker] || e.cont != o.cont || e.prefix != o.prefix || e.anchor != o.anchor || !bytes.Equal(e.raw, o.raw) {
				t.Fatalf("entry %d changed in a round trip: %+v, then %+v", i, o, e)
			}
		}
		// And applying it changes nothing that crashes.
		fn := newFakeNet()
		m0 := fn.join("r0", "")
		fn.join(m.replica, "")
		if _, err := NewDecisions(DecisionsConfig{Messenger: m0, Index: indexer.New(indexer.Options{TTL: time.Minute})}); err != nil {
			t.Fatal(err)
		}
		fn.inject(m.replica, "r0", gossip.KindDecisions, b)
	})
}

// conversationLoad records decisions as a chat fleet makes them: sessions whose prompts
// share a system prompt and grow by a turn each time, over 8 workers. Sessions of calls
// with different bases are different conversations.
func conversationLoad(d *Decisions, decisions int, base uint64) {
	system := sharePrompt(1, 64)
	sessions := make([][]uint64, 200)
	for i := range decisions {
		s := i % len(sessions)
		tag := base + uint64(10_000+i)
		if len(sessions[s]) == 0 || len(sessions[s]) > 900 {
			sessions[s] = append(append([]uint64(nil), system...), sharePrompt(tag, 8)...)
		} else {
			sessions[s] = append(sessions[s], sharePrompt(tag, 12)...)
		}
		d.Record(indexer.Worker{ID: fmt.Sprintf("w%d", s%8)}, sessions[s])
		if i%20 == 19 {
			d.Flush(context.Background())
		}
	}
	d.Flush(context.Background())
}

// BenchmarkDecisionBytes reports the bytes one decision costs per peer, with suffixes
// (the default) and with whole chains every time (FullEvery 1), for a chat workload.
func BenchmarkDecisionBytes(b *testing.B) {
	for _, bc := range []struct {
		name      string
		fullEvery int
	}{{"suffixes", 0}, {"whole-chains", 1}} {
		b.Run(bc.name, func(b *testing.B) {
			fn := newFakeNet()
			ma := fn.join("a", "")
			fn.join("b", "")
			d, err := NewDecisions(DecisionsConfig{Messenger: ma, Index: indexer.New(indexer.Options{TTL: time.Minute}), FullEvery: bc.fullEvery})
			if err != nil {
				b.Fatal(err)
			}
			const perOp = 2000
			base := uint64(0)
			for b.Loop() {
				base += 1 << 32
				conversationLoad(d, perOp, base)
			}
			st := d.m.Stats()
			b.ReportMetric(float64(st.BytesOut["decisions"])/float64(b.N*perOp), "bytes/decision")
			b.ReportMetric(float64(st.DecisionBlocksOut)/float64(b.N*perOp), "blocks/decision")
		})
	}
}

func BenchmarkDecisionEncodeDecode(b *testing.B) {
	parts := make([]queuedDecision, 16)
	for i := range parts {
		parts[i] = queuedDecision{w: indexer.Worker{ID: fmt.Sprintf("worker-%d", i%4)}, cont: i%2 == 1, hashes: sharePrompt(uint64(i), 64)}
	}
	payload, _ := encodeDecisions("replica-1", 1, 1, time.Minute, parts)
	b.Run("encode", func(b *testing.B) {
		b.SetBytes(int64(len(payload)))
		for b.Loop() {
			encodeDecisions("replica-1", 1, 1, time.Minute, parts)
		}
		b.ReportMetric(float64(len(parts)*b.N)/b.Elapsed().Seconds(), "decisions/s")
	})
	b.Run("decode", func(b *testing.B) {
		b.SetBytes(int64(len(payload)))
		var buf []uint64
		for b.Loop() {
			m, err := decodeDecisions(payload)
			if err != nil {
				b.Fatal(err)
			}
			for _, e := range m.entries {
				buf = e.hashes(buf)
			}
		}
		b.ReportMetric(float64(len(parts)*b.N)/b.Elapsed().Seconds(), "decisions/s")
	})
}

// TestGossipPeersUseAdvertisedPeerAddresses: snapshot pulls go to alive members' peer
// ports, never to this replica or a dead one.
func TestGossipPeersUseAdvertisedPeerAddresses(t *testing.T) {
	fn := newFakeNet()
	m := fn.join("a", "127.0.0.1:1")
	fn.join("b", "127.0.0.1:2")
	fn.join("c", "127.0.0.1:3")
	fn.kill("c")
	got := GossipPeers(m)()
	if len(got) != 1 || got[0] != (SnapshotPeer{ID: "b", Addr: "127.0.0.1:2"}) {
		t.Fatalf("peers %v", got)
	}
}

// BenchmarkDecisionRecord is the hot-path cost of recording a decision with sharing on
// (the index's Store included), against the index alone: a conversation's next turn (its
// prompt grows by one block) and a new 512-block prompt.
func BenchmarkDecisionRecord(b *testing.B) {
	fn := newFakeNet()
	ma := fn.join("a", "")
	fn.join("b", "")
	for _, bc := range []struct {
		name  string
		share bool
		fresh bool
	}{{"next-turn/index-only", false, false}, {"next-turn/shared", true, false}, {"new-prompt/index-only", false, true}, {"new-prompt/shared", true, true}} {
		b.Run(bc.name, func(b *testing.B) {
			idx := indexer.New(indexer.Options{TTL: time.Minute})
			d, err := NewDecisions(DecisionsConfig{Messenger: ma, Index: idx})
			if err != nil {
				b.Fatal(err)
			}
			var rec interface {
				Record(indexer.Worker, []uint64)
			} = idx
			if bc.share {
				rec = d
			}
			w := indexer.Worker{ID: "w"}
			// 64 conversations of up to 768 blocks, each turn one block longer.
			convs := make([][]uint64, 64)
			for k := range convs {
				convs[k] = sharePrompt(uint64(k), 768)
			}
			i := 0
			for b.Loop() {
				i++
				if bc.fresh {
					rec.Record(w, sharePrompt(uint64(1e6+i), 512))
				} else {
					rec.Record(w, convs[i%64][:512+(i/64)%256])
				}
				if i%64 == 0 {
					d.Flush(context.Background())
				}
			}
		})
	}
}

func TestReorderedDecisionMessagesAreLateNotLost(t *testing.T) {
	type arrival struct{ epoch, seq uint64 }
	cases := []struct {
		name       string
		arrivals   []arrival
		gaps, late uint64
	}{
		{"in order", []arrival{{1, 1}, {1, 2}, {1, 3}}, 0, 0},
		{"one overtaken", []arrival{{1, 1}, {1, 3}, {1, 2}}, 1, 1},
		{"one lost", []arrival{{1, 1}, {1, 3}, {1, 4}}, 1, 0},
		{"two skipped, one late", []arrival{{1, 1}, {1, 4}, {1, 3}}, 2, 1},
		{"a restart starts over", []arrival{{1, 5}, {2, 1}, {2, 2}}, 0, 0},
		{"a duplicate is neither", []arrival{{1, 1}, {1, 2}, {1, 2}}, 0, 0},
		{"older than the first seen is neither", []arrival{{1, 5}, {1, 4}, {1, 6}}, 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fn := newFakeNet()
			d, err := NewDecisions(DecisionsConfig{Messenger: fn.join("b", ""), Index: indexer.New(indexer.Options{TTL: time.Hour})})
			if err != nil {
				t.Fatal(err)
			}
			for _, a := range tc.arrivals {
				d.noteSeq("a", a.epoch, a.seq)
			}
			if st := d.m.Stats(); st.DecisionGaps != tc.gaps || st.DecisionLate != tc.late {
				t.Fatalf("gaps %d late %d, want %d %d", st.DecisionGaps, st.DecisionLate, tc.gaps, tc.late)
			}
		})
	}
}

// TestReceiverUnderACapHoldsWhatTheOriginHolds: both replicas cap a worker's blocks, and the
// origin records decisions longer than a packet (and one longer than a whole message). The
// receiver stores each decision as the origin did, tail to head, so the cap evicts the same
// blocks on both and the receiver predicts every decision's overlap as the origin does. Cut
// head first and applied piece by piece, the receiver evicted heads and saw nothing of the
// chains whose head it lost.
func TestReceiverUnderACapHoldsWhatTheOriginHolds(t *testing.T) {
	fn := newFakeNet()
	ma, mb := fn.join("a", ""), fn.join("b", "")
	opts := indexer.Options{TTL: time.Minute, MaxBlocksPerWorker: 1500}
	idxA, idxB := indexer.New(opts), indexer.New(opts)
	da, err := NewDecisions(DecisionsConfig{Messenger: ma, Index: idxA, MaxMessageBytes: 8 << 10})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewDecisions(DecisionsConfig{Messenger: mb, Index: idxB}); err != nil {
		t.Fatal(err)
	}
	w := indexer.Worker{ID: "w0"}
	var prompts [][]uint64
	for i, n := range []int{400, 300, 1200, 250, 500} { // 1200 blocks: more than one 8 KiB message
		p := sharePrompt(uint64(100+i), n)
		prompts = append(prompts, p)
		da.Record(w, p)
		da.Flush(context.Background()) // each decision in a batch of its own
	}
	assertSameHoldings(t, idxA, idxB, w, prompts)
}

// assertSameHoldings fails unless the receiver predicts what the origin predicts for each
// prompt, and holds as many blocks of w.
func assertSameHoldings(t *testing.T, origin, receiver *indexer.Index, w indexer.Worker, prompts [][]uint64) {
	t.Helper()
	for i, p := range prompts {
		var a, b int
		for _, m := range origin.FindMatches(p, nil) {
			a = m.Blocks
		}
		for _, m := range receiver.FindMatches(p, nil) {
			b = m.Blocks
		}
		if a != b {
			t.Errorf("decision %d (%d blocks): the origin predicts %d, the receiver %d", i, len(p), a, b)
		}
	}
	if a, b := origin.Blocks(w), receiver.Blocks(w); a != b {
		t.Errorf("the origin holds %d blocks of %s, the receiver %d", a, w.ID, b)
	}
}

// cappedPair is two replicas sharing decisions over a fake network, each with an index
// capped at capBlocks per worker: a sends, b receives.
func cappedPair(t *testing.T, capBlocks int) (da, db *Decisions, idxA, idxB *indexer.Index) {
	t.Helper()
	fn := newFakeNet()
	ma, mb := fn.join("a", ""), fn.join("b", "")
	opts := indexer.Options{TTL: time.Minute, MaxBlocksPerWorker: capBlocks}
	idxA, idxB = indexer.New(opts), indexer.New(opts)
	var err error
	if da, err = NewDecisions(DecisionsConfig{Messenger: ma, Index: idxA}); err != nil {
		t.Fatal(err)
	}
	if db, err = NewDecisions(DecisionsConfig{Messenger: mb, Index: idxB}); err != nil {
		t.Fatal(err)
	}
	return da, db, idxA, idxB
}

// TestASuffixRefreshesTheWholeChainAtTheReceiver: a conversation's next turn goes to peers
// as its new blocks only, but the origin stores the whole prompt again, which makes its
// opening the most recent; the receiver, walking back from the suffix's anchor, must
// too, or a cap evicts the opening there first and hides the conversation.
func TestASuffixRefreshesTheWholeChainAtTheReceiver(t *testing.T) {
	da, db, idxA, idxB := cappedPair(t, 1000)
	w := indexer.Worker{ID: "w0"}
	opening := sharePrompt(1, 400)
	turn2 := append(slices.Clone(opening), sharePrompt(2, 50)...)
	turn3 := append(slices.Clone(turn2), sharePrompt(3, 50)...)
	other, another := sharePrompt(4, 500), sharePrompt(5, 300)
	for _, p := range [][]uint64{opening, turn2, other, turn3, another} {
		da.Record(w, p)
		da.Flush(context.Background())
	}
	assertSameHoldings(t, idxA, idxB, w, [][]uint64{turn3, other, another})
	if st := db.m.Stats(); st.DecisionAnchorsExpanded != 2 || st.DecisionAnchorsMissed != 0 {
		t.Errorf("anchors expanded %d, missed %d; want 2 and 0", st.DecisionAnchorsExpanded, st.DecisionAnchorsMissed)
	}
	if got := db.m.Stats().DecisionBlocksIn; got != 1300 {
		t.Errorf("%d blocks crossed, want 1300 (each block once)", got)
	}
}

// TestARepeatRefreshesTheChainAtTheReceiver: a decision that brings no new block (a prompt
// sent again, or a request's end refreshing its prompt) still refreshes the chain on the
// receiver, so that the cap there evicts what the origin evicts.
func TestARepeatRefreshesTheChainAtTheReceiver(t *testing.T) {
	da, db, idxA, idxB := cappedPair(t, 1000)
	w := indexer.Worker{ID: "w0"}
	first, second, third := sharePrompt(1, 400), sharePrompt(2, 400), sharePrompt(3, 300)
	// first is refreshed after second, so the cap takes second's blocks for third's.
	for _, p := range [][]uint64{first, second, first, third} {
		da.Record(w, p)
		da.Flush(context.Background())
	}
	assertSameHoldings(t, idxA, idxB, w, [][]uint64{first, second, third})
	if got := db.m.Stats().DecisionBlocksIn; got != 1101 {
		t.Errorf("%d blocks crossed, want 1101 (each block once, and the repeat's last)", got)
	}
}

// TestDecisionLagIsMeasuredFromTheDecision: the lag a receiver observes runs from when the
// oldest decision of the message was made, not from when the batch was flushed.
func TestDecisionLagIsMeasuredFromTheDecision(t *testing.T) {
	clock := &shareClock{t: time.Unix(1_700_000_000, 0)}
	fn := newFakeNet()
	ma, mb := fn.join("a", ""), fn.join("b", "")
	da, err := NewDecisions(DecisionsConfig{Messenger: ma, Index: indexer.New(indexer.Options{}), now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	db, err := NewDecisions(DecisionsConfig{Messenger: mb, Index: indexer.New(indexer.Options{}), now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	da.Record(indexer.Worker{ID: "w0"}, sharePrompt(1, 4))
	clock.advance(25 * time.Millisecond)
	da.Record(indexer.Worker{ID: "w1"}, sharePrompt(2, 4))
	clock.advance(10 * time.Millisecond)
	da.Flush(context.Background())
	lag := db.m.Stats().DecisionLag
	if lag.Total() != 1 || lag.Quantile(1) != 40*time.Millisecond || lag.Sum != 35*time.Millisecond {
		t.Fatalf("lag: %d observed, max bucket %v, sum %v; want 1 in the 40 ms bucket, 35 ms", lag.Total(), lag.Quantile(1), lag.Sum)
	}
}

func TestLagHistogramQuantiles(t *testing.T) {
	var h lagHistogram
	for _, d := range []time.Duration{-time.Second, 0, time.Millisecond, 4 * time.Millisecond, 45 * time.Millisecond, time.Minute} {
		h.observe(d)
	}
	before := h.snapshot()
	for range 94 {
		h.observe(2 * time.Millisecond)
	}
	s := h.snapshot()
	tests := []struct {
		q    float64
		want time.Duration
	}{{0.01, 500 * time.Microsecond}, {0.03, time.Millisecond}, {0.5, 2 * time.Millisecond}, {0.98, 5 * time.Millisecond}, {0.99, 50 * time.Millisecond}, {1, -1}}
	for _, tc := range tests {
		if got := s.Quantile(tc.q); got != tc.want {
			t.Errorf("q%.2f = %v, want %v", tc.q, got, tc.want)
		}
	}
	if d := s.Since(before); d.Total() != 94 || d.Quantile(1) != 2*time.Millisecond {
		t.Errorf("since: %d, max %v; want 94 at 2 ms", d.Total(), d.Quantile(1))
	}
	if (LagHistogram{}).Quantile(0.5) != -1 {
		t.Error("an empty histogram has a median")
	}
}

// TestARepeatWithinATickIsNotSentAgain: a decision that left the index as it was (the same
// decision, or one it begins, was recorded within the same tick, and went to the peers then)
// is not queued again, and takes no lock of the sharing: every request of a hot prompt
// records it twice.
func TestARepeatWithinATickIsNotSentAgain(t *testing.T) {
	fn := newFakeNet()
	clock := &shareClock{t: time.Unix(1000, 0)}
	var got captured
	fn.join("b", "").Handle(gossip.KindDecisions, got.handler(t))
	idx := indexer.New(indexer.Options{TTL: time.Minute, Now: clock.now})
	d, err := NewDecisions(DecisionsConfig{Messenger: fn.join("a", ""), Index: idx, now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	p, w := sharePrompt(1, 10), indexer.Worker{ID: "w"}
	steps := []struct {
		name   string
		do     func()
		record []uint64
		want   []string
	}{
		{name: "new chain goes whole", record: p, want: []string{"w:false:10"}},
		{name: "the first repeat refreshes the peers", record: p, want: []string{"w:true:1"}},
		{name: "a repeat within the tick sends nothing", record: p},
		{name: "nor does a prefix of it", record: p[:4]},
		{name: "the next tick refreshes again", do: func() { clock.advance(10 * time.Millisecond) }, record: p,
			want: []string{"w:true:1"}},
	}
	for _, st := range steps {
		if st.do != nil {
			st.do()
		}
		d.Record(w, st.record)
		d.Flush(context.Background())
		if g := got.take(); !slices.Equal(g, st.want) {
			t.Fatalf("%s: peer got %v, want %v", st.name, g, st.want)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		d.Record(w, p)
	}()
	poll.Holds(t, 10*time.Second, "a repeated decision recorded while the sharing was locked", poll.Closed(done))
}
