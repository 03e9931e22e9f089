package kvevents

import (
	"context"
	"encoding/binary"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// recordingSink is a real index that also records which workers were purged.
type recordingSink struct {
	*indexer.Index
	mu      sync.Mutex
	removed []indexer.Worker
}

func newSink() *recordingSink { return &recordingSink{Index: indexer.New(indexer.Options{})} }

func (s *recordingSink) RemoveWorker(w indexer.Worker) {
	s.mu.Lock()
	s.removed = append(s.removed, w)
	s.mu.Unlock()
	s.Index.RemoveWorker(w)
}

func (s *recordingSink) purged() []indexer.Worker {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.removed)
}

// value sums the counters or gauges c collects.
func value(t testing.TB, c prometheus.Collector) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 16)
	go func() { c.Collect(ch); close(ch) }()
	var sum float64
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			t.Fatal(err)
		}
		sum += d.GetCounter().GetValue() + d.GetGauge().GetValue()
	}
	return sum
}

// engine makes BlockStored events with its own block hashes, as an engine would.
type engine struct{ next uint64 }

func (e *engine) stored(tokens []uint32) Event {
	hs := make([]EngineHash, len(tokens)/bs)
	for i := range hs {
		e.next++
		hs[i] = EngineHash(e.next*0x9e3779b97f4a7c15 + 1)
	}
	return store(hs, 0, false, tokens)
}

// promptN is the tokens of test prompt n: two blocks, different for every n.
func promptN(n int) []uint32 { return seqTokens(uint32(n)*1000, 2*bs) }

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(p))
	return len(p), nil
}

// startSub runs a subscriber until the test ends.
func startSub(t *testing.T, cfg Config) *Subscriber {
	t.Helper()
	s := newTestSub(t, cfg)
	runSub(t, s)
	return s
}

// newTestSub makes a subscriber with the tests' defaults, not running.
func newTestSub(t *testing.T, cfg Config) *Subscriber {
	t.Helper()
	if cfg.BlockSize == 0 {
		cfg.BlockSize = bs
	}
	if cfg.Metrics == nil {
		m, err := NewMetrics(prometheus.NewRegistry())
		if err != nil {
			t.Fatal(err)
		}
		cfg.Metrics = m
	}
	cfg.MinBackoff, cfg.MaxBackoff = 10*time.Millisecond, 50*time.Millisecond
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	s, err := NewSubscriber(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// runSub runs s until the returned stop is called or the test ends; stop waits for Run.
func runSub(t *testing.T, s *Subscriber) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func startPub(t *testing.T, cfg PublisherConfig) *Publisher {
	t.Helper()
	cfg.MinBackoff, cfg.MaxBackoff = 10*time.Millisecond, 50*time.Millisecond
	p, err := NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// hasSubscriber reports whether a subscriber is connected and subscribed.
func (p *Publisher) hasSubscriber() bool {
	p.sockMu.Lock()
	defer p.sockMu.Unlock()
	if p.sock == nil {
		return false
	}
	return len(p.sock.(zmq4.Topics).Topics()) > 0
}

// lose assigns the next sequence number and keeps the batch for replay without sending it,
// as if the network had dropped it.
func (p *Publisher) lose(t *testing.T, events []Event) {
	t.Helper()
	payload, err := p.format.Append(nil, Batch{Events: events, DPRank: p.cfg.DPRank, HasDPRank: true})
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.remember(replayed{seq: p.seq, payload: payload})
	p.seq++
}

func publish(t *testing.T, p *Publisher, evs ...Event) {
	t.Helper()
	if err := p.Publish(evs); err != nil {
		t.Fatal(err)
	}
}

func tcp(p interface{ String() string }) string { return "tcp://" + p.String() }

func TestConnectModeAppliesEventsFromABoundPublisher(t *testing.T) {
	cases := []struct {
		name   string
		rank   uint32
		format Format
	}{
		{"array encoding, integer hashes", 0, Format{}},
		{"map encoding, bytes hashes, dp rank 1", 1, Format{Map: true, BytesHashes: true}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := indexer.Worker{ID: "w0", DPRank: c.rank}
			pub := startPub(t, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, Topic: "kv@w0",
				MapEncoding: c.format.Map, BytesHashes: c.format.BytesHashes, DPRank: int(c.rank)})
			sink := newSink()
			sub := startSub(t, Config{Endpoint: tcp(pub.Addr()), Worker: w, Sink: sink})
			poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)

			var e engine
			first := e.stored(promptN(1))
			publish(t, pub, first, e.stored(promptN(2)))
			poll.Holds(t, 15*time.Second, "both prompts indexed", func() bool {
				return matched(sink.Index, w, promptN(1), "") == 2 && matched(sink.Index, w, promptN(2), "") == 2
			})
			publish(t, pub, remove(first.BlockHashes[1]))
			poll.Holds(t, 15*time.Second, "the removal", func() bool { return matched(sink.Index, w, promptN(1), "") == 1 })
			if got := value(t, sub.m.events); got != 3 {
				t.Fatalf("events applied %v, want 3", got)
			}
			if got := value(t, sub.m.lastSeq); got != 1 {
				t.Fatalf("last sequence %v, want 1", got)
			}
		})
	}
}

