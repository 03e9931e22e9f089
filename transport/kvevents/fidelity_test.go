package kvevents

import (
	"errors"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// These tests send what a vLLM engine publishes (msgpack, built field by field after
// vllm/distributed/kv_events.py and the block pool's events) through the real decoder and
// translator, and check that the router predicts the blocks the engine would hit.

// engineStep is one payload an engine publishes and the blocks the engine then hits for the
// request the test asks about.
type engineStep struct {
	what    string
	payload any // encoded with fixture
	want    int
}

// runEngine decodes and applies each step's payload in order, on one translator, and checks
// the overlap of seq after each.
func runEngine(t *testing.T, seq []uint64, steps []engineStep) {
	t.Helper()
	x := indexer.New(indexer.Options{})
	tr := newTranslator(t, w0)
	for _, s := range steps {
		b, err := Decode(fixture(t, s.payload))
		if err != nil {
			t.Fatalf("%s: decode: %v", s.what, err)
		}
		if _, err := tr.Apply(b, x); err != nil {
			t.Fatalf("%s: apply: %v", s.what, err)
		}
		if got := overlap(x, w0, seq); got != s.want {
			t.Fatalf("%s: the router predicts %d blocks, the engine hits %d", s.what, got, s.want)
		}
	}
}

// mapBatch is vLLM main's batch: a map, its events maps tagged by "type".
func mapBatch(events ...any) kv { return kv{"ts", 1754000000.0, "events", events} }

// storedMap is a BlockStored of vLLM main over tokens, hashes sha(first), sha(first+1)...
// after the block sha(parent) (0: none), in group with kind, plus extra fields.
func storedMap(first, n int, parent byte, tokens []uint32, group int, kind string, more ...any) kv {
	hashes := make([]any, n)
	for i := range hashes {
		hashes[i] = sha(byte(first + i))
	}
	var p any
	if parent != 0 {
		p = sha(parent)
	}
	ev := kv{"type", "BlockStored", "block_hashes", hashes, "parent_block_hash", p, "token_ids", tokens,
		"block_size", bs, "medium", "GPU"}
	if kind != "" {
		ev = append(ev, "group_idx", group, "kv_cache_spec_kind", kind)
	}
	return append(ev, more...)
}

// removedMap is a BlockRemoved of vLLM main of sha(h)... in group.
func removedMap(group int, hs ...byte) kv {
	hashes := make([]any, len(hs))
	for i, h := range hs {
		hashes[i] = sha(h)
	}
	return kv{"type", "BlockRemoved", "block_hashes", hashes, "medium", "GPU", "group_idx", group}
}

// TestACopyEvictedKeepsTheBlockWhileAnotherCopyRemains: vLLM does not de-duplicate. Two
// requests that computed the same blocks at once each cache them, so one hash names two
// physical blocks, each stored and evicted on its own: the engine hits a block while either
// copy remains.
func TestACopyEvictedKeepsTheBlockWhileAnotherCopyRemains(t *testing.T) {
	prompt := seqTokens(3000, 4*bs)
	runEngine(t, indexer.SequenceHashes(prompt, bs, indexer.BaseSeed, nil), []engineStep{
		{"four blocks stored", mapBatch(storedMap(1, 4, 0, prompt, 0, "")), 4},
		{"blocks 3 and 4 cached again by a concurrent request", mapBatch(storedMap(3, 2, 2, prompt[2*bs:], 0, "")), 4},
		{"one copy of block 3 evicted", mapBatch(removedMap(0, 3)), 4},
		{"one copy of block 4 evicted", mapBatch(removedMap(0, 4)), 4},
		{"the other copy of block 3 evicted", mapBatch(removedMap(0, 3)), 2},
		{"the other copy of block 4 evicted", mapBatch(removedMap(0, 4)), 2},
		{"block 3 stored once more", mapBatch(storedMap(3, 1, 2, prompt[2*bs:3*bs], 0, "")), 3},
		{"and evicted: no copy left", mapBatch(removedMap(0, 3)), 2},
	})
}

// TestABlockIsAHitOnlyWhileEveryFullAttentionGroupHoldsIt: a model with two full-attention
// groups (different head sizes, say) stores each block in both; vLLM's coordinator hits a
// block only where every full-attention group has it, so one group's eviction ends the hit
// there. A sliding-window group beside them does not take part.
func TestABlockIsAHitOnlyWhileEveryFullAttentionGroupHoldsIt(t *testing.T) {
	prompt := seqTokens(4000, 8*bs)
	runEngine(t, indexer.SequenceHashes(prompt, bs, indexer.BaseSeed, nil), []engineStep{
		{"group 0 stores eight blocks", mapBatch(storedMap(1, 8, 0, prompt, 0, "full_attention")), 8},
		{"group 1 stores them too", mapBatch(storedMap(1, 8, 0, prompt, 1, "full_attention")), 8},
		{"a sliding-window group stores the last two", mapBatch(storedMap(7, 2, 0, prompt, 2, "sliding_window",
			"kv_cache_spec_sliding_window", 32)), 8},
		{"the sliding-window group drops them", mapBatch(removedMap(2, 7, 8)), 8},
		{"group 1 evicts block 5", mapBatch(removedMap(1, 5)), 4},
		{"group 1 caches block 5 again", mapBatch(storedMap(5, 1, 4, prompt[4*bs:5*bs], 1, "full_attention")), 8},
		{"group 0 evicts blocks 7 and 8", mapBatch(removedMap(0, 8, 7)), 6},
		{"group 1 evicts block 8 as well", mapBatch(removedMap(1, 8)), 6},
		{"group 0 caches 7 and 8 again, group 1 still lacks 8", mapBatch(storedMap(7, 2, 6, prompt[6*bs:], 0, "full_attention")), 7},
	})
}

// TestALoRAIDWithoutANameIsNotTheBaseModel: vLLM before lora_name was sent (PR 27577) hashed
// the adapter's lora_int_id into every block and reported only lora_id. A base-model request
// of the same tokens hits none of those blocks.
func TestALoRAIDWithoutANameIsNotTheBaseModel(t *testing.T) {
	prompt := seqTokens(5000, 8*bs)
	hashes := []any{21, 22, 23, 24, 25, 26, 27, 28}
	base := indexer.SequenceHashes(prompt, bs, indexer.BaseSeed, nil)
	cases := []struct {
		name  string
		batch any
		want  int // blocks a base-model request hits
	}{
		{"first layout: [.., block_size, lora_id]", []any{1750000000.0, []any{
			[]any{"BlockStored", hashes, nil, prompt, bs, 3}}}, 0},
		{"with medium: [.., lora_id, medium]", []any{1750000000.0, []any{
			[]any{"BlockStored", hashes, nil, prompt, bs, 3, "GPU"}}}, 0},
		{"map, lora_name nil", mapBatch(kv{"type", "BlockStored", "block_hashes", hashes, "parent_block_hash", nil,
			"token_ids", prompt, "block_size", bs, "lora_id", 3, "medium", "GPU", "lora_name", nil}), 0},
		{"no adapter: lora_id nil", []any{1750000000.0, []any{
			[]any{"BlockStored", hashes, nil, prompt, bs, nil, "GPU"}}}, 8},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			runEngine(t, base, []engineStep{{c.name, c.batch, c.want}})
		})
	}
}

