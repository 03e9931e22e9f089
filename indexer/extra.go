package indexer

import (
	"encoding/binary"
	"math"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// Extra keys: what an engine mixes into a block's hash besides its tokens. vLLM gives each block
// a tuple (its BlockStored's extra_keys) of, in this order: the LoRA name (every block), one
// (identifier, offset) pair per multimodal item whose placeholder tokens overlap the block (the
// offset of the item's first placeholder token from the block's first token, negative when the
// item began in an earlier block), the request's cache_salt (the first block only), and a
// hash of the block's prompt embeddings (bytes). The router keeps the LoRA name in the seed
// (Seed), as before; everything after it goes into the block's extra digest, which changes the
// block's local hash and so, through the chain, the key of the block and of every block after
// it. A block without extra keys has digest 0 and the key it always had.
//
// The digest is xxhash64 over a canonical, typed encoding of the elements, so the request side
// and the KV-event side reach the same digest from the same elements whatever their wire
// encoding: build it with an ExtraDigest, element by element in the engine's order, or for vLLM's
// layout with VLLMBlockExtras.

// extraDomain keeps extra digests apart from every other xxhash of the same bytes.
const extraDomain = "kvrouter-ha/extra/v1\x00"

// extraMixSeed seeds the hash that mixes a block's digest into its local hash.
const extraMixSeed uint64 = 0x6b76726f75746572 // "kvrouter"

// The element tags of the canonical encoding.
const (
	extraNil    = 'n'
	extraFalse  = 'f'
	extraTrue   = 't'
	extraInt    = 'i' // an integer that fits int64
	extraUint   = 'u' // an integer above math.MaxInt64
	extraFloat  = 'd'
	extraString = 's'
	extraBytes  = 'b'
	extraTuple  = 'a' // followed by the element count, then the elements
	extraMap    = 'm' // followed by the pair count, then key, value, key, value...
)

// ExtraDigest accumulates the extra keys of one block, element by element, into a 64-bit
// digest. The zero value is ready to use; Reset makes it ready again. It does not allocate.
type ExtraDigest struct {
	d xxhash.Digest
	n int
}

// Reset forgets every element added.
func (e *ExtraDigest) Reset() { e.n = 0 }

func (e *ExtraDigest) begin(tag byte) {
	if e.n == 0 {
		e.d.ResetWithSeed(0)
		_, _ = e.d.WriteString(extraDomain)
	}
	e.n++
	var b [1]byte
	b[0] = tag
	_, _ = e.d.Write(b[:])
}

func (e *ExtraDigest) uvarint(v uint64) {
	var b [binary.MaxVarintLen64]byte
	_, _ = e.d.Write(b[:binary.PutUvarint(b[:], v)])
}

func (e *ExtraDigest) fixed(v uint64) {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], v)
	_, _ = e.d.Write(b[:])
}

// String adds a string element (a cache salt, a multimodal identifier, a LoRA name).
func (e *ExtraDigest) String(s string) {
	e.begin(extraString)
	e.uvarint(uint64(len(s)))
	_, _ = e.d.WriteString(s)
}

// StringBytes adds a string element given as bytes; it equals String(string(b)).
func (e *ExtraDigest) StringBytes(b []byte) {
	e.begin(extraString)
	e.uvarint(uint64(len(b)))
	_, _ = e.d.Write(b)
}

// Bytes adds a bytes element (vLLM's prompt-embedding hashes), distinct from any string.
func (e *ExtraDigest) Bytes(b []byte) {
	e.begin(extraBytes)
	e.uvarint(uint64(len(b)))
	_, _ = e.d.Write(b)
}

// Int adds an integer element; the same value is the same element however it was encoded.
func (e *ExtraDigest) Int(v int64) {
	e.begin(extraInt)
	e.fixed(uint64(v))
}

// Uint adds a non-negative integer element; it equals Int for values up to math.MaxInt64.
func (e *ExtraDigest) Uint(v uint64) {
	if v <= math.MaxInt64 {
		e.Int(int64(v))
		return
	}
	e.begin(extraUint)
	e.fixed(v)
}

// Float adds a floating-point element.
func (e *ExtraDigest) Float(v float64) {
	e.begin(extraFloat)
	e.fixed(math.Float64bits(v))
}

// Bool adds a boolean element.
func (e *ExtraDigest) Bool(v bool) {
	if v {
		e.begin(extraTrue)
	} else {
		e.begin(extraFalse)
	}
}

// Nil adds a nil element.
func (e *ExtraDigest) Nil() { e.begin(extraNil) }

// Tuple starts a tuple (or list) of n elements: the next n elements added belong to it.
// vLLM's multimodal key is Tuple(2), String(identifier), Int(offset).
func (e *ExtraDigest) Tuple(n int) {
	e.begin(extraTuple)
	e.uvarint(uint64(n))
}