func TestBindModeTellsPublishersApartByTopic(t *testing.T) {
	sink := newSink()
	sub := startSub(t, Config{
		Endpoint:     "tcp://127.0.0.1:0",
		Mode:         Bind,
		TopicPattern: "kv@{host:port}@{model}",
		URLs:         map[string]string{"wa": "http://10.0.0.1:8000", "wb": "http://10.0.0.2:8000"},
		Topics:       map[string]indexer.Worker{"explicit": {ID: "wc"}},
		Sink:         sink,
	})
	poll.Holds(t, 15*time.Second, "the bind", func() bool { return sub.Addr() != nil })
	ep := tcp(sub.Addr())
	topics := map[string]string{"wa": "kv@10.0.0.1:8000@llama", "wb": "kv@10.0.0.2:8000@llama", "wc": "explicit", "": "kv@10.9.9.9:1@x"}
	pubs := map[string]*Publisher{}
	for id, topic := range topics {
		pubs[id] = startPub(t, PublisherConfig{Endpoint: ep, Topic: topic}) // a host: they connect
	}
	for id, p := range pubs {
		poll.Holds(t, 15*time.Second, "publisher "+id+" connected", p.hasSubscriber)
	}
	var e engine
	for i, id := range []string{"wa", "wb", "wc", ""} {
		publish(t, pubs[id], e.stored(promptN(i)))
	}
	for i, id := range []string{"wa", "wb", "wc"} {
		w := indexer.Worker{ID: id}
		poll.Holds(t, 15*time.Second, id+"'s prompt", func() bool { return matched(sink.Index, w, promptN(i), "") == 2 })
		for j := range 3 {
			if j != i && matched(sink.Index, w, promptN(j), "") != 0 {
				t.Fatalf("worker %s got prompt %d", id, j)
			}
		}
	}
	poll.Holds(t, 15*time.Second, "the unknown publisher counted", func() bool { return value(t, sub.m.unknownPublisher) == 1 })
	if got := len(sink.Workers()); got != 3 {
		t.Fatalf("index knows %d workers, want 3 (the unknown publisher must not be guessed)", got)
	}
}

func TestLateSubscriberRecoversThroughReplay(t *testing.T) {
	pub := startPub(t, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, ReplayEndpoint: "tcp://127.0.0.1:0"})
	var e engine
	for i := range 5 {
		publish(t, pub, e.stored(promptN(i))) // nobody listens: ZMQ drops these
	}
	sink := newSink()
	sub := startSub(t, Config{Endpoint: tcp(pub.Addr()), Replay: tcp(pub.ReplayAddr()), Worker: w0, Sink: sink})
	poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)
	publish(t, pub, e.stored(promptN(5)))
	for i := range 6 {
		poll.Holds(t, 15*time.Second, "every prompt", func() bool { return matched(sink.Index, w0, promptN(i), "") == 2 })
	}
	// The subscriber asks for the replay buffer as soon as it connects; the sixth message may
	// already be in it (then its live copy is skipped as a duplicate) or not yet.
	if got := value(t, sub.m.replayed); got != 5 && got != 6 {
		t.Fatalf("replayed %v messages, want the 5 it missed (or 6)", got)
	}
	if got := value(t, sub.m.replays.WithLabelValues(w0.String(), "ok")); got < 1 {
		t.Fatalf("ok replays %v, want at least 1", got)
	}
	if got := value(t, sub.m.restarts); got != 0 {
		t.Fatalf("a duplicate from the replay was taken for %v engine restarts", got)
	}
	if got := value(t, sub.m.gaps); got != 0 {
		t.Fatalf("a late join counted %v gaps", got)
	}
}