// typedStored is a BlockStored of vLLM main with typed extra keys (event_version 1) for an
// 8-block prompt: the cache salt on the first block, an image from offset 3 of block 0 over
// 20 tokens (blocks 0 and 1), the LoRA name on every block when lora is set.
func typedStored(prompt []uint32, lora, salt string, version any) kv {
	hashes := make([]any, 8)
	extras := make([]any, 8)
	for i := range hashes {
		hashes[i] = sha(byte(40 + i))
		var keys []any
		if lora != "" {
			keys = append(keys, kv{"type", "lora", "name", lora})
		}
		switch i {
		case 0:
			keys = append(keys, kv{"type", "mm", "modality", "image", "hash", "img-1", "block_offset", 3})
		case 1:
			keys = append(keys, kv{"type", "mm", "modality", "image", "hash", "img-1", "block_offset", -13})
		}
		if i == 0 && salt != "" {
			keys = append(keys, kv{"type", "cache_salt", "salt", salt})
		}
		if keys != nil {
			extras[i] = keys
		}
	}
	var name any
	if lora != "" {
		name = lora
	}
	ev := kv{"type", "BlockStored", "block_hashes", hashes, "parent_block_hash", nil, "token_ids", prompt,
		"block_size", bs, "lora_id", nil, "medium", "GPU", "lora_name", name}
	if version != nil {
		ev = append(ev, "event_version", version)
	}
	return append(ev, "extra_keys", extras, "group_idx", 0, "kv_cache_spec_kind", "full_attention")
}

// TestTypedExtraKeysPredictWhatTheEngineHits: vLLM's main publishes extra_keys as typed keys
// ({"type": "cache_salt", "salt": ...}, "lora", "mm", "prompt_embeds", "legacy"); a request
// with the same salt, image and adapter hits every block, one with another salt none.
func TestTypedExtraKeysPredictWhatTheEngineHits(t *testing.T) {
	prompt := seqTokens(6000, 8*bs)
	img := []indexer.MMItem{{ID: "img-1", Offset: 3, Length: 20}}
	keys := func(lora, salt string, mm []indexer.MMItem) []uint64 {
		extras := indexer.VLLMBlockExtras(8, bs, salt, mm, nil)
		return indexer.SequenceHashesExtra(prompt, bs, indexer.Seed(lora, ""), extras, nil)
	}
	cases := []struct {
		name  string
		batch any
		seq   []uint64
		want  int
	}{
		{"salt and image, version left out (its default, 1)", mapBatch(typedStored(prompt, "", "s1", nil)), keys("", "s1", img), 8},
		{"version 1 sent", mapBatch(typedStored(prompt, "", "s1", 1)), keys("", "s1", img), 8},
		{"another salt", mapBatch(typedStored(prompt, "", "s1", nil)), keys("", "s2", img), 0},
		{"no salt", mapBatch(typedStored(prompt, "", "s1", nil)), keys("", "", img), 0},
		{"no image", mapBatch(typedStored(prompt, "", "s1", nil)), keys("", "s1", nil), 0},
		{"a LoRA adapter's request", mapBatch(typedStored(prompt, "sql", "s1", nil)), keys("sql", "s1", img), 8},
		{"the base model against the adapter's blocks", mapBatch(typedStored(prompt, "sql", "s1", nil)), keys("", "s1", img), 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			runEngine(t, c.seq, []engineStep{{c.name, c.batch, c.want}})
		})
	}
}

