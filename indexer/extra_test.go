package indexer

import (
	"slices"
	"testing"
)

func TestExtraDigestIsTypedAndOrdered(t *testing.T) {
	sum := func(f func(e *ExtraDigest)) uint64 {
		var e ExtraDigest
		f(&e)
		return e.Sum()
	}
	if got := sum(func(*ExtraDigest) {}); got != 0 {
		t.Fatalf("no elements: %#x, want 0", got)
	}
	same := [][2]func(e *ExtraDigest){
		{func(e *ExtraDigest) { e.Int(7) }, func(e *ExtraDigest) { e.Uint(7) }},
		{func(e *ExtraDigest) { e.String("salt") }, func(e *ExtraDigest) { e.StringBytes([]byte("salt")) }},
		{func(e *ExtraDigest) { e.String("x"); e.Reset(); e.String("a") }, func(e *ExtraDigest) { e.String("a") }},
	}
	for i, p := range same {
		if a, b := sum(p[0]), sum(p[1]); a != b || a == 0 {
			t.Errorf("pair %d: %#x and %#x, want equal and not 0", i, a, b)
		}
	}
	different := []func(e *ExtraDigest){
		func(e *ExtraDigest) { e.String("ab") },
		func(e *ExtraDigest) { e.String("a"); e.String("b") },
		func(e *ExtraDigest) { e.String("b"); e.String("a") },
		func(e *ExtraDigest) { e.Bytes([]byte("ab")) },
		func(e *ExtraDigest) { e.Tuple(2); e.String("a"); e.String("b") },
		func(e *ExtraDigest) { e.Tuple(2); e.String("img"); e.Int(3) },
		func(e *ExtraDigest) { e.Tuple(2); e.String("img"); e.Int(-3) },
		func(e *ExtraDigest) { e.String("img"); e.Int(3) },
		func(e *ExtraDigest) { e.Map(1); e.String("img"); e.Int(3) },
		func(e *ExtraDigest) { e.Uint(1 << 63) },
		func(e *ExtraDigest) { e.Int(-1 << 63) },
		func(e *ExtraDigest) { e.Float(3) },
		func(e *ExtraDigest) { e.Int(3) },
		func(e *ExtraDigest) { e.Nil() },
		func(e *ExtraDigest) { e.Bool(true) },
		func(e *ExtraDigest) { e.Bool(false) },
	}
	seen := map[uint64]int{}
	for i, f := range different {
		d := sum(f)
		if j, ok := seen[d]; ok {
			t.Errorf("elements %d and %d share the digest %#x", j, i, d)
		}
		seen[d] = i
	}
}

func TestVLLMBlockExtrasAttachAsVLLMDoes(t *testing.T) {
	digest := func(f func(e *ExtraDigest)) uint64 {
		var e ExtraDigest
		f(&e)
		return e.Sum()
	}
	mm := func(id string, off int) func(e *ExtraDigest) {
		return func(e *ExtraDigest) { e.Tuple(2); e.String(id); e.Int(int64(off)) }
	}
	// Blocks of 16: an image on tokens 10..40 overlaps blocks 0, 1 and 2 (offsets 10, -6, -22);
	// a second image on 40..44 starts in block 2 too (offset 8), after the first; the salt goes
	// on block 0 only, after the image; block 3 has nothing.
	items := []MMItem{{ID: "b", Offset: 40, Length: 4}, {ID: "a", Offset: 10, Length: 30}}
	got := VLLMBlockExtras(4, 16, "tenant", items, nil)
	want := []uint64{
		digest(func(e *ExtraDigest) { mm("a", 10)(e); e.String("tenant") }),
		digest(mm("a", -6)),
		digest(func(e *ExtraDigest) { mm("a", -22)(e); mm("b", 8)(e) }),
		0,
	}
	if !slices.Equal(got, want) {
		t.Fatalf("extras %#x, want %#x", got, want)
	}
	if got := VLLMBlockExtras(3, 16, "s", nil, nil); got[0] == 0 || got[1] != 0 || got[2] != 0 {
		t.Fatalf("salt only: %#x", got)
	}
	// An item without an identifier stops the keys before its first block.
	if got := VLLMBlockExtras(4, 16, "", []MMItem{{Offset: 20, Length: 4}}, nil); !slices.Equal(got, []uint64{0}) {
		t.Fatalf("unknown item: %#x, want one block", got)
	}
	if got := VLLMBlockExtras(0, 16, "s", nil, nil); len(got) != 0 {
		t.Fatalf("no blocks: %#x", got)
	}
}

func TestSequenceHashesExtra(t *testing.T) {
	tokens := tokenRange(0, 64)
	seed := Seed("lora-a", "")
	if got, want := SequenceHashesExtra(tokens, 16, seed, make([]uint64, 4), nil), SequenceHashes(tokens, 16, seed, nil); !slices.Equal(got, want) {
		t.Fatalf("zero extras changed the keys")
	}
	if got, want := SequenceHashesExtra(tokens, 16, seed, nil, nil), SequenceHashes(tokens, 16, seed, nil); !slices.Equal(got, want) {
		t.Fatalf("nil extras changed the keys")
	}
	salted := SequenceHashesExtra(tokens, 16, seed, VLLMBlockExtras(4, 16, "s", nil, nil), nil)
	plain := SequenceHashes(tokens, 16, seed, nil)
	for i := range salted {
		if salted[i] == plain[i] {
			t.Fatalf("block %d keeps its key under a salt on block 0: the chain must carry it", i)
		}
	}
	// A tail chained from its parent's key, as a BlockStored with a parent is keyed.
	local := BlockHashes(tokens, 16, seed, nil)
	extras := VLLMBlockExtras(4, 16, "s", []MMItem{{ID: "img", Offset: 33, Length: 2}}, nil)
	for i := range local {
		local[i] = MixExtra(local[i], extras[i])
	}
	whole := SequenceHashesExtra(tokens, 16, seed, extras, nil)
	if tail := Chain(whole[1], true, local[2:], nil); !slices.Equal(tail, whole[2:]) {
		t.Fatalf("tail from the parent differs")
	}
	if got := SequenceHashesExtra(tokens, 16, seed, extras[:2], nil); !slices.Equal(got, whole[:2]) {
		t.Fatalf("short extras: %#x, want the first two keys", got)
	}
	if MixExtra(5, 0) != 5 || MixExtra(5, 1) == 5 {
		t.Fatal("MixExtra must leave a block without extras alone and change one with")
	}
}

// TestExtraKeysArePinned fixes the keys of a salted prompt with an image, as
// TestSequenceHashesArePinned does for plain prompts: the KV-event side and the request side
// must agree, so a change here is a change of the definition.
func TestExtraKeysArePinned(t *testing.T) {
	extras := VLLMBlockExtras(3, 16, "tenant-a", []MMItem{{ID: "img-1", Offset: 3, Length: 20}}, nil)
	got := SequenceHashesExtra(tokenRange(0, 48), 16, BaseSeed, extras, nil)
	want := []uint64{0xaeb0e9d2b1f8f0b3, 0xff575568b78039f3, 0xb898622ae568d13b}
	if !slices.Equal(got, want) {
		t.Errorf("got %#x, want %#x", got, want)
	}
}
