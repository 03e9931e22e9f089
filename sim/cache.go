package sim

import (
	"container/list"
	"slices"
	"sync"
)

// EventKind says what a CacheEvent did to the cache.
type EventKind uint8

// The cache event kinds, after vLLM's BlockStored, BlockRemoved and AllBlocksCleared.
const (
	Stored EventKind = iota + 1
	Removed
	Cleared
)

// String names the kind as vLLM's KV events do.
func (k EventKind) String() string {
	switch k {
	case Stored:
		return "BlockStored"
	case Removed:
		return "BlockRemoved"
	case Cleared:
		return "AllBlocksCleared"
	default:
		return "unknown"
	}
}

// BlockRef describes one cached block.
type BlockRef struct {
	// Hash is the block's chained hash (see BlockHash).
	Hash uint64
	// Parent is the previous block's hash, 0 for a prompt's first block.
	Parent uint64
	// Tokens are the block's token ids.
	Tokens []uint32
	// Salt is the request's cache_salt on a prompt's first block (vLLM keys the salt into the
	// first block only; the chain carries it to the others), "" otherwise.
	Salt string
}

// CacheEvent is a batch of blocks stored into or removed from the cache, or a clear.
type CacheEvent struct {
	Kind   EventKind
	Blocks []BlockRef
	// Window is the sliding window in tokens of a hybrid worker (Config.SlidingWindow), 0 for a
	// worker with full attention only; Group is then the event's KV cache group: 0 for the
	// full-attention group, 1 for the sliding-window group. A clear is every group's.
	Window int
	Group  int
}

// CacheStats is a snapshot of the prefix cache.
type CacheStats struct {
	BlockSize int `json:"block_size"`
	// Capacity is the cache size in blocks.
	Capacity int `json:"capacity_blocks"`
	// Blocks is how many blocks are cached, pinned or not.
	Blocks int `json:"blocks_used"`
	// Pinned is how many cached blocks running requests hold.
	Pinned int `json:"blocks_pinned"`
	// Queries counts prompt tokens looked up, and Hits those found cached (vLLM's units).
	Queries uint64 `json:"query_tokens"`
	Hits    uint64 `json:"hit_tokens"`
	// StoredBlocks and EvictedBlocks count blocks ever stored and evicted.
	StoredBlocks  uint64 `json:"stored_blocks"`
	EvictedBlocks uint64 `json:"evicted_blocks"`
}

// BlockHash is the worker's chained block hash: FNV-1a-64 over parent (8 bytes little
// endian) and then each token id (4 bytes little endian). It never returns 0, which means
// "no parent".
func BlockHash(parent uint64, tokens []uint32) uint64 {
	h := uint64(fnvOffset)
	for i := range 8 {
		h ^= (parent >> (8 * i)) & 0xff
		h *= fnvPrime
	}
	if h = fnvTokens(h, tokens); h == 0 {
		h = 1
	}
	return h
}

// saltSeed is the parent hash a salted prompt's first block is hashed with, so that the same
// tokens under another cache_salt are other blocks; 0 for no salt.
func saltSeed(salt string) uint64 {
	if salt == "" {
		return 0
	}
	h := uint64(fnvOffset)
	for _, c := range []byte("sim/cache_salt\x00" + salt) {
		h ^= uint64(c)
		h *= fnvPrime
	}
	if h == 0 {
		h = 1
	}
	return h
}

type block struct {
	ref  BlockRef
	refs int
	// elem is the block's place in the LRU list while no request pins it.
	elem *list.Element
	// slide says the block's twin in the sliding-window group is still cached (hybrid only).
	slide bool
}

// cache is a paged prefix cache with pinning and leaf-first LRU eviction. With a sliding
// window (hybrid attention) every block has a twin in the sliding-window group: stored with it,
// dropped once the window of the request that computed it has moved past it (vLLM frees such
// blocks as the window slides; the simulator removes them at once), or with the block when it
// is evicted. Hits are the full-attention group's: the twins only make the events.
type cache struct {
	blockSize int
	capacity  int
	window    int
	onEvent   func(CacheEvent)

	mu     sync.Mutex
	blocks map[uint64]*block
	lru    list.List // of *block, front is least recently used
	gen    uint64    // bumped by clear, so sequences from before let go of nothing
	pinned int
	stats  CacheStats
}

// sequence is one request's hold on the cache: the blocks of its prefix it pins, in order.
type sequence struct {
	gen    uint64
	blocks []*block
	done   bool
	// salt is the request's cache_salt, which keys its first block.
	salt string
}

