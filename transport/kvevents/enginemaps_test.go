package kvevents

import (
	"bytes"
	"context"
	"errors"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// The subscriber is what cmd/ hands cluster as its EngineMaps (this package may not import
// cluster, so the interface is spelled out).
var _ interface {
	SnapshotEngineMaps(ctx context.Context) (map[indexer.Worker]map[uint64]uint64, error)
	RestoreEngineMaps(maps map[indexer.Worker]map[uint64]uint64) error
} = (*Subscriber)(nil)

// checkRefs fails unless tr's refs count, for every router key, exactly the engine blocks
// mapped to it: the invariant that makes a block leave the index with its last copy.
func checkRefs(t *testing.T, tr *Translator) {
	t.Helper()
	want := map[uint64]uint64{}
	tr.keys.each(func(_, v uint64) { want[v]++ })
	got := map[uint64]uint64{}
	tr.refs.each(func(k, n uint64) { got[k] = n })
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("refs %v, want %v (counted from the keys)", got, want)
	}
}

// engineMapsCase is one way events reach a subscriber, for tests through real sockets.
type engineMapsCase struct {
	name   string
	worker indexer.Worker // the worker the events are keyed by
	sub    Config         // Endpoint and Sink are filled in
	pub    PublisherConfig
}

var engineMapsCases = []engineMapsCase{
	{"connect, array encoding", w0, Config{Worker: w0}, PublisherConfig{Topic: "kv"}},
	{"connect, map encoding, bytes hashes, dp rank 1", indexer.Worker{ID: "w1", DPRank: 1},
		Config{Worker: indexer.Worker{ID: "w1", DPRank: 1}}, PublisherConfig{MapEncoding: true, BytesHashes: true, DPRank: 1}},
	{"bind, topic table", indexer.Worker{ID: "wt"},
		Config{Mode: Bind, Topics: map[string]indexer.Worker{"kv@t": {ID: "wt"}}}, PublisherConfig{Topic: "kv@t"}},
	{"bind, topic pattern, dp rank 2 from the payload", indexer.Worker{ID: "wp", DPRank: 2},
		Config{Mode: Bind, TopicPattern: "kv@{host:port}@{model}", URLs: map[string]string{"wp": "http://10.0.0.7:8000"}},
		PublisherConfig{Topic: "kv@10.0.0.7:8000@m", MapEncoding: true, DPRank: 2}},
}

// start connects a fresh publisher and a subscriber feeding sink; before runs on the
// subscriber before Run starts.
func (c engineMapsCase) start(t *testing.T, sink Sink, before func(*Subscriber)) (*Subscriber, *Publisher, func()) {
	t.Helper()
	cfg, pcfg := c.sub, c.pub
	cfg.Sink = sink
	if cfg.Mode == Connect {
		pcfg.Endpoint, pcfg.Bind = "tcp://127.0.0.1:0", true
		pub := startPub(t, pcfg)
		cfg.Endpoint = tcp(pub.Addr())
		s := newTestSub(t, cfg)
		before(s)
		stop := runSub(t, s)
		poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)
		return s, pub, stop
	}
	cfg.Endpoint = "tcp://127.0.0.1:0"
	s := newTestSub(t, cfg)
	before(s)
	stop := runSub(t, s)
	poll.Holds(t, 15*time.Second, "the bind", func() bool { return s.Addr() != nil })
	// The publisher moves its port up by its rank, as vLLM does; aim below to land on ours.
	ep, err := OffsetPort(tcp(s.Addr()), -pcfg.DPRank)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.Endpoint = ep
	pub := startPub(t, pcfg)
	poll.Holds(t, 15*time.Second, "the publisher connected", pub.hasSubscriber)
	return s, pub, stop
}

