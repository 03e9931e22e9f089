package indexer

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"slices"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// tokenRange returns n tokens start, start+1, ...
func tokenRange(start uint32, n int) []uint32 {
	ts := make([]uint32, n)
	for i := range ts {
		ts[i] = start + uint32(i)
	}
	return ts
}

// referenceLocal computes a block hash the plain way, as an independent check of BlockHashes.
func referenceLocal(block []uint32, seed uint64) uint64 {
	var b []byte
	for _, t := range block {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	d := xxhash.NewWithSeed(seed)
	_, _ = d.Write(b)
	return d.Sum64()
}

// referenceStep is the chain step as DESIGN.md defines it, written out with XXH64's primes
// rather than through the package's helpers.
func referenceStep(prev, local uint64) uint64 {
	const p1, p2 = 11400714785074694791, 14029467366897019727
	return local ^ bits.RotateLeft64(prev*p2, 31)*p1
}

func TestBlockHashesMatchReferenceEncoding(t *testing.T) {
	tests := []struct {
		name      string
		tokens    int
		blockSize int
		seed      uint64
	}{
		{"default block size", 64, 16, BaseSeed},
		{"seeded", 64, 16, 12345},
		{"one-token blocks", 5, 1, 7},
		{"block larger than one encode buffer", 400, 130, 9},
		{"64-token blocks", 128, 64, 3},
		{"odd block: stripes, lanes and a lone token", 3 * 13, 13, 11},
		{"blocks under one stripe", 21, 7, 5},
		{"one-token blocks, seed 0", 3, 1, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tokens := tokenRange(1000, tt.tokens)
			got := BlockHashes(tokens, tt.blockSize, tt.seed, nil)
			if want := tt.tokens / tt.blockSize; len(got) != want {
				t.Fatalf("got %d hashes, want %d", len(got), want)
			}
			for i, h := range got {
				want := referenceLocal(tokens[i*tt.blockSize:(i+1)*tt.blockSize], tt.seed)
				if h != want {
					t.Errorf("block %d: got %#x, want %#x", i, h, want)
				}
			}
		})
	}
}

func TestBlockHashesAreDeterministic(t *testing.T) {
	tokens := tokenRange(7, 160)
	a := BlockHashes(tokens, 16, 1, nil)
	b := BlockHashes(slices.Clone(tokens), 16, 1, make([]uint64, 3, 20))
	if !slices.Equal(a, b) {
		t.Fatalf("same tokens hashed differently: %x vs %x", a, b)
	}
}

func TestPartialLastBlockIsNotHashed(t *testing.T) {
	full := tokenRange(0, 32)
	withTail := append(slices.Clone(full), 99, 98, 97)
	for name, f := range map[string]func([]uint32) []uint64{
		"BlockHashes":    func(ts []uint32) []uint64 { return BlockHashes(ts, 16, 0, nil) },
		"SequenceHashes": func(ts []uint32) []uint64 { return SequenceHashes(ts, 16, 0, nil) },
	} {
		a, b := f(full), f(withTail)
		if len(a) != 2 || !slices.Equal(a, b) {
			t.Errorf("%s: a partial block changed the hashes: %x vs %x", name, a, b)
		}
	}
	if got := SequenceHashes(tokenRange(0, 15), 16, 0, nil); len(got) != 0 {
		t.Errorf("less than one block gave %d hashes", len(got))
	}
}

func TestBadSizesHashNothing(t *testing.T) {
	tokens := tokenRange(0, 32)
	for _, size := range []int{0, -1, -16} {
		if got := BlockHashes(tokens, size, 0, nil); len(got) != 0 {
			t.Errorf("BlockHashes(size %d) = %d hashes", size, len(got))
		}
		if got := SequenceHashes(tokens, size, 0, nil); len(got) != 0 {
			t.Errorf("SequenceHashes(size %d) = %d hashes", size, len(got))
		}
		if got := TextSequenceHashes("hello world", size, 0, nil); len(got) != 0 {
			t.Errorf("TextSequenceHashes(size %d) = %d hashes", size, len(got))
		}
	}
}

