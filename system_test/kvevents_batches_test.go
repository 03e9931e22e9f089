package system_test

import (
	"context"
	byteorder "encoding/binary"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/internal/zmtptest"
)

// An engine's long batches against the real binary: issue 30, publisher item 1.

// longChain is the tokens of chain k, of n blocks, apart from other chains and every kvPrompt.
func longChain(k, n int) []uint32 {
	p := make([]uint32, n*indexer.DefaultBlockSize)
	for i := range p {
		p[i] = uint32(50_000_000*(k+1) + i)
	}
	return p
}

// vllmPayload is a batch in vLLM's current layout (maps, defaults left out), as its msgspec
// encoder writes it; the events are maps with their "type".
func vllmPayload(t *testing.T, events []any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(map[string]any{"ts": float64(time.Now().UnixNano()) / 1e9, "events": events})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// sendVLLM sends [topic, seq, payload] over c.
func sendVLLM(c *zmtptest.Conn, topic string, seq uint64, payload []byte) error {
	return c.Send([]byte(topic), byteorder.BigEndian.AppendUint64(nil, seq), payload)
}

func TestAnEngineEvictingALongContextInOneBatchLeavesNoHits(t *testing.T) {
	const long, removed = 100_000, 70_000
	fl := startFleetAt(t, "127.0.0.2", "127.0.0.3")
	r, bind := startEventsReplica(t, binary, fl)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	w0, err := zmtptest.Dial(ctx, "127.0.0.2", bind, "PUB")
	if err != nil {
		t.Fatal(err)
	}
	defer w0.Close()
	topic := kvTopic(fl.urls[0])
	blocksApplied := func() float64 {
		m, err := luaScrape(ctx, r.Admin)
		if err != nil {
			return -1
		}
		return luaSum(m, "kvrouter_kvevents_blocks_applied_total", `worker="w0"`)
	}

	// seq 0: a small store, sent until the SUB has bound and subscribed.
	small := vllmPayload(t, []any{vllmStored(1, 0, kvBlocks, kvPrompt(1))})
	poll.Until(t, 30*time.Second, func() error {
		if err := sendVLLM(w0, topic, 0, small); err != nil {
			return err
		}
		if _, o, err := kvRoute(ctx, r, kvPrompt(1)); err != nil || o != kvBlocks {
			return fmt.Errorf("prompt 1: %d blocks predicted (%v)", o, err)
		}
		return nil
	})
	base := blocksApplied()
	before := rssOf(r.proc.PID())

	// seq 1: chain A, one BlockStored of 100,000 blocks (1.6M tokens). seq 2: chain B, 70,000
	// blocks in two BlockStored events (under the old limit, so it stored before the fix too).
	// seq 3: the engine evicts chain B, one BlockRemoved per block, in one batch.
	chainA, chainB := longChain(0, long), longChain(1, removed)
	storeA := vllmPayload(t, []any{vllmStored(1_000_000, 0, long, chainA)})
	storeB := vllmPayload(t, []any{vllmStored(2_000_000, 0, removed/2, chainB), vllmStored(2_000_000, removed/2, removed, chainB)})
	evs := make([]any, removed)
	for i := range evs {
		evs[i] = map[string]any{"type": "BlockRemoved", "block_hashes": []any{2_000_000 + i}, "medium": "GPU"}
	}
	evictB := vllmPayload(t, evs)
	t.Logf("payloads: A (one event of %d blocks) %d bytes, B %d bytes, B's %d removals %d bytes",
		long, len(storeA), len(storeB), removed, len(evictB))
	for i, p := range [][]byte{storeA, storeB} {
		if err := sendVLLM(w0, topic, uint64(1+i), p); err != nil {
			t.Fatal(err)
		}
	}
	headA, headB := chainA[:kvTokens], chainB[:kvTokens]
	waitPredicted(t, r, "w0", headB)
	if err := poll.Wait(30*time.Second, func() error {
		if _, o, err := kvRoute(ctx, r, headA); err != nil || o != kvBlocks {
			return fmt.Errorf("%d blocks predicted (%v)", o, err)
		}
		return nil
	}); err != nil {
		t.Errorf("chain A, stored by one event of %d blocks: %v; the engine holds them all", long, err)
	}

	if err := sendVLLM(w0, topic, 3, evictB); err != nil {
		t.Fatal(err)
	}
	if err := poll.Wait(60*time.Second, func() error {
		if w, o, err := kvRoute(ctx, r, headB); err != nil || o != 0 {
			return fmt.Errorf("routes to %s with %d blocks predicted (%v)", w, o, err)
		}
		return nil
	}); err != nil {
		t.Errorf("chain B after its %d removals in one batch: %v; the engine holds none", removed, err)
	}
	if !t.Failed() {
		poll.Until(t, 60*time.Second, func() error {
			if got, want := blocksApplied()-base, float64(long+2*removed); got != want {
				return fmt.Errorf("%v blocks applied, want %v (A stored, B stored and removed)", got, want)
			}
			return nil
		})
	}
	if _, o, err := kvRoute(ctx, r, kvPrompt(1)); err != nil || o != kvBlocks {
		t.Fatalf("prompt 1, never evicted: %d blocks predicted (%v)", o, err)
	}
	if m, err := proc.ReadMemory(strconv.Itoa(r.proc.PID())); err == nil {
		t.Logf("replica (built with -race) RSS %s before the long batches, %d MiB after, peak %d MiB",
			before, m.RSS>>20, m.PeakRSS>>20)
	}
}

// vllmStored is a BlockStored map event of blocks from..to-1 of chain (engine hashes base+i).
func vllmStored(base, from, to int, chain []uint32) map[string]any {
	var parent any
	if from > 0 {
		parent = base + from - 1
	}
	bs := indexer.DefaultBlockSize
	return map[string]any{"type": "BlockStored", "block_hashes": seqHashes(base+from, to-from), "parent_block_hash": parent,
		"token_ids": chain[from*bs : to*bs], "block_size": bs, "medium": "GPU"}
}

// seqHashes is n engine hashes counting up from base, as vLLM's integer hashes are sent.
func seqHashes(base, n int) []any {
	hs := make([]any, n)
	for i := range hs {
		hs[i] = base + i
	}
	return hs
}
