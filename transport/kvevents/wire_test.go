package kvevents

import (
	"bytes"
	"errors"
	"reflect"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// The fixtures below are written field by field with the msgpack library, following vLLM's
// layout, and never with this package's Encode: they check the decoder against the format.

// build returns what fn writes with a fresh msgpack encoder.
func build(t testing.TB, fn func(e *msgpack.Encoder) error) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := fn(msgpack.NewEncoder(&buf)); err != nil {
		t.Fatalf("building fixture: %v", err)
	}
	return buf.Bytes()
}

// seqTokens returns n tokens counting up from start.
func seqTokens(start uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = start + uint32(i)
	}
	return out
}

// sha is a fake 32-byte engine hash, as newer vLLM sends.
func sha(tag byte) []byte { return bytes.Repeat([]byte{tag}, 32) }

// encodeAll writes each value with the typed method its Go type calls for; it covers what the
// fixtures need and no more, so each fixture still spells vLLM's layout out.
func encodeAll(e *msgpack.Encoder, vs ...any) error {
	for _, v := range vs {
		var err error
		switch v := v.(type) {
		case nil:
			err = e.EncodeNil()
		case string:
			err = e.EncodeString(v)
		case []byte:
			err = e.EncodeBytes(v)
		case int:
			err = e.EncodeInt(int64(v))
		case int8:
			err = e.EncodeInt8(v) // the signed one-byte form even for a positive value
		case uint64:
			err = e.EncodeUint64(v) // always the 9-byte form
		case int64:
			err = e.EncodeInt64(v) // always the 9-byte form
		case float64:
			err = e.EncodeFloat64(v)
		case []uint32:
			if err = e.EncodeArrayLen(len(v)); err == nil {
				for _, t := range v {
					if err = e.EncodeUint(uint64(t)); err != nil {
						break
					}
				}
			}
		case []any:
			if err = e.EncodeArrayLen(len(v)); err == nil {
				err = encodeAll(e, v...)
			}
		case kv:
			if err = e.EncodeMapLen(len(v) / 2); err == nil {
				err = encodeAll(e, v...)
			}
		default:
			panic("fixture: unsupported type")
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// kv is a map written in the given key order: k1, v1, k2, v2, ...
type kv []any

func fixture(t testing.TB, v any) []byte {
	return build(t, func(e *msgpack.Encoder) error { return encodeAll(e, v) })
}

// arrayBatchFixture is an older vLLM batch: [ts, [events]] with integer hashes of mixed widths.
func arrayBatchFixture(t testing.TB) []byte {
	return fixture(t, []any{
		1717171717.25,
		[]any{
			[]any{"BlockStored", []any{uint64(1 << 63), int64(-5)}, nil, seqTokens(100, 32), 16, nil, "GPU"},
			[]any{"BlockStored", []any{7}, uint64(1 << 63), seqTokens(500, 16), 16, 3, "GPU", "adapter-a"},
			[]any{"BlockRemoved", []any{int64(-5)}, "GPU"},
			[]any{"AllBlocksCleared"},
		},
	})
}

// mapBatchFixture is a newer vLLM batch: a map with bytes hashes, a 0 parent, the fields newer
// releases add, and a data-parallel rank.
func mapBatchFixture(t testing.TB) []byte {
	return fixture(t, kv{
		"ts", 1717171717.5,
		"events", []any{
			kv{"type", "BlockStored", "block_hashes", []any{sha(1), sha(2)}, "parent_block_hash", 0,
				"token_ids", seqTokens(100, 32), "block_size", 16, "lora_id", nil, "medium", "GPU",
				"lora_name", nil, "extra_keys", []any{nil, []any{"mm", 1}}, "group_idx", 0,
				"kv_cache_spec_kind", "full_attention", "kv_cache_spec_sliding_window", nil},
			// "type" last: the decoder must not depend on its position.
			kv{"block_hashes", []any{sha(2)}, "medium", "CPU", "group_idx", 1, "type", "BlockRemoved"},
			kv{"type", "AllBlocksCleared"},
		},
		"data_parallel_rank", 2,
	})
}

func TestDecodeArrayBatchFixture(t *testing.T) {
	b, err := Decode(arrayBatchFixture(t))
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{
		TS: 1717171717.25,
		Events: []Event{
			{Kind: indexer.Stored, BlockHashes: []EngineHash{UintHash(1 << 63), IntHash(-5)},
				TokenIDs: seqTokens(100, 32), BlockSize: 16, Medium: "GPU"},
			{Kind: indexer.Stored, BlockHashes: []EngineHash{IntHash(7)}, Parent: UintHash(1 << 63), HasParent: true,
				TokenIDs: seqTokens(500, 16), BlockSize: 16, LoRAID: 3, Medium: "GPU", LoRAName: "adapter-a"},
			{Kind: indexer.Removed, BlockHashes: []EngineHash{IntHash(-5)}, Medium: "GPU"},
			{Kind: indexer.Cleared},
		},
	}
	if !reflect.DeepEqual(b, want) {
		t.Fatalf("decoded\n%+v\nwant\n%+v", b, want)
	}
}

func TestDecodeMapBatchFixture(t *testing.T) {
	b, err := Decode(mapBatchFixture(t))
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{
		TS:        1717171717.5,
		DPRank:    2,
		HasDPRank: true,
		Events: []Event{
			{Kind: indexer.Stored, BlockHashes: []EngineHash{BytesHash(sha(1)), BytesHash(sha(2))},
				TokenIDs: seqTokens(100, 32), BlockSize: 16, Medium: "GPU",
				Extras: []uint64{0, extraOf("", "mm", 1)}, HasGroup: true, SpecKind: "full_attention"},
			{Kind: indexer.Removed, BlockHashes: []EngineHash{BytesHash(sha(2))}, Medium: "CPU", Group: 1, HasGroup: true},
			{Kind: indexer.Cleared},
		},
	}
	if !reflect.DeepEqual(b, want) {
		t.Fatalf("decoded\n%+v\nwant\n%+v", b, want)
	}
}

func TestDecodeAcceptsVariants(t *testing.T) {
	stored := func(parent any) []any {
		return []any{"BlockStored", []any{1}, parent, seqTokens(0, 4), 4, nil, nil}
	}
	cases := []struct {
		name  string
		in    any
		check func(t *testing.T, b Batch)
	}{
		{"array batch with dp rank", []any{1.0, []any{}, 3}, func(t *testing.T, b Batch) {
			if !b.HasDPRank || b.DPRank != 3 {
				t.Fatalf("dp rank %d/%v, want 3", b.DPRank, b.HasDPRank)
			}
		}},
		{"array batch with nil dp rank", []any{1.0, []any{}, nil}, func(t *testing.T, b Batch) {
			if b.HasDPRank {
				t.Fatal("nil dp rank read as present")
			}
		}},
		{"integer timestamp", []any{17, []any{}}, func(t *testing.T, b Batch) {
			if b.TS != 17 {
				t.Fatalf("ts %v", b.TS)
			}
		}},
		{"extra batch fields ignored", []any{1.0, []any{}, 0, "future", []any{1, 2}}, nil},
		{"extra map keys ignored", kv{"future", kv{"a", []any{1}}, "events", []any{}}, nil},
		{"nil parent", []any{1.0, []any{stored(nil)}}, func(t *testing.T, b Batch) {
			if b.Events[0].HasParent {
				t.Fatal("nil parent read as present")
			}
		}},
		{"zero parent means none", []any{1.0, []any{stored(0)}}, func(t *testing.T, b Batch) {
			if b.Events[0].HasParent {
				t.Fatal("0 parent read as present")
			}
		}},
		{"negative parent", []any{1.0, []any{stored(-9)}}, func(t *testing.T, b Batch) {
			if ev := b.Events[0]; !ev.HasParent || ev.Parent != IntHash(-9) {
				t.Fatalf("parent %v/%v", ev.Parent, ev.HasParent)
			}
		}},
		{"bytes parent", []any{1.0, []any{stored(sha(4))}}, func(t *testing.T, b Batch) {
			if ev := b.Events[0]; !ev.HasParent || ev.Parent != BytesHash(sha(4)) {
				t.Fatalf("parent %v/%v", ev.Parent, ev.HasParent)
			}
		}},
		{"array event extra fields ignored", []any{1.0, []any{
			[]any{"BlockStored", []any{1}, nil, seqTokens(0, 4), 4, nil, "GPU", nil, []any{nil}, 0, "full", nil},
			[]any{"BlockRemoved", []any{1}, "GPU", 0},
			[]any{"AllBlocksCleared", "future"},
		}}, func(t *testing.T, b Batch) {
			if len(b.Events) != 3 {
				t.Fatalf("%d events", len(b.Events))
			}
		}},
		{"short BlockStored without lora and medium", []any{1.0, []any{
			[]any{"BlockStored", []any{1}, nil, seqTokens(0, 4), 4},
		}}, nil},
		{"BlockRemoved without medium", []any{1.0, []any{[]any{"BlockRemoved", []any{1}}}}, nil},
		{"wide and signed token encodings", []any{1.0, []any{
			[]any{"BlockStored", []any{1}, nil, []any{int64(1), uint64(2), int8(3), 70000}, 4},
		}}, func(t *testing.T, b Batch) {
			if got := b.Events[0].TokenIDs; !reflect.DeepEqual(got, []uint32{1, 2, 3, 70000}) {
				t.Fatalf("tokens %v", got)
			}
		}},
		{"integers equal across widths", []any{1.0, []any{
			[]any{"BlockRemoved", []any{int64(5), uint64(5), 5}},
		}}, func(t *testing.T, b Batch) {
			hs := b.Events[0].BlockHashes
			if hs[0] != hs[1] || hs[1] != hs[2] {
				t.Fatalf("hashes of 5 differ by width: %v", hs)
			}
		}},
		{"integer and bytes hashes stay apart", []any{1.0, []any{
			[]any{"BlockRemoved", []any{5, []byte{0, 0, 0, 0, 0, 0, 0, 5}, -1, uint64(1<<64 - 1)}},
		}}, func(t *testing.T, b Batch) {
			seen := map[EngineHash]bool{}
			for _, h := range b.Events[0].BlockHashes {
				if seen[h] {
					t.Fatalf("two different hashes collide: %v", b.Events[0].BlockHashes)
				}
				seen[h] = true
			}
		}},
		{"empty events", kv{"ts", 1.0, "events", []any{}}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, err := Decode(fixture(t, c.in))
			if err != nil {
				t.Fatal(err)
			}
			if c.check != nil {
				c.check(t, b)
			}
		})
	}
}

// nested returns a value nested depth arrays deep.
func nested(depth int) any {
	var v any = 1
	for range depth {
		v = []any{v}
	}
	return v
}

func TestDecodeRejectsBadInputByCause(t *testing.T) {
	valid := arrayBatchFixture(t)
	ev := func(fields ...any) []byte { return fixture(t, []any{1.0, []any{fields}}) }
	huge := func(n int) []byte { // a batch whose events array claims n elements
		b := []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, codeArray32, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
		return append(b, bytes.Repeat([]byte{0x91, 0xa0}, 10)...)
	}
	cases := []struct {
		name string
		in   []byte
		want error
	}{
		{"empty payload", nil, ErrMalformed},
		{"reserved code", []byte{0xc1}, ErrMalformed},
		{"truncated", valid[:len(valid)-3], ErrMalformed},
		{"trailing bytes", append(append([]byte{}, valid...), 0x01), ErrMalformed},
		{"batch array too short", fixture(t, []any{1.0}), ErrMalformed},
		{"map batch without events", fixture(t, kv{"ts", 1.0}), ErrMalformed},
		{"token count mismatch", ev("BlockStored", []any{1, 2}, nil, seqTokens(0, 20), 16), ErrMalformed},
		{"BlockStored missing fields", ev("BlockStored", []any{1}, nil), ErrMalformed},
		{"map event without type", fixture(t, []any{1.0, []any{kv{"block_hashes", []any{1}}}}), ErrMalformed},
		{"map BlockStored without tokens", fixture(t, []any{1.0, []any{kv{"type", "BlockStored", "block_hashes", []any{1}, "block_size", 16}}}), ErrMalformed},
		{"zero block size", ev("BlockStored", []any{}, nil, []uint32{}, 0), ErrMalformed},
		{"empty event", ev(), ErrMalformed},
		{"array count past the bytes", huge(4000), ErrMalformed},

		{"unknown array tag", ev("BlockMoved", []any{1}), ErrUnknownEvent},
		{"unknown map type", fixture(t, []any{1.0, []any{kv{"type", "KVEvicted"}}}), ErrUnknownEvent},

		{"text, not msgpack", []byte("hello"), ErrWrongType},
		{"batch is a string", fixture(t, "batch"), ErrWrongType},
		{"events not an array", fixture(t, []any{1.0, "events"}), ErrWrongType},
		{"event is a number", fixture(t, []any{1.0, []any{5}}), ErrWrongType},
		{"tag not a string", ev(5, []any{1}), ErrWrongType},
		{"block_hashes a string", ev("BlockRemoved", "abc"), ErrWrongType},
		{"hash a float", ev("BlockRemoved", []any{1.5}), ErrWrongType},
		{"hash nil", ev("BlockRemoved", []any{nil}), ErrWrongType},
		{"hash a string", ev("BlockRemoved", []any{"ab"}), ErrWrongType},
		{"token a string", ev("BlockStored", []any{1}, nil, []any{"a", "b"}, 2), ErrWrongType},
		{"negative token", ev("BlockStored", []any{1}, nil, []any{1, -2}, 2), ErrWrongType},
		{"token past uint32", ev("BlockStored", []any{1}, nil, []any{1, uint64(1 << 40)}, 2), ErrWrongType},
		{"block size a string", ev("BlockStored", []any{1}, nil, seqTokens(0, 16), "16"), ErrWrongType},
		{"medium a number", ev("BlockRemoved", []any{1}, 7), ErrWrongType},
		{"ts a string", fixture(t, []any{"now", []any{}}), ErrWrongType},
		{"dp rank negative", fixture(t, []any{1.0, []any{}, -1}), ErrWrongType},
		{"map key not a string", fixture(t, kv{1, 2, "events", []any{}}), ErrWrongType},

		{"too many events", huge(MaxEvents + 1), ErrTooLarge},
		{"too many block hashes", ev("BlockRemoved", make([]any, MaxBlocksPerEvent+1)), ErrTooLarge},
		{"absurd block size", ev("BlockStored", []any{}, nil, []uint32{}, MaxBlockSize+1), ErrTooLarge},
		{"hash bytes too long", ev("BlockRemoved", []any{make([]byte, MaxHashBytes+1)}), ErrTooLarge},
		{"unknown field nested too deep", fixture(t, kv{"x", nested(maxDepth + 2), "events", []any{}}), ErrTooLarge},
		{"payload too large", make([]byte, MaxPayload+1), ErrTooLarge},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, err := Decode(c.in)
			if !errors.Is(err, c.want) {
				t.Fatalf("Decode error %v, want %v", err, c.want)
			}
			if len(b.Events) != 0 {
				t.Fatalf("a refused payload returned %d events", len(b.Events))
			}
			if got, want := Cause(err), Cause(c.want); got != want {
				t.Fatalf("Cause %q, want %q", got, want)
			}
		})
	}
}