func TestSeedChangesEveryHash(t *testing.T) {
	tokens := tokenRange(0, 256)
	seeds := []uint64{Seed("", ""), Seed("lora-a", ""), Seed("lora-b", ""), Seed("", "salt"), Seed("lora-a", "salt")}
	seen := map[uint64]string{}
	for si, seed := range seeds {
		for i, h := range SequenceHashes(tokens, 16, seed, nil) {
			if prev, dup := seen[h]; dup {
				t.Fatalf("seed %d block %d repeats the hash of %s", si, i, prev)
			}
			seen[h] = "an earlier seed or block"
		}
	}
}

func TestSeedBaseIsFixedAndPairsDiffer(t *testing.T) {
	if got := Seed("", ""); got != BaseSeed {
		t.Fatalf("Seed(\"\", \"\") = %#x, want BaseSeed %#x", got, BaseSeed)
	}
	pairs := [][2]string{{"", ""}, {"a", ""}, {"", "a"}, {"a", "a"}, {"ab", ""}, {"a", "b"}, {"", "ab"}, {"b", "a"}}
	seen := map[uint64][2]string{}
	for _, p := range pairs {
		s := Seed(p[0], p[1])
		if s != Seed(p[0], p[1]) {
			t.Fatalf("Seed%q is not deterministic", p)
		}
		if q, dup := seen[s]; dup {
			t.Fatalf("Seed%q == Seed%q", p, q)
		}
		seen[s] = p
	}
}

// TestLoRAIDSeedsMatchNoNamedSeed: an adapter known only by the engine's integer id keys
// blocks apart from the base model, from every other id and from any adapter name (the
// decimal spelling of the id included).
func TestLoRAIDSeedsMatchNoNamedSeed(t *testing.T) {
	seen := map[uint64]string{BaseSeed: "base"}
	for _, name := range []string{"1", "3", "-1", "sql"} {
		seen[Seed(name, "")] = "name " + name
	}
	for _, id := range []int64{1, 3, -1, 1 << 40} {
		s := LoRAIDSeed(id)
		if s != LoRAIDSeed(id) {
			t.Fatalf("LoRAIDSeed(%d) is not deterministic", id)
		}
		if q, dup := seen[s]; dup {
			t.Fatalf("LoRAIDSeed(%d) == the seed of %s", id, q)
		}
		seen[s] = fmt.Sprintf("id %d", id)
	}
}

func TestSequenceHashesChainBlockHashes(t *testing.T) {
	// Every count of blocks up to ten, odd and even: blocks are hashed two at a time.
	for blocks := range 11 {
		t.Run(fmt.Sprintf("blocks=%d", blocks), func(t *testing.T) { checkSequenceChain(t, blocks) })
	}
}

func checkSequenceChain(t *testing.T, blocks int) {
	tokens := tokenRange(3, 16*blocks+5)
	local := BlockHashes(tokens, 16, 42, nil)
	want := make([]uint64, len(local))
	for i, l := range local {
		want[i] = l
		if i > 0 {
			want[i] = referenceStep(want[i-1], l)
		}
	}
	if got := Chain(0, false, local, nil); !slices.Equal(got, want) {
		t.Errorf("Chain: got %x, want %x", got, want)
	}
	if got := SequenceHashes(tokens, 16, 42, nil); !slices.Equal(got, want) {
		t.Errorf("SequenceHashes: got %x, want %x", got, want)
	}
	inPlace := slices.Clone(local)
	if got := Chain(0, false, inPlace, inPlace); !slices.Equal(got, want) {
		t.Errorf("Chain in place: got %x, want %x", got, want)
	}
}

func TestChainWithParentEqualsChainOfWhole(t *testing.T) {
	tokens := tokenRange(100, 16*12)
	whole := SequenceHashes(tokens, 16, 5, nil)
	local := BlockHashes(tokens, 16, 5, nil)
	for k := 1; k < len(local); k++ {
		tail := Chain(whole[k-1], true, local[k:], nil)
		if !slices.Equal(tail, whole[k:]) {
			t.Fatalf("split at %d: tail chained from parent %x differs from %x", k, tail, whole[k:])
		}
	}
}

