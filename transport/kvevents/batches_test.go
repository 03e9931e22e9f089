package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// The payloads here are vLLM's current layout (kv_events.py without array_like: the batch and
// its events are maps, defaults left out), written field by field with the msgpack library as
// the engine's msgspec writes them, never with this package's Encode.

// vllmStored is a BlockStored of the blocks numbered from..to-1 of a chain (engine hash
// base+i, tokens of block i counting up from 16*i), its parent the block before from.
func vllmStored(base, from, to int) kv {
	hashes := make([]any, 0, to-from)
	for i := from; i < to; i++ {
		hashes = append(hashes, base+i)
	}
	var parent any
	if from > 0 {
		parent = base + from - 1
	}
	return kv{"type", "BlockStored", "block_hashes", hashes, "parent_block_hash", parent,
		"token_ids", seqTokens(uint32(from*bs), (to-from)*bs), "block_size", bs, "medium", "GPU"}
}

// vllmRemoved is one BlockRemoved per block numbered from..to-1, as an engine evicting a long
// context block by block sends them.
func vllmRemoved(base, from, to int) []any {
	evs := make([]any, 0, to-from)
	for i := from; i < to; i++ {
		evs = append(evs, kv{"type", "BlockRemoved", "block_hashes", []any{base + i}, "medium", "GPU"})
	}
	return evs
}

// vllmBatch is a map batch of the events; a rank, when not nil, comes after them as msgspec
// writes it.
func vllmBatch(t testing.TB, rank any, evs ...any) []byte {
	b := kv{"ts", 1733300000.5, "events", evs}
	if rank != nil {
		b = append(b, "data_parallel_rank", rank)
	}
	return fixture(t, b)
}

// chainKeys is the router's keys of the first n blocks of the chain vllmStored describes.
func chainKeys(n int) []uint64 {
	return indexer.SequenceHashes(seqTokens(0, n*bs), bs, indexer.Seed("", ""), nil)
}

// rawRouter is a bare ZMQ ROUTER bound on loopback: a replay socket that answers as the test
// tells it.
func rawRouter(t *testing.T) zmq4.Socket {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	router := zmq4.NewRouter(ctx)
	t.Cleanup(func() { _ = router.Close(); cancel() })
	if err := router.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	return router
}

// sendRaw publishes one message [topic, seq, payload] on a bare PUB.
func sendRaw(t *testing.T, pub zmq4.Socket, seq uint64, payload []byte) {
	t.Helper()
	if err := pub.Send(zmq4.NewMsgFrom([]byte("kv@w0"), binary.BigEndian.AppendUint64(nil, seq), payload)); err != nil {
		t.Fatal(err)
	}
}

// TestBatchesOverTheEventLimitAreAppliedWhole sends an engine's long batches through the
// subscriber: 70,000 single-block BlockRemoved events in one batch (an engine evicting a long
// context), and one BlockStored of 100,000 blocks. Each used to be dropped whole ("events of
// 70000 elements (limit 65536)"), leaving the evicted chain predicting hits for ever, or the
// stored one predicting none.
func TestBatchesOverTheEventLimitAreAppliedWhole(t *testing.T) {
	type step struct {
		what    string
		payload func(t testing.TB) []byte
		blocks  int // the prediction for the chain afterwards: what the engine would hit
	}
	cases := []struct {
		name  string
		chain int // blocks of the chain the prediction is asked for
		steps []step
	}{
		{"70,000 BlockRemoved in one batch remove the whole chain", 70000, []step{
			{"store 70,000 blocks in two events", func(t testing.TB) []byte {
				return vllmBatch(t, nil, vllmStored(1, 0, 35000), vllmStored(1, 35000, 70000))
			}, 70000},
			{"remove them, one event per block", func(t testing.TB) []byte {
				return vllmBatch(t, nil, vllmRemoved(1, 0, 70000)...)
			}, 0},
		}},
		{"one BlockStored of 100,000 blocks stores them all", 100000, []step{
			{"store 100,000 blocks in one event", func(t testing.TB) []byte {
				return vllmBatch(t, nil, vllmStored(1, 0, 100000))
			}, 100000},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pub := rawPub(t)
			sink := newSink()
			sub := startSub(t, Config{Endpoint: tcp(pub.Addr()), Worker: w0, Sink: sink})
			poll.Holds(t, 15*time.Second, "the subscription", func() bool { return len(pub.(zmq4.Topics).Topics()) > 0 })
			keys := chainKeys(c.chain)
			for i, s := range c.steps {
				p := s.payload(t)
				t.Logf("%s: payload of %d bytes", s.what, len(p))
				sendRaw(t, pub, uint64(i), p)
				poll.Holds(t, 30*time.Second, s.what+": the message handled", func() bool {
					return value(t, sub.m.lastSeq) == float64(i) && value(t, sub.m.events) > 0 ||
						value(t, sub.m.decodeErrors) > 0
				})
				if got := value(t, sub.m.decodeErrors); got != 0 {
					t.Fatalf("%s: %v messages dropped", s.what, got)
				}
				poll.Holds(t, 30*time.Second, s.what+": the prediction", func() bool {
					return overlap(sink.Index, w0, keys) == s.blocks
				})
			}
		})
	}
}

