package hints

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
)

// BenchmarkHealthGossipBytes measures the gossip volume per replica (memberlist's own
// traffic included) while three replicas run their health views over 50 workers, with
// 0 or 10 of them failing everywhere, over a 5-second window per iteration. Run with
// -benchtime 1x.
func BenchmarkHealthGossipBytes(b *testing.B) {
	for _, failing := range []int{0, 10} {
		b.Run(fmt.Sprintf("failing=%d", failing), func(b *testing.B) {
			var gs []*gossip.Gossip
			for i := range 3 {
				cfg := gossip.Config{Name: fmt.Sprintf("r%d", i+1), BindAddr: "127.0.0.1:0"}
				if i > 0 {
					cfg.Seeds = []string{gs[0].Addr()}
				}
				g, err := gossip.New(cfg)
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
			views := make([]*HealthView, 3)
			for i, g := range gs {
				views[i] = NewHealthView(g.Name(), HealthViewOptions{Alive: g.IsAlive})
				go views[i].Run(b.Context(), g, 200*time.Millisecond)
			}
			probe := func() {
				for _, v := range views {
					for w := range 50 {
						v.Observe(fmt.Sprintf("worker-%02d.example:8000", w), w >= failing)
					}
				}
			}
			probe() // the first round's news is not the steady state
			time.Sleep(time.Second)
			b.ResetTimer()
			var out uint64
			for range b.N {
				before := gs[0].Stats().BytesOut
				// One probe round a second, as the checker does, for the window.
				for range 5 {
					probe()
					time.Sleep(time.Second) // measuring a rate over wall time
				}
				out += gs[0].Stats().BytesOut - before
			}
			b.ReportMetric(float64(out)/5/float64(b.N), "out_B/s/replica")
			if ok, _ := views[1].Routable("worker-00.example:8000"); failing > 0 && ok {
				b.Error("a failing worker is still routable")
			}
		})
	}
}
