// Package indexer knows which worker holds which prompt-prefix blocks.
//
// Prompts are cut into blocks of BlockSize tokens; each full block gets a local hash and the
// blocks chain into sequence hashes (seq[0] = local[0], seq[i] = H(seq[i-1], local[i])), so a
// sequence hash names a whole prefix. The Index maps sequence hashes to the workers that hold
// them and answers, for a prompt, how many leading blocks each worker already has.
package indexer

import (
	"fmt"
	"time"
)

// DefaultBlockSize is vLLM's default KV block size in tokens.
const DefaultBlockSize = 16

// Worker names one KV cache: a worker and one of its data-parallel ranks.
type Worker struct {
	ID     string
	DPRank uint32
}

// String renders the worker as "id" for rank 0 and "id/rank" otherwise.
func (w Worker) String() string {
	if w.DPRank == 0 {
		return w.ID
	}
	return fmt.Sprintf("%s/%d", w.ID, w.DPRank)
}

// Match is how many leading blocks of a prompt one worker holds.
type Match struct {
	Worker Worker
	Blocks int
	// Slot is a small number the index gives the worker, from 1 up (0: none given). It is the
	// same in every match of the worker while the worker stays known, and may be reused for
	// another worker after RemoveWorker, so a caller can keep its own per-worker data in a
	// table indexed by Slot, instead of hashing the worker's name for every match, provided it
	// checks Worker on each use.
	Slot int
}

// EventKind says what an Event does to a worker's blocks.
type EventKind uint8

// The event kinds, after vLLM's KV events.
const (
	Stored EventKind = iota + 1
	Removed
	Cleared
)

// Event is one change to one worker's cache, in router sequence hashes.
// A stored event with a parent has already been chained from the parent's key
// (see Chain); the index only ever sees sequence hashes.
type Event struct {
	Kind   EventKind
	Worker Worker
	Blocks []uint64
}

// Options tune an Index.
type Options struct {
	// TTL drops an entry this long after it was last stored; 0 keeps entries until removed
	// (precise mode). Approximate mode uses DESIGN's default of 120 s. Entries go when Expire
	// (or a Store to the same worker) runs, so the TTL is a lower bound; it is kept in 10 ms
	// ticks, rounded up.
	TTL time.Duration
	// MaxBlocksPerWorker caps one worker's entries, evicting its least recently stored first
	// (a prompt's tail before its head); 0 is no cap.
	MaxBlocksPerWorker int
	// Now is the clock for TTLs; nil means time.Now.
	Now func() time.Time
}
