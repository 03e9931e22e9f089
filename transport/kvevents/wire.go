// Package kvevents is the precise-mode feed of the index: it subscribes to vLLM's KV events over
// ZMQ, turns the engine's opaque block hashes into the router's own sequence hashes, and applies
// them to an index; and it publishes such events, for the simulated worker.
//
// The wire format is vLLM's: three frames (topic, 8-byte big-endian sequence number, msgpack
// payload), the payload a batch in the array or the map encoding, each event tagged by its
// first element or by a "type" key. See DESIGN.md beside this file for the sequence rules, the
// reconnect and replay strategy, the limits and the quirks of the ZMQ library.
package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/cespare/xxhash/v2"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// Limits on one payload. They are far above anything vLLM sends (a batch is one engine step),
// and low enough that a hostile or broken publisher cannot make the router allocate much.
const (
	// MaxPayload is the largest payload Decode accepts, in bytes.
	MaxPayload = 64 << 20
	// MaxEvents is the most events one Batch holds: Decode refuses a payload of more, and
	// DecodePieces hands a longer batch on in pieces of at most this many. SGLang sends one
	// BlockStored per page, and its default page is one token, so a long prefill step is many
	// thousand events; an engine evicting a long context sends a BlockRemoved per block.
	MaxEvents = 1 << 16
	// MaxBlocksPerEvent is the most block hashes one event may carry: as many as
	// MaxTokensPerEvent, since a stored block has at least one token (a removal of a whole
	// 100,000-block context is one event).
	MaxBlocksPerEvent = MaxTokensPerEvent
	// MaxTokensPerEvent is the most token ids one BlockStored event may carry.
	MaxTokensPerEvent = 1 << 21
	// MaxBlockSize is the largest block size, in tokens, an event may declare.
	MaxBlockSize = 4096
	// MaxHashBytes is the longest engine hash given as bytes (vLLM's sha256 hashes are 32).
	MaxHashBytes = 256
	// MaxDPRank is the highest data-parallel rank a batch may name.
	MaxDPRank = 65535
	// MaxGroup is the highest KV cache group index (vLLM's group_idx) an event may name.
	MaxGroup = 4095
	// MaxExtraBytes bounds one string or bytes element of extra_keys (a cache salt, a
	// multimodal identifier, a prompt-embedding hash).
	MaxExtraBytes = 64 << 10
	// maxString bounds map keys, medium and LoRA names.
	maxString = 1024
	// maxDepth bounds the nesting of fields skipped as unknown.
	maxDepth = 32
)

// The causes a payload is refused for; Cause maps an error to its metric label.
var (
	// ErrMalformed: not msgpack, truncated, trailing bytes, a missing field, inconsistent sizes.
	ErrMalformed = errors.New("malformed")
	// ErrUnknownEvent: an event tag or "type" this package does not know.
	ErrUnknownEvent = errors.New("unknown event type")
	// ErrWrongType: a field of the wrong msgpack type or out of its range.
	ErrWrongType = errors.New("wrong field type")
	// ErrTooLarge: a payload, list, string or nesting past the limits above.
	ErrTooLarge = errors.New("too large")
)

// Cause is the metric label of a decode error: "malformed", "unknown_event", "wrong_type",
// "too_large", or "other" for an error not from this package.
func Cause(err error) string {
	switch {
	case errors.Is(err, ErrTooLarge):
		return "too_large"
	case errors.Is(err, ErrUnknownEvent):
		return "unknown_event"
	case errors.Is(err, ErrWrongType):
		return "wrong_type"
	case errors.Is(err, ErrMalformed):
		return "malformed"
	default:
		return "other"
	}
}

// EngineHash is an engine's block hash, opaque to the router. vLLM sends integers (any width,
// negative too) or bytes; each becomes a 64-bit digest of a kind byte and the value, so an
// integer and a byte string never share an EngineHash and the per-worker maps stay compact.
type EngineHash uint64

// Kind bytes of the digest. Negative integers have their own kind so that -1 and 2^64-1, which
// share their 8 bytes, stay apart.
const (
	kindNegative byte = 1
	kindInteger  byte = 2
	kindBytes    byte = 3
	// kindGroup salts a KV cache group's blocks (translate.go), not a hash of the wire.
	kindGroup byte = 4
)

// IntHash is the EngineHash of an integer hash.
func IntHash(v int64) EngineHash {
	if v < 0 {
		return digestInt(kindNegative, uint64(v))
	}
	return digestInt(kindInteger, uint64(v))
}

// UintHash is the EngineHash of a non-negative integer hash; it equals IntHash for values that
// fit an int64, whatever width the publisher encoded them with.
func UintHash(v uint64) EngineHash { return digestInt(kindInteger, v) }

// BytesHash is the EngineHash of a hash sent as bytes.
func BytesHash(b []byte) EngineHash {
	if len(b) <= 64 {
		// One-shot on the stack: the common case (vLLM's 32-byte hashes) without a digest.
		var buf [65]byte
		buf[0] = kindBytes
		n := copy(buf[1:], b)
		return EngineHash(xxhash.Sum64(buf[:1+n]))
	}
	var d xxhash.Digest
	d.Reset()
	_, _ = d.Write([]byte{kindBytes})
	_, _ = d.Write(b)
	return EngineHash(d.Sum64())
}

func digestInt(kind byte, v uint64) EngineHash {
	var b [9]byte
	b[0] = kind
	binary.BigEndian.PutUint64(b[1:], v)
	return EngineHash(xxhash.Sum64(b[:]))
}

// Event is one vLLM KV event. Kind is indexer.Stored (BlockStored), indexer.Removed
// (BlockRemoved) or indexer.Cleared (AllBlocksCleared); the other fields are those of the kind.
type Event struct {
	Kind        indexer.EventKind
	BlockHashes []EngineHash
	// Parent is the block before BlockHashes[0]; HasParent is false when the publisher sent
	// nil or 0 ("no parent").
	Parent    EngineHash
	HasParent bool
	// TokenIDs are all tokens of the stored blocks: len(BlockHashes) * BlockSize of them.
	TokenIDs  []uint32
	BlockSize int
	LoRAName  string
	// LoRAID is vLLM's integer adapter id; 0 is none (sent as nil).
	LoRAID int
	// Medium is where the blocks live ("GPU", "CPU", ...); empty when not sent.
	Medium string
	// Version is a BlockStored's event_version when sent (vLLM from the typed extra keys on
	// sends it only when it is not 1, its default); 0 when absent. Decode fills it; typed
	// extra keys are read by their shape whatever it says.
	Version int

	// Extras holds, per block hash, the digest of the block's extra_keys (multimodal items,
	// cache salt, prompt-embedding hashes) as indexer.ExtraDigest computes it, the leading LoRA
	// name left out (it seeds the keys already); 0 for a block without extra keys. nil when
	// the event carried no extra_keys. Decode fills it; Encode ignores it (see ExtraKeys).
	Extras []uint64
	// ExtraKeys are the extra_keys Encode writes, one tuple per block hash (nil for none),
	// elements of type string, []byte, int, int64, uint64, float64, bool, nil or []any.
	// Decode leaves it nil and fills Extras instead.
	ExtraKeys [][]any
	// Group is vLLM's group_idx: the KV cache group the blocks belong to (hybrid models have
	// a full-attention group and sliding-window or Mamba groups). HasGroup is false when the
	// event did not say (older vLLM, SGLang): group 0.
	Group    int
	HasGroup bool
	// SpecKind is kv_cache_spec_kind ("full_attention", "sliding_window", "mamba", ...) and
	// SlidingWindow kv_cache_spec_sliding_window in tokens, when a BlockStored carried them.
	SpecKind      string
	SlidingWindow int
}