func TestEngineMapsTravelWithTheIndexSnapshot(t *testing.T) {
	for _, c := range engineMapsCases {
		for _, restore := range []bool{true, false} {
			name := c.name + ", restored"
			if !restore {
				name = c.name + ", not restored (the failure the maps prevent)"
			}
			t.Run(name, func(t *testing.T) {
				w := c.worker
				// Replica A sees the engine store three prompts, and offload the first to CPU.
				sinkA := newSink()
				a, pubA, stopA := c.start(t, sinkA, func(*Subscriber) {})
				var e engine
				p0, p1, p2 := e.stored(promptN(0)), e.stored(promptN(1)), e.stored(promptN(2))
				cpu := p0
				cpu.Medium = "CPU" // the same engine hashes: the medium's salt keeps them apart
				publish(t, pubA, p0, p1, p2, cpu)
				poll.Holds(t, 15*time.Second, "A applied the events", func() bool { return value(t, a.m.events) == 4 })
				stopA() // a stopped subscriber is read directly
				snap, err := a.SnapshotEngineMaps(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if len(snap) != 1 || len(snap[w]) != 8 {
					t.Fatalf("snapshot %v, want the 8 blocks of %s", snap, w)
				}
				var idx bytes.Buffer
				if err := sinkA.WriteSnapshot(&idx); err != nil {
					t.Fatal(err)
				}

				// Replica B starts: it loads A's index snapshot and, unless not restored, the maps.
				sinkB := newSink()
				if err := sinkB.ReadSnapshot(&idx); err != nil {
					t.Fatal(err)
				}
				b, pubB, _ := c.start(t, sinkB, func(b *Subscriber) {
					if !restore {
						return
					}
					if err := b.RestoreEngineMaps(snap); err != nil {
						t.Fatal(err)
					}
					got, err := b.SnapshotEngineMaps(context.Background()) // Run not started
					if err != nil {
						t.Fatal(err)
					}
					if !reflect.DeepEqual(got, snap) {
						t.Fatalf("restored maps %v, want %v", got, snap)
					}
					checkRefs(t, b.streams[w].tr)
				})

				// The engine evicts blocks stored before B started.
				rmCPU := remove(p0.BlockHashes...)
				rmCPU.Medium = "CPU"
				publish(t, pubB, remove(p1.BlockHashes[1]), remove(p0.BlockHashes...), rmCPU)
				poll.Holds(t, 15*time.Second, "B applied the removals", func() bool { return value(t, b.m.events) == 3 })
				want := map[int]int{0: 0, 1: 1, 2: 2} // prompt -> blocks left in B's index
				unknown := 0.0
				if !restore {
					want = map[int]int{0: 2, 1: 2, 2: 2} // stale blocks stay, routing to them
					unknown = 5
				}
				for n, blocks := range want {
					if got := matched(sinkB.Index, w, promptN(n), ""); got != blocks {
						t.Errorf("prompt %d: B's index holds %d blocks, want %d", n, got, blocks)
					}
				}
				if got := value(t, b.m.unknownRemoved); got != unknown {
					t.Errorf("unresolved removals %v, want %v", got, unknown)
				}
			})
		}
	}
}

func TestRestoreEngineMapsMergesWithinTheCap(t *testing.T) {
	tokens := seqTokens(0, 2*bs)
	rk := indexer.SequenceHashes(tokens, bs, indexer.BaseSeed, nil) // router keys of engine blocks 1, 2
	live := []Event{store([]EngineHash{1, 2}, 0, false, tokens)}
	// The live blocks as the subscriber keys them: integer hashes 1 and 2, as decoded.
	k1, k2 := uint64(UintHash(1)), uint64(UintHash(2))
	wa3, wb1 := indexer.Worker{ID: "wa", DPRank: 3}, indexer.Worker{ID: "wb", DPRank: 1}
	bind := Config{Mode: Bind, Topics: map[string]indexer.Worker{"t": {ID: "wa"}},
		TopicPattern: "kv@{host:port}@{model}", URLs: map[string]string{"wb": "http://10.0.0.2:8000"}}
	cases := []struct {
		name    string
		cfg     Config
		live    []Event // applied (on topic "t") before the restore
		maps    map[indexer.Worker]map[uint64]uint64
		wantLen map[indexer.Worker]int               // every worker with a map afterwards
		wantHas map[indexer.Worker]map[uint64]uint64 // entries that must be there
		dropped float64
	}{
		{
			name:    "into an empty translator",
			cfg:     Config{Worker: w0},
			maps:    map[indexer.Worker]map[uint64]uint64{w0: {10: 100, 11: 100, 12: 101}},
			wantLen: map[indexer.Worker]int{w0: 3},
			wantHas: map[indexer.Worker]map[uint64]uint64{w0: {10: 100, 11: 100, 12: 101}},
		},
		{
			name:    "a live entry keeps its key",
			cfg:     Config{Worker: w0},
			live:    live,
			maps:    map[indexer.Worker]map[uint64]uint64{w0: {k1: 999, 3: rk[0]}},
			wantLen: map[indexer.Worker]int{w0: 3},
			wantHas: map[indexer.Worker]map[uint64]uint64{w0: {k1: rk[0], k2: rk[1], 3: rk[0]}},
		},
		{
			name:    "entries past the cap are dropped and counted",
			cfg:     Config{Worker: w0, MaxBlocks: 3},
			live:    live,
			maps:    map[indexer.Worker]map[uint64]uint64{w0: {10: 100, 11: 101, 12: 102}},
			wantLen: map[indexer.Worker]int{w0: 3},
			wantHas: map[indexer.Worker]map[uint64]uint64{w0: {k1: rk[0], k2: rk[1]}},
			dropped: 2,
		},
		{
			name: "connect mode ignores other workers and ranks",
			cfg:  Config{Worker: w0},
			maps: map[indexer.Worker]map[uint64]uint64{
				w0: {5: 50}, {ID: "w0", DPRank: 1}: {6: 60}, {ID: "other"}: {7: 70}},
			wantLen: map[indexer.Worker]int{w0: 1},
		},
		{
			name: "bind mode takes every rank of the IDs a topic can name",
			cfg:  bind,
			maps: map[indexer.Worker]map[uint64]uint64{
				{ID: "wa"}: {1: 1}, wa3: {2: 2}, wb1: {3: 3}, {ID: "wz"}: {4: 4}},
			wantLen: map[indexer.Worker]int{{ID: "wa"}: 1, wa3: 1, wb1: 1},
		},
		{
			name: "bind mode without a pattern does not take the URLs' IDs",
			cfg:  Config{Mode: Bind, Topics: bind.Topics, URLs: bind.URLs},
			maps: map[indexer.Worker]map[uint64]uint64{
				{ID: "wa"}: {1: 1}, {ID: "wb"}: {3: 3}},
			wantLen: map[indexer.Worker]int{{ID: "wa"}: 1},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := c.cfg
			cfg.Endpoint, cfg.Sink = "tcp://127.0.0.1:1", newSink()
			s := newTestSub(t, cfg)
			if len(c.live) > 0 {
				handleAll(t, s, "t", []uint64{0}, []Batch{{Events: c.live}})
			}
			if err := s.RestoreEngineMaps(c.maps); err != nil {
				t.Fatal(err)
			}
			got, err := s.SnapshotEngineMaps(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			gotLen := map[indexer.Worker]int{}
			for w, m := range got {
				gotLen[w] = len(m)
				for k, v := range c.wantHas[w] {
					if m[k] != v {
						t.Errorf("worker %s: engine block %d -> %d, want %d", w, k, m[k], v)
					}
				}
			}
			if !reflect.DeepEqual(gotLen, c.wantLen) {
				t.Errorf("blocks per worker %v, want %v", gotLen, c.wantLen)
			}
			for _, st := range s.streams {
				checkRefs(t, st.tr)
			}
			if got := value(t, s.m.overCapacity); got != c.dropped {
				t.Errorf("over capacity %v, want %v", got, c.dropped)
			}
		})
	}
}

func TestSnapshotEngineMapsWhileEventsFlow(t *testing.T) {
	pub := startPub(t, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, ReplayEndpoint: "tcp://127.0.0.1:0"})
	sink := newSink()
	sub := startSub(t, Config{Endpoint: tcp(pub.Addr()), Replay: tcp(pub.ReplayAddr()), Worker: w0, Sink: sink})
	poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)

	// Batch i stores prompt i (two blocks) and removes prompt i-window: a consistent copy
	// holds both blocks of a prompt or neither.
	const n, window = 300, 10
	var e engine
	prompts := make([]Event, n)
	partner := map[uint64]uint64{} // by the keys the subscriber holds: the hashes as decoded
	for i := range prompts {
		prompts[i] = e.stored(promptN(i))
		h0, h1 := uint64(UintHash(uint64(prompts[i].BlockHashes[0]))), uint64(UintHash(uint64(prompts[i].BlockHashes[1])))
		partner[h0], partner[h1] = h1, h0
	}
	// Entries restored meanwhile, with engine hashes no prompt uses.
	extra := map[uint64]uint64{}
	for k := uint64(1); len(extra) < 50; k++ {
		if _, used := partner[k]; !used {
			extra[k] = 7
		}
	}

	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := range n {
			evs := []Event{prompts[i]}
			if i >= window {
				evs = append(evs, remove(prompts[i-window].BlockHashes...))
			}
			if err := pub.Publish(evs); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	go func() {
		defer wg.Done()
		for k, v := range extra {
			m := map[indexer.Worker]map[uint64]uint64{w0: {k: v}, {ID: "not-served"}: {k: v}}
			if err := sub.RestoreEngineMaps(m); err != nil {
				t.Error(err)
				return
			}
		}
	}()

	ctx := context.Background()
	deadline := time.Now().Add(15 * time.Second)
	snapshots, midway := 0, 0
	for {
		maps, err := sub.SnapshotEngineMaps(ctx)
		snapshots++
		if seq := value(t, sub.m.lastSeq); seq > 0 && seq < n-1 {
			midway++
		}
		if err != nil {
			t.Fatal(err)
		}
		for k := range maps[w0] {
			p, ok := partner[k]
			if !ok {
				if _, ok := extra[k]; !ok {
					t.Fatalf("snapshot holds engine block %d, never stored", k)
				}
				continue
			}
			if _, ok := maps[w0][p]; !ok {
				t.Fatalf("snapshot holds engine block %d without %d, stored in the same batch", k, p)
			}
		}
		if len(maps) > 1 {
			t.Fatalf("snapshot has workers %v, want only %s", maps, w0)
		}
		if value(t, sub.m.lastSeq) == n-1 && len(maps[w0]) == 2*window+len(extra) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out: last sequence %v, %d blocks", value(t, sub.m.lastSeq), len(maps[w0]))
		}
	}
	wg.Wait()
	t.Logf("%d snapshots, %d of them while the events flowed", snapshots, midway)

	maps, err := sub.SnapshotEngineMaps(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := map[uint64]uint64{}
	for k, v := range extra {
		want[k] = v
	}
	for i := n - window; i < n; i++ {
		rk := indexer.SequenceHashes(promptN(i), bs, indexer.BaseSeed, nil)
		for j, h := range prompts[i].BlockHashes {
			want[uint64(UintHash(uint64(h)))] = rk[j]
		}
	}
	if !reflect.DeepEqual(maps[w0], want) {
		t.Fatalf("final map of %d blocks differs from the %d expected", len(maps[w0]), len(want))
	}
	sub.acquire() // Run is still going: look inside under its lock
	checkRefs(t, sub.streams[w0].tr)
	sub.release()
	if matched(sink.Index, w0, promptN(n-1), "") != 2 || matched(sink.Index, w0, promptN(0), "") != 0 {
		t.Fatal("the index does not follow the events")
	}
}