func TestTextSequenceHashesChunksBytes(t *testing.T) {
	text := strings.Repeat("The quick brown fox. ", 10) // 210 bytes
	got := TextSequenceHashes(text, 64, 77, nil)
	if len(got) != 3 {
		t.Fatalf("got %d chunks of 210 bytes at 64, want 3 (the partial fourth is not hashed)", len(got))
	}
	var prev uint64
	for i := range got {
		d := xxhash.NewWithSeed(77)
		_, _ = d.WriteString(text[i*64 : (i+1)*64])
		want := d.Sum64()
		if i > 0 {
			want = referenceStep(prev, want)
		}
		if got[i] != want {
			t.Errorf("chunk %d: got %#x, want %#x", i, got[i], want)
		}
		prev = want
	}
	longer := TextSequenceHashes(text+"more text that changes only the tail", 64, 77, nil)
	if !slices.Equal(longer[:3], got) {
		t.Errorf("extending the text changed the leading chunks")
	}
	if other := TextSequenceHashes(text, 64, 78, nil); other[0] == got[0] {
		t.Errorf("a different seed gave the same first chunk hash")
	}
}

func TestHashingDoesNotAllocateWithCapacity(t *testing.T) {
	tokens := tokenRange(0, 8192)
	text := strings.Repeat("x", 4096)
	dst := make([]uint64, 0, 512)
	local := BlockHashes(tokens, 16, 1, nil)
	for name, f := range map[string]func(){
		"BlockHashes":        func() { dst = BlockHashes(tokens, 16, 1, dst) },
		"SequenceHashes":     func() { dst = SequenceHashes(tokens, 16, 1, dst) },
		"Chain":              func() { dst = Chain(9, true, local, dst) },
		"TextSequenceHashes": func() { dst = TextSequenceHashes(text, 64, 1, dst) },
		"Seed":               func() { _ = Seed("lora", "salt") },
	} {
		if n := testing.AllocsPerRun(20, f); n != 0 {
			t.Errorf("%s allocates %v times per call", name, n)
		}
	}
}

func FuzzChain(f *testing.F) {
	f.Add([]byte("0123456789abcdef0123456789abcdef0123456789abcdef"), uint8(4), uint8(2), uint64(0))
	f.Add([]byte{1, 2, 3}, uint8(1), uint8(0), uint64(1))
	f.Fuzz(func(t *testing.T, raw []byte, blockSize, split uint8, seed uint64) {
		tokens := make([]uint32, len(raw)/2)
		for i := range tokens {
			tokens[i] = uint32(binary.LittleEndian.Uint16(raw[2*i:]))
		}
		bs := int(blockSize)
		whole := SequenceHashes(tokens, bs, seed, nil)
		local := BlockHashes(tokens, bs, seed, nil)
		if !slices.Equal(Chain(0, false, local, nil), whole) {
			t.Fatalf("SequenceHashes differs from Chain of BlockHashes")
		}
		if len(whole) < 2 {
			return
		}
		k := 1 + int(split)%(len(whole)-1)
		if tail := Chain(whole[k-1], true, local[k:], nil); !slices.Equal(tail, whole[k:]) {
			t.Fatalf("chain from parent at %d differs from the whole chain", k)
		}
	})
}

func TestXXH64MatchesTheLibraryOnEveryShape(t *testing.T) {
	tokens := tokenRange(0xfff0_0000, 100)
	for n := 0; n <= len(tokens); n++ {
		for _, seed := range []uint64{0, 1, 0xdead_beef_cafe_f00d} {
			if got, want := xxh64Tokens(tokens[:n], seed), referenceLocal(tokens[:n], seed); got != want {
				t.Fatalf("%d tokens, seed %#x: %#x, want %#x", n, seed, got, want)
			}
		}
	}
}

// TestSequenceHashesArePinned fixes the keys of one prompt: every replica and the KV-event
// translator must compute the same keys, so a change here is a change of the key definition
// (DESIGN.md, Hashing), to be made on purpose and noted, never by accident.
func TestSequenceHashesArePinned(t *testing.T) {
	tests := []struct {
		name string
		seed uint64
		want []uint64
	}{
		{"base seed", BaseSeed, []uint64{0x8a44256aed976c78, 0xf3367536aca614fb, 0x682aad03f1cefbff}},
		{"lora seed", Seed("lora-a", ""), []uint64{0xf5e6dabb7fde8a93, 0x2dae2da902a105f5, 0x3bc8a8cd94bd7170}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := SequenceHashes(tokenRange(0, 48), 16, tt.seed, nil); !slices.Equal(got, tt.want) {
				t.Errorf("got %#x, want %#x", got, tt.want)
			}
		})
	}
}