// Batch is one payload: the events of one engine step.
type Batch struct {
	// TS is the engine's wall clock when it built the batch, in seconds since the epoch.
	TS     float64
	Events []Event
	// DPRank is the data-parallel rank that published the batch, when HasDPRank.
	DPRank    int
	HasDPRank bool
}

// Validate checks the invariants Decode guarantees, for batches built by other code: known
// kinds, sizes within the limits, and token ids consistent with the block hashes.
func (b Batch) Validate() error {
	if len(b.Events) > MaxEvents {
		return fmt.Errorf("%w: %d events in a batch (limit %d)", ErrTooLarge, len(b.Events), MaxEvents)
	}
	if b.HasDPRank && (b.DPRank < 0 || b.DPRank > MaxDPRank) {
		return fmt.Errorf("%w: data_parallel_rank %d out of 0..%d", ErrWrongType, b.DPRank, MaxDPRank)
	}
	for i := range b.Events {
		if err := b.Events[i].validate(); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
	}
	return nil
}

func (e *Event) validate() error {
	switch e.Kind {
	case indexer.Stored:
		if len(e.BlockHashes) > MaxBlocksPerEvent {
			return fmt.Errorf("%w: %d block hashes (limit %d)", ErrTooLarge, len(e.BlockHashes), MaxBlocksPerEvent)
		}
		if len(e.TokenIDs) > MaxTokensPerEvent {
			return fmt.Errorf("%w: %d token ids (limit %d)", ErrTooLarge, len(e.TokenIDs), MaxTokensPerEvent)
		}
		if e.BlockSize > MaxBlockSize {
			return fmt.Errorf("%w: block_size %d (limit %d)", ErrTooLarge, e.BlockSize, MaxBlockSize)
		}
		if e.BlockSize < 1 {
			return fmt.Errorf("%w: block_size %d", ErrMalformed, e.BlockSize)
		}
		// vLLM skips the null blocks of a sliding-window (or Mamba) group in block_hashes but
		// not in token_ids, which cover every block from the parent on: the hashes name the
		// last blocks. Fewer tokens than hashes, or a partial block, is malformed.
		if len(e.TokenIDs) < len(e.BlockHashes)*e.BlockSize || len(e.TokenIDs)%e.BlockSize != 0 {
			return fmt.Errorf("%w: %d token ids for %d blocks of %d", ErrMalformed,
				len(e.TokenIDs), len(e.BlockHashes), e.BlockSize)
		}
		if e.Extras != nil && len(e.Extras) != len(e.BlockHashes) {
			return fmt.Errorf("%w: %d extra_keys for %d blocks", ErrMalformed, len(e.Extras), len(e.BlockHashes))
		}
		if e.ExtraKeys != nil && len(e.ExtraKeys) != len(e.BlockHashes) {
			return fmt.Errorf("%w: %d extra_keys for %d blocks", ErrMalformed, len(e.ExtraKeys), len(e.BlockHashes))
		}
		if e.SlidingWindow < 0 || e.SlidingWindow > math.MaxInt32 {
			return fmt.Errorf("%w: kv_cache_spec_sliding_window %d", ErrWrongType, e.SlidingWindow)
		}
	case indexer.Removed:
		if len(e.BlockHashes) > MaxBlocksPerEvent {
			return fmt.Errorf("%w: %d block hashes (limit %d)", ErrTooLarge, len(e.BlockHashes), MaxBlocksPerEvent)
		}
	case indexer.Cleared:
	default:
		return fmt.Errorf("%w: kind %d", ErrUnknownEvent, e.Kind)
	}
	if e.HasGroup && (e.Group < 0 || e.Group > MaxGroup) {
		return fmt.Errorf("%w: group_idx %d out of 0..%d", ErrWrongType, e.Group, MaxGroup)
	}
	return nil
}

// The event tags, as vLLM names its event classes.
const (
	tagStored  = "BlockStored"
	tagRemoved = "BlockRemoved"
	tagCleared = "AllBlocksCleared"
)

// msgpack codes this file dispatches on (the library exports them as variables, not constants).
const (
	codeNil     = 0xc0
	codeFalse   = 0xc2
	codeTrue    = 0xc3
	codeBin8    = 0xc4
	codeBin16   = 0xc5
	codeBin32   = 0xc6
	codeFloat   = 0xca
	codeDouble  = 0xcb
	codeUint8   = 0xcc
	codeUint16  = 0xcd
	codeUint32  = 0xce
	codeUint64  = 0xcf
	codeInt8    = 0xd0
	codeInt16   = 0xd1
	codeInt32   = 0xd2
	codeInt64   = 0xd3
	codeStr8    = 0xd9
	codeStr16   = 0xda
	codeStr32   = 0xdb
	codeArray16 = 0xdc
	codeArray32 = 0xdd
	codeMap16   = 0xde
	codeMap32   = 0xdf
)

func isArray(c byte) bool { return c&0xf0 == 0x90 || c == codeArray16 || c == codeArray32 }
func isMap(c byte) bool   { return c&0xf0 == 0x80 || c == codeMap16 || c == codeMap32 }
func isStr(c byte) bool   { return c&0xe0 == 0xa0 || c == codeStr8 || c == codeStr16 || c == codeStr32 }
func isBin(c byte) bool   { return c == codeBin8 || c == codeBin16 || c == codeBin32 }
func isInt(c byte) bool {
	return c <= 0x7f || c >= 0xe0 || (c >= codeUint8 && c <= codeInt64)
}