// TestDecodePiecesBoundsWhatItHolds decodes long batches in vLLM's layouts and checks that
// every event arrives once, in order, in pieces of at most MaxEvents events that all carry the
// batch's rank (which the map layout gives after the events), and that a batch whose last event
// is bad hands nothing on.
func TestDecodePiecesBoundsWhatItHolds(t *testing.T) {
	bad := append(vllmRemoved(1, 0, 70000), kv{"type", "BlockMoved"})
	cases := []struct {
		name            string
		payload         []byte
		events, hashes  int
		pieces          int
		rank            int
		hasRank         bool
		err             error
		decodeRefusesIt bool
	}{
		{"map batch, 70,000 removals, rank after the events", vllmBatch(t, 3, vllmRemoved(1, 0, 70000)...),
			70000, 70000, 2, 3, true, nil, true},
		{"array batch, 70,000 removals", fixture(t, []any{1.5, vllmRemoved(1, 0, 70000), 1}),
			70000, 70000, 2, 1, true, nil, true},
		{"one stored event of 100,000 blocks", vllmBatch(t, nil, vllmStored(1, 0, 100000)),
			1, 100000, 1, 0, false, nil, false},
		{"300,000 single-block stores", vllmBatch(t, nil, func() []any {
			evs := make([]any, 300000)
			for i := range evs {
				evs[i] = vllmStored(1, i, i+1)
			}
			return evs
		}()...), 300000, 300000, 5, 0, false, nil, true},
		{"a bad event after 70,000 good ones", vllmBatch(t, nil, bad...), 0, 0, 0, 0, false, ErrUnknownEvent, true},
		{"a small batch is one piece", vllmBatch(t, 0, vllmStored(1, 0, 3)), 1, 3, 1, 0, true, nil, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := NewDecoder()
			var events, hashes, pieces int
			next := EngineHash(0)
			err := d.DecodePieces(c.payload, func(b Batch) error {
				pieces++
				if len(b.Events) > MaxEvents {
					t.Errorf("piece %d holds %d events", pieces, len(b.Events))
				}
				if b.DPRank != c.rank || b.HasDPRank != c.hasRank || b.TS == 0 {
					t.Errorf("piece %d: rank %d (%v), ts %v", pieces, b.DPRank, b.HasDPRank, b.TS)
				}
				if err := b.Validate(); err != nil {
					t.Errorf("piece %d: %v", pieces, err)
				}
				for _, ev := range b.Events {
					if next == 0 {
						next = ev.BlockHashes[0]
					} else if ev.BlockHashes[0] == next {
						t.Fatalf("event %d handed on twice", events)
					}
					next = ev.BlockHashes[0]
					events++
					hashes += len(ev.BlockHashes)
				}
				return nil
			})
			if !errors.Is(err, c.err) {
				t.Fatalf("error %v, want %v", err, c.err)
			}
			if events != c.events || hashes != c.hashes || pieces != c.pieces {
				t.Fatalf("%d events, %d hashes in %d pieces; want %d, %d in %d", events, hashes, pieces,
					c.events, c.hashes, c.pieces)
			}
			t.Logf("%d bytes: buffers held %d events, %d hashes, %d tokens", len(c.payload),
				cap(d.events), cap(d.hashes), cap(d.tokens))
			if _, err := Decode(c.payload); (err != nil) != c.decodeRefusesIt {
				t.Fatalf("Decode: %v", err)
			}
		})
	}
	stop := errors.New("stop")
	if err := NewDecoder().DecodePieces(cases[0].payload, func(Batch) error { return stop }); err != stop {
		t.Fatalf("an error of fn came back as %v", err)
	}
}

// checkPieces decodes payload in pieces of at most two events (FuzzDecode) and checks they
// hold b's events, in order, each piece with b's timestamp and rank.
func checkPieces(t *testing.T, payload []byte, b Batch) {
	d := NewDecoder()
	d.pieceEvents = 2
	i := 0
	err := d.DecodePieces(payload, func(p Batch) error {
		if len(p.Events) > 2 || p.DPRank != b.DPRank || p.HasDPRank != b.HasDPRank || !sameFloat(p.TS, b.TS) {
			t.Fatalf("piece of %d events, rank %d (%v), ts %v; batch rank %d (%v), ts %v",
				len(p.Events), p.DPRank, p.HasDPRank, p.TS, b.DPRank, b.HasDPRank, b.TS)
		}
		for _, ev := range p.Events {
			if i >= len(b.Events) || !reflect.DeepEqual(ev, b.Events[i]) {
				t.Fatalf("piece event %d differs from the batch's", i)
			}
			i++
		}
		return nil
	})
	if err != nil || i != len(b.Events) {
		t.Fatalf("pieces: %d of %d events, %v", i, len(b.Events), err)
	}
}