// blockingSink holds the run loop inside Apply until released, like a replay that takes long.
type blockingSink struct {
	Sink
	entered, release chan struct{}
	once             sync.Once
}

func (b *blockingSink) Apply(ev indexer.Event) error {
	b.once.Do(func() { close(b.entered) })
	<-b.release
	return b.Sink.Apply(ev)
}

func TestSnapshotEngineMapsHonoursTheContext(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	pub := startPub(t, PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true})
	sink := &blockingSink{Sink: newSink(), entered: make(chan struct{}), release: make(chan struct{})}
	s := newTestSub(t, Config{Endpoint: tcp(pub.Addr()), Worker: w0, Sink: sink})

	// Run not started: read directly.
	if m, err := s.SnapshotEngineMaps(context.Background()); err != nil || len(m) != 0 {
		t.Fatalf("before Run: %v, %v; want an empty snapshot", m, err)
	}
	if _, err := s.SnapshotEngineMaps(cancelled); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled context before Run: %v", err)
	}

	stop := runSub(t, s)
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(sink.release) }) }
	t.Cleanup(release) // runs before runSub's cleanup, which waits for Run
	poll.Holds(t, 15*time.Second, "the subscription", pub.hasSubscriber)
	var e engine
	publish(t, pub, e.stored(promptN(0)))
	select {
	case <-sink.entered:
	case <-time.After(15 * time.Second):
		t.Fatal("timed out waiting for the run loop to reach the sink")
	}

	// The run loop is busy with a message: a snapshot must give up with its context.
	if _, err := s.SnapshotEngineMaps(cancelled); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled context while Run is busy: %v", err)
	}
	ctx, cancelWait := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := s.SnapshotEngineMaps(ctx)
		errc <- err
	}()
	cancelWait()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("context cancelled while waiting: %v", err)
	}

	release()
	m, err := s.SnapshotEngineMaps(context.Background())
	if err != nil || len(m[w0]) != 2 {
		t.Fatalf("after the message: %v, %v; want its 2 blocks", m, err)
	}
	stop()
	if m, err := s.SnapshotEngineMaps(context.Background()); err != nil || len(m[w0]) != 2 {
		t.Fatalf("after Run stopped: %v, %v; want 2 blocks", m, err)
	}
}