func TestGapInSequence(t *testing.T) {
	for _, withReplay := range []bool{true, false} {
		name := "counted without replay"
		if withReplay {
			name = "recovered through replay"
		}
		t.Run(name, func(t *testing.T) {
			cfg := PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true}
			if withReplay {
				cfg.ReplayEndpoint = "tcp://127.0.0.1:0"
			}
			pub := startPub(t, cfg)
			sink := newSink()
			scfg := Config{Endpoint: tcp(pub.Addr()), Worker: w0, Sink: sink}
			if withReplay {
				scfg.Replay = tcp(pub.ReplayAddr())
			}
			sub := startSub(t, scfg)
			poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)
			var e engine
			publish(t, pub, e.stored(promptN(0)))
			poll.Holds(t, 15*time.Second, "prompt 0", func() bool { return matched(sink.Index, w0, promptN(0), "") == 2 })
			pub.lose(t, []Event{e.stored(promptN(1))})
			publish(t, pub, e.stored(promptN(2)))
			poll.Holds(t, 15*time.Second, "prompt 2", func() bool { return matched(sink.Index, w0, promptN(2), "") == 2 })

			wantLost := 0
			if withReplay {
				wantLost = 2
			}
			if got := matched(sink.Index, w0, promptN(1), ""); got != wantLost {
				t.Fatalf("lost prompt has %d blocks indexed, want %d", got, wantLost)
			}
			if got := value(t, sub.m.gaps); got != 1 {
				t.Fatalf("gaps %v, want 1", got)
			}
			wantMissed := 1.0
			if withReplay {
				wantMissed = 0
			}
			if got := value(t, sub.m.missed); got != wantMissed {
				t.Fatalf("missed %v, want %v", got, wantMissed)
			}
		})
	}
}

// restartPublisher closes pub and binds a new one on the same port starting at startSeq.
func restartPublisher(t *testing.T, pub *Publisher, startSeq uint64) *Publisher {
	t.Helper()
	ep := tcp(pub.Addr())
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	return startPub(t, PublisherConfig{Endpoint: ep, Bind: true, StartSeq: startSeq})
}

func TestPublisherThatComesBackIsReconnectedAndKept(t *testing.T) {
	pub := startPub(t, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true})
	sink := newSink()
	sub := startSub(t, Config{Endpoint: tcp(pub.Addr()), Worker: w0, Sink: sink})
	poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)
	var e engine
	publish(t, pub, e.stored(promptN(0)))
	poll.Holds(t, 15*time.Second, "prompt 0", func() bool { return matched(sink.Index, w0, promptN(0), "") == 2 })

	pub = restartPublisher(t, pub, pub.NextSeq()) // the same engine, its sequence going on
	poll.Holds(t, 15*time.Second, "the lost connection noticed", func() bool {
		return value(t, sub.m.connects.WithLabelValues(tcp(pub.Addr()), "lost")) >= 1
	})
	poll.Holds(t, 15*time.Second, "the resubscription", pub.hasSubscriber)
	publish(t, pub, e.stored(promptN(1)))
	poll.Holds(t, 15*time.Second, "prompt 1", func() bool { return matched(sink.Index, w0, promptN(1), "") == 2 })
	if matched(sink.Index, w0, promptN(0), "") != 2 {
		t.Fatal("a reconnect purged the worker")
	}
	if got := value(t, sub.m.restarts); got != 0 {
		t.Fatalf("restarts %v, want 0", got)
	}
}