func newCache(blockSize, capacity int, onEvent func(CacheEvent)) *cache {
	return newHybridCache(blockSize, capacity, 0, onEvent)
}

// newHybridCache is newCache for a hybrid-attention worker whose sliding window is window
// tokens (0: full attention only).
func newHybridCache(blockSize, capacity, window int, onEvent func(CacheEvent)) *cache {
	return &cache{
		blockSize: blockSize,
		capacity:  capacity,
		window:    window,
		onEvent:   onEvent,
		blocks:    make(map[uint64]*block),
	}
}

// eventBatch collects one call's events, one event per kind. A store at capacity evicts one
// block per block it stores; reported one by one, that would be a Removed and a Stored event
// per block (an engine batches a step's events instead).
type eventBatch []CacheEvent

func (b *eventBatch) add(kind EventKind, ref BlockRef) { b.addGroup(kind, 0, 0, ref) }

// addGroup adds ref to the batch's event of kind in group (of a worker with window w).
func (b *eventBatch) addGroup(kind EventKind, group, w int, ref BlockRef) {
	for i := range *b {
		if (*b)[i].Kind == kind && (*b)[i].Group == group {
			(*b)[i].Blocks = append((*b)[i].Blocks, ref)
			return
		}
	}
	*b = append(*b, CacheEvent{Kind: kind, Blocks: []BlockRef{ref}, Window: w, Group: group})
}

// addBoth adds ref to the event of kind of the full-attention group and, on a hybrid worker,
// of the sliding-window group too.
func (c *cache) addBoth(b *eventBatch, kind EventKind, ref BlockRef, twin bool) {
	b.addGroup(kind, 0, c.window, ref)
	if c.window > 0 && twin {
		b.addGroup(kind, 1, c.window, ref)
	}
}

// emit runs with c.mu held so that events reach the hook in the order they happened. Within
// one call, evictions made room for the stores, so removals go first.
func (c *cache) emit(events eventBatch) {
	if c.onEvent == nil {
		return
	}
	slices.SortStableFunc(events, func(a, b CacheEvent) int {
		return boolInt(a.Kind != Removed) - boolInt(b.Kind != Removed)
	})
	for _, e := range events {
		c.onEvent(e)
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// acquire pins the longest cached prefix of tokens and returns the sequence holding it.
func (c *cache) acquire(tokens []uint32) *sequence { return c.acquireSalted(tokens, "") }

// acquireSalted is acquire for a request with a cache_salt: only blocks stored under the same
// salt are its prefix.
func (c *cache) acquireSalted(tokens []uint32, salt string) *sequence {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := &sequence{gen: c.gen, salt: salt}
	// As vLLM does, leave the last prompt token to compute even when everything is cached.
	limit := 0
	if len(tokens) > 0 {
		limit = (len(tokens) - 1) / c.blockSize
	}
	c.walkPrefix(tokens, salt, limit, func(b *block) {
		c.pin(b)
		s.blocks = append(s.blocks, b)
	})
	c.stats.Queries += uint64(len(tokens))
	c.stats.Hits += uint64(len(s.blocks) * c.blockSize)
	return s
}

func (c *cache) pin(b *block) {
	if b.refs == 0 {
		c.lru.Remove(b.elem)
		b.elem = nil
		c.pinned++
	}
	b.refs++
}

// store caches the full blocks of tokens past those s already holds, pinned by s. tokens
// must extend the prefix s was acquired with. Without room it stops: it never waits.
func (c *cache) store(s *sequence, tokens []uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s.done || s.gen != c.gen {
		return
	}
	var events, slides eventBatch
	defer func() {
		c.slide(s, len(tokens), &slides)
		c.emit(events)
		c.emit(slides)
	}()
	var parent uint64
	if n := len(s.blocks); n > 0 {
		parent = s.blocks[n-1].ref.Hash
	}
	for i := len(s.blocks); (i+1)*c.blockSize <= len(tokens); i++ {
		chunk := tokens[i*c.blockSize : (i+1)*c.blockSize]
		ref := BlockRef{Parent: parent}
		if i == 0 {
			ref.Salt = s.salt
			ref.Hash = BlockHash(saltSeed(s.salt), chunk)
		} else {
			ref.Hash = BlockHash(parent, chunk)
		}
		b := c.blocks[ref.Hash]
		switch {
		case b != nil && slices.Equal(b.ref.Tokens, chunk):
			// Another request stored it meanwhile.
			c.pin(b)
		case b != nil:
			// A hash collision: keep the resident block and stop the chain here.
			return
		default:
			if len(c.blocks) >= c.capacity && !c.evictOne(&events) {
				return
			}
			ref.Tokens = slices.Clone(chunk)
			b = &block{ref: ref, refs: 1, slide: c.window > 0}
			c.blocks[ref.Hash] = b
			c.pinned++
			c.stats.StoredBlocks++
			c.addBoth(&events, Stored, b.ref, true)
		}
		s.blocks = append(s.blocks, b)
		parent = ref.Hash
	}
}

// slide drops, on a hybrid worker, the sliding-window twins of s's blocks that lie wholly
// before the window of s's next token once computed tokens are done: vLLM skips the tokens
// before computed - window + 1. It runs with c.mu held.
func (c *cache) slide(s *sequence, computed int, slides *eventBatch) {
	if c.window <= 0 {
		return
	}
	skipped := computed - c.window + 1
	for i, b := range s.blocks {
		if (i+1)*c.blockSize > skipped {
			return
		}
		if b.slide {
			b.slide = false
			slides.addGroup(Removed, 1, c.window, b.ref)
		}
	}
}

// evictOne drops the least recently used unpinned block; false when every block is pinned.
func (c *cache) evictOne(events *eventBatch) bool {
	front := c.lru.Front()
	if front == nil {
		return false
	}
	b := c.lru.Remove(front).(*block)
	b.elem = nil
	delete(c.blocks, b.ref.Hash)
	c.stats.EvictedBlocks++
	c.addBoth(events, Removed, b.ref, b.slide)
	return true
}

// release unpins s's blocks, leaf first, so that a prefix's head stays the most recently
// used and its tail is evicted first.
func (c *cache) release(s *sequence) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s.done {
		return
	}
	s.done = true
	if s.gen != c.gen {
		return
	}
	for i := len(s.blocks) - 1; i >= 0; i-- {
		b := s.blocks[i]
		b.refs--
		if b.refs == 0 {
			b.elem = c.lru.PushBack(b)
			c.pinned--
		}
	}
}

// clear drops every block, pinned or not; running requests keep running but cache nothing
// more until they finish.
func (c *cache) clear() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	c.blocks = make(map[uint64]*block)
	c.lru.Init()
	c.pinned = 0
	c.emit(eventBatch{{Kind: Cleared, Window: c.window}})
}

