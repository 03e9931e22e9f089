package replica

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

// eventWorker is a simulated worker that publishes its KV events over ZMQ on loopback and
// can be restarted on the same ports, as an engine process would be.
type eventWorker struct {
	t        *testing.T
	spec     routing.WorkerSpec
	httpAddr string
	pubAddr  string
	replay   string
	sim      *sim.Worker
	pub      *kvevents.Publisher
	cancel   context.CancelFunc
	done     chan struct{}
}

// startEventWorker starts worker id publishing KV events (with a replay socket).
func startEventWorker(t *testing.T, id string) *eventWorker {
	t.Helper()
	w := &eventWorker{t: t, httpAddr: loopbacktest.Addr(t), pubAddr: loopbacktest.Addr(t), replay: loopbacktest.Addr(t)}
	w.spec = routing.WorkerSpec{ID: id, URL: "http://" + w.httpAddr, KVEvents: "tcp://" + w.pubAddr, KVReplay: "tcp://" + w.replay}
	w.start()
	t.Cleanup(w.stop)
	return w
}

// start runs a fresh engine on the worker's ports: an empty cache and sequence numbers from 0.
func (w *eventWorker) start() {
	t := w.t
	t.Helper()
	pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{
		Endpoint: "tcp://" + w.pubAddr, Bind: true, ReplayEndpoint: "tcp://" + w.replay,
	})
	if err != nil {
		t.Fatalf("publisher: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := simConfig(0)
	c.ID = w.spec.ID
	c.OnEvent = sim.PublishEvents(ctx, pub, sim.DefaultBlockSize, nil)
	sw, err := sim.New(c)
	if err != nil {
		t.Fatal(err)
	}
	var ln net.Listener
	eventually(t, "the worker's port to be free again", func() (bool, string) {
		ln, err = net.Listen("tcp", w.httpAddr)
		return err == nil, fmt.Sprint(err)
	})
	w.sim, w.pub, w.cancel, w.done = sw, pub, cancel, make(chan struct{})
	go func() { defer close(w.done); _ = sw.Serve(ctx, ln) }()
}

func (w *eventWorker) stop() {
	if w.cancel == nil {
		return
	}
	w.cancel()
	<-w.done
	w.pub.Close()
	w.cancel = nil
}

// direct sends a completion straight to the worker, bypassing the router: only the worker's
// KV events can tell the router about it.
func (w *eventWorker) direct(tokens []uint32) {
	w.t.Helper()
	resp, err := http.Post("http://"+w.httpAddr+"/v1/completions", "application/json",
		bytes.NewReader(completionBody(tokens, 2, false)))
	if err != nil {
		w.t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		w.t.Fatalf("direct request: %s", resp.Status)
	}
}

func startPreciseReplica(t *testing.T, workers ...*eventWorker) *Replica {
	t.Helper()
	var fleet testFleet
	for _, w := range workers {
		fleet = append(fleet, &testWorker{spec: w.spec})
	}
	return startTestReplica(t, fleet, func(c *Config) {
		c.OverlayTTL = time.Second
		if testing.Verbose() {
			c.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
		}
	})
}

// preciseBlocks is how many leading blocks of tokens the replica's event-fed index credits to
// worker id.
func preciseBlocks(rep *Replica, id string, tokens []uint32) int {
	seq := indexer.SequenceHashes(tokens, indexer.DefaultBlockSize, indexer.BaseSeed, nil)
	for _, m := range rep.precise.FindMatches(seq, nil) {
		if m.Worker.ID == id {
			return m.Blocks
		}
	}
	return 0
}

func waitPrecise(t *testing.T, rep *Replica, id string, tokens []uint32, want int) {
	t.Helper()
	eventually(t, fmt.Sprintf("the events to credit %s with %d blocks", id, want), func() (bool, string) {
		got := preciseBlocks(rep, id, tokens)
		return got == want, fmt.Sprintf("credited %d", got)
	})
}

func TestPreciseModePredictsWhatTheWorkerCached(t *testing.T) {
	a, b := startEventWorker(t, "w0"), startEventWorker(t, "w1")
	rep := startPreciseReplica(t, a, b)
	client := newRouterClient(t, rep)
	prefix := promptTokens(31, 64*16)
	// The prefix reaches w1's cache without the router seeing the request: only the events
	// can route the next request there.
	b.direct(prefix)
	waitPrecise(t, rep, "w1", prefix, 64)
	for i := range 5 {
		prompt := concat(prefix, promptTokens(uint64(100+i), 8*16))
		ans := client.complete(prompt, 2, nil).mustOK(t)
		if ans.worker() != "w1" {
			t.Fatalf("request %d went to %s; the events say w1 holds its prefix", i, ans.worker())
		}
		predicted := ans.overlap(t) * indexer.DefaultBlockSize
		if cached := ans.cachedTokens(t); predicted != cached {
			t.Fatalf("request %d: predicted %d cached tokens, the worker reports %d", i, predicted, cached)
		}
	}
}

// TestAWhollyCachedPromptPredictsAllButItsLastBlock: the engine computes a prompt's last token
// even when every block of it is cached, so a 128-token prompt (8 blocks, all held) reports 112
// cached tokens; the router, crediting the worker with all 8 blocks from the events, must
// predict 7, and so must a prompt one token past the blocks (8 full blocks hit).
func TestAWhollyCachedPromptPredictsAllButItsLastBlock(t *testing.T) {
	w := startEventWorker(t, "w0")
	rep := startPreciseReplica(t, w)
	client := newRouterClient(t, rep)
	prompt := promptTokens(61, 8*16)
	w.direct(prompt)
	waitPrecise(t, rep, "w0", prompt, 8)
	cases := []struct {
		name   string
		prompt []uint32
		want   int // blocks the engine reports cached
	}{
		{"the whole prompt in full blocks", prompt, 7},
		{"one token past the full blocks", concat(prompt, promptTokens(99, 1)), 8},
	}
	for _, c := range cases {
		ans := client.complete(c.prompt, 2, nil).mustOK(t)
		predicted, cached := ans.overlap(t)*indexer.DefaultBlockSize, ans.cachedTokens(t)
		if predicted != cached || cached != c.want*indexer.DefaultBlockSize {
			t.Fatalf("%s: predicted %d cached tokens, the worker reports %d (want %d)", c.name, predicted, cached, c.want*indexer.DefaultBlockSize)
		}
	}
}

func TestRestartedWorkerIsPurgedAndRelearned(t *testing.T) {
	w := startEventWorker(t, "w0")
	rep := startPreciseReplica(t, w)
	before, after := promptTokens(41, 32*16), promptTokens(42, 32*16)
	w.direct(before)
	waitPrecise(t, rep, "w0", before, 32)
	// The engine restarts: an empty cache, and sequence numbers from 0 again. Its events go
	// out once the router has reconnected (what a PUB sends before a SUB is connected is
	// lost; a busy engine's next step would carry on, an idle test worker would not).
	client := newRouterClient(t, rep)
	connects := func() float64 {
		return client.scrapeMetrics()[`kvrouter_kvevents_connects_total{endpoint="`+w.spec.KVEvents+`",result="ok"}`]
	}
	before1 := connects()
	w.stop()
	w.start()
	eventually(t, "the router to reconnect to the restarted worker", func() (bool, string) {
		n := connects()
		return n > before1, fmt.Sprintf("%v connects", n)
	})
	w.direct(after)
	waitPrecise(t, rep, "w0", after, 32)
	if got := preciseBlocks(rep, "w0", before); got != 0 {
		t.Fatalf("after the restart the index still credits w0 with %d blocks it lost", got)
	}
}

func TestRestartedReplicaRecoversThroughReplay(t *testing.T) {
	w := startEventWorker(t, "w0")
	first := startPreciseReplica(t, w)
	early, late := promptTokens(51, 24*16), promptTokens(52, 24*16)
	w.direct(early)
	waitPrecise(t, first, "w0", early, 24)
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	// A new replica joins after the events about `early` were published: ZMQ drops them for
	// a late subscriber, so only the worker's replay socket can bring them back.
	second := startPreciseReplica(t, w)
	w.direct(late)
	waitPrecise(t, second, "w0", late, 24)
	waitPrecise(t, second, "w0", early, 24)
}

// saltedBody is a completion body with vLLM's cache_salt.
func saltedBody(tokens []uint32, salt string) []byte {
	b, err := json.Marshal(map[string]any{"model": sim.DefaultModel, "prompt": tokens, "max_tokens": 2, "cache_salt": salt})
	if err != nil {
		panic(err)
	}
	return b
}

// TestCacheSaltKeepsPromptsApartAsTheEngineDoes: a prompt cached on a worker under one
// cache_salt (learned from the worker's events, whose extra_keys carry the salt) is predicted
// there only for the same salt: the same tokens with another salt, or none, are predicted
// uncached, as the worker then reports.
func TestCacheSaltKeepsPromptsApartAsTheEngineDoes(t *testing.T) {
	a := startEventWorker(t, "w0")
	rep := startPreciseReplica(t, a)
	client := newRouterClient(t, rep)
	prefix := promptTokens(41, 32*16)
	first := client.post("/v1/completions", saltedBody(prefix, "tenant-a"), nil).mustOK(t)
	if got := first.cachedTokens(t); got != 0 {
		t.Fatalf("first request found %d tokens cached", got)
	}
	waitRouterIdle(t, rep)
	eventually(t, "the salted prompt's events", func() (bool, string) {
		// One token past the prefix, so that all 32 blocks can be a hit (the engine computes
		// a prompt's last token however much of it is cached).
		ans := client.post("/v1/route", saltedBody(concat(prefix, promptTokens(40, 1)), "tenant-a"), nil)
		return bytes.Contains(ans.body, []byte(`"overlap_blocks":32`)), string(ans.body)
	})
	for _, tc := range []struct {
		name string
		body []byte
		want int
	}{
		{"same salt", saltedBody(concat(prefix, promptTokens(42, 16)), "tenant-a"), 32 * 16},
		{"another salt", saltedBody(concat(prefix, promptTokens(43, 16)), "tenant-b"), 0},
		{"no salt", completionBody(concat(prefix, promptTokens(44, 16)), 2, false), 0},
	} {
		ans := client.post("/v1/completions", tc.body, nil).mustOK(t)
		predicted := ans.overlap(t) * indexer.DefaultBlockSize
		if cached := ans.cachedTokens(t); predicted != tc.want || cached != tc.want {
			t.Fatalf("%s: predicted %d cached tokens, the worker reports %d, want %d", tc.name, predicted, cached, tc.want)
		}
		waitRouterIdle(t, rep)
	}
}
