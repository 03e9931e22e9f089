package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// realNode is a node on real sockets: Raft over TCP, bbolt with fsync, gRPC peer port.
type realNode struct {
	node  *Node
	aff   *Affinity
	srv   *peer.Server
	pool  *peer.Pool
	cfg   Config
	peerL net.Listener
}

// stop stops the node without handing leadership over, as a crash would.
func (r *realNode) stop() {
	_ = r.node.Close()
	r.srv.Stop()
	r.pool.Close()
}

// startRealNode opens a node with cfg on real sockets.
func startRealNode(tb testing.TB, cfg Config) *realNode {
	tb.Helper()
	pl, err := net.Listen("tcp", cfg.PeerAddr)
	if err != nil {
		tb.Fatal(err)
	}
	r := &realNode{cfg: cfg, peerL: pl, pool: peer.NewPool(peer.ClientOptions{})}
	cfg.Peers = r.pool
	n, err := Open(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	r.node = n
	r.srv = peer.NewServer(n.PeerHandler(), peer.ServerOptions{})
	go r.srv.Serve(pl)
	r.aff = NewAffinity(n)
	return r
}

// startRealCluster starts size nodes bootstrapped together with LAN defaults.
func startRealCluster(tb testing.TB, size int) []*realNode {
	tb.Helper()
	dir := tb.TempDir()
	var seeds []string
	cfgs := make([]Config, size)
	for i := range size {
		cfgs[i] = Config{
			ID: fmt.Sprintf("r%d", i), DataDir: filepath.Join(dir, fmt.Sprintf("r%d", i)),
			RaftBind: loopbacktest.Addr(tb), PeerAddr: loopbacktest.Addr(tb), BootstrapExpect: size,
		}
		seeds = append(seeds, cfgs[i].PeerAddr)
	}
	nodes := make([]*realNode, size)
	for i := range size {
		cfgs[i].Join = seeds
		nodes[i] = startRealNode(tb, cfgs[i])
	}
	tb.Cleanup(func() {
		for _, n := range nodes {
			if n != nil {
				n.stop()
			}
		}
	})
	waitLeader(tb, nodes)
	return nodes
}

func waitLeader(tb testing.TB, nodes []*realNode) int {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		for i, n := range nodes {
			if n != nil && n.node.IsLeader() && n.node.lead.isEstablished() {
				return i
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	tb.Fatal("no leader")
	return -1
}

// bindOnce binds a fresh session through a, reporting how long it took.
func bindOnce(ctx context.Context, a *Affinity, session string) (time.Duration, error) {
	start := time.Now()
	l, err := a.Acquire(ctx, session, nil)
	if err != nil {
		return 0, err
	}
	defer l.Release()
	if _, ok := l.Binding(); ok {
		return 0, errors.New("fresh session already bound")
	}
	if _, err := l.Commit(ctx, indexer.Worker{ID: "w1"}, ""); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// BenchmarkBindThreeReplicas is new bindings through three replicas on loopback with fsync
// on: clients spread over all three (followers forward to the leader), many binds in flight
// so that Raft batches them into one fsync. It reports binds/s and bind latency p50/p99.
func BenchmarkBindThreeReplicas(b *testing.B) {
	for _, clients := range []int{1, 16, 256} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) { benchBind(b, clients) })
	}
}

func benchBind(b *testing.B, clients int) {
	nodes := startRealCluster(b, 3)
	var (
		mu   sync.Mutex
		lats []time.Duration
		next atomic.Int64
	)
	ctx := context.Background()
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a := nodes[c%3].aff
			var mine []time.Duration
			for {
				i := next.Add(1)
				if i > int64(b.N) {
					break
				}
				d, err := bindOnce(ctx, a, fmt.Sprintf("bench-%d", i))
				if err != nil {
					b.Error(err)
					return
				}
				mine = append(mine, d)
			}
			mu.Lock()
			lats = append(lats, mine...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	slices.Sort(lats)
	if len(lats) > 0 {
		b.ReportMetric(float64(len(lats))/elapsed.Seconds(), "binds/s")
		b.ReportMetric(float64(lats[len(lats)/2].Microseconds()), "p50-us")
		b.ReportMetric(float64(lats[len(lats)*99/100].Microseconds()), "p99-us")
	}
}

// BenchmarkFailover kills the leader (no leadership transfer) and measures the time until
// a survivor acknowledges a new binding; each iteration restarts the killed node first.
func BenchmarkFailover(b *testing.B) {
	nodes := startRealCluster(b, 3)
	var times []time.Duration
	ctx := context.Background()
	i := 0
	for b.Loop() {
		i++
		li := waitLeader(b, nodes)
		survivor := nodes[(li+1)%3]
		killed := nodes[li]
		killed.stop()
		nodes[li] = nil
		start := time.Now()
		for {
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, err := bindOnce(cctx, survivor.aff, fmt.Sprintf("failover-%d", i))
			cancel()
			if err == nil {
				break
			}
			if time.Since(start) > 30*time.Second {
				b.Fatalf("no binding 30 s after the leader died: %v", err)
			}
		}
		times = append(times, time.Since(start))
		b.StopTimer()
		nodes[li] = startRealNode(b, killed.cfg)
		b.StartTimer()
	}
	slices.Sort(times)
	b.ReportMetric(float64(times[len(times)/2].Milliseconds()), "p50-ms")
	b.ReportMetric(float64(times[len(times)-1].Milliseconds()), "max-ms")
}
