package sim

import (
	"context"
	"log/slog"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

// EventPublisher is where a worker's KV events go (kvevents.Publisher).
type EventPublisher interface {
	Publish(events []kvevents.Event) error
}

// PublishEvents returns a Config.OnEvent hook that publishes the cache's changes in vLLM's KV
// event format. The block hashes are the worker's own (FNV, not the router's xxhash), so a
// router must derive its keys from the token ids, as it must with a real engine.
//
// The hook runs under the cache's lock, so it only queues the change; one goroutine (until ctx
// ends) encodes and publishes in order. Encoding a long prompt's blocks under the lock stalled
// every other request of the worker. A full queue makes the hook wait rather than drop: a change
// the router never hears of would leave its index wrong until the blocks are touched again.
func PublishEvents(ctx context.Context, pub EventPublisher, blockSize int, log *slog.Logger) func(CacheEvent) {
	queue := make(chan CacheEvent, 4096)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case ce := <-queue:
				events := translateCacheEvent(ce, blockSize)
				if len(events) == 0 {
					continue
				}
				if err := pub.Publish(events); err != nil && log != nil {
					log.Warn("publishing KV events failed", "error", err)
				}
			}
		}
	}()
	return func(ce CacheEvent) {
		select {
		case queue <- ce:
		case <-ctx.Done():
		}
	}
}

// translateCacheEvent turns one cache change into vLLM events; stored blocks are split into
// runs that chain (each block's parent is the one before it), one BlockStored per run. A
// salted prompt's first block carries its cache_salt in extra_keys, as vLLM's does. A hybrid
// worker's events name their group as vLLM's do: group_idx on every store and removal, the
// group's kv_cache_spec_kind (and sliding window) on its stores.
func translateCacheEvent(ce CacheEvent, blockSize int) []kvevents.Event {
	group := func(ev *kvevents.Event) {
		if ce.Window <= 0 {
			return
		}
		ev.Group, ev.HasGroup = ce.Group, true
		if ev.Kind != indexer.Stored {
			return
		}
		if ce.Group == 0 {
			ev.SpecKind = "full_attention"
		} else {
			ev.SpecKind, ev.SlidingWindow = "sliding_window", ce.Window
		}
	}
	switch ce.Kind {
	case Cleared:
		return []kvevents.Event{{Kind: indexer.Cleared}}
	case Removed:
		if len(ce.Blocks) == 0 {
			return nil
		}
		ev := kvevents.Event{Kind: indexer.Removed, Medium: "GPU"}
		for _, b := range ce.Blocks {
			ev.BlockHashes = append(ev.BlockHashes, kvevents.UintHash(b.Hash))
		}
		group(&ev)
		return []kvevents.Event{ev}
	case Stored:
		var out []kvevents.Event
		for i := 0; i < len(ce.Blocks); {
			first := ce.Blocks[i]
			ev := kvevents.Event{Kind: indexer.Stored, BlockSize: blockSize, Medium: "GPU"}
			if first.Parent != 0 {
				ev.Parent, ev.HasParent = kvevents.UintHash(first.Parent), true
			}
			salted := false
			j := i
			for ; j < len(ce.Blocks) && (j == i || ce.Blocks[j].Parent == ce.Blocks[j-1].Hash); j++ {
				ev.BlockHashes = append(ev.BlockHashes, kvevents.UintHash(ce.Blocks[j].Hash))
				ev.TokenIDs = append(ev.TokenIDs, ce.Blocks[j].Tokens...)
				salted = salted || ce.Blocks[j].Salt != ""
			}
			if salted {
				ev.ExtraKeys = make([][]any, j-i)
				for k := i; k < j; k++ {
					if s := ce.Blocks[k].Salt; s != "" {
						ev.ExtraKeys[k-i] = []any{s}
					}
				}
			}
			group(&ev)
			out = append(out, ev)
			i = j
		}
		return out
	}
	return nil
}
