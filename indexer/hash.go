package indexer

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// BaseSeed is the block-hash seed of a prompt with no LoRA adapter and no cache salt, so that
// such prompts hash as plain xxhash64 and are easy to reproduce outside the router.
const BaseSeed uint64 = 0

// seedDomain keeps seeds apart from any other use of xxhash over the same strings.
const seedDomain = "kvrouter-ha/seed/v1\x00"

// Seed returns the block-hash seed for a LoRA adapter name and a cache salt. Both empty gives
// BaseSeed; any other pair gives a seed that differs from every other pair, because the two
// names are length-prefixed before they are mixed ("a","" and "","a" are different seeds).
// Engines key a cache salt into a prompt's first block only (vLLM's extra_keys), and the KV-event
// translator seeds with the LoRA name alone: to meet their keys, pass "" here and the salt
// through VLLMBlockExtras and SequenceHashesExtra.
func Seed(lora, salt string) uint64 {
	if lora == "" && salt == "" {
		return BaseSeed
	}
	var d xxhash.Digest
	d.ResetWithSeed(0)
	var n [binary.MaxVarintLen64]byte
	_, _ = d.WriteString(seedDomain)
	_, _ = d.Write(n[:binary.PutUvarint(n[:], uint64(len(lora)))])
	_, _ = d.WriteString(lora)
	_, _ = d.Write(n[:binary.PutUvarint(n[:], uint64(len(salt)))])
	_, _ = d.WriteString(salt)
	return d.Sum64()
}

// loraIDDomain keeps LoRAIDSeed's seeds apart from Seed's.
const loraIDDomain = "kvrouter-ha/lora-int-id/v1\x00"

// LoRAIDSeed returns the block-hash seed of the blocks of an adapter that an engine names only
// by its integer id: vLLM before lora_name was sent (PR 27577) hashed lora_int_id into every
// block and reported only lora_id. The id is the engine's own numbering, which requests do not
// carry, so no request is keyed by this seed: such blocks match nothing (a predicted miss for
// the adapter's requests), and a base-model request, keyed by BaseSeed, never matches them.
func LoRAIDSeed(id int64) uint64 {
	var d xxhash.Digest
	d.ResetWithSeed(0)
	_, _ = d.WriteString(loraIDDomain)
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(id))
	_, _ = d.Write(b[:])
	return d.Sum64()
}

// BlockHashes appends to dst[:0] the local hash of every full block of blockSize tokens:
// xxhash64 with seed over the block's tokens as little-endian uint32 bytes. A partial last
// block is not hashed, and a blockSize below 1 hashes nothing. It does not allocate when dst
// has room for len(tokens)/blockSize hashes.
func BlockHashes(tokens []uint32, blockSize int, seed uint64, dst []uint64) []uint64 {
	dst = dst[:0]
	if blockSize < 1 {
		return dst
	}
	if blockSize == DefaultBlockSize {
		for start := 0; start+DefaultBlockSize <= len(tokens); start += DefaultBlockSize {
			dst = append(dst, xxh64Block16(tokens[start:start+DefaultBlockSize], seed))
		}
		return dst
	}
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		dst = append(dst, xxh64Tokens(tokens[start:start+blockSize], seed))
	}
	return dst
}

// chainStep is H(prev, local) = local XOR round(prev), round(x) = rotl64(x*P2, 31)*P1 being
// XXH64's lane round with a zero accumulator (P1, P2 its primes). round is a bijection, so two
// different prefixes followed by the same block never share a key, and a key differs from
// another only as a fresh xxhash64 (local) does. It is short on purpose: each block's key
// waits for the previous one, so this step is the only serial part of hashing a prompt (the
// blocks' local hashes are independent), and at 8 cycles instead of the 30 of a full xxhash64
// of the pair it stays off the critical path. See DESIGN.md (Hashing).
func chainStep(prev, local uint64) uint64 { return local ^ xxRound(0, prev) }

// Chain appends to dst[:0] the sequence hashes of local block hashes: seq[0] is local[0], or
// H(parent, local[0]) when hasParent, and seq[i] = H(seq[i-1], local[i]). Chaining a tail of
// a prompt from the sequence hash of the block before it gives the same keys as chaining the
// whole prompt, which is how a KV event that names a parent block is keyed. dst may be local
// itself (the chain is computed in place). It does not allocate when dst has room.
func Chain(parent uint64, hasParent bool, local []uint64, dst []uint64) []uint64 {
	dst = dst[:0]
	prev, chained := parent, hasParent
	for _, l := range local {
		h := l
		if chained {
			h = chainStep(prev, l)
		}
		dst = append(dst, h)
		prev, chained = h, true
	}
	return dst
}

// SequenceHashes appends to dst[:0] the sequence hashes of a token prompt: Chain(0, false,
// BlockHashes(tokens, blockSize, seed, nil), dst) in one pass. It does not allocate when dst
// has room for len(tokens)/blockSize hashes.
func SequenceHashes(tokens []uint32, blockSize int, seed uint64, dst []uint64) []uint64 {
	dst = dst[:0]
	if blockSize < 1 {
		return dst
	}
	// chainStep(0, l) is l, so the first block needs no case of its own.
	var prev uint64
	if blockSize == DefaultBlockSize {
		const bs = DefaultBlockSize
		start := 0
		for ; start+2*bs <= len(tokens); start += 2 * bs {
			la, lb := xxh64Block16x2(tokens[start:start+bs], tokens[start+bs:start+2*bs], seed)
			prev = chainStep(prev, la)
			dst = append(dst, prev)
			prev = chainStep(prev, lb)
			dst = append(dst, prev)
		}
		if start+bs <= len(tokens) {
			dst = append(dst, chainStep(prev, xxh64Block16(tokens[start:start+bs], seed)))
		}
		return dst
	}
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		prev = chainStep(prev, xxh64Tokens(tokens[start:start+blockSize], seed))
		dst = append(dst, prev)
	}
	return dst
}

// TextSequenceHashes appends to dst[:0] the sequence hashes of a text prompt that has no token
// ids (approximate mode only): the text is cut into chunks of chunkBytes bytes, each chunk's
// local hash is xxhash64 with seed over its bytes, and the chunks chain as in Chain. A partial
// last chunk is not hashed, and a chunkBytes below 1 hashes nothing. Chunks cut bytes, not
// characters: a multi-byte character may straddle two chunks, which is harmless because only
// equality of prefixes matters.
func TextSequenceHashes(text string, chunkBytes int, seed uint64, dst []uint64) []uint64 {
	dst = dst[:0]
	if chunkBytes < 1 {
		return dst
	}
	var d xxhash.Digest
	var prev uint64
	for start := 0; start+chunkBytes <= len(text); start += chunkBytes {
		d.ResetWithSeed(seed)
		_, _ = d.WriteString(text[start : start+chunkBytes])
		h := d.Sum64()
		if start > 0 {
			h = chainStep(prev, h)
		}
		dst = append(dst, h)
		prev = h
	}
	return dst
}
