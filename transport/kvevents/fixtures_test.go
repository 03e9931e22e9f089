package kvevents

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// The byte fixtures in testdata are msgpack payloads built field by field with the msgpack
// library (encodeAll in wire_test.go), following the publishers' struct layouts as their
// sources define them: vLLM's vllm/distributed/kv_events.py (msgspec structs: EventBatch,
// BlockStored, BlockRemoved, AllBlocksCleared, tag=True, omit_defaults=True, with or without
// array_like) and SGLang's python/sglang/srt/disaggregation/kv_events.py (array_like, tagged)
// with the events its radix cache emits (one BlockStored per page). Nothing here was captured
// from a running engine; each file says in its header which release's layout it follows.
// `go test -run TestFixtureFilesAreCurrent -update` rewrites them from the builders below.

var update = flag.Bool("update", false, "rewrite the testdata fixtures from their builders")

type byteFixture struct {
	name   string // file name in testdata
	header string // where the layout comes from
	build  func(testing.TB) []byte
}

var fixtures = []byteFixture{
	{"vllm_map_hybrid.hex", `vLLM, current main (kv_events.py without array_like): the batch and
the events are maps, the event's tag under "type", fields at their defaults left out
(omit_defaults). A hybrid model (one full-attention group, one sliding-window group of 128
tokens) serving a LoRA request with an image and a cache_salt: group 0 stores three blocks
whose extra_keys are (lora_name, (mm identifier, offset of the image in the block), salt) for
block 0, (lora_name, (identifier, -13)) for block 1, (lora_name,) for block 2; group 1 stores
only the last block (null blocks before the window are skipped in block_hashes, not in
token_ids), then removes it (BlockRemoved with group_idx).`, vllmMapHybrid},
	{"vllm_array_batch_map_events.hex", `vLLM releases with EventBatch array_like and
KVCacheEvent tagged maps: [ts, [events...], data_parallel_rank]; bytes hashes (sha256, 32
bytes), a BlockStored with extra_keys [None, None] and group_idx 0, a BlockRemoved with
group_idx 1.`, vllmArrayBatchMapEvents},
	{"vllm_array_events_hybrid.hex", `vLLM's array_like events (older layout) carrying the
newer trailing fields positionally: ["BlockStored", block_hashes, parent, token_ids,
block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
kv_cache_spec_sliding_window] with extra_keys nil before a set group_idx (msgspec writes
every field up to the last non-default one), and ["BlockRemoved", block_hashes, medium,
group_idx].`, vllmArrayEventsHybrid},
	{"vllm_legacy_array.hex", `The first vLLM layout (v0.9): [ts, [events]] with
["BlockStored", block_hashes, parent, token_ids, block_size, lora_id] and
["BlockRemoved", block_hashes]: no medium, no lora_name, no group.`, vllmLegacyArray},
	{"sglang_pages.hex", `SGLang (kv_events.py: EventBatch [ts, events, attn_dp_rank],
array_like tagged events) with its radix cache's events at the default page size of 1: one
BlockStored per page, ["BlockStored", [hash], parent, [token], 1, None, "GPU"], parents
chaining page to page, hashes signed 64-bit integers (hash_str_to_int64 of a sha256 chain);
then one BlockRemoved per page of the evicted leaf, ["BlockRemoved", [hash], "GPU"].
32 tokens stored (two 16-token router blocks), the last 16 removed.`, sglangPages},
	{"sglang_bigram.hex", `SGLang with EAGLE: bigram radix keys, so token_ids are pairs
(token, next token) per position; page size 4, 16 tokens in four pages.`, sglangBigram},
}

// Prompts of the fixtures.
var (
	fixturePrompt = seqTokens(1000, 48) // vLLM fixtures: three 16-token blocks
	sglangPrompt  = seqTokens(5000, 32)
	bigramPrompt  = seqTokens(7000, 16)
)

func vllmMapHybrid(t testing.TB) []byte {
	return fixture(t, kv{
		"ts", 1754000000.5,
		"events", []any{
			kv{"type", "BlockStored", "block_hashes", []any{sha(1), sha(2), sha(3)}, "parent_block_hash", nil,
				"token_ids", fixturePrompt, "block_size", 16, "lora_id", 7, "medium", "GPU", "lora_name", "adapter",
				"extra_keys", []any{
					[]any{"adapter", []any{"img-1", 3}, "salt-x"},
					[]any{"adapter", []any{"img-1", -13}},
					[]any{"adapter"},
				},
				"group_idx", 0, "kv_cache_spec_kind", "full_attention"},
			kv{"type", "BlockStored", "block_hashes", []any{sha(3)}, "parent_block_hash", nil,
				"token_ids", fixturePrompt, "block_size", 16, "lora_id", 7, "medium", "GPU", "lora_name", "adapter",
				"extra_keys", []any{[]any{"adapter"}},
				"group_idx", 1, "kv_cache_spec_kind", "sliding_window", "kv_cache_spec_sliding_window", 128},
			kv{"type", "BlockRemoved", "block_hashes", []any{sha(3)}, "medium", "GPU", "group_idx", 1},
		},
		"data_parallel_rank", 0,
	})
}

