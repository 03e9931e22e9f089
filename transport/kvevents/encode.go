package kvevents

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// Format chooses how Encode lays a batch out.
type Format struct {
	// Map writes the batch and its events as maps (newer vLLM) rather than tagged arrays.
	Map bool
	// BytesHashes writes each EngineHash as its 8 big-endian bytes rather than as an integer,
	// as vLLM does with its sha256-based hashes.
	BytesHashes bool
}

// Encode writes b in vLLM's layout, array encoding unless mapEncoding; hashes are integers.
func Encode(b Batch, mapEncoding bool) ([]byte, error) {
	return Format{Map: mapEncoding}.Append(nil, b)
}

// Append appends b, in vLLM's layout, to dst. An EngineHash h is written as the integer h (or
// its 8 bytes), so decoding gives UintHash(h) (or BytesHash of the bytes): a different value,
// but the same one every time, which is all the router needs of an opaque hash.
//
// Arrays: [ts, events, dp_rank?] and ["BlockStored", block_hashes, parent_block_hash,
// token_ids, block_size, lora_id, medium, lora_name, extra_keys?, group_idx?,
// kv_cache_spec_kind?, kv_cache_spec_sliding_window?], ["BlockRemoved", block_hashes, medium,
// group_idx?], ["AllBlocksCleared"]; the optional fields are written, as msgspec writes them,
// up to the last one set (nil for those before it that are not). Maps: {"ts", "events",
// "data_parallel_rank"} and the same fields by name with "type", the optional ones only when
// set. nil stands for no parent, lora_id 0, and an empty medium or LoRA name. Extra keys are
// written from ExtraKeys (Extras, digests, cannot be written back).
func (f Format) Append(dst []byte, b Batch) ([]byte, error) {
	if err := b.Validate(); err != nil {
		return dst, fmt.Errorf("encode: %w", err)
	}
	buf := bytes.NewBuffer(dst)
	w := writer{e: msgpack.NewEncoder(buf), f: f}
	w.batch(b)
	if w.err != nil {
		return dst, fmt.Errorf("encode: %w", w.err)
	}
	return buf.Bytes(), nil
}

// writer keeps the first error so that the layout code reads as the layout.
type writer struct {
	e   *msgpack.Encoder
	f   Format
	err error
}

func (w *writer) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *writer) str(s string) { w.do(w.e.EncodeString(s)) }

func (w *writer) optStr(s string) {
	if s == "" {
		w.do(w.e.EncodeNil())
		return
	}
	w.str(s)
}

func (w *writer) hash(h EngineHash) {
	if w.f.BytesHashes {
		var b [8]byte
		binary.BigEndian.PutUint64(b[:], uint64(h))
		w.do(w.e.EncodeBytes(b[:]))
		return
	}
	w.do(w.e.EncodeUint(uint64(h)))
}

func (w *writer) hashes(hs []EngineHash) {
	w.do(w.e.EncodeArrayLen(len(hs)))
	for _, h := range hs {
		w.hash(h)
	}
}

func (w *writer) batch(b Batch) {
	if w.f.Map {
		n := 2
		if b.HasDPRank {
			n++
		}
		w.do(w.e.EncodeMapLen(n))
		w.str("ts")
		w.do(w.e.EncodeFloat64(b.TS))
		w.str("events")
	} else {
		n := 2
		if b.HasDPRank {
			n++
		}
		w.do(w.e.EncodeArrayLen(n))
		w.do(w.e.EncodeFloat64(b.TS))
	}
	w.do(w.e.EncodeArrayLen(len(b.Events)))
	for i := range b.Events {
		w.event(&b.Events[i])
	}
	if b.HasDPRank {
		if w.f.Map {
			w.str("data_parallel_rank")
		}
		w.do(w.e.EncodeInt(int64(b.DPRank)))
	}
}