// Decoder decodes payloads, reusing its buffers from one payload to the next: the Batch it
// returns, and every slice in it, are valid only until its next Decode. A Decoder is not safe
// for concurrent use.
type Decoder struct {
	payload []byte
	r       bytes.Reader
	d       *msgpack.Decoder
	scratch []byte
	events  []Event
	hashes  []EngineHash
	tokens  []uint32
	// medium and kind remember the last medium and kv_cache_spec_kind strings so that "GPU"
	// and "full_attention" are not allocated per event.
	medium, kind string
	// extras holds the events' extra-key digests; pending the digests of the extra_keys of the
	// event being decoded, resolved once its lora_name is known (a map may give it after).
	extras  []uint64
	pending []extraEntry
	// hasExtras says the event being decoded carried a list in extra_keys.
	hasExtras bool
	// sink takes the digest writes nobody reads (the first element of a tuple, for the digest
	// that leaves it out).
	sink indexer.ExtraDigest
	// typed holds the string fields of the typed extra key being decoded (typedKey).
	typed []byte
	// emit, when set (DecodePieces), takes the events decoded so far whenever they fill a
	// piece, and the event list is then unbounded in count; emitted counts its calls.
	emit    func([]Event) error
	emitted int
	// pieceEvents is the most events of a piece (pieceEvents; the fuzz target makes it small).
	pieceEvents int
}

// extraEntry is one block's extra_keys as decoded: the digest of all its elements, and of all
// but the first, which vLLM makes the LoRA name when the request has one.
type extraEntry struct {
	all, rest uint64
	// first is the xxhash of the first element, when firstStr says it is a string.
	first    uint64
	firstStr bool
}

// NewDecoder returns a Decoder.
func NewDecoder() *Decoder {
	d := &Decoder{scratch: make([]byte, 0, 64), pieceEvents: pieceEvents}
	d.d = msgpack.NewDecoder(&d.r)
	return d
}

// Decode decodes one payload into a Batch whose slices it owns; see Decoder for the fast path.
func Decode(payload []byte) (Batch, error) { return NewDecoder().Decode(payload) }

// Decode decodes one payload in either of vLLM's batch encodings. On error nothing of the
// payload is returned, and the error wraps one of ErrMalformed, ErrUnknownEvent, ErrWrongType
// or ErrTooLarge.
func (d *Decoder) Decode(payload []byte) (Batch, error) {
	if len(payload) > MaxPayload {
		return Batch{}, fmt.Errorf("%w: payload of %d bytes (limit %d)", ErrTooLarge, len(payload), MaxPayload)
	}
	d.payload = payload
	d.r.Reset(payload)
	d.d.Reset(&d.r)
	d.events = d.events[:0]
	d.hashes = d.hashes[:0]
	d.tokens = d.tokens[:0]
	d.extras = d.extras[:0]
	b, err := d.batch()
	if err == nil && d.r.Len() != 0 {
		err = fmt.Errorf("%w: %d trailing bytes after the batch", ErrMalformed, d.r.Len())
	}
	if err != nil {
		return Batch{}, err
	}
	return b, nil
}

func (d *Decoder) batch() (Batch, error) {
	c, err := d.peek("batch")
	if err != nil {
		return Batch{}, err
	}
	switch {
	case isArray(c):
		return d.arrayBatch()
	case isMap(c):
		return d.mapBatch()
	default:
		return Batch{}, fmt.Errorf("%w: batch is msgpack code %#x, want an array or a map", ErrWrongType, c)
	}
}

// arrayBatch decodes [ts, events, dp_rank?, ...].
func (d *Decoder) arrayBatch() (Batch, error) {
	n, err := d.arrayLen("batch", 1<<16)
	if err != nil {
		return Batch{}, err
	}
	if n < 2 {
		return Batch{}, fmt.Errorf("%w: batch array of %d elements, want [ts, events, ...]", ErrMalformed, n)
	}
	var b Batch
	if b.TS, err = d.float("ts"); err != nil {
		return Batch{}, err
	}
	if b.Events, err = d.eventList(); err != nil {
		return Batch{}, err
	}
	if n >= 3 {
		if b.DPRank, b.HasDPRank, err = d.dpRank(); err != nil {
			return Batch{}, err
		}
	}
	return b, d.skipN(max(0, n-3), 0)
}

// mapBatch decodes {"ts": ..., "events": [...], "data_parallel_rank": ...}, keys in any order.
func (d *Decoder) mapBatch() (Batch, error) {
	n, err := d.mapLen("batch")
	if err != nil {
		return Batch{}, err
	}
	var b Batch
	haveEvents := false
	for range n {
		key, err := d.str("map key")
		if err != nil {
			return Batch{}, err
		}
		switch string(key) {
		case "ts":
			b.TS, err = d.float("ts")
		case "events":
			b.Events, err = d.eventList()
			haveEvents = true
		case "data_parallel_rank", "attn_dp_rank": // vLLM's name, SGLang's name
			b.DPRank, b.HasDPRank, err = d.dpRank()
		default:
			err = d.skip(0)
		}
		if err != nil {
			return Batch{}, err
		}
	}
	if !haveEvents {
		return Batch{}, fmt.Errorf("%w: batch map without \"events\"", ErrMalformed)
	}
	return b, nil
}

func (d *Decoder) dpRank() (int, bool, error) {
	c, err := d.peek("data_parallel_rank")
	if err != nil {
		return 0, false, err
	}
	if c == codeNil {
		return 0, false, d.d.DecodeNil()
	}
	r, err := d.int("data_parallel_rank", 0, MaxDPRank)
	return int(r), err == nil, err
}

func (d *Decoder) eventList() ([]Event, error) {
	limit := MaxEvents
	if d.emit != nil {
		limit = math.MaxInt // in pieces: bounded by the bytes left
	}
	n, err := d.arrayLen("events", limit)
	if err != nil {
		return nil, err
	}
	for i := range n {
		if d.emit != nil && d.pieceFull() {
			if err := d.flush(); err != nil {
				return nil, err
			}
		}
		// Decoded in place: an Event is a couple of hundred bytes, not worth copying twice.
		d.events = append(d.events, Event{})
		if err := d.event(&d.events[len(d.events)-1]); err != nil {
			return nil, fmt.Errorf("event %d: %w", i, err)
		}
	}
	return d.events[:len(d.events):len(d.events)], nil
}

func (d *Decoder) event(ev *Event) error {
	c, err := d.peek("event")
	if err != nil {
		return err
	}
	d.hasExtras = false
	switch {
	case isArray(c):
		err = d.arrayEvent(ev)
	case isMap(c):
		err = d.mapEvent(ev)
	default:
		return fmt.Errorf("%w: event is msgpack code %#x, want an array or a map", ErrWrongType, c)
	}
	if err != nil {
		return err
	}
	if d.hasExtras && ev.Kind == indexer.Stored {
		d.resolveExtras(ev)
	}
	return ev.validate()
}

