package peer

import (
	"context"
	"testing"
)

// BenchmarkApplyRoundTrip is one forwarded command over loopback gRPC: the floor a
// follower adds to a new session's bind.
func BenchmarkApplyRoundTrip(b *testing.B) {
	c := dial(b, serve(b, &fakeHandler{}, ServerOptions{}), ClientOptions{})
	cmd := make([]byte, 64)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := c.Apply(ctx, cmd); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReadIndex compares linearizable reads from many goroutines, each with its own
// RPC and shared through a ReadIndexBatcher; callers/rpc is the batching gain.
func BenchmarkReadIndex(b *testing.B) {
	for _, bc := range []struct {
		name    string
		batched bool
	}{{"direct", false}, {"batched", true}} {
		b.Run(bc.name, func(b *testing.B) {
			h := &fakeHandler{}
			c := dial(b, serve(b, h, ServerOptions{}), ClientOptions{})
			read := c.ReadIndex
			if bc.batched {
				read = NewReadIndexBatcher(c.ReadIndex).ReadIndex
			}
			ctx := context.Background()
			b.SetParallelism(16)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := read(ctx); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			h.mu.Lock()
			rpcs := h.reads
			h.mu.Unlock()
			if rpcs > 0 {
				b.ReportMetric(float64(b.N)/float64(rpcs), "callers/rpc")
			}
		})
	}
}