func TestRestartedPublisherPurgesTheWorker(t *testing.T) {
	pub := startPub(t, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true})
	sink := newSink()
	sub := startSub(t, Config{Endpoint: tcp(pub.Addr()), Worker: w0, Sink: sink})
	poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)
	var e engine
	publish(t, pub, e.stored(promptN(0)))
	publish(t, pub, e.stored(promptN(1)))
	poll.Holds(t, 15*time.Second, "prompt 1", func() bool { return matched(sink.Index, w0, promptN(1), "") == 2 })

	pub = restartPublisher(t, pub, 0) // a restarted engine counts from 0 again
	poll.Holds(t, 15*time.Second, "the resubscription", pub.hasSubscriber)
	var fresh engine
	publish(t, pub, fresh.stored(promptN(2)))
	poll.Holds(t, 15*time.Second, "prompt 2", func() bool { return matched(sink.Index, w0, promptN(2), "") == 2 })
	if got := value(t, sub.m.restarts); got != 1 {
		t.Fatalf("restarts %v, want 1", got)
	}
	for _, n := range []int{0, 1} {
		if matched(sink.Index, w0, promptN(n), "") != 0 {
			t.Fatalf("prompt %d of the old engine survived its restart", n)
		}
	}
	if got := sink.purged(); !slices.Equal(got, []indexer.Worker{w0}) {
		t.Fatalf("purged %v, want [w0]", got)
	}
}

func TestConnectingPublisherFindsARestartedSubscriber(t *testing.T) {
	run := func(ep string, sink Sink) (*Subscriber, context.CancelFunc, chan error) {
		m, _ := NewMetrics(nil)
		s, err := NewSubscriber(Config{Endpoint: ep, Mode: Bind, Topics: map[string]indexer.Worker{"t": w0},
			BlockSize: bs, Sink: sink, Metrics: m, Logger: testLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- s.Run(ctx) }()
		poll.Holds(t, 15*time.Second, "the bind", func() bool { return s.Addr() != nil })
		return s, cancel, done
	}
	sink1 := newSink()
	sub1, stop1, done1 := run("tcp://127.0.0.1:0", sink1)
	ep := tcp(sub1.Addr())
	pub := startPub(t, PublisherConfig{Endpoint: ep, Topic: "t"})
	poll.Holds(t, 15*time.Second, "the publisher connected", pub.hasSubscriber)
	var e engine
	publish(t, pub, e.stored(promptN(0)))
	poll.Holds(t, 15*time.Second, "prompt 0 at the first subscriber", func() bool { return matched(sink1.Index, w0, promptN(0), "") == 2 })
	stop1()
	if err := <-done1; err != nil {
		t.Fatal(err)
	}

	sink2 := newSink()
	_, stop2, done2 := run(ep, sink2)
	defer func() { stop2(); <-done2 }()
	n := 1
	poll.Holds(t, 15*time.Second, "a prompt at the second subscriber", func() bool {
		publish(t, pub, e.stored(promptN(n))) // until the publisher has reconnected
		n++
		return sink2.Blocks(w0) > 0
	})
}

func TestSilentWorkerIsReportedNotPurged(t *testing.T) {
	pub := startPub(t, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true})
	sink := newSink()
	sub := startSub(t, Config{Endpoint: tcp(pub.Addr()), Worker: w0, Sink: sink, SilenceAfter: 40 * time.Millisecond})
	poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)
	var e engine
	publish(t, pub, e.stored(promptN(0)))
	poll.Holds(t, 15*time.Second, "the silence gauge past the limit", func() bool { return value(t, sub.m.silence) > 0.04 })
	if matched(sink.Index, w0, promptN(0), "") != 2 {
		t.Fatal("a silent worker was purged")
	}
}