func TestCauseOfForeignErrorIsOther(t *testing.T) {
	if got := Cause(errors.New("boom")); got != "other" {
		t.Fatalf("Cause %q", got)
	}
}

// sampleBatch has every kind of event and every optional field.
func sampleBatch() Batch {
	return Batch{
		TS: 1717171717.125,
		Events: []Event{
			{Kind: indexer.Stored, BlockHashes: []EngineHash{11, 12}, TokenIDs: seqTokens(1, 32), BlockSize: 16, Medium: "GPU"},
			{Kind: indexer.Stored, BlockHashes: []EngineHash{13}, Parent: 12, HasParent: true, TokenIDs: seqTokens(90000, 16),
				BlockSize: 16, LoRAID: 2, LoRAName: "sql-lora", Medium: "CPU"},
			{Kind: indexer.Stored, BlockHashes: []EngineHash{14, 15}, TokenIDs: seqTokens(7, 32), BlockSize: 16,
				LoRAName: "sql-lora", Medium: "GPU", ExtraKeys: [][]any{{"sql-lora", []any{"img", 3}, "salt"}, nil},
				HasGroup: true, Group: 0, SpecKind: "full_attention"},
			{Kind: indexer.Stored, BlockHashes: []EngineHash{15}, TokenIDs: seqTokens(7, 32), BlockSize: 16, Medium: "GPU",
				HasGroup: true, Group: 1, SpecKind: "sliding_window", SlidingWindow: 128},
			{Kind: indexer.Stored, BlockHashes: []EngineHash{16}, TokenIDs: seqTokens(3, 16), BlockSize: 16,
				HasGroup: true, Group: 2},
			{Kind: indexer.Removed, BlockHashes: []EngineHash{15}, Medium: "GPU", HasGroup: true, Group: 1},
			{Kind: indexer.Removed, BlockHashes: []EngineHash{11}, Medium: "GPU"},
			{Kind: indexer.Removed, BlockHashes: []EngineHash{}},
			{Kind: indexer.Cleared},
		},
		DPRank:    1,
		HasDPRank: true,
	}
}

