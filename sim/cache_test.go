package sim

import (
	"slices"
	"testing"
)

// storeAndRelease runs a whole request through c: look up, store, release.
func storeAndRelease(c *cache, tokens []uint32) (matchedBlocks int) {
	s := c.acquire(tokens)
	matched := len(s.blocks)
	c.store(s, tokens)
	c.release(s)
	return matched
}

// matchBlocks reports how many leading blocks of tokens are cached, without pinning.
func matchBlocks(c *cache, tokens []uint32) int {
	s := c.acquire(tokens)
	defer c.release(s)
	return len(s.blocks)
}

func TestCacheHitsSharedPrefixOnly(t *testing.T) {
	c := newCache(4, 100, nil)
	a := seqTokens(100, 13) // 3 full blocks and one token
	if got := storeAndRelease(c, a); got != 0 {
		t.Fatalf("first lookup matched %d blocks, want 0", got)
	}
	if got := c.snapshot().Blocks; got != 3 {
		t.Fatalf("cached %d blocks, want 3 (partial block not cached)", got)
	}
	b := append(slices.Clone(a[:8]), seqTokens(900, 9)...)
	if got := matchBlocks(c, b); got != 2 {
		t.Fatalf("shared 2-block prefix matched %d blocks", got)
	}
	// The whole prompt cached: the last token is still computed, as in vLLM.
	if got := matchBlocks(c, a[:12]); got != 2 {
		t.Fatalf("fully cached 3-block prompt matched %d blocks, want 2", got)
	}
	st := c.snapshot()
	if st.Queries != 13+17+12 || st.Hits != 4*(0+2+2) {
		t.Fatalf("queries %d hits %d, want %d %d", st.Queries, st.Hits, 13+17+12, 16)
	}
}

func TestCacheEvictsLeastRecentlyUsed(t *testing.T) {
	var events []CacheEvent
	c := newCache(4, 4, func(e CacheEvent) { events = append(events, e) })
	a, b, d := seqTokens(100, 9), seqTokens(200, 9), seqTokens(300, 9)
	storeAndRelease(c, a)
	storeAndRelease(c, b)
	if got := matchBlocks(c, a); got != 2 { // refreshes a: b is now the least recent
		t.Fatalf("a matched %d blocks, want 2", got)
	}
	events = nil
	storeAndRelease(c, d)
	if got := matchBlocks(c, b); got != 0 {
		t.Fatalf("b matched %d blocks after eviction, want 0", got)
	}
	if got := matchBlocks(c, a); got != 2 {
		t.Fatalf("a matched %d blocks, want 2 (recently used)", got)
	}
	bHashes := []uint64{BlockHash(0, b[:4])}
	bHashes = append(bHashes, BlockHash(bHashes[0], b[4:8]))
	var removed []uint64
	for _, e := range events {
		if e.Kind == Removed {
			for _, r := range e.Blocks {
				removed = append(removed, r.Hash)
			}
		}
	}
	// Leaf first: b's second block goes before its first.
	if want := []uint64{bHashes[1], bHashes[0]}; !slices.Equal(removed, want) {
		t.Fatalf("removed %v, want %v", removed, want)
	}
}

func TestCacheEvictsPrefixTailFirst(t *testing.T) {
	c := newCache(4, 3, nil)
	a := seqTokens(100, 13)
	storeAndRelease(c, a)
	storeAndRelease(c, seqTokens(500, 5)) // one new block: one of a's must go
	if got := matchBlocks(c, a); got != 2 {
		t.Fatalf("a matched %d blocks, want 2: the tail block should have been evicted", got)
	}
}

func TestPinnedBlocksAreNotEvicted(t *testing.T) {
	c := newCache(4, 4, nil)
	a := seqTokens(100, 13)
	sa := c.acquire(a)
	c.store(sa, a) // 3 blocks pinned by a running request
	b := seqTokens(200, 13)
	sb := c.acquire(b)
	c.store(sb, b) // room for one more; the rest must not displace a
	if got := len(sb.blocks); got != 1 {
		t.Fatalf("b stored %d blocks, want 1", got)
	}
	st := c.snapshot()
	if st.Blocks != 4 || st.Pinned != 4 || st.EvictedBlocks != 0 {
		t.Fatalf("stats %+v: want 4 blocks, 4 pinned, no evictions", st)
	}
	c.release(sb)
	c.release(sa)
	if got := c.snapshot().Pinned; got != 0 {
		t.Fatalf("%d blocks still pinned after release", got)
	}
	if got := matchBlocks(c, a); got != 3 {
		t.Fatalf("a matched %d blocks, want 3", got)
	}
}

func TestRequestLargerThanCacheStoresWhatFits(t *testing.T) {
	c := newCache(4, 2, nil)
	big := seqTokens(1, 401)
	storeAndRelease(c, big)
	if st := c.snapshot(); st.Blocks != 2 || st.Pinned != 0 {
		t.Fatalf("stats %+v: want 2 blocks cached and none pinned", st)
	}
	if got := matchBlocks(c, big); got != 2 {
		t.Fatalf("matched %d blocks, want the 2 that fit", got)
	}
}

func TestStoreEventsChainBlocks(t *testing.T) {
	var events []CacheEvent
	c := newCache(4, 100, func(e CacheEvent) { events = append(events, e) })
	a := seqTokens(7, 14)
	storeAndRelease(c, a)
	if len(events) != 1 || events[0].Kind != Stored || len(events[0].Blocks) != 3 {
		t.Fatalf("events %+v, want one Stored batch of 3 blocks", events)
	}
	var parent uint64
	for i, r := range events[0].Blocks {
		want := a[i*4 : (i+1)*4]
		if r.Parent != parent || !slices.Equal(r.Tokens, want) || r.Hash != BlockHash(parent, want) {
			t.Fatalf("block %d = %+v, want parent %d tokens %v", i, r, parent, want)
		}
		parent = r.Hash
	}
	storeAndRelease(c, a) // all cached already: nothing new to report
	if len(events) != 1 {
		t.Fatalf("re-storing cached blocks emitted %+v", events[1:])
	}
}

func TestClearDropsEverythingAndEmitsCleared(t *testing.T) {
	var events []CacheEvent
	c := newCache(4, 100, func(e CacheEvent) { events = append(events, e) })
	running := seqTokens(1, 9)
	s := c.acquire(running)
	c.store(s, running)
	storeAndRelease(c, seqTokens(50, 9))
	c.clear()
	if last := events[len(events)-1]; last.Kind != Cleared {
		t.Fatalf("last event %v, want Cleared", last.Kind)
	}
	// A request running across the clear stores nothing more and releases cleanly.
	c.store(s, seqTokens(1, 20))
	c.release(s)
	if st := c.snapshot(); st.Blocks != 0 || st.Pinned != 0 {
		t.Fatalf("stats %+v after clear, want empty", st)
	}
	if got := storeAndRelease(c, running); got != 0 {
		t.Fatalf("matched %d blocks after clear", got)
	}
}

func TestBlockHashChainsAndIsNotZero(t *testing.T) {
	a := BlockHash(0, []uint32{1, 2, 3})
	if a == 0 || a == BlockHash(0, []uint32{1, 2, 4}) || a == BlockHash(a, []uint32{1, 2, 3}) {
		t.Fatalf("hash does not depend on tokens and parent")
	}
	if a != BlockHash(0, []uint32{1, 2, 3}) {
		t.Fatalf("hash is not deterministic")
	}
}
