package kvevents

import (
	"errors"
	"reflect"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

const bs = 16

var w0 = indexer.Worker{ID: "w0"}

// matched is how many leading blocks of tokens w holds in x.
func matched(x *indexer.Index, w indexer.Worker, tokens []uint32, lora string) int {
	seq := indexer.SequenceHashes(tokens, bs, indexer.Seed(lora, ""), nil)
	for _, m := range x.FindMatches(seq, nil) {
		if m.Worker == w {
			return m.Blocks
		}
	}
	return 0
}

func newTranslator(t testing.TB, w indexer.Worker) *Translator {
	t.Helper()
	tr, err := NewTranslator(w, bs, 0)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// store is a BlockStored of the given engine hashes over tokens.
func store(hashes []EngineHash, parent EngineHash, hasParent bool, tokens []uint32) Event {
	return Event{Kind: indexer.Stored, BlockHashes: hashes, Parent: parent, HasParent: hasParent, TokenIDs: tokens, BlockSize: bs}
}

func remove(hashes ...EngineHash) Event { return Event{Kind: indexer.Removed, BlockHashes: hashes} }

func apply(t *testing.T, tr *Translator, sink Sink, evs ...Event) Counts {
	t.Helper()
	c, err := tr.Apply(Batch{Events: evs}, sink)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestStoredChainsFromParentToTheRouterKeysOfTheWholePrompt(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	prompt := seqTokens(1000, 4*bs)
	// The engine stores the prompt in two steps, the second naming the first's last block.
	c := apply(t, tr, x,
		store([]EngineHash{101, 102}, 0, false, prompt[:2*bs]),
		store([]EngineHash{103, 104}, 102, true, prompt[2*bs:]))
	if c.Events != 2 || c.Blocks != 4 {
		t.Fatalf("counts %+v", c)
	}
	if got := matched(x, w0, prompt, ""); got != 4 {
		t.Fatalf("router sees %d of 4 blocks", got)
	}
	// The keys are the router's own: the same prompt hashed by the router matches, and the
	// engine's hashes appear nowhere.
	want := indexer.SequenceHashes(prompt, bs, indexer.BaseSeed, nil)
	snap := tr.Snapshot()
	for i, h := range []EngineHash{101, 102, 103, 104} {
		if snap[h] != want[i] {
			t.Fatalf("engine block %d -> %x, want router key %x", h, snap[h], want[i])
		}
	}
}

func TestUnknownParentIsCountedAndNothingInvented(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	c := apply(t, tr, x, store([]EngineHash{2}, 999, true, seqTokens(0, bs)))
	if c.UnknownParent != 1 || c.Blocks != 0 {
		t.Fatalf("counts %+v", c)
	}
	if x.Blocks(w0) != 0 || tr.Len() != 0 {
		t.Fatalf("index has %d blocks, translator %d", x.Blocks(w0), tr.Len())
	}
	// A child of the dropped block is dropped too: its parent is now unknown.
	c = apply(t, tr, x, store([]EngineHash{3}, 2, true, seqTokens(bs, bs)))
	if c.UnknownParent != 1 {
		t.Fatalf("counts %+v", c)
	}
}

func TestRemovedResolvesAndUnknownHashesAreCounted(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	prompt := seqTokens(0, 3*bs)
	apply(t, tr, x, store([]EngineHash{1, 2, 3}, 0, false, prompt))
	c := apply(t, tr, x, remove(3, 77))
	if c.UnknownRemoved != 1 || c.Blocks != 1 {
		t.Fatalf("counts %+v", c)
	}
	if got := matched(x, w0, prompt, ""); got != 2 {
		t.Fatalf("after removing the tail the worker holds %d blocks, want 2", got)
	}
	if tr.Len() != 2 {
		t.Fatalf("translator remembers %d blocks, want 2", tr.Len())
	}
}

func TestClearedForgetsEverything(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	prompt := seqTokens(0, 2*bs)
	apply(t, tr, x, store([]EngineHash{1, 2}, 0, false, prompt), Event{Kind: indexer.Cleared})
	if x.Blocks(w0) != 0 || tr.Len() != 0 {
		t.Fatalf("after clear: index %d, translator %d", x.Blocks(w0), tr.Len())
	}
	// A later child of a cleared block has no parent to chain from.
	if c := apply(t, tr, x, store([]EngineHash{3}, 2, true, seqTokens(99, bs))); c.UnknownParent != 1 {
		t.Fatalf("counts %+v", c)
	}
}

func TestOtherBlockSizeIsDroppedAndCounted(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	ev := Event{Kind: indexer.Stored, BlockHashes: []EngineHash{1}, TokenIDs: seqTokens(0, 32), BlockSize: 32}
	if c := apply(t, tr, x, ev); c.BlockSizeMismatch != 1 || x.Blocks(w0) != 0 {
		t.Fatalf("counts %+v, index %d", c, x.Blocks(w0))
	}
}

func TestInvalidBatchAppliesNothing(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	b := Batch{Events: []Event{
		store([]EngineHash{1}, 0, false, seqTokens(0, bs)),
		{Kind: indexer.Stored, BlockHashes: []EngineHash{2}, TokenIDs: seqTokens(0, 3), BlockSize: bs}, // bad
	}}
	if _, err := tr.Apply(b, x); !errors.Is(err, ErrMalformed) {
		t.Fatalf("Apply error %v, want ErrMalformed", err)
	}
	if x.Blocks(w0) != 0 || tr.Len() != 0 {
		t.Fatalf("a bad batch was partly applied: index %d, translator %d", x.Blocks(w0), tr.Len())
	}
}

func TestLoRANameSeedsTheKeys(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	prompt := seqTokens(0, bs)
	ev := store([]EngineHash{1}, 0, false, prompt)
	ev.LoRAName = "sql"
	apply(t, tr, x, ev)
	if matched(x, w0, prompt, "sql") != 1 || matched(x, w0, prompt, "") != 0 {
		t.Fatal("a LoRA block must match only prompts of that adapter")
	}
}

func TestBlocksTheRouterCannotTellApartLeaveWithTheLastHolder(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	prompt := seqTokens(0, bs)
	// Same tokens under two engine hashes (say, two cache salts), and the first also offloaded
	// to CPU: three holders of one router key.
	cpu := store([]EngineHash{1}, 0, false, prompt)
	cpu.Medium = "CPU"
	apply(t, tr, x, store([]EngineHash{1}, 0, false, prompt), store([]EngineHash{2}, 0, false, prompt), cpu)
	for i, ev := range []Event{remove(1), remove(2)} {
		apply(t, tr, x, ev)
		if matched(x, w0, prompt, "") != 1 {
			t.Fatalf("after removal %d the block left the index while other copies remain", i)
		}
	}
	cpuRemove := remove(1)
	cpuRemove.Medium = "CPU"
	apply(t, tr, x, cpuRemove)
	if matched(x, w0, prompt, "") != 0 {
		t.Fatal("the block stayed after its last copy was removed")
	}
}

func TestEngineHashReusedForOtherTokensMovesTheKey(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	a, b := seqTokens(0, bs), seqTokens(500, bs)
	apply(t, tr, x, store([]EngineHash{1}, 0, false, a), store([]EngineHash{1}, 0, false, b))
	if matched(x, w0, a, "") != 0 || matched(x, w0, b, "") != 1 {
		t.Fatal("the reused engine hash must name only its new block")
	}
	apply(t, tr, x, remove(1))
	if x.Blocks(w0) != 0 {
		t.Fatalf("index keeps %d blocks", x.Blocks(w0))
	}
}

func TestCapDropsStoresPastIt(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr, err := NewTranslator(w0, bs, 2)
	if err != nil {
		t.Fatal(err)
	}
	c := apply(t, tr, x, store([]EngineHash{1, 2, 3}, 0, false, seqTokens(0, 3*bs)))
	if c.OverCapacity != 3 || tr.Len() != 0 {
		t.Fatalf("counts %+v, len %d", c, tr.Len())
	}
}

func TestPurgeSnapshotAndRestore(t *testing.T) {
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	prompt := seqTokens(0, 2*bs)
	apply(t, tr, x, store([]EngineHash{1, 2}, 0, false, prompt))
	snap := tr.Snapshot()
	tr.Purge()
	if tr.Len() != 0 {
		t.Fatal("Purge kept blocks")
	}
	other := newTranslator(t, w0)
	if err := other.Restore(snap); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(other.Snapshot(), snap) {
		t.Fatal("Restore did not load the snapshot")
	}
	// The restored map resolves removals and chains children.
	apply(t, other, x, store([]EngineHash{3}, 2, true, seqTokens(777, bs)), remove(1))
	full := append(append([]uint32{}, prompt...), seqTokens(777, bs)...)
	if got := matched(x, w0, full, ""); got != 0 {
		t.Fatalf("after removing the head the prefix match is %d, want 0", got)
	}
	if other.Len() != 2 {
		t.Fatalf("len %d, want 2", other.Len())
	}
	small, _ := NewTranslator(w0, bs, 1)
	if err := small.Restore(snap); err == nil {
		t.Fatal("restoring past the cap succeeded")
	}
}

func TestNewTranslatorRejectsBadBlockSize(t *testing.T) {
	for _, n := range []int{0, -1, MaxBlockSize + 1} {
		if _, err := NewTranslator(w0, n, 0); err == nil {
			t.Errorf("block size %d accepted", n)
		}
	}
}