func TestBadMessagesAreDroppedByCauseAndTheStreamGoesOn(t *testing.T) {
	raw := zmq4.NewPub(context.Background())
	defer func() { _ = raw.Close() }()
	if err := raw.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	sink := newSink()
	sub := startSub(t, Config{Endpoint: tcp(raw.Addr()), Worker: w0, Sink: sink})
	poll.Holds(t, 15*time.Second, "the subscription", func() bool { return len(raw.(zmq4.Topics).Topics()) > 0 })
	seq := func(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }
	var e engine
	good, err := Encode(Batch{Events: []Event{e.stored(promptN(0))}}, false)
	if err != nil {
		t.Fatal(err)
	}
	bad := []zmq4.Msg{
		zmq4.NewMsgFrom([]byte("t"), good),                                             // two frames
		zmq4.NewMsgFrom([]byte("t"), []byte{1, 2, 3}, good),                            // short sequence
		zmq4.NewMsgFrom([]byte("t"), seq(0), []byte("garbage")),                        // not a batch
		zmq4.NewMsgFrom([]byte("t"), seq(0), append([]byte{0x92, 0xcb}, good[2:9]...)), // truncated
	}
	for _, m := range bad {
		if err := raw.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if err := raw.Send(zmq4.NewMsgFrom([]byte("t"), seq(0), good)); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 15*time.Second, "the good message", func() bool { return matched(sink.Index, w0, promptN(0), "") == 2 })
	for cause, want := range map[string]float64{"frame": 2, "wrong_type": 1, "malformed": 1} {
		if got := value(t, sub.m.decodeErrors.WithLabelValues(w0.String(), cause)); got != want {
			t.Errorf("dropped for %s: %v, want %v", cause, got, want)
		}
	}
}

// handleAll feeds messages straight to a subscriber that is not running, for the sequence
// rules without sockets.
func handleAll(t *testing.T, s *Subscriber, topic string, seqs []uint64, batches []Batch) {
	t.Helper()
	for i, n := range seqs {
		payload, err := Encode(batches[i], i%2 == 1)
		if err != nil {
			t.Fatal(err)
		}
		s.handle(context.Background(), zmq4.NewMsgFrom([]byte(topic), binary.BigEndian.AppendUint64(nil, n), payload))
	}
}

func TestSequenceRules(t *testing.T) {
	cases := []struct {
		name                   string
		seqs                   []uint64
		gaps, missed, restarts float64
		purges                 int
		indexed                []int // prompts (by message index) expected in the index at the end
		absent                 []int
	}{
		{"in order", []uint64{0, 1, 2}, 0, 0, 0, 0, []int{0, 1, 2}, nil},
		{"first message late is accepted", []uint64{7, 8}, 0, 0, 0, 0, []int{0, 1}, nil},
		{"gap counted and applied", []uint64{0, 3}, 1, 2, 0, 0, []int{0, 1}, nil},
		{"sequence back to 0 purges", []uint64{0, 1, 0}, 0, 0, 1, 1, []int{2}, []int{0, 1}},
		{"repeated sequence purges", []uint64{4, 4}, 0, 0, 1, 1, []int{1}, []int{0}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sink := newSink()
			m, _ := NewMetrics(nil)
			s, err := NewSubscriber(Config{Endpoint: "tcp://127.0.0.1:1", Worker: w0, BlockSize: bs, Sink: sink, Metrics: m})
			if err != nil {
				t.Fatal(err)
			}
			var e engine
			batches := make([]Batch, len(c.seqs))
			for i := range batches {
				batches[i] = Batch{Events: []Event{e.stored(promptN(i))}}
			}
			handleAll(t, s, "", c.seqs, batches)
			for name, pair := range map[string][2]float64{
				"gaps": {value(t, m.gaps), c.gaps}, "missed": {value(t, m.missed), c.missed},
				"restarts": {value(t, m.restarts), c.restarts},
			} {
				if pair[0] != pair[1] {
					t.Errorf("%s %v, want %v", name, pair[0], pair[1])
				}
			}
			if got := len(sink.purged()); got != c.purges {
				t.Errorf("purges %d, want %d", got, c.purges)
			}
			for _, i := range c.indexed {
				if matched(sink.Index, w0, promptN(i), "") != 2 {
					t.Errorf("prompt %d missing", i)
				}
			}
			for _, i := range c.absent {
				if matched(sink.Index, w0, promptN(i), "") != 0 {
					t.Errorf("prompt %d should be gone", i)
				}
			}
			if got := value(t, m.lastSeq); got != float64(c.seqs[len(c.seqs)-1]) {
				t.Errorf("last sequence %v", got)
			}
		})
	}
}