// asDecoded is what decoding an encoding of b gives: each hash h as the integer h, or its
// 8 bytes.
func asDecoded(b Batch, bytesHashes bool) Batch {
	conv := func(h EngineHash) EngineHash {
		if bytesHashes {
			return BytesHash([]byte{byte(h >> 56), byte(h >> 48), byte(h >> 40), byte(h >> 32), byte(h >> 24), byte(h >> 16), byte(h >> 8), byte(h)})
		}
		return UintHash(uint64(h))
	}
	out := b
	out.Events = nil
	for _, ev := range b.Events {
		if ev.BlockHashes != nil {
			hs := make([]EngineHash, len(ev.BlockHashes))
			for i, h := range ev.BlockHashes {
				hs[i] = conv(h)
			}
			ev.BlockHashes = hs
		}
		if ev.HasParent {
			ev.Parent = conv(ev.Parent)
		}
		if ev.Kind != indexer.Stored {
			ev.TokenIDs = nil
		}
		if ev.ExtraKeys != nil {
			ev.Extras = make([]uint64, len(ev.ExtraKeys))
			for i, k := range ev.ExtraKeys {
				ev.Extras[i] = extraOf(ev.LoRAName, k...)
			}
			ev.ExtraKeys = nil
		}
		out.Events = append(out.Events, ev)
	}
	return out
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	for _, f := range []Format{{}, {Map: true}, {BytesHashes: true}, {Map: true, BytesHashes: true}} {
		t.Run(formatName(f), func(t *testing.T) {
			b := sampleBatch()
			payload, err := f.Append(nil, b)
			if err != nil {
				t.Fatal(err)
			}
			got, err := Decode(payload)
			if err != nil {
				t.Fatal(err)
			}
			if want := asDecoded(b, f.BytesHashes); !reflect.DeepEqual(got, want) {
				t.Fatalf("round trip\n%+v\nwant\n%+v", got, want)
			}
		})
	}
}