// resolveExtras turns the pending extra_keys of a BlockStored into ev.Extras: a block's
// digest leaves its first element out when that is the event's LoRA name (vLLM puts the name
// first in every block's tuple; the router has it in the seed), and keeps it otherwise.
func (d *Decoder) resolveExtras(ev *Event) {
	var lora uint64
	if ev.LoRAName != "" {
		lora = xxhash.Sum64String(ev.LoRAName)
	}
	start := len(d.extras)
	for _, x := range d.pending {
		if ev.LoRAName != "" && x.firstStr && x.first == lora {
			d.extras = append(d.extras, x.rest)
		} else {
			d.extras = append(d.extras, x.all)
		}
	}
	ev.Extras = d.extras[start:len(d.extras):len(d.extras)]
}

// arrayEvent decodes a tagged array event, vLLM's array_like layout: ["BlockStored",
// block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
// extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, ...],
// ["BlockRemoved", block_hashes, medium, group_idx, ...] or ["AllBlocksCleared", ...]. msgspec
// drops trailing fields at their defaults, so any prefix from block_size (BlockStored) or
// block_hashes (BlockRemoved) on is an older release's event (SGLang's BlockStored stops
// after lora_id or medium). Fields past those are a newer release's and skipped.
func (d *Decoder) arrayEvent(ev *Event) error {
	n, err := d.arrayLen("event", 1<<16)
	if err != nil {
		return err
	}
	if n < 1 {
		return fmt.Errorf("%w: empty event array", ErrMalformed)
	}
	tag, err := d.str("event tag")
	if err != nil {
		return err
	}
	known := 0 // how many fields after the tag this package reads
	switch string(tag) {
	case tagStored:
		ev.Kind, known = indexer.Stored, 11
		if n < 5 {
			return fmt.Errorf("%w: BlockStored with %d fields, want at least 4", ErrMalformed, n-1)
		}
	case tagRemoved:
		ev.Kind, known = indexer.Removed, 3
		if n < 2 {
			return fmt.Errorf("%w: BlockRemoved without block_hashes", ErrMalformed)
		}
	case tagCleared:
		ev.Kind = indexer.Cleared
	default:
		return fmt.Errorf("%w: %.64q", ErrUnknownEvent, tag)
	}
	i := 0
	for ; i < n-1 && i < known; i++ {
		if err := d.positional(ev, i); err != nil {
			return err
		}
	}
	return d.skipN(n-1-i, 0)
}

// positional decodes field i (after the tag) of an array event whose Kind is set.
func (d *Decoder) positional(ev *Event, i int) error {
	if ev.Kind == indexer.Removed {
		switch i {
		case 0:
			return d.blockHashes(ev)
		case 1:
			return d.mediumField(ev)
		default:
			return d.group(ev)
		}
	}
	switch i {
	case 0:
		return d.blockHashes(ev)
	case 1:
		return d.parent(ev)
	case 2:
		return d.tokenIDs(ev)
	case 3:
		return d.blockSize(ev)
	case 4:
		return d.loraID(ev)
	case 5:
		return d.mediumField(ev)
	case 6:
		return d.loraName(ev)
	case 7:
		return d.extraKeys()
	case 8:
		return d.group(ev)
	case 9:
		return d.specKind(ev)
	default:
		return d.slidingWindow(ev)
	}
}

// mapEvent decodes {"type": tag, field: value, ...}; the type may come after the fields.
func (d *Decoder) mapEvent(ev *Event) error {
	n, err := d.mapLen("event")
	if err != nil {
		return err
	}
	var kind indexer.EventKind
	var haveHashes, haveTokens, haveSize bool
	for range n {
		key, err := d.str("map key")
		if err != nil {
			return err
		}
		switch string(key) {
		case "type":
			kind, err = d.eventType()
		case "block_hashes":
			err = d.blockHashes(ev)
			haveHashes = true
		case "parent_block_hash":
			err = d.parent(ev)
		case "token_ids":
			err = d.tokenIDs(ev)
			haveTokens = true
		case "block_size":
			err = d.blockSize(ev)
			haveSize = true
		case "lora_id":
			err = d.loraID(ev)
		case "medium":
			err = d.mediumField(ev)
		case "lora_name":
			err = d.loraName(ev)
		case "extra_keys":
			err = d.extraKeys()
		case "event_version":
			err = d.eventVersion(ev)
		case "group_idx":
			err = d.group(ev)
		case "kv_cache_spec_kind":
			err = d.specKind(ev)
		case "kv_cache_spec_sliding_window":
			err = d.slidingWindow(ev)
		default:
			err = d.skip(0)
		}
		if err != nil {
			return err
		}
	}
	ev.Kind = kind
	switch kind {
	case indexer.Stored:
		if !haveHashes || !haveTokens || !haveSize {
			return fmt.Errorf("%w: BlockStored without block_hashes, token_ids or block_size", ErrMalformed)
		}
	case indexer.Removed:
		if !haveHashes {
			return fmt.Errorf("%w: BlockRemoved without block_hashes", ErrMalformed)
		}
	case indexer.Cleared:
	default:
		return fmt.Errorf("%w: event map without \"type\"", ErrMalformed)
	}
	return nil
}

func (d *Decoder) eventType() (indexer.EventKind, error) {
	t, err := d.str("event type")
	if err != nil {
		return 0, err
	}
	switch string(t) {
	case tagStored:
		return indexer.Stored, nil
	case tagRemoved:
		return indexer.Removed, nil
	case tagCleared:
		return indexer.Cleared, nil
	default:
		return 0, fmt.Errorf("%w: %.64q", ErrUnknownEvent, t)
	}
}

func (d *Decoder) blockHashes(ev *Event) error {
	n, err := d.arrayLen("block_hashes", MaxBlocksPerEvent)
	if err != nil {
		return err
	}
	start := len(d.hashes)
	for range n {
		// The common encodings straight from the payload; the rest through the decoder.
		if h, used := quickHash(d.payload[len(d.payload)-d.r.Len():]); used > 0 {
			d.hashes = append(d.hashes, h)
			if _, err := d.r.Seek(int64(used), io.SeekCurrent); err != nil {
				return malformed("block_hashes", err)
			}
			continue
		}
		h, isNil, err := d.hash("block_hashes")
		if err != nil {
			return err
		}
		if isNil {
			return fmt.Errorf("%w: nil in block_hashes", ErrWrongType)
		}
		d.hashes = append(d.hashes, h)
	}
	ev.BlockHashes = d.hashes[start:len(d.hashes):len(d.hashes)]
	return nil
}

