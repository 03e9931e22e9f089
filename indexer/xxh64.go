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
