package hints

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// brokenSource sends the first half of a real snapshot, then the stream breaks.
type brokenSource struct {
	data  []byte
	calls atomic.Int32
}

func (b *brokenSource) WriteIndexSnapshot(_ context.Context, w io.Writer) error {
	b.calls.Add(1)
	if _, err := w.Write(b.data[:len(b.data)/2]); err != nil {
		return err
	}
	return errors.New("connection reset mid-snapshot")
}

// gatedSource serves src's snapshot once the gate opens.
type gatedSource struct {
	src   peer.SnapshotSource
	gate  chan struct{}
	calls atomic.Int32
}

func (g *gatedSource) WriteIndexSnapshot(ctx context.Context, w io.Writer) error {
	g.calls.Add(1)
	select {
	case <-g.gate:
	case <-ctx.Done():
		return ctx.Err()
	}
	return g.src.WriteIndexSnapshot(ctx, w)
}

// bigIndex holds n entries over 4 workers.
func bigIndex(n int) *indexer.Index {
	x := indexer.New(indexer.Options{TTL: time.Hour})
	for i := 0; n > 0; i++ {
		k := min(n, 500)
		x.Store(indexer.Worker{ID: fmt.Sprintf("w%d", i%4)}, sharePrompt(uint64(1000+i), k))
		n -= k
	}
	return x
}