func TestBindModeTakesTheRankFromThePayload(t *testing.T) {
	sink := newSink()
	m, _ := NewMetrics(nil)
	s, err := NewSubscriber(Config{Endpoint: "tcp://127.0.0.1:1", Mode: Bind, BlockSize: bs, Sink: sink, Metrics: m,
		Topics: map[string]indexer.Worker{"kv@a": {ID: "wa"}}})
	if err != nil {
		t.Fatal(err)
	}
	var e engine
	// Ranks 0 and 2 of one worker share a topic; each has its own sequence.
	handleAll(t, s, "kv@a", []uint64{0, 0, 1}, []Batch{
		{Events: []Event{e.stored(promptN(0))}, HasDPRank: true, DPRank: 0},
		{Events: []Event{e.stored(promptN(1))}, HasDPRank: true, DPRank: 2},
		{Events: []Event{e.stored(promptN(2))}, HasDPRank: true, DPRank: 2},
	})
	r0, r2 := indexer.Worker{ID: "wa"}, indexer.Worker{ID: "wa", DPRank: 2}
	if matched(sink.Index, r0, promptN(0), "") != 2 || matched(sink.Index, r2, promptN(1), "") != 2 ||
		matched(sink.Index, r2, promptN(2), "") != 2 || matched(sink.Index, r0, promptN(1), "") != 0 {
		t.Fatal("events landed on the wrong rank")
	}
	if got := value(t, m.restarts); got != 0 {
		t.Fatalf("interleaved ranks read as restarts: %v", got)
	}
}

