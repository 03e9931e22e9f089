package indexer

import "math/bits"

// XXH64 over a block of uint32 tokens (their little-endian bytes). The results are exactly
// xxhash64's (hash_test.go checks them against github.com/cespare/xxhash), but reading the
// tokens as lanes directly skips the byte encoding, the digest's bookkeeping and the call into
// the general function, which on 16-token blocks cost more than the hashing itself.

const (
	xxPrime1 uint64 = 11400714785074694791
	xxPrime2 uint64 = 14029467366897019727
	xxPrime3 uint64 = 1609587929392839161
	xxPrime4 uint64 = 9650029242287828579
	xxPrime5 uint64 = 2870177450012600261
)

func xxRound(acc, input uint64) uint64 {
	acc += input * xxPrime2
	acc = bits.RotateLeft64(acc, 31)
	return acc * xxPrime1
}

func xxAvalanche(h uint64) uint64 {
	h ^= h >> 33
	h *= xxPrime2
	h ^= h >> 29
	h *= xxPrime3
	h ^= h >> 32
	return h
}

// lane is the little-endian uint64 made of two consecutive tokens.
func lane(a, b uint32) uint64 { return uint64(a) | uint64(b)<<32 }

// xxh64Tokens is xxhash64 with seed over the little-endian bytes of tokens.
func xxh64Tokens(tokens []uint32, seed uint64) uint64 {
	if len(tokens) == DefaultBlockSize {
		return xxh64Block16(tokens, seed)
	}
	n := len(tokens)
	var h uint64
	if n >= 8 { // at least one 32-byte stripe
		v1, v2, v3, v4 := seed+xxPrime1+xxPrime2, seed+xxPrime2, seed, seed-xxPrime1
		for len(tokens) >= 8 {
			t := tokens[:8:8]
			v1 = xxRound(v1, lane(t[0], t[1]))
			v2 = xxRound(v2, lane(t[2], t[3]))
			v3 = xxRound(v3, lane(t[4], t[5]))
			v4 = xxRound(v4, lane(t[6], t[7]))
			tokens = tokens[8:]
		}
		h = xxConverge(v1, v2, v3, v4)
	} else {
		h = seed + xxPrime5
	}
	h += uint64(n) * 4
	for len(tokens) >= 2 {
		h ^= xxRound(0, lane(tokens[0], tokens[1]))
		h = bits.RotateLeft64(h, 27)*xxPrime1 + xxPrime4
		tokens = tokens[2:]
	}
	if len(tokens) == 1 {
		h ^= uint64(tokens[0]) * xxPrime1
		h = bits.RotateLeft64(h, 23)*xxPrime2 + xxPrime3
	}
	return xxAvalanche(h)
}

// xxConverge folds the four lanes into one, as xxMerge four times does; the four lanes' rounds
// are written out first because they do not depend on one another, and only the merges chain.
func xxConverge(v1, v2, v3, v4 uint64) uint64 {
	h := bits.RotateLeft64(v1, 1) + bits.RotateLeft64(v2, 7) + bits.RotateLeft64(v3, 12) + bits.RotateLeft64(v4, 18)
	r1, r2, r3, r4 := xxRound(0, v1), xxRound(0, v2), xxRound(0, v3), xxRound(0, v4)
	h = (h^r1)*xxPrime1 + xxPrime4
	h = (h^r2)*xxPrime1 + xxPrime4
	h = (h^r3)*xxPrime1 + xxPrime4
	return (h^r4)*xxPrime1 + xxPrime4
}

// xxh64Block16 is xxh64Tokens for a block of vLLM's default 16 tokens (64 bytes, two stripes),
// written out straight: it is the whole of hashing a prompt, and 30 of its 32 multiplications
// per block are here, so the loop and tail bookkeeping of the general shape show.
func xxh64Block16(t []uint32, seed uint64) uint64 {
	t = t[:16:16]
	v1, v2, v3, v4 := seed+xxPrime1+xxPrime2, seed+xxPrime2, seed, seed-xxPrime1
	v1 = xxRound(v1, lane(t[0], t[1]))
	v2 = xxRound(v2, lane(t[2], t[3]))
	v3 = xxRound(v3, lane(t[4], t[5]))
	v4 = xxRound(v4, lane(t[6], t[7]))
	v1 = xxRound(v1, lane(t[8], t[9]))
	v2 = xxRound(v2, lane(t[10], t[11]))
	v3 = xxRound(v3, lane(t[12], t[13]))
	v4 = xxRound(v4, lane(t[14], t[15]))
	return xxAvalanche(xxConverge(v1, v2, v3, v4) + 64)
}

// xxh64Block16x2 is xxh64Block16 of two blocks at once. Each block's hash is a chain of
// dependent multiplies, so one block at a time leaves the multiplier idle most cycles; with
// the two chains side by side in one instruction stream the processor overlaps them instead
// of relying on its reorder window, which only reaches a little way into the next block.
func xxh64Block16x2(a, b []uint32, seed uint64) (uint64, uint64) {
	a, b = a[:16:16], b[:16:16]
	a1, a2, a3, a4 := seed+xxPrime1+xxPrime2, seed+xxPrime2, seed, seed-xxPrime1
	b1, b2, b3, b4 := a1, a2, a3, a4
	a1 = xxRound(a1, lane(a[0], a[1]))
	b1 = xxRound(b1, lane(b[0], b[1]))
	a2 = xxRound(a2, lane(a[2], a[3]))
	b2 = xxRound(b2, lane(b[2], b[3]))
	a3 = xxRound(a3, lane(a[4], a[5]))
	b3 = xxRound(b3, lane(b[4], b[5]))
	a4 = xxRound(a4, lane(a[6], a[7]))
	b4 = xxRound(b4, lane(b[6], b[7]))
	a1 = xxRound(a1, lane(a[8], a[9]))
	b1 = xxRound(b1, lane(b[8], b[9]))
	a2 = xxRound(a2, lane(a[10], a[11]))
	b2 = xxRound(b2, lane(b[10], b[11]))
	a3 = xxRound(a3, lane(a[12], a[13]))
	b3 = xxRound(b3, lane(b[12], b[13]))
	a4 = xxRound(a4, lane(a[14], a[15]))
	b4 = xxRound(b4, lane(b[14], b[15]))
	ha := bits.RotateLeft64(a1, 1) + bits.RotateLeft64(a2, 7) + bits.RotateLeft64(a3, 12) + bits.RotateLeft64(a4, 18)
	hb := bits.RotateLeft64(b1, 1) + bits.RotateLeft64(b2, 7) + bits.RotateLeft64(b3, 12) + bits.RotateLeft64(b4, 18)
	ra1, rb1 := xxRound(0, a1), xxRound(0, b1)
	ra2, rb2 := xxRound(0, a2), xxRound(0, b2)
	ra3, rb3 := xxRound(0, a3), xxRound(0, b3)
	ra4, rb4 := xxRound(0, a4), xxRound(0, b4)
	ha = (ha^ra1)*xxPrime1 + xxPrime4
	hb = (hb^rb1)*xxPrime1 + xxPrime4
	ha = (ha^ra2)*xxPrime1 + xxPrime4
	hb = (hb^rb2)*xxPrime1 + xxPrime4
	ha = (ha^ra3)*xxPrime1 + xxPrime4
	hb = (hb^rb3)*xxPrime1 + xxPrime4
	ha = (ha^ra4)*xxPrime1 + xxPrime4
	hb = (hb^rb4)*xxPrime1 + xxPrime4
	return xxAvalanche(ha + 64), xxAvalanche(hb + 64)
}
