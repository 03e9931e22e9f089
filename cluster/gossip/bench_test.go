package gossip

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// benchCluster starts three replicas with the production timings (LANTimings).
func benchCluster(b *testing.B, key []byte) []*Gossip {
	b.Helper()
	var gs []*Gossip
	for i := range 3 {
		cfg := Config{Name: fmt.Sprintf("r%d", i+1), BindAddr: "127.0.0.1:0", SecretKey: key, Registerer: prometheus.NewRegistry(),
			Meta: Meta{Version: "bench", PeerAddr: "10.0.0.1:7001", RaftAddr: "10.0.0.1:7000"}}
		if i > 0 {
			cfg.Seeds = []string{gs[0].Addr()}
		}
		g, err := New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = g.Shutdown() })
		if i > 0 {
			if _, err := g.Join(b.Context()); err != nil {
				b.Fatal(err)
			}
		}
		gs = append(gs, g)
	}
	for _, g := range gs {
		waitAlive(b, g, "r1", "r2", "r3")
	}
	return gs
}

// BenchmarkIdleBytes measures memberlist's own traffic (probes, acks, push/pull) per
// replica in a quiet three-replica cluster, over a 5-second window per iteration.
// Run with -benchtime 1x.
func BenchmarkIdleBytes(b *testing.B) {
	for _, tc := range []struct {
		name string
		key  []byte
	}{{"plain", nil}, {"encrypted", []byte("0123456789abcdef")}} {
		b.Run(tc.name, func(b *testing.B) {
			gs := benchCluster(b, tc.key)
			const window = 5 * time.Second
			b.ResetTimer()
			var out uint64
			for range b.N {
				before := gs[0].Stats().BytesOut
				time.Sleep(window) // measuring a rate over wall time, not waiting for a condition
				out += gs[0].Stats().BytesOut - before
			}
			b.ReportMetric(float64(out)/window.Seconds()/float64(b.N), "out_B/s/replica")
		})
	}
}

// BenchmarkBroadcast measures what a 100-byte broadcast costs on the wire from its
// sender (every transmission, plus the packets it rides on), and how often it arrived.
func BenchmarkBroadcast(b *testing.B) {
	gs := benchCluster(b, nil)
	var got atomic.Int64
	for _, g := range gs[1:] {
		g.Handle(KindLoad, func(string, []byte) { got.Add(1) })
	}
	payload := make([]byte, 100)
	before := gs[0].Stats()
	b.ResetTimer()
	dropped := 0
	for i := range b.N {
		payload[0] = byte(i)
		if err := gs[0].Broadcast(KindLoad, payload); err != nil {
			dropped++
		}
		if i%100 == 99 {
			// Let the queue drain at the gossip rate rather than measure the drop path.
			for gs[0].Stats().QueuedBroadcasts > 50 {
				time.Sleep(time.Millisecond)
			}
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for got.Load() < int64(2*(b.N-dropped)) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	b.StopTimer()
	after := gs[0].Stats()
	b.ReportMetric(float64(after.BytesOut-before.BytesOut)/float64(b.N), "wire_out_B/op")
	b.ReportMetric(float64(after.PayloadBytesOut-before.PayloadBytesOut)/float64(b.N), "payload_out_B/op")
	// Each receiver may see a broadcast more than once (it is retransmitted to random
	// members); handlers are idempotent.
	b.ReportMetric(float64(got.Load())/float64(2*b.N), "deliveries/receiver/op")
}