// sameFloat is == that holds for NaN too.
func sameFloat(a, b float64) bool { return a == b || a != a && b != b }

// restartedEngine is how TestEngineRestartPastOurSequenceIsPurged reaches the subscriber.
type restartedEngine struct {
	name   string
	bind   bool // the subscriber binds and the engine connects (the router never reconnects)
	replay bool
}

// TestEngineRestartPastOurSequenceIsPurged: the old engine publishes seq 0 and the subscriber
// applies it; the router is away while the engine restarts and its new incarnation publishes
// 0-2; then it publishes 3, which the router hears. The old incarnation's blocks must go. The
// sequence alone cannot tell (3 follows 0 as a gap would), so the subscriber checks the replay
// socket's message at its last sequence against the one it applied, and, without a replay
// socket, takes a gap on a new connection as a restart.
func TestEngineRestartPastOurSequenceIsPurged(t *testing.T) {
	cases := []restartedEngine{
		{"connect mode, replay: the resync after the reconnect", false, true},
		{"bind mode, replay: the gap's replay", true, true},
		{"connect mode, no replay: a gap on a new connection", false, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sink := newSink()
			cfg := PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, Topic: "kv@w0", MapEncoding: true}
			if c.replay {
				cfg.ReplayEndpoint = "tcp://127.0.0.1:0"
			}
			var sub *Subscriber
			if c.bind { // the engine connects to the router's bound SUB
				sub = newTestSub(t, Config{Endpoint: "tcp://127.0.0.1:0", Mode: Bind,
					Topics: map[string]indexer.Worker{"kv@w0": w0}, Sink: sink})
				runSub(t, sub)
				poll.Holds(t, 15*time.Second, "the bind", func() bool { return sub.Addr() != nil })
				cfg.Endpoint, cfg.Bind = tcp(sub.Addr()), false
			}
			pub := startPub(t, cfg)
			var replay string
			if c.replay {
				replay = tcp(pub.ReplayAddr())
			}
			stop := func() {}
			if c.bind {
				if err := sub.SetWorkers(context.Background(), Workers{Replays: map[string]string{w0.ID: replay}}); err != nil {
					t.Fatal(err)
				}
			} else {
				sub = newTestSub(t, Config{Endpoint: tcp(pub.Addr()), Replay: replay, Worker: w0, Sink: sink})
				stop = runSub(t, sub)
				cfg.Endpoint = tcp(pub.Addr()) // the restarted engine binds the same port
			}
			cfg.ReplayEndpoint = replay
			poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)
			var old, e engine
			publish(t, pub, old.stored(promptN(0))) // seq 0 of the old incarnation
			poll.Holds(t, 15*time.Second, "the old engine's prompt", func() bool { return matched(sink.Index, w0, promptN(0), "") == 2 })

			stop() // the router goes away (connect mode: a bound router does not notice)
			if err := pub.Close(); err != nil {
				t.Fatal(err)
			}
			pub = startPub(t, cfg)    // the new incarnation, on the same ports, from seq 0
			for n := 1; n <= 3; n++ { // seq 0-2: nobody hears them
				pub.lose(t, []Event{e.stored(promptN(n))})
			}
			if !c.bind {
				runSub(t, sub) // the router is back
			}
			poll.Holds(t, 15*time.Second, "the new subscription", pub.hasSubscriber)
			publish(t, pub, e.stored(promptN(4))) // seq 3
			poll.Holds(t, 15*time.Second, "seq 3 applied", func() bool { return matched(sink.Index, w0, promptN(4), "") == 2 })
			if got := matched(sink.Index, w0, promptN(0), ""); got != 0 {
				t.Fatalf("the old incarnation's prompt predicts %d blocks; the engine holds none", got)
			}
			if c.replay {
				for n := 1; n <= 3; n++ {
					if got := matched(sink.Index, w0, promptN(n), ""); got != 2 {
						t.Errorf("prompt %d of the new incarnation (replayed) predicts %d blocks, want 2", n, got)
					}
				}
			}
			if got := value(t, sub.m.restarts); got != 1 {
				t.Errorf("restarts %v, want 1", got)
			}
		})
	}
}

