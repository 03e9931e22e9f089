package kvevents

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// overlap is how many leading blocks of seq w holds in x.
func overlap(x *indexer.Index, w indexer.Worker, seq []uint64) int {
	for _, m := range x.FindMatches(seq, nil) {
		if m.Worker == w {
			return m.Blocks
		}
	}
	return 0
}

// applyFixture decodes a testdata fixture and applies it through a fresh translator.
func applyFixture(t *testing.T, name string, x *indexer.Index) Counts {
	t.Helper()
	b, err := Decode(loadFixture(t, name))
	if err != nil {
		t.Fatal(err)
	}
	c, err := newTranslator(t, w0).Apply(b, x)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// requestKeys is what the request side computes for fixturePrompt: the LoRA in the seed, the
// image and the salt through vLLM's extra keys.
func requestKeys(lora, salt string, mm ...indexer.MMItem) []uint64 {
	extras := indexer.VLLMBlockExtras(len(fixturePrompt)/bs, bs, salt, mm, nil)
	return indexer.SequenceHashesExtra(fixturePrompt, bs, indexer.Seed(lora, ""), extras, nil)
}

// TestSlidingWindowRemovalsKeepTheFullAttentionPrefix fails if the translator merges KV cache
// groups: the sliding-window group stores and then removes the last block under the same
// engine hash as the full-attention group's, and only the full-attention group says what a
// prefix hit has.
func TestSlidingWindowRemovalsKeepTheFullAttentionPrefix(t *testing.T) {
	x := indexer.New(indexer.Options{})
	c := applyFixture(t, "vllm_map_hybrid.hex", x)
	img := indexer.MMItem{ID: "img-1", Offset: 3, Length: 20}
	if got := overlap(x, w0, requestKeys("adapter", "salt-x", img)); got != 3 {
		t.Fatalf("overlap %d blocks after the sliding-window group's removal, want all 3 of the full-attention group", got)
	}
	if c.OtherGroup != 2 || c.UnknownRemoved != 0 {
		t.Fatalf("counts %+v: want the sliding-window group's store and removal counted as another group's", c)
	}

	// The same removal in the full-attention group does take the block out.
	tr := newTranslator(t, indexer.Worker{ID: "w1"})
	b, err := Decode(loadFixture(t, "vllm_array_events_hybrid.hex"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Apply(b, x); err != nil {
		t.Fatal(err)
	}
	plain := indexer.SequenceHashes(fixturePrompt, bs, indexer.BaseSeed, nil)
	if got := overlap(x, indexer.Worker{ID: "w1"}, plain); got != 2 {
		t.Fatalf("overlap %d after a sliding-window removal, want 2", got)
	}
	apply(t, tr, x, Event{Kind: indexer.Removed, BlockHashes: []EngineHash{UintHash(12)}, Medium: "GPU", HasGroup: true})
	if got := overlap(x, indexer.Worker{ID: "w1"}, plain); got != 1 {
		t.Fatalf("overlap %d after the full-attention group's removal, want 1", got)
	}
}

func TestGroupKindsDecideWhatFeedsTheIndex(t *testing.T) {
	prompt := seqTokens(300, 2*bs)
	full := indexer.SequenceHashes(prompt, bs, indexer.BaseSeed, nil)
	cases := []struct {
		name   string
		ev     Event
		feeds  bool
		blocks int
	}{
		{"no group (older vLLM, SGLang)", Event{}, true, 2},
		{"group 0 without a kind", Event{HasGroup: true}, true, 2},
		{"another group without a kind", Event{HasGroup: true, Group: 3}, false, 0},
		{"mla", Event{HasGroup: true, Group: 2, SpecKind: "mla_attention"}, true, 2},
		{"mamba in group 0", Event{HasGroup: true, SpecKind: "mamba"}, false, 0},
		{"a window without a kind", Event{HasGroup: true, Group: 1, SlidingWindow: 512}, false, 0},
		{"chunked local attention", Event{HasGroup: true, Group: 1, SpecKind: "chunked_local_attention"}, false, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			x := indexer.New(indexer.Options{})
			tr := newTranslator(t, w0)
			ev := store([]EngineHash{1, 2}, 0, false, prompt)
			ev.Group, ev.HasGroup, ev.SpecKind, ev.SlidingWindow = c.ev.Group, c.ev.HasGroup, c.ev.SpecKind, c.ev.SlidingWindow
			cnt := apply(t, tr, x, ev)
			if got := overlap(x, w0, full); got != c.blocks {
				t.Fatalf("overlap %d, want %d", got, c.blocks)
			}
			if (cnt.OtherGroup == 0) != c.feeds {
				t.Fatalf("counts %+v", cnt)
			}
			// A removal names only the group: the kind learned from the store decides.
			rm := remove(2)
			rm.Group, rm.HasGroup = c.ev.Group, c.ev.HasGroup
			cnt = apply(t, tr, x, rm)
			if c.feeds && overlap(x, w0, full) != 1 || !c.feeds && cnt.OtherGroup != 1 {
				t.Fatalf("after the removal: overlap %d, counts %+v", overlap(x, w0, full), cnt)
			}
		})
	}
}

func TestExtraKeysKeepImagesAndSaltsApart(t *testing.T) {
	x := indexer.New(indexer.Options{})
	applyFixture(t, "vllm_map_hybrid.hex", x)
	img := indexer.MMItem{ID: "img-1", Offset: 3, Length: 20}
	cases := []struct {
		name string
		seq  []uint64
		want int
	}{
		{"the same request", requestKeys("adapter", "salt-x", img), 3},
		{"another image, same tokens", requestKeys("adapter", "salt-x", indexer.MMItem{ID: "img-2", Offset: 3, Length: 20}), 0},
		{"the image elsewhere", requestKeys("adapter", "salt-x", indexer.MMItem{ID: "img-1", Offset: 4, Length: 19}), 0},
		{"another salt", requestKeys("adapter", "salt-y", img), 0},
		{"no salt", requestKeys("adapter", "", img), 0},
		{"no LoRA", requestKeys("", "salt-x", img), 0},
		{"an image the router cannot name", requestKeys("adapter", "salt-x", indexer.MMItem{Offset: 3, Length: 20}), 0},
		{"tokens only (the bug: one key for every image)", indexer.SequenceHashes(fixturePrompt, bs, indexer.Seed("adapter", ""), nil), 0},
	}
	for _, c := range cases {
		if got := overlap(x, w0, c.seq); got != c.want {
			t.Errorf("%s: overlap %d, want %d", c.name, got, c.want)
		}
	}
}

func TestEnginePagesSmallerThanARouterBlockAreRegrouped(t *testing.T) {
	x := indexer.New(indexer.Options{})
	b, err := Decode(loadFixture(t, "sglang_pages.hex"))
	if err != nil {
		t.Fatal(err)
	}
	tr := newTranslator(t, w0)
	stores := Batch{Events: b.Events[:32]}
	c, err := tr.Apply(stores, x)
	if err != nil {
		t.Fatal(err)
	}
	if c.Blocks != 2 || c.UnknownParent != 0 || c.BlockSizeMismatch != 0 || tr.Len() != 32 {
		t.Fatalf("counts %+v, %d pages remembered", c, tr.Len())
	}
	if got := matched(x, w0, sglangPrompt, ""); got != 2 {
		t.Fatalf("overlap %d, want 2 router blocks from 32 one-token pages", got)
	}
	// The leaf's pages go one by one; the router block leaves with the page that completed it.
	if _, err := tr.Apply(Batch{Events: b.Events[32:]}, x); err != nil {
		t.Fatal(err)
	}
	if got := matched(x, w0, sglangPrompt, ""); got != 1 || tr.Len() != 16 {
		t.Fatalf("overlap %d with %d pages after removing the second block's pages, want 1 and 16", got, tr.Len())
	}
	// A page whose parent was never seen breaks the chain: nothing invented.
	c = apply(t, tr, x, Event{Kind: indexer.Stored, BlockHashes: []EngineHash{IntHash(-77)}, Parent: IntHash(-78),
		HasParent: true, TokenIDs: []uint32{1}, BlockSize: 1})
	if c.UnknownParent != 1 {
		t.Fatalf("counts %+v", c)
	}

	x = indexer.New(indexer.Options{})
	applyFixture(t, "sglang_bigram.hex", x)
	if got := matched(x, w0, bigramPrompt, ""); got != 1 {
		t.Fatalf("bigram pages: overlap %d, want 1", got)
	}
}

// rawPub is a bare ZMQ PUB socket bound on loopback, for payloads this package did not encode.
func rawPub(t *testing.T) zmq4.Socket {
	t.Helper()
	pub := zmq4.NewPub(context.Background())
	t.Cleanup(func() { _ = pub.Close() })
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	return pub
}

func TestSGLangFixtureThroughTheSubscriber(t *testing.T) {
	pub := rawPub(t)
	sink := newSink()
	sub := startSub(t, Config{Endpoint: tcp(pub.Addr()), Worker: w0, Sink: sink})
	poll.Holds(t, 15*time.Second, "the subscription", func() bool { return len(pub.(zmq4.Topics).Topics()) > 0 })
	msg := zmq4.NewMsgFrom([]byte("kv@sglang"), binary.BigEndian.AppendUint64(nil, 0), loadFixture(t, "sglang_pages.hex"))
	if err := pub.Send(msg); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 15*time.Second, "the batch applied", func() bool { return value(t, sub.m.lastSeq) == 0 && value(t, sub.m.events) > 0 })
	if got := matched(sink.Index, w0, sglangPrompt, ""); got != 1 {
		t.Fatalf("overlap %d, want 1 (two blocks stored, the second removed)", got)
	}
	if got := value(t, sub.m.decodeErrors); got != 0 {
		t.Fatalf("%v messages dropped", got)
	}
}

func TestReplayFrameLayouts(t *testing.T) {
	seq := binary.BigEndian.AppendUint64(nil, 5)
	p := []byte{0x90}
	cases := []struct {
		name   string
		frames [][]byte
		ok     bool
	}{
		{"[seq, payload]", [][]byte{seq, p}, true},
		{"vLLM: [\"\", seq, payload]", [][]byte{{}, seq, p}, true},
		{"[topic, seq, payload]", [][]byte{[]byte("kv"), seq, p}, true},
		{"llm-d: [\"\", topic, seq, payload]", [][]byte{{}, []byte("kv"), seq, p}, true},
		{"identity echoed: [id, \"\", topic, seq, payload]", [][]byte{[]byte("id"), {}, []byte("kv"), seq, p}, true},
		{"one frame", [][]byte{seq}, false},
		{"short sequence", [][]byte{{}, {1, 2}, p}, false},
		{"four frames without the delimiter", [][]byte{[]byte("x"), []byte("kv"), seq, p}, false},
		{"five frames without the delimiter", [][]byte{[]byte("id"), []byte("x"), []byte("kv"), seq, p}, false},
		{"six frames", [][]byte{{}, {}, {}, {}, seq, p}, false},
	}
	for _, c := range cases {
		s, payload, ok := replayFrames(c.frames)
		if ok != c.ok || ok && (binary.BigEndian.Uint64(s) != 5 || len(payload) != 1) {
			t.Errorf("%s: ok %v, want %v", c.name, ok, c.ok)
		}
	}
}

// TestReplayAnswersWithATopicAreAccepted runs a ROUTER that answers as llm-d-inference-sim
// does, [identity, "", topic, seq, payload], which a DEALER receives as four frames.
func TestReplayAnswersWithATopicAreAccepted(t *testing.T) {
	ctx := context.Background()
	router := rawRouter(t)
	var e engine
	var payloads [][]byte
	for i := range 3 {
		p, err := Encode(Batch{Events: []Event{e.stored(promptN(i))}}, true)
		if err != nil {
			t.Fatal(err)
		}
		payloads = append(payloads, p)
	}
	go func() {
		m, err := router.Recv()
		if err != nil {
			return
		}
		id := m.Frames[0]
		for i, p := range payloads {
			_ = router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte("kv@sim"), binary.BigEndian.AppendUint64(nil, uint64(i)), p))
		}
		_ = router.Send(zmq4.NewMsgFrom(id, []byte{}, []byte("kv@sim"), binary.BigEndian.AppendUint64(nil, ^uint64(0)), []byte{}))
	}()
	s := newTestSub(t, Config{Endpoint: "tcp://127.0.0.1:1", Worker: w0, Sink: newSink()})
	got, err := s.fetchReplay(ctx, tcp(router.Addr()), 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[2].seq != 2 || string(got[1].payload) != string(payloads[1]) {
		t.Fatalf("replayed %d messages: %+v", len(got), got)
	}
}