// quickHash decodes a hash at the start of p in the encodings publishers use (a non-negative
// integer, 32- and 64-bit unsigned included, or up to 255 bytes) and says how many bytes it
// took; 0 leaves everything else, and every error, to the decoder.
func quickHash(p []byte) (EngineHash, int) {
	if len(p) == 0 {
		return 0, 0
	}
	switch c := p[0]; {
	case c <= 0x7f:
		return UintHash(uint64(c)), 1
	case c == codeUint64 && len(p) >= 9:
		return UintHash(binary.BigEndian.Uint64(p[1:])), 9
	case c == codeUint32 && len(p) >= 5:
		return UintHash(uint64(binary.BigEndian.Uint32(p[1:]))), 5
	case c == codeBin8 && len(p) >= 2 && int(p[1]) <= MaxHashBytes && len(p) >= 2+int(p[1]):
		return BytesHash(p[2 : 2+int(p[1])]), 2 + int(p[1])
	}
	return 0, 0
}

func (d *Decoder) parent(ev *Event) error {
	c, err := d.peek("parent_block_hash")
	if err != nil {
		return err
	}
	if isInt(c) {
		// Some publishers send 0 for "no parent"; a real hash of 0 is not worth the ambiguity.
		v, err := d.d.DecodeUint64()
		if err != nil {
			return malformed("parent_block_hash", err)
		}
		if v == 0 {
			ev.Parent, ev.HasParent = 0, false
			return nil
		}
		if c == codeUint64 || int64(v) >= 0 {
			ev.Parent = UintHash(v)
		} else {
			ev.Parent = IntHash(int64(v))
		}
		ev.HasParent = true
		return nil
	}
	h, isNil, err := d.hash("parent_block_hash")
	if err != nil {
		return err
	}
	ev.Parent, ev.HasParent = h, !isNil
	return nil
}

// tokenIDs decodes the token list straight from the payload: it is most of a BlockStored's
// bytes, and per-element calls through the generic decoder would dominate the decode.
func (d *Decoder) tokenIDs(ev *Event) error {
	n, err := d.arrayLen("token_ids", MaxTokensPerEvent)
	if err != nil {
		return err
	}
	start := len(d.tokens)
	d.tokens = grow(d.tokens, n)
	out := d.tokens[start : start+n]
	p := d.payload[len(d.payload)-d.r.Len():]
	i := 0
	for ; i < n && len(p) > 0; i++ {
		c := p[0]
		switch {
		case c <= 0x7f:
			out[i] = uint32(c)
			p = p[1:]
		case c == codeUint8 && len(p) >= 2:
			out[i] = uint32(p[1])
			p = p[2:]
		case c == codeUint16 && len(p) >= 3:
			out[i] = uint32(binary.BigEndian.Uint16(p[1:]))
			p = p[3:]
		case c == codeUint32 && len(p) >= 5:
			out[i] = binary.BigEndian.Uint32(p[1:])
			p = p[5:]
		default:
			v, used, err := slowToken(p)
			if err != nil {
				return fmt.Errorf("token_ids[%d]: %w", i, err)
			}
			out[i] = v
			p = p[used:]
		}
	}
	if i < n {
		return fmt.Errorf("%w: token_ids truncated after %d of %d", ErrMalformed, i, n)
	}
	if _, err := d.r.Seek(int64(len(d.payload)-len(p)), io.SeekStart); err != nil {
		return malformed("token_ids", err)
	}
	d.tokens = d.tokens[:start+n]
	ev.TokenIDs = d.tokens[start : start+n : start+n]
	return nil
}

// slowToken decodes a token id in a rarer encoding at the start of p: an integer in one of
// the rarer widths, or SGLang's bigram key, a short array whose first element is the token (with
// EAGLE, SGLang's radix keys pair each token with the next one, and its events pass the pairs
// on). It says how many bytes it used.
func slowToken(p []byte) (uint32, int, error) {
	c := p[0]
	if c&0xf0 != 0x90 { // not a fixarray: an integer or an error
		return slowUint32(p)
	}
	n := int(c & 0x0f)
	if n == 0 {
		return 0, 0, fmt.Errorf("%w: token id is an empty array", ErrWrongType)
	}
	used := 1
	var first uint32
	for j := range n {
		if used >= len(p) {
			return 0, 0, fmt.Errorf("%w: truncated token pair", ErrMalformed)
		}
		v, k, err := rawUint32(p[used:])
		if err != nil {
			return 0, 0, err
		}
		if j == 0 {
			first = v
		}
		used += k
	}
	return first, used, nil
}

// rawUint32 decodes an integer token id at the start of p (non-empty) and says how many bytes
// it used.
func rawUint32(p []byte) (uint32, int, error) {
	switch c := p[0]; {
	case c <= 0x7f:
		return uint32(c), 1, nil
	case c == codeUint8 && len(p) >= 2:
		return uint32(p[1]), 2, nil
	case c == codeUint16 && len(p) >= 3:
		return uint32(binary.BigEndian.Uint16(p[1:])), 3, nil
	case c == codeUint32 && len(p) >= 5:
		return binary.BigEndian.Uint32(p[1:]), 5, nil
	}
	return slowUint32(p)
}

// slowUint32 decodes a token id in one of the rarer integer encodings (signed widths, 64-bit
// widths) at the start of p, and says how many bytes it used.
func slowUint32(p []byte) (uint32, int, error) {
	c := p[0]
	var v int64
	var size int
	switch {
	case c >= 0xe0:
		v, size = int64(int8(c)), 1
	case c == codeInt8 && len(p) >= 2:
		v, size = int64(int8(p[1])), 2
	case c == codeInt16 && len(p) >= 3:
		v, size = int64(int16(binary.BigEndian.Uint16(p[1:]))), 3
	case c == codeInt32 && len(p) >= 5:
		v, size = int64(int32(binary.BigEndian.Uint32(p[1:]))), 5
	case (c == codeInt64 || c == codeUint64) && len(p) >= 9:
		u := binary.BigEndian.Uint64(p[1:])
		if c == codeUint64 && u > math.MaxUint32 {
			return 0, 0, fmt.Errorf("%w: token id %d out of range", ErrWrongType, u)
		}
		v, size = int64(u), 9
	case isInt(c):
		return 0, 0, fmt.Errorf("%w: truncated integer", ErrMalformed)
	default:
		return 0, 0, fmt.Errorf("%w: token id is msgpack code %#x, want an integer", ErrWrongType, c)
	}
	if v < 0 || v > math.MaxUint32 {
		return 0, 0, fmt.Errorf("%w: token id %d out of range", ErrWrongType, v)
	}
	return uint32(v), size, nil
}

func (d *Decoder) blockSize(ev *Event) error {
	v, err := d.int("block_size", math.MinInt64, math.MaxInt64)
	if err != nil {
		return err
	}
	switch {
	case v > MaxBlockSize:
		return fmt.Errorf("%w: block_size %d (limit %d)", ErrTooLarge, v, MaxBlockSize)
	case v < 1:
		return fmt.Errorf("%w: block_size %d", ErrMalformed, v)
	}
	ev.BlockSize = int(v)
	return nil
}