func formatName(f Format) string {
	name := "array"
	if f.Map {
		name = "map"
	}
	if f.BytesHashes {
		return name + "/bytes"
	}
	return name + "/int"
}

// TestEncodeWritesVLLMLayout pins the bytes: the array encoding of a small batch must equal the
// hand-built fixture of the same batch.
func TestEncodeWritesVLLMLayout(t *testing.T) {
	b := Batch{TS: 2.5, Events: []Event{
		{Kind: indexer.Stored, BlockHashes: []EngineHash{7}, TokenIDs: seqTokens(1, 4), BlockSize: 4, Medium: "GPU"},
		{Kind: indexer.Removed, BlockHashes: []EngineHash{7}, Medium: "GPU"},
		{Kind: indexer.Cleared},
	}}
	got, err := Encode(b, false)
	if err != nil {
		t.Fatal(err)
	}
	want := build(t, func(e *msgpack.Encoder) error {
		return encodeAll(e, []any{2.5, []any{
			[]any{"BlockStored", []any{7}, nil, seqTokens(1, 4), 4, nil, "GPU", nil},
			[]any{"BlockRemoved", []any{7}, "GPU"},
			[]any{"AllBlocksCleared"},
		}})
	})
	if !bytes.Equal(got, want) {
		t.Fatalf("Encode\n%x\nwant\n%x", got, want)
	}
	gotMap, err := Encode(b, true)
	if err != nil {
		t.Fatal(err)
	}
	wantMap := build(t, func(e *msgpack.Encoder) error {
		return encodeAll(e, kv{"ts", 2.5, "events", []any{
			kv{"type", "BlockStored", "block_hashes", []any{7}, "parent_block_hash", nil, "token_ids", seqTokens(1, 4),
				"block_size", 4, "lora_id", nil, "medium", "GPU", "lora_name", nil},
			kv{"type", "BlockRemoved", "block_hashes", []any{7}, "medium", "GPU"},
			kv{"type", "AllBlocksCleared"},
		}})
	})
	if !bytes.Equal(gotMap, wantMap) {
		t.Fatalf("Encode map\n%x\nwant\n%x", gotMap, wantMap)
	}
}

