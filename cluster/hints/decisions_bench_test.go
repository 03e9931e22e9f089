package hints

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// BenchmarkDecisionsRecordParallel is the router's record through decision sharing from
// every core at once, one peer joined: a hot 8-block prompt on one of two workers, as
// routing records each request at dispatch and at completion. Every 4,096th record flushes
// (the queue stays small, as the 50 ms flush keeps it).
func BenchmarkDecisionsRecordParallel(b *testing.B) {
	fn := newFakeNet()
	fn.join("b", "").Handle(gossip.KindDecisions, func(string, []byte) {})
	idx := indexer.New(indexer.Options{TTL: 2 * time.Minute, MaxBlocksPerWorker: 1 << 16})
	d, err := NewDecisions(DecisionsConfig{Messenger: fn.join("a", ""), Index: idx})
	if err != nil {
		b.Fatal(err)
	}
	workers := []indexer.Worker{{ID: "w0"}, {ID: "w1"}}
	p := sharePrompt(1, 8)
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			d.Record(workers[i%len(workers)], p)
			if i++; i%4096 == 0 {
				d.Flush(context.Background())
			}
		}
	})
}