// TestSnapshotCutMidwayIsRetriedElsewhere: a peer whose stream breaks half-way (after
// real chunks reached the puller) is given up on, nothing of it is loaded, and the
// replica stays cold until another peer's whole snapshot arrives.
func TestSnapshotCutMidwayIsRetriedElsewhere(t *testing.T) {
	src := bigIndex(80_000)
	good := warmSync(t, "good", src, nil, nil)
	var full bytes.Buffer
	if err := good.WriteIndexSnapshot(context.Background(), &full); err != nil {
		t.Fatal(err)
	}
	if full.Len() < 600<<10 {
		t.Fatalf("snapshot of %d bytes: too small for the half to cross a chunk", full.Len())
	}
	broken := &brokenSource{data: full.Bytes()}
	gated := &gatedSource{src: good, gate: make(chan struct{})}
	addrBroken, addrGood := servePeer(t, broken), servePeer(t, gated)

	pool := peer.NewPool(peer.ClientOptions{})
	defer pool.Close()
	m, _ := NewMetrics(nil)
	dst := indexer.New(indexer.Options{TTL: time.Hour})
	s, err := NewIndexSync(IndexSyncConfig{
		Self: "new", Approx: dst, Fetch: PoolFetcher(pool, "new", 0), MinBackoff: 10 * time.Millisecond, Metrics: m,
		Peers: func() []SnapshotPeer {
			// The good peer shows up only after the broken one failed twice.
			ps := []SnapshotPeer{{ID: "broken", Addr: addrBroken}}
			if broken.calls.Load() >= 2 {
				ps = append(ps, SnapshotPeer{ID: "good", Addr: addrGood})
			}
			return ps
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	done := make(chan struct{})
	go func() { defer close(done); s.Run(ctx) }()

	poll.Until(t, 10*time.Second, func() error {
		if b, g := broken.calls.Load(), gated.calls.Load(); b < 2 || g < 1 {
			return fmt.Errorf("broken peer tried %d times, good peer %d", b, g)
		}
		return nil
	})
	if s.Warm() || dst.Len() != 0 {
		t.Fatalf("after broken streams only: warm %v with %d entries; want cold and empty", s.Warm(), dst.Len())
	}
	if got := m.Stats().Snapshots[SnapshotBroken]; got < 2 {
		t.Fatalf("%d broken pulls counted, want at least 2", got)
	}
	close(gated.gate)
	select {
	case <-s.Warmed():
	case <-ctx.Done():
		t.Fatal("never warm after the good peer answered")
	}
	<-done
	if dst.Len() != src.Len() {
		t.Fatalf("loaded %d entries of %d", dst.Len(), src.Len())
	}
	if st := m.Stats(); st.Snapshots[SnapshotOK] != 1 || st.SnapshotBytes < int64(full.Len()) || !st.Warm {
		t.Fatalf("stats after the good pull: %+v", st)
	}
}

// TestStartingAloneOrAmongColdPeersEndsCold: with no peer at all, or only peers that are
// themselves loading, there is nothing to pull: the replica turns warm after the
// discovery wait instead of waiting for ever.
func TestStartingAloneOrAmongColdPeersEndsCold(t *testing.T) {
	cold, err := NewIndexSync(IndexSyncConfig{
		Self: "c", Approx: indexer.New(indexer.Options{}), Peers: func() []SnapshotPeer { return nil },
		Fetch: func(context.Context, string) ([]byte, error) { return nil, errors.New("unused") },
	})
	if err != nil {
		t.Fatal(err)
	}
	coldAddr := servePeer(t, cold) // never Run: stays cold and refuses
	pool := peer.NewPool(peer.ClientOptions{})
	defer pool.Close()
	for _, tc := range []struct {
		name  string
		peers []SnapshotPeer
	}{
		{"alone", nil},
		{"only cold peers", []SnapshotPeer{{ID: "c", Addr: coldAddr}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, _ := NewMetrics(nil)
			s, err := NewIndexSync(IndexSyncConfig{
				Self: "new", Approx: indexer.New(indexer.Options{}), Metrics: m,
				Peers: func() []SnapshotPeer { return tc.peers }, Fetch: PoolFetcher(pool, "new", 0),
				DiscoveryWait: 200 * time.Millisecond, MinBackoff: 10 * time.Millisecond,
			})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := s.Run(ctx); err != nil || !s.Warm() {
				t.Fatalf("Run: %v, warm %v", err, s.Warm())
			}
			if len(tc.peers) > 0 && m.Stats().Snapshots[SnapshotCold] == 0 {
				t.Fatal("the cold peer's refusal was not counted")
			}
		})
	}
}

func TestBadContainersLoadNothing(t *testing.T) {
	src := bigIndex(300)
	var full bytes.Buffer
	if err := warmSync(t, "src", src, nil, nil).WriteIndexSnapshot(context.Background(), &full); err != nil {
		t.Fatal(err)
	}
	b := full.Bytes()
	tests := map[string][]byte{
		"empty":               nil,
		"wrong magic":         append([]byte("KVSX"), b[4:]...),
		"version 9":           append(append([]byte("KVSS"), 9), b[5:]...),
		"no end":              b[:len(b)-1],
		"bytes after the end": append(append([]byte(nil), b...), 0),
		"section too long":    append([]byte("KVSS\x01\x01\xff\xff\x03"), b[5:]...),
		"corrupt section":     append(append(append([]byte(nil), b[:40]...), b[40]^1), b[41:]...),
		"half":                b[:len(b)/2],
	}
	for name, in := range tests {
		t.Run(name, func(t *testing.T) {
			dst := indexer.New(indexer.Options{TTL: time.Hour})
			s, err := NewIndexSync(IndexSyncConfig{
				Self: "x", Approx: dst, Peers: func() []SnapshotPeer { return nil },
				Fetch: func(context.Context, string) ([]byte, error) { return nil, nil },
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.load(in); err == nil {
				t.Fatal("a bad container loaded")
			}
			if dst.Len() != 0 {
				t.Fatalf("a bad container loaded %d entries", dst.Len())
			}
		})
	}
}

func FuzzSnapshotContainer(f *testing.F) {
	var full bytes.Buffer
	src := bigIndex(20)
	s, err := NewIndexSync(IndexSyncConfig{
		Self: "src", Approx: src, Precise: bigIndex(5), DiscoveryWait: time.Millisecond,
		EngineMaps: &fakeEngineMaps{maps: map[indexer.Worker]map[uint64]uint64{{ID: "w0"}: {1: 2}}},
		Peers:      func() []SnapshotPeer { return nil },
		Fetch:      func(context.Context, string) ([]byte, error) { return nil, nil },
	})
	if err != nil {
		f.Fatal(err)
	}
	s.Run(context.Background())
	if err := s.WriteIndexSnapshot(context.Background(), &full); err != nil {
		f.Fatal(err)
	}
	f.Add(full.Bytes())
	f.Add([]byte("KVSS\x01\x03\x05\x01\x01a\x00\x00\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		dst, err := NewIndexSync(IndexSyncConfig{
			Self: "x", Approx: indexer.New(indexer.Options{TTL: time.Hour}), Precise: indexer.New(indexer.Options{}),
			EngineMaps: &fakeEngineMaps{},
			Peers:      func() []SnapshotPeer { return nil },
			Fetch:      func(context.Context, string) ([]byte, error) { return nil, nil },
		})
		if err != nil {
			t.Fatal(err)
		}
		_ = dst.load(b) // must not panic; errors are expected
	})
}

func BenchmarkSnapshotServeAndLoad(b *testing.B) {
	src := bigIndex(1 << 20)
	var s *IndexSync
	s, err := NewIndexSync(IndexSyncConfig{
		Self: "src", Approx: src, Peers: func() []SnapshotPeer { return nil }, DiscoveryWait: time.Millisecond,
		Fetch: func(context.Context, string) ([]byte, error) { return nil, nil },
	})
	if err != nil {
		b.Fatal(err)
	}
	s.Run(context.Background())
	addr := servePeer(b, s)
	pool := peer.NewPool(peer.ClientOptions{})
	defer pool.Close()
	fetch := PoolFetcher(pool, "bench", 0)
	var size int
	for b.Loop() {
		data, err := fetch(context.Background(), addr)
		if err != nil {
			b.Fatal(err)
		}
		size = len(data)
		dst, _ := NewIndexSync(IndexSyncConfig{
			Self: "dst", Approx: indexer.New(indexer.Options{TTL: time.Hour}), Peers: s.cfg.Peers, Fetch: fetch,
		})
		if err := dst.load(data); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(size)/float64(src.Len()), "B/entry")
	b.ReportMetric(float64(src.Len())*float64(b.N)/b.Elapsed().Seconds()/1e6, "Mentries/s")
}