// TestDroppedMessagesAreNotGaps: a message that fails to decode still took its sequence
// number; the message after it must not be counted as a gap and replayed (to fail again).
// Four causes of drops, 16 each, are logged as one summary line with a count per cause.
func TestDroppedMessagesAreNotGapsAndAreSummedInTheLog(t *testing.T) {
	pub := startPub(t, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, ReplayEndpoint: "tcp://127.0.0.1:0"})
	sink := newSink()
	var logged bytes.Buffer // handle runs here, in the test's goroutine
	sub := newTestSub(t, Config{Endpoint: "tcp://127.0.0.1:1", Replay: tcp(pub.ReplayAddr()), Worker: w0, Sink: sink,
		Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	good := func(n int) []byte { return vllmBatch(t, nil, vllmStored(1000*n, 0, 2)) }
	msg := func(seq uint64, frames ...[]byte) zmq4.Msg {
		return zmq4.NewMsgFrom(append([][]byte{[]byte("kv@w0"), binary.BigEndian.AppendUint64(nil, seq)}, frames...)...)
	}
	ctx := context.Background()
	seq := uint64(0)
	sub.acquire()
	sub.handle(ctx, msg(seq, good(0)))
	for range 16 {
		for _, bad := range [][][]byte{
			{[]byte("garbage")},                  // wrong_type
			{good(1)[:10]},                       // malformed
			{vllmBatch(t, nil, kv{"type", "X"})}, // unknown_event
		} {
			seq++
			pub.lose(t, nil) // the replay socket holds something at every sequence
			sub.handle(ctx, msg(seq, bad...))
		}
		sub.handle(ctx, zmq4.NewMsgFrom([]byte("kv@w0"), good(2))) // frame: no sequence
	}
	seq++
	sub.handle(ctx, msg(seq, good(3)))
	sub.drops.flush(sub.log, time.Now().Add(logEvery))
	sub.release()

	for what, got := range map[string]float64{
		"gaps": value(t, sub.m.gaps), "missed": value(t, sub.m.missed), "replays": value(t, sub.m.replays),
		"restarts": value(t, sub.m.restarts),
	} {
		if got != 0 {
			t.Errorf("%s %v, want 0", what, got)
		}
	}
	if got := value(t, sub.m.lastSeq); got != float64(seq) {
		t.Errorf("last sequence %v, want %d", got, seq)
	}
	t.Logf("the log:\n%s", logged.String())
	lines := strings.Count(logged.String(), "messages dropped")
	if lines < 1 || lines > 2 {
		t.Errorf("%d summary lines, want 1 or 2:\n%s", lines, logged.String())
	}
	for _, cause := range []string{"frame", "malformed", "unknown_event", "wrong_type"} {
		sum := 0
		for _, m := range regexp.MustCompile(` `+cause+`=(\d+)`).FindAllStringSubmatch(logged.String(), -1) {
			n, _ := strconv.Atoi(m[1])
			sum += n
		}
		if sum != 16 {
			t.Errorf("the log sums %d drops for %s, want 16:\n%s", sum, cause, logged.String())
		}
	}
}

// TestASilentReplaySocketIsLeftAloneAfterAFailure: a replay endpoint that takes requests and
// never answers costs one ReplayTimeout, not one per gap: later gaps skip the replay while it
// waits out its backoff, and are applied at once.
func TestASilentReplaySocketIsLeftAloneAfterAFailure(t *testing.T) {
	ctx := context.Background()
	router := rawRouter(t)
	go func() { // takes requests, answers none
		for {
			if _, err := router.Recv(); err != nil {
				return
			}
		}
	}()
	sink := newSink()
	s := newTestSub(t, Config{Endpoint: "tcp://127.0.0.1:1", Replay: tcp(router.Addr()), Worker: w0, Sink: sink,
		ReplayTimeout: 200 * time.Millisecond})
	s.replayMin, s.replayMax = time.Hour, time.Hour // the backoff outlasts the test
	const gaps = 10
	start := time.Now()
	s.acquire()
	for i := range gaps + 1 {
		s.handle(ctx, zmq4.NewMsgFrom([]byte("kv@w0"), binary.BigEndian.AppendUint64(nil, uint64(2*i)),
			vllmBatch(t, nil, vllmStored(1000*i, 0, 2))))
	}
	s.release()
	t.Logf("%d gaps handled in %v (replay timeout 200ms)", gaps, time.Since(start))
	if got := value(t, s.m.replays.WithLabelValues(w0.String(), "error")); got != 1 {
		t.Errorf("%v failed replay requests, want 1", got)
	}
	if got := value(t, s.m.replays.WithLabelValues(w0.String(), "skipped")); got != gaps-1 {
		t.Errorf("%v replays skipped, want %d", got, gaps-1)
	}
	if got := value(t, s.m.missed); got != gaps {
		t.Errorf("%v messages missed, want %d", got, gaps)
	}
}
