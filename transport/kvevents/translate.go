package kvevents

import (
	"fmt"
	"slices"

	"github.com/cespare/xxhash/v2"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// Sink receives the translated events; indexer.Index is one. It must not keep ev.Blocks after
// Apply returns: the translator reuses that slice.
type Sink interface {
	Apply(ev indexer.Event) error
	RemoveWorker(w indexer.Worker)
}

// DefaultMaxBlocks caps one worker's engine-hash map. A GPU cache holds some hundred thousand
// blocks; the cap only stops a publisher that never removes from growing the router for ever.
const DefaultMaxBlocks = 1 << 22

// Counts says what one Apply did.
type Counts struct {
	// Events and Blocks were applied to the sink (removed blocks count once they resolve).
	Events, Blocks int
	// UnknownParent counts stored events dropped because their parent was never seen.
	UnknownParent int
	// BlockSizeMismatch counts stored events dropped for a block size not the router's.
	BlockSizeMismatch int
	// UnknownRemoved counts removed hashes that were never stored (or already forgotten).
	UnknownRemoved int
	// OverCapacity counts stored blocks dropped because the worker's map was full.
	OverCapacity int
	// OtherGroup counts events of KV cache groups that do not feed the index: a hybrid
	// model's sliding-window, Mamba or chunked-local groups (see Translator).
	OtherGroup int
}

// Add adds o to c.
func (c *Counts) Add(o Counts) {
	c.Events += o.Events
	c.Blocks += o.Blocks
	c.UnknownParent += o.UnknownParent
	c.BlockSizeMismatch += o.BlockSizeMismatch
	c.UnknownRemoved += o.UnknownRemoved
	c.OverCapacity += o.OverCapacity
	c.OtherGroup += o.OtherGroup
}

// Translator turns one worker's engine events into indexer events keyed by the router's own
// sequence hashes. It remembers, per engine block, the router key it computed, so that
// BlockRemoved resolves and a later BlockStored can chain from its parent. It also counts how
// many engine blocks map to each router key: blocks the router cannot tell apart (a cache salt
// or multimodal inputs an older engine does not report, the same block on GPU and offloaded to
// CPU) leave the index only when the last of them goes, and so does a block cached twice under
// one hash (two physical copies: vLLM does not de-duplicate). With several full-attention
// groups a block is a hit only while every one of them holds it, as vLLM's coordinator
// requires: one group's removal takes it out of the index.
//
// KV cache groups (vLLM's group_idx) are kept apart: the same engine hash names a block in
// every group of a hybrid model, and each group stores and removes its blocks on its own. Only
// full-attention groups feed the index (a prefix hit needs their blocks); a sliding-window
// group drops its blocks as the window moves on, and those removals must not take the prefix
// out of the index. A group's kind comes from its BlockStored events (kv_cache_spec_kind); a
// group never described is group 0 (older vLLM, SGLang) feeding the index, or another one that
// does not. Engine blocks smaller than the router's, dividing it (SGLang's pages, one token by
// default), are regrouped into router blocks along their parent links. A Translator is not
// safe for concurrent use.
type Translator struct {
	worker    indexer.Worker
	blockSize int
	maxBlocks int

	keys *table // engine block (salted by medium and group) -> router key
	// refs counts, per router key salted by group (refKey), the engine blocks of that group
	// that map to it.
	refs *table
	// copies counts, per engine block, the physical copies past the first: vLLM does not
	// de-duplicate, so two requests that computed the same block at once each cache it, under
	// one hash, and each copy is stored and later removed on its own. dups is their total, so
	// that a removal looks copies up only while there are any.
	copies *table
	dups   int
	// full lists the full-attention groups that have stored blocks, in the order met: vLLM
	// hits a block only if every one of them holds it (see indexed).
	full []int
	// pages holds engine blocks smaller than a router block (same salted keys as keys).
	pages map[uint64]*page
	// groups says, per group learned from a BlockStored, whether it feeds the index.
	groups map[int]bool

	seq, gone, out []uint64 // scratch
	gather         []uint32 // scratch: one router block's tokens
	loraName       string
	loraSeed       uint64
}

// page is an engine block smaller than the router's block. A router block is complete at the
// page whose end reaches its last token: that page owns the router key, computed from the
// tokens of it and the pages before it in the block, chained from the key of the router block
// before (prefix).
type page struct {
	parent uint64 // salted key of the page before, when hasParent
	prefix uint64 // key of the last router block completed before this page's block
	own    uint64 // the key of the router block this page completes, when owns
	tokens []uint32
	extra  uint64 // the page's extra digest
	fill   int    // tokens of this page's router block up to this page's end

	hasParent, hasPrefix, owns bool
}

// NewTranslator returns a Translator for worker w whose index uses blocks of blockSize tokens.
// maxBlocks caps the engine blocks remembered (0 means DefaultMaxBlocks).
func NewTranslator(w indexer.Worker, blockSize, maxBlocks int) (*Translator, error) {
	if blockSize < 1 || blockSize > MaxBlockSize {
		return nil, fmt.Errorf("kvevents: block size %d out of 1..%d", blockSize, MaxBlockSize)
	}
	if maxBlocks <= 0 {
		maxBlocks = DefaultMaxBlocks
	}
	return &Translator{
		worker:    w,
		blockSize: blockSize,
		maxBlocks: maxBlocks,
		keys:      newTable(),
		refs:      newTable(),
		copies:    newTable(),
		pages:     make(map[uint64]*page),
	}, nil
}

// Worker is the worker the translator keys its events by.
func (t *Translator) Worker() indexer.Worker { return t.worker }

// Len is the number of engine blocks remembered.
func (t *Translator) Len() int { return t.keys.Len() + len(t.pages) }

// Apply validates the whole batch, then translates its events in order and applies them to
// sink. A batch that fails validation changes nothing. Events that cannot be translated (a
// parent never seen, another block size) are dropped and counted, not guessed at: the
// router's keys chain from the parent's key, and an invented one would never match a prompt.
func (t *Translator) Apply(b Batch, sink Sink) (Counts, error) {
	var c Counts
	if err := b.Validate(); err != nil {
		return c, err
	}
	for i := range b.Events {
		if err := t.apply(&b.Events[i], sink, &c); err != nil {
			return c, fmt.Errorf("kvevents: worker %s: %w", t.worker, err)
		}
	}
	return c, nil
}

func (t *Translator) apply(ev *Event, sink Sink, c *Counts) error {
	switch ev.Kind {
	case indexer.Stored:
		if !t.feeds(ev) {
			c.OtherGroup++
			return nil
		}
		if ev.BlockSize != t.blockSize {
			if ev.BlockSize < t.blockSize && t.blockSize%ev.BlockSize == 0 {
				return t.storedPages(ev, sink, c)
			}
			c.BlockSizeMismatch++
			return nil
		}
		return t.stored(ev, sink, c)
	case indexer.Removed:
		if !t.feeds(ev) {
			c.OtherGroup++
			return nil
		}
		salt, gs := saltOf(ev), groupSalt(ev.Group)
		t.gone = t.gone[:0]
		for _, h := range ev.BlockHashes {
			k := uint64(h ^ salt)
			if t.dups > 0 && t.dropCopy(k) {
				continue // another physical copy of the block remains
			}
			key, ok := t.keys.take(k)
			if !ok {
				p, isPage := t.pages[k]
				if !isPage {
					c.UnknownRemoved++
					continue
				}
				delete(t.pages, k)
				if !p.owns {
					continue
				}
				key = p.own
			}
			// The group's last block of this key is gone: with several full-attention groups
			// the engine no longer hits the block even if another group still holds it.
			if t.refs.decr(refKey(key, gs)) {
				t.gone = append(t.gone, key)
			}
		}
		c.Events++
		if len(t.gone) == 0 {
			return nil
		}
		c.Blocks += len(t.gone)
		return sink.Apply(indexer.Event{Kind: indexer.Removed, Worker: t.worker, Blocks: t.gone})
	default: // Cleared; Validate let nothing else through
		t.Purge()
		c.Events++
		return sink.Apply(indexer.Event{Kind: indexer.Cleared, Worker: t.worker})
	}
}

// Full-attention kinds of vLLM's kv_cache_spec_kind: their groups need every block of a
// prefix, so theirs are the blocks a prefix hit is made of.
func fullAttention(kind string) bool {
	switch kind {
	case "", "full_attention", "mla_attention", "sink_full_attention":
		return true
	}
	return false
}

// feeds reports whether the event's group feeds the index, learning the group's kind from a
// BlockStored that describes it, and a full-attention group's existence from its first store.
func (t *Translator) feeds(ev *Event) bool {
	full := t.groupFeeds(ev)
	if full && ev.Kind == indexer.Stored && !slices.Contains(t.full, ev.Group) {
		t.full = append(t.full, ev.Group)
	}
	return full
}

func (t *Translator) groupFeeds(ev *Event) bool {
	if ev.Kind == indexer.Stored && (ev.SpecKind != "" || ev.SlidingWindow > 0) {
		full := fullAttention(ev.SpecKind) && ev.SlidingWindow == 0
		if t.groups == nil {
			t.groups = make(map[int]bool)
		}
		if len(t.groups) < MaxGroup+1 {
			t.groups[ev.Group] = full
		}
		return full
	}
	if full, ok := t.groups[ev.Group]; ok {
		return full
	}
	return ev.Group == 0
}

// refKey is the key refs counts a router key under for the group salted gs (groupSalt): a
// block's copies in two full-attention groups are counted apart, since the engine needs both.
func refKey(key uint64, gs EngineHash) uint64 { return key ^ uint64(gs) }

// indexed reports whether every full-attention group met holds key, as vLLM's hit needs
// (its coordinator takes a block only when each full-attention group has it cached).
func (t *Translator) indexed(key uint64) bool {
	for _, g := range t.full {
		if _, ok := t.refs.get(refKey(key, groupSalt(g))); !ok {
			return false
		}
	}
	return true
}

// dropCopy takes one physical copy of engine block k off, if it has more than one, and
// reports whether it did (the block stays).
func (t *Translator) dropCopy(k uint64) bool {
	n, ok := t.copies.get(k)
	if !ok {
		return false
	}
	if n > 1 {
		t.copies.put(k, n-1)
	} else {
		t.copies.take(k)
	}
	t.dups--
	return true
}

// forgetCopies drops every extra copy counted for engine block k (its hash now names other
// tokens, so the copies went without an event).
func (t *Translator) forgetCopies(k uint64) {
	if t.dups == 0 {
		return
	}
	if n, ok := t.copies.take(k); ok {
		t.dups -= int(n)
	}
}

// saltOf is what the translator XORs an event's engine hashes with: the medium's salt and the
// group's, so that a block's copies on two media, or in two groups, are separate entries.
func saltOf(ev *Event) EngineHash { return mediumSalt(ev.Medium) ^ groupSalt(ev.Group) }

// groupSalt keeps a group's blocks apart from the same hashes in another group. Group 0, the
// only group of a model without hybrid attention, is unsalted.
func groupSalt(g int) EngineHash {
	if g == 0 {
		return 0
	}
	return digestInt(kindGroup, uint64(g))
}

// parentKey finds the router key of the block whose salted engine key is k (an offloaded
// block's parent may be known only on the GPU: unsalted by medium).
func (t *Translator) parentKey(ev *Event, h EngineHash) (uint64, bool) {
	salt := saltOf(ev)
	if key, ok := t.keys.get(uint64(h ^ salt)); ok {
		return key, true
	}
	if ms := mediumSalt(ev.Medium); ms != 0 {
		return t.keys.get(uint64(h ^ salt ^ ms))
	}
	return 0, false
}

func (t *Translator) stored(ev *Event, sink Sink, c *Counts) error {
	n := len(ev.BlockHashes)
	if n == 0 {
		return nil
	}
	if t.Len()+n > t.maxBlocks {
		c.OverCapacity += n
		return nil
	}
	salt := saltOf(ev)
	var parent uint64
	if ev.HasParent {
		var ok bool
		if parent, ok = t.parentKey(ev, ev.Parent); !ok {
			c.UnknownParent++
			return nil
		}
	}
	t.seq = indexer.BlockHashes(ev.TokenIDs, t.blockSize, t.seed(ev), t.seq)
	// The hashes name the last blocks of token_ids (vLLM leaves a group's null blocks out).
	first := len(t.seq) - n
	if ev.Extras != nil {
		for i, x := range ev.Extras {
			t.seq[first+i] = indexer.MixExtra(t.seq[first+i], x)
		}
	}
	t.seq = indexer.Chain(parent, ev.HasParent, t.seq, t.seq)
	keys := t.seq[first:]
	gs := groupSalt(ev.Group)
	t.gone = t.gone[:0]
	for i, h := range ev.BlockHashes {
		key, k := keys[i], uint64(h^salt)
		if old, had := t.keys.put(k, key); had {
			if old == key {
				// Another physical block under the same hash (vLLM does not de-duplicate):
				// the block stays cached until each copy is removed.
				t.copies.incr(k)
				t.dups++
				continue
			}
			// The engine reused a hash for other tokens; the old key loses this holder.
			t.forgetCopies(k)
			if t.refs.decr(refKey(old, gs)) {
				t.gone = append(t.gone, old)
			}
		}
		t.refs.incr(refKey(key, gs))
	}
	if len(t.gone) > 0 {
		if err := sink.Apply(indexer.Event{Kind: indexer.Removed, Worker: t.worker, Blocks: t.gone}); err != nil {
			return err
		}
	}
	c.Events++
	c.Blocks += n
	if len(t.full) > 1 {
		// Several full-attention groups: only the blocks every one of them holds are hits.
		t.out = t.out[:0]
		for _, key := range keys {
			if t.indexed(key) {
				t.out = append(t.out, key)
			}
		}
		if keys = t.out; len(keys) == 0 {
			return nil
		}
	}
	return sink.Apply(indexer.Event{Kind: indexer.Stored, Worker: t.worker, Blocks: keys})
}

// storedPages applies a BlockStored of engine blocks smaller than the router's (a divisor of
// it): each is remembered with where it ends in its router block, and the one that ends a
// router block gets that block's key, from the tokens of the pages since the block began.
func (t *Translator) storedPages(ev *Event, sink Sink, c *Counts) error {
	n, ps := len(ev.BlockHashes), ev.BlockSize
	if n == 0 {
		return nil
	}
	if t.Len()+n > t.maxBlocks {
		c.OverCapacity += n
		return nil
	}
	salt := saltOf(ev)
	seed := t.seed(ev)
	off := len(ev.TokenIDs) - n*ps
	t.gone, t.out = t.gone[:0], t.out[:0]
	parent, hasParent := uint64(ev.Parent^salt), ev.HasParent
	for i, h := range ev.BlockHashes {
		k := uint64(h ^ salt)
		p := &page{parent: parent, hasParent: hasParent, tokens: ev.TokenIDs[off+i*ps : off+(i+1)*ps]}
		if ev.Extras != nil {
			p.extra = ev.Extras[i]
		}
		if hasParent {
			pp := t.pages[parent]
			if pp == nil {
				c.UnknownParent++
				break // the rest chains from this page
			}
			if pp.fill == t.blockSize {
				p.prefix, p.hasPrefix = pp.own, pp.owns
			} else {
				p.prefix, p.hasPrefix, p.fill = pp.prefix, pp.hasPrefix, pp.fill
			}
		}
		p.fill += ps
		if p.fill > t.blockSize {
			c.BlockSizeMismatch++ // pages of another size in one router block
			break
		}
		if p.fill == t.blockSize && !t.complete(p, seed) {
			c.UnknownParent++
			break
		}
		if old, had := t.pages[k]; had {
			if old.owns && (!p.owns || old.own != p.own) && t.refs.decr(old.own) {
				t.gone = append(t.gone, old.own)
			}
			if old.owns && p.owns && old.own == p.own {
				t.refs.decr(old.own) // stored again: the count stays
			}
		}
		p.tokens = slices.Clone(p.tokens)
		t.pages[k] = p
		if p.owns {
			t.refs.incr(p.own)
			t.out = append(t.out, p.own)
		}
		parent, hasParent = k, true
	}
	if len(t.gone) > 0 {
		if err := sink.Apply(indexer.Event{Kind: indexer.Removed, Worker: t.worker, Blocks: t.gone}); err != nil {
			return err
		}
	}
	c.Events++
	c.Blocks += len(t.out)
	if len(t.out) == 0 {
		return nil
	}
	return sink.Apply(indexer.Event{Kind: indexer.Stored, Worker: t.worker, Blocks: t.out})
}

// complete computes the key of the router block p ends, from the tokens of p and the pages
// before it in the block; false when one of them is no longer known.
func (t *Translator) complete(p *page, seed uint64) bool {
	per := t.blockSize / len(p.tokens)
	t.gather = grow(t.gather[:0], t.blockSize)[:t.blockSize]
	var ex indexer.ExtraDigest
	extra := false
	cur := p
	for i := per - 1; i >= 0; i-- {
		if cur == nil || len(cur.tokens) != len(p.tokens) {
			return false
		}
		copy(t.gather[i*len(p.tokens):], cur.tokens)
		extra = extra || cur.extra != 0
		if i > 0 {
			if !cur.hasParent {
				return false
			}
			cur = t.pages[cur.parent]
		}
	}
	if extra {
		// Pages with extra keys make a block the request side cannot key as the engine did
		// (vLLM attaches them per engine block): a key of its own, which matches no prompt.
		cur = p
		for range per {
			ex.Uint(cur.extra)
			if cur.hasParent {
				cur = t.pages[cur.parent]
			}
		}
	}
	local := indexer.MixExtra(indexer.BlockHashes(t.gather, t.blockSize, seed, t.seq[:0])[0], ex.Sum())
	t.seq = indexer.Chain(p.prefix, p.hasPrefix, []uint64{local}, t.seq[:0])
	p.own, p.owns = t.seq[0], true
	return true
}

// seed returns the event's block-hash seed, caching the last LoRA name's: a worker serves few
// adapters, often one. An event with lora_id and no lora_name comes from a vLLM that hashed the
// adapter's integer id into every block (before lora_name was sent): its blocks get a seed of
// their own (indexer.LoRAIDSeed), so they never match a base-model request.
func (t *Translator) seed(ev *Event) uint64 {
	lora := ev.LoRAName
	if lora == "" {
		if ev.LoRAID != 0 {
			return indexer.LoRAIDSeed(int64(ev.LoRAID))
		}
		return indexer.BaseSeed
	}
	if lora != t.loraName {
		t.loraName, t.loraSeed = lora, indexer.Seed(lora, "")
	}
	return t.loraSeed
}

// mediumSalt keeps a block on one medium apart from the same block on another, so removing it
// from the GPU does not forget its CPU copy. GPU, the default, is unsalted.
func mediumSalt(medium string) EngineHash {
	if medium == "" || medium == "GPU" {
		return 0
	}
	return EngineHash(xxhash.Sum64String(medium))
}

// Purge forgets every engine block and what it learned of the groups (the engine restarted).
// It does not touch the index: the caller removes the worker there.
func (t *Translator) Purge() {
	t.keys.reset()
	t.refs.reset()
	t.copies.reset()
	t.dups = 0
	clear(t.pages)
	t.groups = nil
	t.full = t.full[:0]
}

// Snapshot copies out the engine-block to router-key map, for a snapshot of the worker.
func (t *Translator) Snapshot() map[EngineHash]uint64 {
	out := make(map[EngineHash]uint64, t.keys.Len())
	t.keys.each(func(k, v uint64) { out[EngineHash(k)] = v })
	return out
}

// merge adds the entries of m, keyed as the translator keys them (engine hash XOR the medium's
// salt), that it does not have yet, for a map snapshotted by another replica. An entry it
// already has wins whatever its key: it came from a live event, newer than the snapshot. Past
// maxBlocks the rest are dropped, as stores past the cap are; which ones depends on m's
// iteration order, and any choice is as good, since the cap only bounds memory. refs gains one
// holder per added entry, so a restored block leaves the index with its last copy like any.
func (t *Translator) merge(m map[uint64]uint64) (added, kept, dropped int) {
	for k, v := range m {
		if _, ok := t.keys.get(k); ok {
			kept++
			continue
		}
		if t.Len() >= t.maxBlocks {
			dropped++
			continue
		}
		t.keys.put(k, v)
		t.refs.incr(v)
		added++
	}
	return added, kept, dropped
}

// Restore replaces the translator's map with m, as Snapshot returned it.
func (t *Translator) Restore(m map[EngineHash]uint64) error {
	if len(m) > t.maxBlocks {
		return fmt.Errorf("kvevents: snapshot of %d blocks over the cap of %d", len(m), t.maxBlocks)
	}
	t.Purge()
	for k, v := range m {
		t.keys.put(uint64(k), v)
		t.refs.incr(v)
	}
	return nil
}
