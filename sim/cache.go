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
}

// CacheEvent is a batch of blocks stored into or removed from the cache, or a clear.
type CacheEvent struct {
	Kind   EventKind
	Blocks []BlockRef
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
	const (
		offset64 = 14695981039346656037
		prime64  = 1099511628211
	)
	h := uint64(offset64)
	for i := range 8 {
		h ^= (parent >> (8 * i)) & 0xff
		h *= prime64
	}
	for _, t := range tokens {
		for i := range 4 {
			h ^= uint64(t>>(8*i)) & 0xff
			h *= prime64
		}
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
}

// cache is a paged prefix cache with pinning and leaf-first LRU eviction.
type cache struct {
	blockSize int
	capacity  int
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
}

func newCache(blockSize, capacity int, onEvent func(CacheEvent)) *cache {
	return &cache{
		blockSize: blockSize,
		capacity:  capacity,
		onEvent:   onEvent,
		blocks:    make(map[uint64]*block),
	}
}

// eventBatch collects one call's events, one event per kind. A store at capacity evicts one
// block per block it stores; reported one by one, that would be a Removed and a Stored event
// per block (an engine batches a step's events instead).
type eventBatch []CacheEvent

func (b *eventBatch) add(kind EventKind, ref BlockRef) {
	for i := range *b {
		if (*b)[i].Kind == kind {
			(*b)[i].Blocks = append((*b)[i].Blocks, ref)
			return
		}
	}
	*b = append(*b, CacheEvent{Kind: kind, Blocks: []BlockRef{ref}})
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
func (c *cache) acquire(tokens []uint32) *sequence {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := &sequence{gen: c.gen}
	// As vLLM does, leave the last prompt token to compute even when everything is cached.
	limit := 0
	if len(tokens) > 0 {
		limit = (len(tokens) - 1) / c.blockSize
	}
	c.walkPrefix(tokens, limit, func(b *block) {
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
	var events eventBatch
	defer func() { c.emit(events) }()
	var parent uint64
	if n := len(s.blocks); n > 0 {
		parent = s.blocks[n-1].ref.Hash
	}
	for i := len(s.blocks); (i+1)*c.blockSize <= len(tokens); i++ {
		chunk := tokens[i*c.blockSize : (i+1)*c.blockSize]
		h := BlockHash(parent, chunk)
		b := c.blocks[h]
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
			b = &block{ref: BlockRef{Hash: h, Parent: parent, Tokens: slices.Clone(chunk)}, refs: 1}
			c.blocks[h] = b
			c.pinned++
			c.stats.StoredBlocks++
			events.add(Stored, b.ref)
		}
		s.blocks = append(s.blocks, b)
		parent = h
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
	events.add(Removed, b.ref)
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
	c.emit(eventBatch{{Kind: Cleared}})
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
	f := &sequence{gen: c.gen, blocks: slices.Clone(s.blocks[:min(n, len(s.blocks))])}
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

// cachedBlocks counts the full blocks of tokens, from the first, that are cached, without
// pinning them or counting a lookup.
func (c *cache) cachedBlocks(tokens []uint32) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	c.walkPrefix(tokens, len(tokens)/c.blockSize, func(*block) { n++ })
	return n
}

// walkPrefix calls found for each of the first (at most limit) full blocks of tokens that
// are cached, in order, stopping at the first that is not. It runs with c.mu held.
func (c *cache) walkPrefix(tokens []uint32, limit int, found func(*block)) {
	var parent uint64
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