func (c *cache) snapshot() CacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.stats
	st.BlockSize = c.blockSize
	st.Capacity = c.capacity
	st.Blocks = len(c.blocks)
	st.Pinned = c.pinned
	return st
}

// usage is the share of the capacity that running requests pin, like vLLM's
// kv_cache_usage_perc (cached but unpinned blocks count as free there too).
func (c *cache) usage() float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return float64(c.pinned) / float64(c.capacity)
}

// fork pins the first n blocks s holds again, in a sequence of their own that outlives s:
// a prefill leg's prompt blocks wait in it for a decode worker to pull them. It returns nil
// when s holds nothing any more (released, or from before a clear).
func (c *cache) fork(s *sequence, n int) *sequence {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s.done || s.gen != c.gen {
		return nil
	}
	f := &sequence{gen: c.gen, blocks: slices.Clone(s.blocks[:min(n, len(s.blocks))]), salt: s.salt}
	for _, b := range f.blocks {
		c.pin(b)
	}
	return f
}

// live reports whether s still holds its blocks: not released and not from before a clear.
func (c *cache) live(s *sequence) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !s.done && s.gen == c.gen
}

// cachedBlocks counts the full blocks of tokens (under cache_salt salt), from the first, that
// are cached, without pinning them or counting a lookup.
func (c *cache) cachedBlocks(tokens []uint32, salt string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	c.walkPrefix(tokens, salt, len(tokens)/c.blockSize, func(*block) { n++ })
	return n
}

// walkPrefix calls found for each of the first (at most limit) full blocks of tokens that
// are cached under salt, in order, stopping at the first that is not. It runs with c.mu held.
func (c *cache) walkPrefix(tokens []uint32, salt string, limit int, found func(*block)) {
	parent := saltSeed(salt)
	for i := range limit {
		chunk := tokens[i*c.blockSize : (i+1)*c.blockSize]
		b := c.blocks[BlockHash(parent, chunk)]
		if b == nil || !slices.Equal(b.ref.Tokens, chunk) {
			return
		}
		found(b)
		parent = b.ref.Hash
	}
}