func vllmArrayBatchMapEvents(t testing.TB) []byte {
	return fixture(t, []any{
		1754000001.25,
		[]any{
			kv{"type", "BlockStored", "block_hashes", []any{sha(4), sha(5)}, "parent_block_hash", nil,
				"token_ids", fixturePrompt[:32], "block_size", 16, "lora_id", nil, "medium", "GPU", "lora_name", nil,
				"extra_keys", []any{nil, nil}, "group_idx", 0},
			kv{"type", "BlockRemoved", "block_hashes", []any{sha(5)}, "medium", "GPU", "group_idx", 1},
		},
		1,
	})
}

func vllmArrayEventsHybrid(t testing.TB) []byte {
	return fixture(t, []any{
		1754000002.0,
		[]any{
			[]any{"BlockStored", []any{11, 12}, nil, fixturePrompt[:32], 16, nil, "GPU", nil, nil, 0, "full_attention"},
			[]any{"BlockStored", []any{12}, nil, fixturePrompt[:32], 16, nil, "GPU", nil, nil, 1, "sliding_window", 64},
			[]any{"BlockRemoved", []any{12}, "GPU", 1},
		},
	})
}

func vllmLegacyArray(t testing.TB) []byte {
	return fixture(t, []any{
		1750000000.0,
		[]any{
			[]any{"BlockStored", []any{21, 22}, nil, fixturePrompt[:32], 16, nil},
			[]any{"BlockRemoved", []any{22}},
		},
	})
}

// sglangHashes chains sha256 page by page and keeps the first 8 bytes as a signed integer, as
// SGLang's compute_node_hash_values and hash_str_to_int64 do; the values only need to be
// stable and distinct.
func sglangHashes(tokens []uint32, page int) []int64 {
	var out []int64
	var prev []byte
	for i := 0; i+page <= len(tokens); i += page {
		h := sha256.New()
		h.Write(prev)
		for _, tok := range tokens[i : i+page] {
			h.Write(binary.LittleEndian.AppendUint32(nil, tok))
		}
		prev = h.Sum(nil)
		out = append(out, int64(binary.BigEndian.Uint64(prev)))
	}
	return out
}

func sglangPages(t testing.TB) []byte {
	hs := sglangHashes(sglangPrompt, 1)
	var events []any
	var parent any
	for i, h := range hs {
		events = append(events, []any{"BlockStored", []any{h}, parent, []any{int(sglangPrompt[i])}, 1, nil, "GPU"})
		parent = h
	}
	for _, h := range hs[16:] {
		events = append(events, []any{"BlockRemoved", []any{h}, "GPU"})
	}
	return fixture(t, []any{1754000003.0, events, 0})
}

func sglangBigram(t testing.TB) []byte {
	hs := sglangHashes(bigramPrompt, 4)
	var events []any
	var parent any
	for p, h := range hs {
		var pairs []any
		for j := p * 4; j < p*4+4; j++ {
			next := bigramPrompt[j] + 1000 // the token after the prompt's last is the output's
			if j+1 < len(bigramPrompt) {
				next = bigramPrompt[j+1]
			}
			pairs = append(pairs, []any{int(bigramPrompt[j]), int(next)})
		}
		events = append(events, []any{"BlockStored", []any{h}, parent, pairs, 4, nil, "GPU"})
		parent = h
	}
	return fixture(t, []any{1754000004.0, events})
}

// writeHex renders a fixture file: the header as comment lines, then the bytes in hex.
func writeHex(header string, b []byte) []byte {
	var out bytes.Buffer
	for _, line := range strings.Split(header, "\n") {
		out.WriteString("# " + line + "\n")
	}
	for len(b) > 0 {
		n := min(32, len(b))
		out.WriteString(hex.EncodeToString(b[:n]) + "\n")
		b = b[n:]
	}
	return out.Bytes()
}

// loadFixture reads a testdata fixture: comment lines start with '#', the rest is hex.
func loadFixture(t testing.TB, name string) []byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	var digits strings.Builder
	for _, line := range strings.Split(string(raw), "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			digits.WriteString(line)
		}
	}
	b, err := hex.DecodeString(digits.String())
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return b
}