func (w *writer) event(ev *Event) {
	switch ev.Kind {
	case indexer.Stored:
		opt := 0 // optional trailing fields written
		switch {
		case ev.SlidingWindow != 0:
			opt = 4
		case ev.SpecKind != "":
			opt = 3
		case ev.HasGroup:
			opt = 2
		case ev.ExtraKeys != nil:
			opt = 1
		}
		if w.f.Map {
			opt = boolInt(ev.ExtraKeys != nil) + boolInt(ev.HasGroup) + boolInt(ev.SpecKind != "") +
				boolInt(ev.SlidingWindow != 0)
		}
		w.head(tagStored, 7+opt)
		w.field("block_hashes")
		w.hashes(ev.BlockHashes)
		w.field("parent_block_hash")
		if ev.HasParent {
			w.hash(ev.Parent)
		} else {
			w.do(w.e.EncodeNil())
		}
		w.field("token_ids")
		w.do(w.e.EncodeArrayLen(len(ev.TokenIDs)))
		for _, t := range ev.TokenIDs {
			w.do(w.e.EncodeUint(uint64(t)))
		}
		w.field("block_size")
		w.do(w.e.EncodeInt(int64(ev.BlockSize)))
		w.field("lora_id")
		if ev.LoRAID == 0 {
			w.do(w.e.EncodeNil())
		} else {
			w.do(w.e.EncodeInt(int64(ev.LoRAID)))
		}
		w.field("medium")
		w.optStr(ev.Medium)
		w.field("lora_name")
		w.optStr(ev.LoRAName)
		w.optional(opt, 0, ev.ExtraKeys != nil, "extra_keys", func() { w.extraKeys(ev.ExtraKeys) })
		w.optional(opt, 1, ev.HasGroup, "group_idx", func() { w.do(w.e.EncodeInt(int64(ev.Group))) })
		w.optional(opt, 2, ev.SpecKind != "", "kv_cache_spec_kind", func() { w.str(ev.SpecKind) })
		w.optional(opt, 3, ev.SlidingWindow != 0, "kv_cache_spec_sliding_window", func() {
			w.do(w.e.EncodeInt(int64(ev.SlidingWindow)))
		})
	case indexer.Removed:
		w.head(tagRemoved, 2+boolInt(ev.HasGroup))
		w.field("block_hashes")
		w.hashes(ev.BlockHashes)
		w.field("medium")
		w.optStr(ev.Medium)
		if ev.HasGroup {
			w.field("group_idx")
			w.do(w.e.EncodeInt(int64(ev.Group)))
		}
	default:
		w.head(tagCleared, 0)
	}
}

// head starts an event of n fields after its tag.
func (w *writer) head(tag string, n int) {
	if w.f.Map {
		w.do(w.e.EncodeMapLen(n + 1))
		w.str("type")
	} else {
		w.do(w.e.EncodeArrayLen(n + 1))
	}
	w.str(tag)
}

// field names the next field in the map encoding; arrays are positional.
func (w *writer) field(name string) {
	if w.f.Map {
		w.str(name)
	}
}

// optional writes the optional BlockStored field i (0: extra_keys .. 3: the sliding window):
// in a map only when set, in an array as nil when not set but a later one is (opt fields are
// written in all).
func (w *writer) optional(opt, i int, set bool, name string, write func()) {
	if w.f.Map {
		if set {
			w.str(name)
			write()
		}
		return
	}
	if i >= opt {
		return
	}
	if set {
		write()
	} else {
		w.do(w.e.EncodeNil())
	}
}

// extraKeys writes one tuple (or nil) per block.
func (w *writer) extraKeys(keys [][]any) {
	w.do(w.e.EncodeArrayLen(len(keys)))
	for _, k := range keys {
		if k == nil {
			w.do(w.e.EncodeNil())
			continue
		}
		w.do(w.e.EncodeArrayLen(len(k)))
		for _, v := range k {
			w.do(w.e.Encode(v))
		}
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