// TestEncodeWritesTheNewFieldsAsMsgspecDoes: in an array, every optional field up to the last
// one set (nil before it), in a map only the ones set.
func TestEncodeWritesTheNewFieldsAsMsgspecDoes(t *testing.T) {
	b := Batch{TS: 2.5, Events: []Event{
		{Kind: indexer.Stored, BlockHashes: []EngineHash{7}, TokenIDs: seqTokens(1, 4), BlockSize: 4, Medium: "GPU",
			HasGroup: true, Group: 1},
		{Kind: indexer.Removed, BlockHashes: []EngineHash{7}, Medium: "GPU", HasGroup: true, Group: 1},
	}}
	got, err := Encode(b, false)
	if err != nil {
		t.Fatal(err)
	}
	want := fixture(t, []any{2.5, []any{
		[]any{"BlockStored", []any{7}, nil, seqTokens(1, 4), 4, nil, "GPU", nil, nil, 1},
		[]any{"BlockRemoved", []any{7}, "GPU", 1},
	}})
	if !bytes.Equal(got, want) {
		t.Fatalf("Encode\n%x\nwant\n%x", got, want)
	}
	gotMap, err := Encode(b, true)
	if err != nil {
		t.Fatal(err)
	}
	wantMap := fixture(t, kv{"ts", 2.5, "events", []any{
		kv{"type", "BlockStored", "block_hashes", []any{7}, "parent_block_hash", nil, "token_ids", seqTokens(1, 4),
			"block_size", 4, "lora_id", nil, "medium", "GPU", "lora_name", nil, "group_idx", 1},
		kv{"type", "BlockRemoved", "block_hashes", []any{7}, "medium", "GPU", "group_idx", 1},
	}})
	if !bytes.Equal(gotMap, wantMap) {
		t.Fatalf("Encode map\n%x\nwant\n%x", gotMap, wantMap)
	}
}