func TestFixtureFilesAreCurrent(t *testing.T) {
	for _, fx := range fixtures {
		want := fx.build(t)
		path := filepath.Join("testdata", fx.name)
		if *update {
			if err := os.WriteFile(path, writeHex(fx.header, want), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if got := loadFixture(t, fx.name); !bytes.Equal(got, want) {
			t.Errorf("%s differs from its builder; run go test -run TestFixtureFilesAreCurrent -update", fx.name)
		}
	}
}

// extraOf is the digest of one block's extra_keys tuple as the router keeps it: the first
// element left out when it is the event's LoRA name.
func extraOf(lora string, elems ...any) uint64 {
	if len(elems) > 0 && lora != "" && elems[0] == lora {
		elems = elems[1:]
	}
	var e indexer.ExtraDigest
	var add func(v any)
	add = func(v any) {
		switch v := v.(type) {
		case string:
			e.String(v)
		case int:
			e.Int(int64(v))
		case []any:
			e.Tuple(len(v))
			for _, x := range v {
				add(x)
			}
		default:
			panic("extraOf: unsupported type")
		}
	}
	for _, v := range elems {
		add(v)
	}
	return e.Sum()
}

func TestDecodeFixtures(t *testing.T) {
	b := func(name string) Batch {
		t.Helper()
		got, err := Decode(loadFixture(t, name))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return got
	}
	t.Run("vllm map hybrid", func(t *testing.T) {
		got := b("vllm_map_hybrid.hex")
		hs := []EngineHash{BytesHash(sha(1)), BytesHash(sha(2)), BytesHash(sha(3))}
		want := Batch{TS: 1754000000.5, HasDPRank: true, Events: []Event{
			{Kind: indexer.Stored, BlockHashes: hs, TokenIDs: fixturePrompt, BlockSize: 16, LoRAID: 7, Medium: "GPU",
				LoRAName: "adapter", HasGroup: true, SpecKind: "full_attention", Extras: []uint64{
					extraOf("adapter", "adapter", []any{"img-1", 3}, "salt-x"),
					extraOf("adapter", "adapter", []any{"img-1", -13}),
					0, // only the LoRA name: nothing beyond the seed
				}},
			{Kind: indexer.Stored, BlockHashes: hs[2:], TokenIDs: fixturePrompt, BlockSize: 16, LoRAID: 7, Medium: "GPU",
				LoRAName: "adapter", Group: 1, HasGroup: true, SpecKind: "sliding_window", SlidingWindow: 128,
				Extras: []uint64{0}},
			{Kind: indexer.Removed, BlockHashes: hs[2:], Medium: "GPU", Group: 1, HasGroup: true},
		}}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("decoded\n%+v\nwant\n%+v", got, want)
		}
	})
	t.Run("vllm array batch, map events", func(t *testing.T) {
		got := b("vllm_array_batch_map_events.hex")
		if !got.HasDPRank || got.DPRank != 1 || len(got.Events) != 2 {
			t.Fatalf("%+v", got)
		}
		if ev := got.Events[0]; !reflect.DeepEqual(ev.Extras, []uint64{0, 0}) || !ev.HasGroup || ev.Group != 0 {
			t.Fatalf("stored %+v", ev)
		}
		if ev := got.Events[1]; !ev.HasGroup || ev.Group != 1 {
			t.Fatalf("removed %+v", ev)
		}
	})
	t.Run("vllm array events with trailing fields", func(t *testing.T) {
		got := b("vllm_array_events_hybrid.hex")
		want := []Event{
			{Kind: indexer.Stored, BlockHashes: []EngineHash{UintHash(11), UintHash(12)}, TokenIDs: fixturePrompt[:32],
				BlockSize: 16, Medium: "GPU", HasGroup: true, SpecKind: "full_attention"},
			{Kind: indexer.Stored, BlockHashes: []EngineHash{UintHash(12)}, TokenIDs: fixturePrompt[:32], BlockSize: 16,
				Medium: "GPU", Group: 1, HasGroup: true, SpecKind: "sliding_window", SlidingWindow: 64},
			{Kind: indexer.Removed, BlockHashes: []EngineHash{UintHash(12)}, Medium: "GPU", Group: 1, HasGroup: true},
		}
		if !reflect.DeepEqual(got.Events, want) {
			t.Fatalf("decoded\n%+v\nwant\n%+v", got.Events, want)
		}
	})
	t.Run("vllm legacy", func(t *testing.T) {
		got := b("vllm_legacy_array.hex")
		if len(got.Events) != 2 || got.Events[0].HasGroup || got.Events[0].Extras != nil || got.Events[1].Medium != "" {
			t.Fatalf("%+v", got)
		}
	})
	t.Run("sglang pages", func(t *testing.T) {
		got := b("sglang_pages.hex")
		if len(got.Events) != 48 || !got.HasDPRank || got.DPRank != 0 {
			t.Fatalf("%d events, rank %d/%v", len(got.Events), got.DPRank, got.HasDPRank)
		}
		if ev := got.Events[1]; ev.BlockSize != 1 || !ev.HasParent || ev.TokenIDs[0] != sglangPrompt[1] {
			t.Fatalf("page 1 %+v", ev)
		}
	})
	t.Run("sglang bigram", func(t *testing.T) {
		got := b("sglang_bigram.hex")
		var tokens []uint32
		for _, ev := range got.Events {
			tokens = append(tokens, ev.TokenIDs...)
		}
		if !reflect.DeepEqual(tokens, bigramPrompt) {
			t.Fatalf("tokens %v, want the first of each pair %v", tokens, bigramPrompt)
		}
	})
}
