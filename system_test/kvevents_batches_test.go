package system_test

import (
	"context"
	byteorder "encoding/binary"
	"fmt"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/internal/zmtptest"
)

// An engine's long batches and an engine restart the sequence cannot show, against the real
// binary: issue 30, publisher items 1 and 2.

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

// vllmEngine is a vLLM engine's two KV-event sockets, as its ZmqEventPublisher binds them: a
// PUB sending [topic, seq, payload] and a replay ROUTER answering [identity, "", start] with
// [identity, "", seq, payload] for each buffered batch from start on, then seq -1.
type vllmEngine struct {
	pub, replay zmq4.Socket
	cancel      context.CancelFunc
	done        chan struct{}

	mu   sync.Mutex
	ring [][]byte // payload by sequence number
}

// startVLLMEngine binds an engine's sockets on pubAddr and replayAddr (host:port on loopback).
func startVLLMEngine(t *testing.T, pubAddr, replayAddr string) *vllmEngine {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	e := &vllmEngine{pub: zmq4.NewPub(ctx), replay: zmq4.NewRouter(ctx), cancel: cancel, done: make(chan struct{})}
	t.Cleanup(e.close)
	if err := e.pub.Listen("tcp://" + pubAddr); err != nil {
		t.Fatal(err)
	}
	if err := e.replay.Listen("tcp://" + replayAddr); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(e.done)
		for {
			m, err := e.replay.Recv()
			if err != nil {
				return
			}
			if len(m.Frames) != 3 || len(m.Frames[2]) != 8 {
				continue
			}
			id, start := m.Frames[0], byteorder.BigEndian.Uint64(m.Frames[2])
			e.mu.Lock()
			ring := e.ring
			e.mu.Unlock()
			for seq := start; seq < uint64(len(ring)); seq++ {
				_ = e.replay.Send(zmq4.NewMsgFrom(id, []byte{}, byteorder.BigEndian.AppendUint64(nil, seq), ring[seq]))
			}
			_ = e.replay.Send(zmq4.NewMsgFrom(id, []byte{}, byteorder.BigEndian.AppendUint64(nil, ^uint64(0)), []byte{}))
		}
	}()
	return e
}

// subscribed reports whether a SUB's subscription has reached the PUB.
func (e *vllmEngine) subscribed() bool { return len(e.pub.(zmq4.Topics).Topics()) > 0 }

// publish buffers the next batch for replay and, when send, publishes it.
func (e *vllmEngine) publish(t *testing.T, payload []byte, send bool) {
	t.Helper()
	e.mu.Lock()
	seq := uint64(len(e.ring))
	e.ring = append(e.ring, payload)
	e.mu.Unlock()
	if !send {
		return
	}
	if err := e.pub.Send(zmq4.NewMsgFrom([]byte("kv@w0"), byteorder.BigEndian.AppendUint64(nil, seq), payload)); err != nil {
		t.Fatal(err)
	}
}

// close stops the engine: its sockets close, as the process's would.
func (e *vllmEngine) close() {
	e.cancel()
	_ = e.pub.Close()
	_ = e.replay.Close()
	<-e.done
}

// TestAnEngineRestartPastTheRoutersSequenceIsPurged: the old engine publishes seq 0; the router
// is away (SIGSTOP) while the engine restarts on the same ports and its new incarnation
// publishes seq 0-2; the router comes back, and hears seq 3. The sequence alone says "a gap";
// the replay's message at seq 0 is not the one the router applied, so the old incarnation's
// blocks must go and the new one's stay.
func TestAnEngineRestartPastTheRoutersSequenceIsPurged(t *testing.T) {
	fl := startFleetAt(t, "127.0.0.2")
	pubAddr, replayAddr := loopbacktest.Addr(t), loopbacktest.Addr(t)
	old := startVLLMEngine(t, pubAddr, replayAddr)
	path := filepath.Join(t.TempDir(), "fleet.json")
	if err := proc.WriteFleetFile(path, []map[string]string{{"id": "w0", "url": fl.urls[0],
		"kv_events": "tcp://" + pubAddr, "kv_replay": "tcp://" + replayAddr}}); err != nil {
		t.Fatal(err)
	}
	c := startClusterOf(t, binary, 1, nil, "--workers-file", path)
	r := c.replicas[0]
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	prompt := func(n int) []byte { return vllmPayload(t, []any{vllmStored(1000*(n+1), 0, kvBlocks, kvPrompt(n))}) }

	poll.Holds(t, 30*time.Second, "the replica's subscription", old.subscribed)
	old.publish(t, prompt(0), true) // seq 0
	waitPredicted(t, r, "w0", kvPrompt(0))

	c.signal(r, syscall.SIGSTOP)
	old.close()
	fresh := startVLLMEngine(t, pubAddr, replayAddr) // the same ports, its sequence from 0
	for n := 1; n <= 3; n++ {
		fresh.publish(t, prompt(n), false) // seq 0-2, while the router is away
	}
	c.signal(r, syscall.SIGCONT)
	poll.Holds(t, 30*time.Second, "the replica's new subscription", fresh.subscribed)
	fresh.publish(t, prompt(4), true) // seq 3
	waitPredicted(t, r, "w0", kvPrompt(4))
	if _, o, err := kvRoute(ctx, r, kvPrompt(0)); err != nil || o != 0 {
		t.Errorf("the old incarnation's prompt: %d blocks predicted (%v); the engine holds none", o, err)
	}
	for n := 1; n <= 3; n++ {
		if _, o, err := kvRoute(ctx, r, kvPrompt(n)); err != nil || o != kvBlocks {
			t.Errorf("prompt %d, published by the new incarnation while the router was away: %d blocks predicted (%v)", n, o, err)
		}
	}
}