func TestEncodeRefusesInvalidBatches(t *testing.T) {
	cases := map[string]Batch{
		"unknown kind":   {Events: []Event{{Kind: 9}}},
		"token mismatch": {Events: []Event{{Kind: indexer.Stored, BlockHashes: []EngineHash{1}, TokenIDs: seqTokens(0, 3), BlockSize: 4}}},
		"dp rank":        {HasDPRank: true, DPRank: -1},
	}
	for name, b := range cases {
		if _, err := Encode(b, false); err == nil {
			t.Errorf("%s: encoded", name)
		}
	}
}

func TestDecoderReuseDoesNotLeakPreviousBatch(t *testing.T) {
	d := NewDecoder()
	if _, err := d.Decode(mapBatchFixture(t)); err != nil {
		t.Fatal(err)
	}
	b, err := d.Decode(fixture(t, []any{1.0, []any{[]any{"AllBlocksCleared"}}}))
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 1 || b.Events[0].Kind != indexer.Cleared || b.HasDPRank {
		t.Fatalf("second decode %+v", b)
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(arrayBatchFixture(f))
	f.Add(mapBatchFixture(f))
	for _, fx := range fixtures { // testdata: every event shape of vLLM and SGLang
		f.Add(loadFixture(f, fx.name))
	}
	for _, form := range []Format{{}, {Map: true}, {BytesHashes: true}, {Map: true, BytesHashes: true}} {
		p, err := form.Append(nil, sampleBatch())
		if err != nil {
			f.Fatal(err)
		}
		f.Add(p)
	}
	f.Add(fixture(f, mapBatch(typedStored(seqTokens(0, 8*bs), "sql", "s1", 1)))) // typed extra keys
	f.Add([]byte{})
	f.Add([]byte{0xc1})
	f.Add([]byte("not msgpack at all"))
	f.Add([]byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := Decode(payload)
		if err != nil {
			if Cause(err) == "other" {
				t.Fatalf("error without a cause: %v", err)
			}
			return
		}
		if err := b.Validate(); err != nil {
			t.Fatalf("decoded batch fails validation: %v", err)
		}
		// What decodes must re-encode and decode to as many events, and translate safely.
		for _, m := range []bool{false, true} {
			p, err := Encode(b, m)
			if err != nil {
				t.Fatalf("re-encode: %v", err)
			}
			again, err := Decode(p)
			if err != nil {
				t.Fatalf("re-decode: %v", err)
			}
			if len(again.Events) != len(b.Events) {
				t.Fatalf("re-decode has %d events, want %d", len(again.Events), len(b.Events))
			}
		}
		tr, err := NewTranslator(indexer.Worker{ID: "w"}, 16, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tr.Apply(b, indexer.New(indexer.Options{})); err != nil {
			t.Fatalf("apply: %v", err)
		}
		checkPieces(t, payload, b)
	})
}