// Map starts a map of n pairs: the next 2n elements added are its keys and values, in order.
func (e *ExtraDigest) Map(n int) {
	e.begin(extraMap)
	e.uvarint(uint64(n))
}

// Len is the number of elements added since the last Reset, tuple headers included.
func (e *ExtraDigest) Len() int { return e.n }

// Sum returns the digest of the elements added: 0 when none were (a block without extra keys),
// never 0 otherwise.
func (e *ExtraDigest) Sum() uint64 {
	if e.n == 0 {
		return 0
	}
	s := e.d.Sum64()
	if s == 0 {
		s = 1
	}
	return s
}

// MMItem is one multimodal input of a prompt as vLLM hashes it: its identifier (vLLM's
// mm_hash, or the UUID the client gave in multi_modal_uuids when vLLM uses it as the
// identifier) and the span of its placeholder tokens in the prompt's token ids.
type MMItem struct {
	// ID is the item's identifier; "" when the router cannot know it.
	ID string
	// Offset is the index of the item's first placeholder token in the prompt; Length the
	// number of placeholder tokens.
	Offset, Length int
}

// VLLMBlockExtras appends to dst[:0] the extra digest of each of the first nBlocks blocks of
// blockSize tokens of a prompt, as vLLM attaches extra keys to blocks (LoRA excluded: it is in
// the seed): every multimodal item whose placeholder span overlaps the block, in the order of
// mm (sorted by Offset, as vLLM keeps them), as (ID, Offset - block start); then cacheSalt on
// the first block only. A block without either gets 0. The items' IDs must be vLLM's
// identifiers for the keys to meet the engine's; an item with an empty ID cannot be keyed, and
// the result stops before the first block it overlaps (fewer than nBlocks digests), so that no
// key is predicted for blocks whose key the router cannot know. Items need not be sorted by
// the caller but must not be given out of vLLM's order when they overlap one block.
func VLLMBlockExtras(nBlocks, blockSize int, cacheSalt string, mm []MMItem, dst []uint64) []uint64 {
	dst = dst[:0]
	if blockSize < 1 || nBlocks < 1 {
		return dst
	}
	if !slices.IsSortedFunc(mm, func(a, b MMItem) int { return a.Offset - b.Offset }) {
		mm = slices.Clone(mm)
		slices.SortStableFunc(mm, func(a, b MMItem) int { return a.Offset - b.Offset })
	}
	var e ExtraDigest
	next := 0 // the first item that may overlap this block or a later one
	for i := range nBlocks {
		start, end := i*blockSize, (i+1)*blockSize
		e.Reset()
		for next < len(mm) && mm[next].Offset+mm[next].Length <= start {
			next++
		}
		for j := next; j < len(mm) && mm[j].Offset < end; j++ {
			it := mm[j]
			if it.Length <= 0 || it.Offset+it.Length <= start {
				continue
			}
			if it.ID == "" {
				return dst
			}
			e.Tuple(2)
			e.String(it.ID)
			e.Int(int64(it.Offset - start))
		}
		if i == 0 && cacheSalt != "" {
			e.String(cacheSalt)
		}
		dst = append(dst, e.Sum())
	}
	return dst
}

// MixExtra returns the local hash of a block whose extra digest is extra: local itself for
// extra 0, otherwise xxhash64 (seeded apart) of the two. BlockHashes gives the local hashes to
// mix; Chain links the results.
func MixExtra(local, extra uint64) uint64 {
	if extra == 0 {
		return local
	}
	pair := [4]uint32{uint32(local), uint32(local >> 32), uint32(extra), uint32(extra >> 32)}
	return xxh64Tokens(pair[:], extraMixSeed)
}

// SequenceHashesExtra appends to dst[:0] the sequence hashes of a token prompt whose blocks
// carry extra keys: extras[i] is block i's extra digest (0: none), for example from
// VLLMBlockExtras. Without extras (all zero, or none) it equals SequenceHashes. The result has
// min(len(tokens)/blockSize, len(extras)) hashes when extras is shorter than the prompt's
// blocks and not nil: a caller that could not key the later blocks (VLLMBlockExtras stopped)
// gets no hashes for them. A nil extras hashes every full block. It does not allocate when dst
// has room for len(tokens)/blockSize hashes.
func SequenceHashesExtra(tokens []uint32, blockSize int, seed uint64, extras []uint64, dst []uint64) []uint64 {
	if extras == nil {
		return SequenceHashes(tokens, blockSize, seed, dst)
	}
	if n := len(extras) * max(blockSize, 0); n < len(tokens) {
		tokens = tokens[:n]
	}
	dst = BlockHashes(tokens, blockSize, seed, dst)
	for i := range dst {
		dst[i] = MixExtra(dst[i], extras[i])
	}
	return Chain(0, false, dst, dst)
}
