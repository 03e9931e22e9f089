package hints

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// threeReplicas starts three sharing replicas on one in-memory network.
func threeReplicas(t *testing.T, opts shareOptions) (*fakeNet, []*shareReplica) {
	fn := newFakeNet()
	rs := make([]*shareReplica, 3)
	for i := range rs {
		rs[i] = newShareReplica(t, fn, fmt.Sprintf("r%d", i), opts)
	}
	return fn, rs
}

// routeAndCommit routes a prompt on r as a request would, and commits it (the worker
// answered), which records the decision.
func routeAndCommit(t *testing.T, r *shareReplica, seq []uint64) routing.Decision {
	t.Helper()
	ctx := context.Background()
	a, err := r.router.Route(ctx, &routing.Request{PromptTokens: 16 * len(seq), Hashes: seq, DPRank: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Finish()
	if _, err := a.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return a.Decision()
}

// TestDecisionsOnOneReplicaReachTheOthers: a decision made on one replica shows in the
// others' FindMatches, so a follow-up of the same prompt on another replica goes to the
// same worker; the follow-up itself travels as its new blocks only.
func TestDecisionsOnOneReplicaReachTheOthers(t *testing.T) {
	_, rs := threeReplicas(t, shareOptions{})
	prompt := sharePrompt(1, 64)
	d := routeAndCommit(t, rs[0], prompt)
	w := d.Target.Worker
	poll.Until(t, 5*time.Second, func() error {
		for _, r := range rs[1:] {
			if got := r.overlap(prompt, w); got != len(prompt) {
				return fmt.Errorf("%s credits %s with %d of %d blocks", r.name, w, got, len(prompt))
			}
		}
		return nil
	})

	// The next turn of the conversation lands on another replica: it follows the prefix.
	next := append(append([]uint64(nil), prompt...), sharePrompt(2, 16)...)
	before := rs[1].metrics.Stats().DecisionBlocksOut
	d2 := routeAndCommit(t, rs[1], next)
	if d2.Target.Worker != w || d2.Overlap != len(prompt) {
		t.Fatalf("follow-up on r1 went to %s with overlap %d; want %s with %d", d2.Target.Worker, d2.Overlap, w, len(prompt))
	}
	poll.Until(t, 5*time.Second, func() error {
		for _, r := range []*shareReplica{rs[0], rs[2]} {
			if got := r.overlap(next, w); got != len(next) {
				return fmt.Errorf("%s credits %s with %d of %d blocks", r.name, w, got, len(next))
			}
		}
		return nil
	})
	// r1 had the 64-block prefix from r0, not from its own sending, so it sends the whole
	// chain once; a third turn on r1 then sends only its 16 new blocks to each peer.
	third := append(append([]uint64(nil), next...), sharePrompt(3, 16)...)
	poll.Until(t, 5*time.Second, func() error {
		if got := rs[1].metrics.Stats().DecisionBlocksOut - before; got != 2*80 {
			return fmt.Errorf("r1 sent %d blocks for its first decision, want 160", got)
		}
		return nil
	})
	routeAndCommit(t, rs[1], third)
	poll.Until(t, 5*time.Second, func() error {
		if got := rs[1].metrics.Stats().DecisionBlocksOut - before; got != 2*80+2*16 {
			return fmt.Errorf("r1 sent %d blocks in all, want 192 (the third turn's 16 new blocks to each of 2 peers)", got)
		}
		if got := rs[2].overlap(third, w); got != len(third) {
			return fmt.Errorf("r2 credits %s with %d of %d blocks", w, got, len(third))
		}
		return nil
	})
}

// TestLoadPublishedByOneChangesAnothersChoice: r1 sees no overlap anywhere and has no load
// of its own, so it would spread requests over all workers; once r0 publishes that w0 is
// busy with its requests, r1 stops choosing w0.
func TestLoadPublishedByOneChangesAnothersChoice(t *testing.T) {
	_, rs := threeReplicas(t, shareOptions{loadTTL: time.Minute})
	w0 := indexer.Worker{ID: "w0"}
	choose := func() map[string]int {
		got := map[string]int{}
		for i := range 60 {
			a, err := rs[1].router.Route(context.Background(), &routing.Request{
				PromptTokens: 256, Hashes: sharePrompt(uint64(100+i), 16), DPRank: -1, QueryOnly: true,
			})
			if err != nil {
				t.Fatal(err)
			}
			got[a.Decision().Target.Worker.ID]++
		}
		return got
	}
	if got := choose(); got["w0"] == 0 {
		t.Fatalf("before any load, r1 never chose w0: %v", got)
	}
	for range 4 {
		tk := rs[0].tracker.Start(w0, 2048, 128)
		defer tk.Finish()
	}
	poll.Until(t, 5*time.Second, func() error {
		if got := rs[1].remote.Remote(w0); got.Requests != 4 {
			return fmt.Errorf("r1 sees %+v of r0's load on w0", got)
		}
		return nil
	})
	if got := choose(); got["w0"] != 0 {
		t.Fatalf("r1 still sends to w0, busy with r0's requests: %v", got)
	}
}

// TestKilledReplicasLoadShareExpires: a replica that dies stops counting in the others'
// load, whether it vanishes silently (its shares expire after the TTL) or the gossip layer
// declares it dead (its shares go at once).
func TestKilledReplicasLoadShareExpires(t *testing.T) {
	tests := []struct {
		name    string
		loadTTL time.Duration
		declare bool
	}{
		{"silent crash: the TTL expires it", 200 * time.Millisecond, false},
		{"declared dead: forgotten at once", time.Hour, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fn, rs := threeReplicas(t, shareOptions{loadTTL: tc.loadTTL})
			w1 := indexer.Worker{ID: "w1"}
			tk := rs[0].tracker.Start(w1, 512, 32)
			defer tk.Finish()
			poll.Until(t, 5*time.Second, func() error {
				for _, r := range rs[1:] {
					if got := r.remote.Load(w1); got.Requests != 1 {
						return fmt.Errorf("%s sees load %+v on w1", r.name, got)
					}
				}
				return nil
			})
			// kill -9: r0 sends nothing more, and, unless declared, stays a member.
			rs[0].stop()
			fn.setDrop(func(from, _ string, _ gossip.Kind) bool { return from == "r0" })
			if tc.declare {
				fn.kill("r0")
			}
			poll.Until(t, 5*time.Second, func() error {
				for _, r := range rs[1:] {
					if got := r.remote.Load(w1); got != (routing.Load{}) {
						return fmt.Errorf("%s still counts %+v on w1", r.name, got)
					}
				}
				return nil
			})
		})
	}
}

// fakeEngineMaps stands in for the KV event translators' maps.
type fakeEngineMaps struct {
	mu   sync.Mutex
	maps map[indexer.Worker]map[uint64]uint64
}

func (f *fakeEngineMaps) SnapshotEngineMaps(context.Context) (map[indexer.Worker]map[uint64]uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.maps, nil
}

func (f *fakeEngineMaps) RestoreEngineMaps(m map[indexer.Worker]map[uint64]uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.maps = m
	return nil
}

// warmSync returns a warm IndexSync over the indexes (the first replica: no peers).
func warmSync(t *testing.T, self string, approx, precise *indexer.Index, maps EngineMaps) *IndexSync {
	t.Helper()
	s, err := NewIndexSync(IndexSyncConfig{
		Self: self, Approx: approx, Precise: precise, EngineMaps: maps,
		Peers: func() []SnapshotPeer { return nil }, DiscoveryWait: time.Millisecond,
		Fetch: func(context.Context, string) ([]byte, error) { return nil, errors.New("unused") },
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Run(context.Background()); err != nil || !s.Warm() {
		t.Fatalf("a replica without peers should start warm: %v", err)
	}
	return s
}

// TestRestartedReplicaIsWarmBeforeReady: a replica that restarts with empty indexes pulls
// a peer's snapshot over real gRPC before its readiness hook passes, so at the first
// moment it would report ready it already predicts an overlap for a known prefix.
func TestRestartedReplicaIsWarmBeforeReady(t *testing.T) {
	fn, rs := threeReplicas(t, shareOptions{})
	prompt := sharePrompt(7, 40)
	w := routeAndCommit(t, rs[0], prompt).Target.Worker
	poll.Until(t, 5*time.Second, func() error {
		if got := rs[1].overlap(prompt, w); got != len(prompt) {
			return fmt.Errorf("r1 credits %s with %d blocks", w, got)
		}
		return nil
	})
	// Precise mode too: each replica's events-fed index and engine-hash maps (the same
	// events reach every replica).
	addrs := map[string]string{}
	for _, r := range rs[:2] {
		precise := indexer.New(indexer.Options{})
		precise.Store(indexer.Worker{ID: "w2"}, sharePrompt(8, 24))
		maps := &fakeEngineMaps{maps: map[indexer.Worker]map[uint64]uint64{{ID: "w2"}: {0xe1: 0xa1, 0xe2: 0xa2}}}
		addrs[r.name] = servePeer(t, warmSync(t, r.name, r.index, precise, maps))
	}

	// r2 restarts: new process, new indexes, same name.
	rs[2].stop()
	fn.kill("r2")
	msgr := fn.join("r2", "")
	approx2, precise2, maps2 := indexer.New(indexer.Options{TTL: time.Minute}), indexer.New(indexer.Options{}), &fakeEngineMaps{}
	pool := peer.NewPool(peer.ClientOptions{})
	defer pool.Close()
	sync2, err := NewIndexSync(IndexSyncConfig{
		Self: "r2", Approx: approx2, Precise: precise2, EngineMaps: maps2,
		Peers: func() []SnapshotPeer {
			var out []SnapshotPeer
			for _, m := range alivePeers(msgr) {
				out = append(out, SnapshotPeer{ID: m.Name, Addr: addrs[m.Name]})
			}
			return out
		},
		Fetch: PoolFetcher(pool, "r2", 0),
	})
	if err != nil {
		t.Fatal(err)
	}
	ready := sync2.Warm // the readiness hook (with Raft's, in the binary)
	if ready() {
		t.Fatal("a restarted replica is ready before it pulled the index")
	}
	if err := sync2.WriteIndexSnapshot(context.Background(), nil); !errors.Is(err, peer.ErrNotWarm) {
		t.Fatalf("a cold replica served a snapshot: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	go sync2.Run(ctx)
	select {
	case <-sync2.Warmed():
	case <-ctx.Done():
		t.Fatal("never warm")
	}
	if !ready() {
		t.Fatal("Warmed closed before Warm")
	}
	var got int
	for _, m := range approx2.FindMatches(prompt, nil) {
		if m.Worker == w {
			got = m.Blocks
		}
	}
	if got != len(prompt) {
		t.Fatalf("ready with an overlap of %d for a known %d-block prefix", got, len(prompt))
	}
	if precise2.Len() != 24 || len(maps2.maps[indexer.Worker{ID: "w2"}]) != 2 {
		t.Fatalf("precise mode: %d entries and maps %v restored", precise2.Len(), maps2.maps)
	}
}