func (d *Decoder) loraID(ev *Event) error {
	v, err := d.optInt("lora_id", math.MinInt64, math.MaxInt64)
	ev.LoRAID = int(v)
	return err
}

func (d *Decoder) mediumField(ev *Event) error {
	s, isNil, err := d.optStr("medium")
	if err != nil || isNil {
		return err
	}
	if string(s) != d.medium {
		d.medium = string(s)
	}
	ev.Medium = d.medium
	return nil
}

func (d *Decoder) loraName(ev *Event) error {
	s, isNil, err := d.optStr("lora_name")
	if err != nil || isNil {
		return err
	}
	ev.LoRAName = string(s)
	return nil
}

func (d *Decoder) group(ev *Event) error {
	c, err := d.peek("group_idx")
	if err != nil {
		return err
	}
	if c == codeNil {
		ev.Group, ev.HasGroup = 0, false
		return d.d.DecodeNil()
	}
	v, err := d.int("group_idx", 0, MaxGroup)
	ev.Group, ev.HasGroup = int(v), err == nil
	return err
}

func (d *Decoder) specKind(ev *Event) error {
	s, isNil, err := d.optStr("kv_cache_spec_kind")
	if err != nil || isNil {
		return err
	}
	if string(s) != d.kind {
		d.kind = string(s)
	}
	ev.SpecKind = d.kind
	return nil
}

func (d *Decoder) slidingWindow(ev *Event) error {
	v, err := d.optInt("kv_cache_spec_sliding_window", 0, math.MaxInt32)
	ev.SlidingWindow = int(v)
	return err
}

// optInt reads an integer in lo..hi, or nil as 0.
func (d *Decoder) optInt(what string, lo, hi int64) (int64, error) {
	c, err := d.peek(what)
	if err != nil {
		return 0, err
	}
	if c == codeNil {
		return 0, d.d.DecodeNil()
	}
	return d.int(what, lo, hi)
}

// extraKeys decodes vLLM's extra_keys: nil, or a list with one entry per block hash, each nil
// or a tuple of elements (strings, integers, bytes, nested tuples). Each entry becomes a digest
// (indexer.ExtraDigest, element by element), resolved against lora_name once the event is
// whole (resolveExtras).
func (d *Decoder) extraKeys() error {
	c, err := d.peek("extra_keys")
	if err != nil {
		return err
	}
	d.pending = d.pending[:0]
	if c == codeNil {
		d.hasExtras = false
		return d.d.DecodeNil()
	}
	n, err := d.arrayLen("extra_keys", MaxBlocksPerEvent)
	if err != nil {
		return err
	}
	d.hasExtras = true
	for range n {
		c, err := d.peek("extra_keys entry")
		if err != nil {
			return err
		}
		if c == codeNil {
			if err := d.d.DecodeNil(); err != nil {
				return malformed("extra_keys entry", err)
			}
			d.pending = append(d.pending, extraEntry{})
			continue
		}
		if !isArray(c) {
			return fmt.Errorf("%w: extra_keys entry is msgpack code %#x, want an array or nil", ErrWrongType, c)
		}
		m, err := d.arrayLen("extra_keys entry", math.MaxInt)
		if err != nil {
			return err
		}
		var all, rest indexer.ExtraDigest
		var x extraEntry
		for j := range m {
			c, err := d.peek("extra key")
			if err != nil {
				return err
			}
			if isMap(c) {
				// vLLM's typed keys (event_version 1): the element the engine hashed, as the
				// untyped tuple had it.
				second := &rest
				if j == 0 {
					second = nil
				}
				lora, isLoRA, err := d.typedKey(&all, second)
				if err != nil {
					return err
				}
				if j == 0 && isLoRA {
					x.first, x.firstStr = lora, true
				}
				continue
			}
			if j > 0 {
				if err := d.extraValue(&all, &rest, 1); err != nil {
					return err
				}
				continue
			}
			if !isStr(c) {
				if err := d.extraValue(&all, nil, 1); err != nil {
					return err
				}
				continue
			}
			b, err := d.raw("extra key", MaxExtraBytes)
			if err != nil {
				return err
			}
			x.first, x.firstStr = xxhash.Sum64(b), true
			all.StringBytes(b)
		}
		x.all, x.rest = all.Sum(), rest.Sum()
		d.pending = append(d.pending, x)
	}
	return nil
}

// Typed extra keys of vLLM's BlockStored from event_version 1 (kv_events.py's ExtraKey
// structs, tagged maps): each stands for one element of the tuple the engine hashed.
const (
	typedLoRA   = "lora"          // {"name": str}: the LoRA name, a string element
	typedSalt   = "cache_salt"    // {"salt": str}: the cache salt, a string element
	typedEmbeds = "prompt_embeds" // {"hash": bytes}: a bytes element
	typedMM     = "mm"            // {"modality", "hash": str, "block_offset": int}: (hash, offset)
	typedLegacy = "legacy"        // {"value": any}: the element itself
)

