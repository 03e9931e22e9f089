package kvevents

import (
	"fmt"

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
}

// Add adds o to c.
func (c *Counts) Add(o Counts) {
	c.Events += o.Events
	c.Blocks += o.Blocks
	c.UnknownParent += o.UnknownParent
	c.BlockSizeMismatch += o.BlockSizeMismatch
	c.UnknownRemoved += o.UnknownRemoved
	c.OverCapacity += o.OverCapacity
}

// Translator turns one worker's engine events into indexer events keyed by the router's own
// sequence hashes. It remembers, per engine block, the router key it computed, so that
// BlockRemoved resolves and a later BlockStored can chain from its parent. It also counts how
// many engine blocks map to each router key: blocks the router cannot tell apart (a cache salt
// or multimodal inputs the router does not hash, the same block on GPU and offloaded to CPU)
// leave the index only when the last of them goes. A Translator is not safe for concurrent use.
type Translator struct {
	worker    indexer.Worker
	blockSize int
	maxBlocks int

	keys *table // engine block (salted by medium) -> router key
	refs *table // router key -> how many engine blocks map to it

	seq, gone []uint64 // scratch
	loraName  string
	loraSeed  uint64
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
	}, nil
}

// Worker is the worker the translator keys its events by.
func (t *Translator) Worker() indexer.Worker { return t.worker }

// Len is the number of engine blocks remembered.
func (t *Translator) Len() int { return t.keys.Len() }

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
		return t.stored(ev, sink, c)
	case indexer.Removed:
		salt := mediumSalt(ev.Medium)
		t.gone = t.gone[:0]
		for _, h := range ev.BlockHashes {
			key, ok := t.keys.take(uint64(h ^ salt))
			if !ok {
				c.UnknownRemoved++
				continue
			}
			if t.refs.decr(key) {
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

func (t *Translator) stored(ev *Event, sink Sink, c *Counts) error {
	if ev.BlockSize != t.blockSize {
		c.BlockSizeMismatch++
		return nil
	}
	n := len(ev.BlockHashes)
	if n == 0 {
		return nil
	}
	if t.keys.Len()+n > t.maxBlocks {
		c.OverCapacity += n
		return nil
	}
	salt := mediumSalt(ev.Medium)
	var parent uint64
	if ev.HasParent {
		var ok bool
		if parent, ok = t.keys.get(uint64(ev.Parent ^ salt)); !ok && salt != 0 {
			// An offloaded block's parent may be known only on the GPU.
			parent, ok = t.keys.get(uint64(ev.Parent))
		}
		if !ok {
			c.UnknownParent++
			return nil
		}
	}
	t.seq = indexer.BlockHashes(ev.TokenIDs, t.blockSize, t.seed(ev.LoRAName), t.seq)
	t.seq = indexer.Chain(parent, ev.HasParent, t.seq, t.seq)
	t.gone = t.gone[:0]
	for i, h := range ev.BlockHashes {
		key := t.seq[i]
		if old, had := t.keys.put(uint64(h^salt), key); had {
			if old == key {
				continue // stored again: the index refreshes it, the count stays
			}
			// The engine reused a hash for other tokens; the old key loses this holder.
			if t.refs.decr(old) {
				t.gone = append(t.gone, old)
			}
		}
		t.refs.incr(key)
	}
	if len(t.gone) > 0 {
		if err := sink.Apply(indexer.Event{Kind: indexer.Removed, Worker: t.worker, Blocks: t.gone}); err != nil {
			return err
		}
	}
	c.Events++
	c.Blocks += n
	return sink.Apply(indexer.Event{Kind: indexer.Stored, Worker: t.worker, Blocks: t.seq})
}

// seed caches the last LoRA name's seed: a worker serves few adapters, often one.
func (t *Translator) seed(lora string) uint64 {
	if lora != t.loraName {
		t.loraName, t.loraSeed = lora, indexer.Seed(lora, "")
	}
	if lora == "" {
		return indexer.BaseSeed
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

// Purge forgets every engine block (the engine restarted). It does not touch the index: the
// caller removes the worker there.
func (t *Translator) Purge() {
	t.keys.reset()
	t.refs.reset()
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
		if t.keys.Len() >= t.maxBlocks {
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