// TestTypedAndUntypedExtraKeysDigestAlike: each typed key stands for the element the engine
// hashed, so an event with typed keys and one with the tuples they came from (vLLM before the
// typed schema) give the same digest per block.
func TestTypedAndUntypedExtraKeysDigestAlike(t *testing.T) {
	embed := []byte{1, 2, 3, 4}
	cases := []struct {
		name         string
		typed, plain []any
	}{
		{"salt", []any{kv{"type", "cache_salt", "salt", "s"}}, []any{"s"}},
		{"lora first, then an image", []any{kv{"type", "lora", "name", "sql"}, kv{"type", "mm", "modality", "image", "hash", "h", "block_offset", -2}},
			[]any{"sql", []any{"h", -2}}},
		{"fields in another order", []any{kv{"block_offset", 7, "hash", "h", "type", "mm"}}, []any{[]any{"h", 7}}},
		{"prompt embeddings", []any{kv{"type", "prompt_embeds", "hash", embed}}, []any{embed}},
		{"a legacy key", []any{kv{"type", "legacy", "value", []any{"x", 1}}}, []any{[]any{"x", 1}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			digest := func(keys []any) uint64 {
				b, err := Decode(fixture(t, mapBatch(kv{"type", "BlockStored", "block_hashes", []any{1}, "parent_block_hash", nil,
					"token_ids", seqTokens(0, bs), "block_size", bs, "lora_name", "sql", "extra_keys", []any{keys}})))
				if err != nil {
					t.Fatal(err)
				}
				return b.Events[0].Extras[0]
			}
			if typed, plain := digest(c.typed), digest(c.plain); typed != plain || typed == 0 {
				t.Fatalf("typed digest %#x, untyped %#x", typed, plain)
			}
		})
	}
}

// TestBadTypedExtraKeysAreRefused: a typed key without its type or its field, or with a field
// of the wrong type, fails the payload with a clear error and applies nothing.
func TestBadTypedExtraKeysAreRefused(t *testing.T) {
	cases := []struct {
		name string
		key  kv
		want error
	}{
		{"no type", kv{"salt", "s"}, ErrMalformed},
		{"a salt without salt", kv{"type", "cache_salt"}, ErrMalformed},
		{"a salt as bytes", kv{"type", "cache_salt", "salt", []byte("s")}, ErrMalformed},
		{"an image without its offset", kv{"type", "mm", "hash", "h"}, ErrMalformed},
		{"a salt as a number", kv{"type", "cache_salt", "salt", 5}, ErrWrongType},
		{"a type that is not a string", kv{"type", 5}, ErrWrongType},
		{"a legacy key without value", kv{"type", "legacy"}, ErrMalformed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Decode(fixture(t, mapBatch(kv{"type", "BlockStored", "block_hashes", []any{1}, "parent_block_hash", nil,
				"token_ids", seqTokens(0, bs), "block_size", bs, "extra_keys", []any{[]any{c.key}}})))
			if !errors.Is(err, c.want) {
				t.Fatalf("error %v, want %v", err, c.want)
			}
		})
	}
}

// TestAnUnknownTypedKeyMatchesNoRequest: a typed key of a kind a newer vLLM may add keys the
// block apart from every request (a predicted miss, never a false hit), and two such blocks
// with different values stay apart.
func TestAnUnknownTypedKeyMatchesNoRequest(t *testing.T) {
	prompt := seqTokens(7000, bs)
	stored := func(v string) kv {
		return mapBatch(kv{"type", "BlockStored", "block_hashes", []any{1}, "parent_block_hash", nil,
			"token_ids", prompt, "block_size", bs, "extra_keys", []any{[]any{kv{"type", "future", "thing", v}}}})
	}
	runEngine(t, indexer.SequenceHashes(prompt, bs, indexer.BaseSeed, nil), []engineStep{{"unknown key", stored("a"), 0}})
	a, err := Decode(fixture(t, stored("a")))
	if err != nil {
		t.Fatal(err)
	}
	da := a.Events[0].Extras[0]
	b, err := Decode(fixture(t, stored("b")))
	if err != nil {
		t.Fatal(err)
	}
	if da == 0 || da == b.Events[0].Extras[0] {
		t.Fatalf("digests %#x and %#x", da, b.Events[0].Extras[0])
	}
}