// typedKey reads one typed extra key (a map tagged by "type", fields in any order) and adds to
// a and b (b may be nil) the element the engine hashed for it, so that a block's digest is the
// same whether its engine sends typed or untyped keys, and the same as the request side's. It
// reports the LoRA name's xxhash for a "lora" key. A key of a type this package does not know
// becomes an element of its own, which no request produces: a predicted miss, never a false
// hit. A known type missing its field, or with a field of the wrong type, is an error.
func (d *Decoder) typedKey(a, b *indexer.ExtraDigest) (lora uint64, isLoRA bool, err error) {
	if b == nil {
		b = &d.sink
	}
	n, err := d.mapLen("typed extra key")
	if err != nil {
		return 0, false, err
	}
	d.typed = d.typed[:0]
	var typ, val [2]int // spans of the type and of the string or bytes field in d.typed
	var haveType, haveVal, valBin, haveOffset, haveValue, legacyDone bool
	var offset int64
	var other indexer.ExtraDigest // fields of an unknown type, in the order met
	other.String("typed")
	for range n {
		key, err := d.str("typed extra key field")
		if err != nil {
			return 0, false, err
		}
		switch string(key) {
		case "type":
			s, err := d.str("typed extra key type")
			if err != nil {
				return 0, false, err
			}
			typ, haveType = d.keepTyped(s), true
			other.StringBytes(s)
		case "name", "salt", "hash":
			c, err := d.peek("typed extra key field")
			if err != nil {
				return 0, false, err
			}
			if !isStr(c) && !isBin(c) {
				return 0, false, fmt.Errorf("%w: typed extra key field is msgpack code %#x, want a string or bytes", ErrWrongType, c)
			}
			s, err := d.raw("typed extra key field", MaxExtraBytes)
			if err != nil {
				return 0, false, err
			}
			val, haveVal, valBin = d.keepTyped(s), true, isBin(c)
			other.StringBytes(s)
		case "block_offset":
			if offset, err = d.int("typed extra key block_offset", math.MinInt64, math.MaxInt64); err != nil {
				return 0, false, err
			}
			haveOffset = true
			other.Int(offset)
		case "value":
			haveValue = true
			// msgspec writes the tag first, so a legacy key's value is usually read knowing it
			// is one: then it is the element itself, as in an untyped tuple.
			if haveType && string(d.typed[typ[0]:typ[1]]) == typedLegacy {
				if err := d.extraValue(a, b, 2); err != nil {
					return 0, false, err
				}
				legacyDone = true
				continue
			}
			if err := d.extraValue(&other, nil, 2); err != nil {
				return 0, false, err
			}
		default: // "modality" (not hashed by the engine) and fields of newer releases
			other.StringBytes(key)
			if err := d.extraValue(&other, nil, 2); err != nil {
				return 0, false, err
			}
		}
	}
	if !haveType {
		return 0, false, fmt.Errorf("%w: typed extra key without \"type\"", ErrMalformed)
	}
	t, v := d.typed[typ[0]:typ[1]], d.typed[val[0]:val[1]]
	need := func(ok bool, field string) error {
		if !ok {
			return fmt.Errorf("%w: typed extra key %.64q without a valid %q", ErrMalformed, t, field)
		}
		return nil
	}
	switch string(t) {
	case typedLoRA, typedSalt:
		field := "name"
		if string(t) == typedSalt {
			field = "salt"
		}
		if err := need(haveVal && !valBin, field); err != nil {
			return 0, false, err
		}
		a.StringBytes(v)
		b.StringBytes(v)
		return xxhash.Sum64(v), string(t) == typedLoRA, nil
	case typedEmbeds:
		if err := need(haveVal, "hash"); err != nil {
			return 0, false, err
		}
		a.Bytes(v)
		b.Bytes(v)
	case typedMM:
		if err := need(haveVal && !valBin && haveOffset, "hash and block_offset"); err != nil {
			return 0, false, err
		}
		for _, e := range []*indexer.ExtraDigest{a, b} {
			e.Tuple(2)
			e.StringBytes(v)
			e.Int(offset)
		}
	case typedLegacy:
		if err := need(haveValue, "value"); err != nil {
			return 0, false, err
		}
		if !legacyDone { // the value came before the type: an element of its own
			sum := other.Sum()
			a.Uint(sum)
			b.Uint(sum)
		}
	default:
		sum := other.Sum()
		a.Uint(sum)
		b.Uint(sum)
	}
	return 0, false, nil
}

// keepTyped copies s (scratch space) into d.typed and returns its span there.
func (d *Decoder) keepTyped(s []byte) [2]int {
	start := len(d.typed)
	d.typed = append(d.typed, s...)
	return [2]int{start, len(d.typed)}
}

// eventVersion reads BlockStored's event_version (1 introduced the typed extra keys, which
// are told from untyped ones by their shape, so the number changes nothing here; vLLM leaves
// it out at its default, 1).
func (d *Decoder) eventVersion(ev *Event) error {
	v, err := d.optInt("event_version", 0, math.MaxInt32)
	ev.Version = int(v)
	return err
}

// extraValue reads one element of an extra_keys tuple into a (and b, unless nil), nesting at
// most maxDepth deep.
func (d *Decoder) extraValue(a, b *indexer.ExtraDigest, depth int) error {
	if depth > maxDepth {
		return fmt.Errorf("%w: extra_keys nested deeper than %d", ErrTooLarge, maxDepth)
	}
	if b == nil {
		b = &d.sink // written and never read
	}
	c, err := d.peek("extra key")
	if err != nil {
		return err
	}
	switch {
	case c == codeNil:
		a.Nil()
		b.Nil()
		return malformed("extra key", d.d.DecodeNil())
	case c == codeFalse || c == codeTrue:
		v, err := d.d.DecodeBool()
		a.Bool(v)
		b.Bool(v)
		return malformed("extra key", err)
	case c == codeUint64:
		v, err := d.d.DecodeUint64()
		a.Uint(v)
		b.Uint(v)
		return malformed("extra key", err)
	case isInt(c):
		v, err := d.d.DecodeInt64()
		a.Int(v)
		b.Int(v)
		return malformed("extra key", err)
	case c == codeFloat || c == codeDouble:
		v, err := d.d.DecodeFloat64()
		a.Float(v)
		b.Float(v)
		return malformed("extra key", err)
	case isStr(c) || isBin(c):
		s, err := d.raw("extra key", MaxExtraBytes)
		if err != nil {
			return err
		}
		if isStr(c) {
			a.StringBytes(s)
			b.StringBytes(s)
		} else {
			a.Bytes(s)
			b.Bytes(s)
		}
		return nil
	case isArray(c) || isMap(c):
		var n, elems int
		if isArray(c) {
			n, err = d.arrayLen("extra key", math.MaxInt)
			elems = n
			a.Tuple(n)
			b.Tuple(n)
		} else {
			n, err = d.mapLen("extra key")
			elems = 2 * n
			a.Map(n)
			b.Map(n)
		}
		if err != nil {
			return err
		}
		for range elems {
			if err := d.extraValue(a, b, depth+1); err != nil {
				return err
			}
		}
		return nil
	default:
		return fmt.Errorf("%w: extra key is msgpack code %#x", ErrWrongType, c)
	}
}

// peek returns the next msgpack code without consuming it.
func (d *Decoder) peek(what string) (byte, error) {
	c, err := d.d.PeekCode()
	if err != nil {
		return 0, malformed(what, err)
	}
	if c == 0xc1 {
		return 0, fmt.Errorf("%w: %s: msgpack code 0xc1 is never used", ErrMalformed, what)
	}
	return c, nil
}

// arrayLen reads an array header. A length past limit is ErrTooLarge; one past the bytes left
// is truncation (every element takes at least one byte), caught before anything is allocated.
func (d *Decoder) arrayLen(what string, limit int) (int, error) {
	c, err := d.peek(what)
	if err != nil {
		return 0, err
	}
	if !isArray(c) {
		return 0, fmt.Errorf("%w: %s is msgpack code %#x, want an array", ErrWrongType, what, c)
	}
	n, err := d.d.DecodeArrayLen()
	if err != nil {
		return 0, malformed(what, err)
	}
	if n > limit {
		return 0, fmt.Errorf("%w: %s of %d elements (limit %d)", ErrTooLarge, what, n, limit)
	}
	if n > d.r.Len() {
		return 0, fmt.Errorf("%w: %s of %d elements in %d bytes", ErrMalformed, what, n, d.r.Len())
	}
	return n, nil
}