func TestBindModeOnARankPortGivesUnrankedBatchesThatRank(t *testing.T) {
	sink := newSink()
	s, err := NewSubscriber(Config{Endpoint: "tcp://127.0.0.1:1", Mode: Bind, BlockSize: bs, Sink: sink, Rank: 3,
		Topics: map[string]indexer.Worker{"kv@a": {ID: "wa"}, "kv@b": {ID: "wb", DPRank: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	var e engine
	// An older vLLM's batch says no rank: it is the rank of the port it came to. A batch that
	// says one, or a topic mapped to one, keeps its own.
	handleAll(t, s, "kv@a", []uint64{0, 0}, []Batch{
		{Events: []Event{e.stored(promptN(0))}},
		{Events: []Event{e.stored(promptN(1))}, HasDPRank: true, DPRank: 0},
	})
	handleAll(t, s, "kv@b", []uint64{0}, []Batch{{Events: []Event{e.stored(promptN(2))}}})
	for _, c := range []struct {
		w      indexer.Worker
		prompt int
	}{{indexer.Worker{ID: "wa", DPRank: 3}, 0}, {indexer.Worker{ID: "wa"}, 1}, {indexer.Worker{ID: "wb", DPRank: 1}, 2}} {
		if got := matched(sink.Index, c.w, promptN(c.prompt), ""); got != 2 {
			t.Errorf("prompt %d on %s: %d blocks, want 2", c.prompt, c.w, got)
		}
	}
}

func TestNewSubscriberRejectsBadConfig(t *testing.T) {
	sink := newSink()
	cases := map[string]Config{
		"no endpoint":     {Worker: w0, BlockSize: bs, Sink: sink},
		"no sink":         {Endpoint: "tcp://127.0.0.1:1", Worker: w0, BlockSize: bs},
		"no block size":   {Endpoint: "tcp://127.0.0.1:1", Worker: w0, Sink: sink},
		"connect, no id":  {Endpoint: "tcp://127.0.0.1:1", BlockSize: bs, Sink: sink},
		"bind, no topics": {Endpoint: "tcp://127.0.0.1:1", Mode: Bind, BlockSize: bs, Sink: sink},
		"bad pattern":     {Endpoint: "tcp://127.0.0.1:1", Mode: Bind, BlockSize: bs, Sink: sink, TopicPattern: "kv@{model}"},
		"bad url":         {Endpoint: "tcp://127.0.0.1:1", Mode: Bind, BlockSize: bs, Sink: sink, TopicPattern: "{host:port}", URLs: map[string]string{"w": "::"}},
		"unknown mode":    {Endpoint: "tcp://127.0.0.1:1", Mode: 7, Worker: w0, BlockSize: bs, Sink: sink},
		"bind, bad rank":  {Endpoint: "tcp://127.0.0.1:1", Mode: Bind, BlockSize: bs, Sink: sink, Topics: map[string]indexer.Worker{"t": w0}, Rank: -1},
	}
	for name, cfg := range cases {
		if _, err := NewSubscriber(cfg); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestTopicPattern(t *testing.T) {
	cases := []struct {
		pattern, topic, want string
		ok                   bool
	}{
		{"kv@{host:port}@{model}", "kv@10.0.0.1:8000@llama-3", "10.0.0.1:8000", true},
		{"kv@{host:port}@{model}", "kv@[::1]:8000@m", "[::1]:8000", true},
		{"kv@{host:port}@{model}", "kv@10.0.0.1:8000", "", false},
		{"kv@{host:port}@{model}", "xx@10.0.0.1:8000@m", "", false},
		{"kv@{host:port}@{model}", "kv@@m", "", false},
		{"{host:port}", "h:1", "h:1", true},
		{"{model}/{host:port}/kv", "m/h:1/kv", "h:1", true},
		{"{model}/{host:port}/kv", "m/h:1/kvx", "", false},
	}
	for _, c := range cases {
		p, err := parseTopicPattern(c.pattern)
		if err != nil {
			t.Fatalf("%q: %v", c.pattern, err)
		}
		got, ok := p.match(c.topic)
		if got != c.want || ok != c.ok {
			t.Errorf("%q on %q: %q %v, want %q %v", c.pattern, c.topic, got, ok, c.want, c.ok)
		}
	}
	for _, bad := range []string{"kv", "kv@{host:port", "kv@host:port}", "{host:port}{model}", "{host:port}@{host:port}"} {
		if _, err := parseTopicPattern(bad); err == nil {
			t.Errorf("pattern %q accepted", bad)
		}
	}
}

func TestOffsetPortAndRankEndpoint(t *testing.T) {
	cases := []struct {
		ep   string
		rank int
		want string
		ok   bool
	}{
		{"tcp://*:5557", 0, "tcp://*:5557", true},
		{"tcp://*:5557", 2, "tcp://*:5559", true},
		{"tcp://10.0.0.1:5557", 1, "tcp://10.0.0.1:5558", true},
		{"tcp://[::1]:5557", 1, "tcp://[::1]:5558", true},
		{"ipc:///tmp/kv", 3, "ipc:///tmp/kv", true},
		{"tcp://h:65535", 1, "", false},
		{"tcp://h", 1, "", false},
	}
	for _, c := range cases {
		got, err := OffsetPort(c.ep, c.rank)
		if (err == nil) != c.ok || (c.ok && got != c.want) {
			t.Errorf("OffsetPort(%q, %d) = %q, %v; want %q", c.ep, c.rank, got, err, c.want)
		}
	}
	if got, _ := rankEndpoint("tcp://127.0.0.1:0", 3); got != "tcp://127.0.0.1:0" {
		t.Errorf("an ephemeral port was offset: %q", got)
	}
}

func TestPublisherRingKeepsTheNewest(t *testing.T) {
	pub := startPub(t, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, ReplayEndpoint: "tcp://127.0.0.1:0",
		ReplayBuffer: 3, StartSeq: 10})
	for range 5 {
		publish(t, pub, Event{Kind: indexer.Cleared})
	}
	var seqs []uint64
	for _, r := range pub.since(0) {
		seqs = append(seqs, r.seq)
	}
	if !slices.Equal(seqs, []uint64{12, 13, 14}) {
		t.Fatalf("ring holds %v, want [12 13 14]", seqs)
	}
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(nil); err != ErrClosed {
		t.Fatalf("Publish after Close: %v", err)
	}
}