func (d *Decoder) mapLen(what string) (int, error) {
	c, err := d.peek(what)
	if err != nil {
		return 0, err
	}
	if !isMap(c) {
		return 0, fmt.Errorf("%w: %s is msgpack code %#x, want a map", ErrWrongType, what, c)
	}
	n, err := d.d.DecodeMapLen()
	if err != nil {
		return 0, malformed(what, err)
	}
	if n > d.r.Len()/2 {
		return 0, fmt.Errorf("%w: %s of %d entries in %d bytes", ErrMalformed, what, n, d.r.Len())
	}
	return n, nil
}

// str reads a string (not nil) into scratch space valid until the next read.
func (d *Decoder) str(what string) ([]byte, error) {
	s, isNil, err := d.optStr(what)
	if err == nil && isNil {
		err = fmt.Errorf("%w: %s is nil, want a string", ErrWrongType, what)
	}
	return s, err
}

// optStr reads a string or nil into scratch space valid until the next read.
func (d *Decoder) optStr(what string) ([]byte, bool, error) {
	c, err := d.peek(what)
	if err != nil {
		return nil, false, err
	}
	if c == codeNil {
		return nil, true, d.d.DecodeNil()
	}
	if !isStr(c) {
		return nil, false, fmt.Errorf("%w: %s is msgpack code %#x, want a string", ErrWrongType, what, c)
	}
	b, err := d.raw(what, maxString)
	return b, false, err
}

// raw reads the body of a string or bin whose code is next, bounded by limit.
func (d *Decoder) raw(what string, limit int) ([]byte, error) {
	n, err := d.d.DecodeBytesLen()
	if err != nil {
		return nil, malformed(what, err)
	}
	if n > limit {
		return nil, fmt.Errorf("%w: %s of %d bytes (limit %d)", ErrTooLarge, what, n, limit)
	}
	if n > d.r.Len() {
		return nil, fmt.Errorf("%w: %s of %d bytes, %d left", ErrMalformed, what, n, d.r.Len())
	}
	d.scratch = grow(d.scratch[:0], n)[:n]
	if _, err := io.ReadFull(&d.r, d.scratch); err != nil {
		return nil, malformed(what, err)
	}
	return d.scratch, nil
}

// hash reads an engine hash: an integer of any width or bytes; nil reports isNil.
func (d *Decoder) hash(what string) (EngineHash, bool, error) {
	c, err := d.peek(what)
	if err != nil {
		return 0, false, err
	}
	switch {
	case c == codeNil:
		return 0, true, d.d.DecodeNil()
	case c == codeUint64:
		v, err := d.d.DecodeUint64()
		if err != nil {
			return 0, false, malformed(what, err)
		}
		return UintHash(v), false, nil
	case isInt(c):
		v, err := d.d.DecodeInt64()
		if err != nil {
			return 0, false, malformed(what, err)
		}
		return IntHash(v), false, nil
	case isBin(c):
		b, err := d.raw(what, MaxHashBytes)
		if err != nil {
			return 0, false, err
		}
		return BytesHash(b), false, nil
	default:
		return 0, false, fmt.Errorf("%w: %s is msgpack code %#x, want an integer or bytes", ErrWrongType, what, c)
	}
}

// int reads an integer in [lo, hi].
func (d *Decoder) int(what string, lo, hi int64) (int64, error) {
	c, err := d.peek(what)
	if err != nil {
		return 0, err
	}
	if !isInt(c) {
		return 0, fmt.Errorf("%w: %s is msgpack code %#x, want an integer", ErrWrongType, what, c)
	}
	if c == codeUint64 {
		v, err := d.d.DecodeUint64()
		if err != nil {
			return 0, malformed(what, err)
		}
		if v > math.MaxInt64 || int64(v) > hi {
			return 0, fmt.Errorf("%w: %s %d out of range", ErrWrongType, what, v)
		}
		return int64(v), nil
	}
	v, err := d.d.DecodeInt64()
	if err != nil {
		return 0, malformed(what, err)
	}
	if v < lo || v > hi {
		return 0, fmt.Errorf("%w: %s %d out of range %d..%d", ErrWrongType, what, v, lo, hi)
	}
	return v, nil
}

// float reads a timestamp: a float of either width, or an integer.
func (d *Decoder) float(what string) (float64, error) {
	c, err := d.peek(what)
	if err != nil {
		return 0, err
	}
	switch {
	case c == codeFloat || c == codeDouble:
		v, err := d.d.DecodeFloat64()
		if err != nil {
			return 0, malformed(what, err)
		}
		return v, nil
	case isInt(c):
		v, err := d.int(what, math.MinInt64, math.MaxInt64)
		return float64(v), err
	default:
		return 0, fmt.Errorf("%w: %s is msgpack code %#x, want a number", ErrWrongType, what, c)
	}
}

// skipN skips n values.
func (d *Decoder) skipN(n, depth int) error {
	for range n {
		if err := d.skip(depth); err != nil {
			return err
		}
	}
	return nil
}

// skip skips one value of any type. Unlike the library's Skip it bounds the nesting (a deep
// payload must not grow the stack without limit) and checks lengths against the bytes left.
func (d *Decoder) skip(depth int) error {
	if depth > maxDepth {
		return fmt.Errorf("%w: nesting deeper than %d", ErrTooLarge, maxDepth)
	}
	c, err := d.peek("value")
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		n, err := d.arrayLen("array", math.MaxInt)
		if err != nil {
			return err
		}
		return d.skipN(n, depth+1)
	case isMap(c):
		n, err := d.mapLen("map")
		if err != nil {
			return err
		}
		return d.skipN(2*n, depth+1)
	case isStr(c) || isBin(c):
		n, err := d.d.DecodeBytesLen()
		if err != nil {
			return malformed("string", err)
		}
		if n > d.r.Len() {
			return fmt.Errorf("%w: string of %d bytes, %d left", ErrMalformed, n, d.r.Len())
		}
		_, err = d.r.Seek(int64(n), io.SeekCurrent)
		return malformed("string", err)
	default:
		// Scalars and extensions: the library reads at most the bytes that are there.
		return malformed("value", d.d.Skip())
	}
}

// malformed wraps a low-level read error (truncation, bad code) as ErrMalformed; nil stays nil.
func malformed(what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %s: %w", ErrMalformed, what, err)
}

// grow returns s with room for n more elements.
func grow[T any](s []T, n int) []T {
	if cap(s)-len(s) >= n {
		return s
	}
	return append(s[:cap(s)], make([]T, len(s)+n-cap(s))...)[:len(s)]
}
