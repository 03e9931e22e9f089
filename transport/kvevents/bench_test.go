package kvevents

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// benchBatches returns n payloads of a steady engine: each batch stores 16 new prompts of 16
// blocks of 16 tokens (half of them continuing the previous batch's prompt from its last
// block), and removes what a batch `window` steps earlier stored, so the index stays the same
// size however long the benchmark cycles through the batches.
func benchBatches(b *testing.B, n, window int, f Format) (payloads [][]byte, storedPerBatch int) {
	const events, blocks = 16, 16
	stored := make([][]EngineHash, n)
	var e engine
	var token uint32
	var lastOfPrev EngineHash
	for i := range n {
		var evs []Event
		for j := range events {
			tokens := make([]uint32, blocks*bs)
			for k := range tokens {
				token++
				tokens[k] = token
			}
			ev := e.stored(tokens)
			if j%2 == 1 {
				ev.Parent, ev.HasParent = lastOfPrev, true
			}
			lastOfPrev = ev.BlockHashes[blocks-1]
			stored[i] = append(stored[i], ev.BlockHashes...)
			evs = append(evs, ev)
		}
		evs = append(evs, remove(stored[(i-window+n)%n]...))
		p, err := f.Append(nil, Batch{TS: float64(i), Events: evs})
		if err != nil {
			b.Fatal(err)
		}
		payloads = append(payloads, p)
	}
	return payloads, events * blocks
}

// discard is a Sink that does nothing, to tell this package's cost from the index's.
type discard struct{}

func (discard) Apply(indexer.Event) error   { return nil }
func (discard) RemoveWorker(indexer.Worker) {}

// BenchmarkDecodeApply decodes vLLM payloads and applies them through a Translator to a real
// index, as one subscriber does for one publisher ("index"), or to a sink that does nothing
// ("discard": decoding and translation alone). blocks/s counts stored blocks; every batch also
// removes as many, and block-events/s counts both.
func BenchmarkDecodeApply(b *testing.B) {
	for _, sinkName := range []string{"index", "discard"} {
		for _, f := range []Format{{}, {Map: true, BytesHashes: true}} {
			b.Run(sinkName+"/"+formatName(f), func(b *testing.B) {
				payloads, perBatch := benchBatches(b, 256, 64, f)
				var sink Sink = discard{}
				if sinkName == "index" {
					sink = indexer.New(indexer.Options{})
				}
				tr, err := NewTranslator(w0, bs, 0)
				if err != nil {
					b.Fatal(err)
				}
				d := NewDecoder()
				var bytes int
				b.ReportAllocs()
				b.ResetTimer()
				for i := range b.N {
					p := payloads[i%len(payloads)]
					bytes += len(p)
					batch, err := d.Decode(p)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := tr.Apply(batch, sink); err != nil {
						b.Fatal(err)
					}
				}
				sec := b.Elapsed().Seconds()
				b.ReportMetric(float64(b.N*perBatch)/sec, "blocks/s")
				b.ReportMetric(float64(2*b.N*perBatch)/sec, "block-events/s")
				b.ReportMetric(float64(bytes)/float64(b.N), "B/batch")
			})
		}
	}
}

// BenchmarkDecode is the decoder alone, for comparison with BenchmarkDecodeApply.
func BenchmarkDecode(b *testing.B) {
	payloads, perBatch := benchBatches(b, 256, 64, Format{})
	d := NewDecoder()
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if _, err := d.Decode(payloads[i%len(payloads)]); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*perBatch)/b.Elapsed().Seconds(), "blocks/s")
}

// BenchmarkSocketPublishApply is the whole path over loopback TCP: one Publisher (encoding in
// the caller) to one Subscriber applying to an index; it ends when the subscriber has applied
// the last batch.
func BenchmarkSocketPublishApply(b *testing.B) {
	payloads, perBatch := benchBatches(b, 256, 64, Format{})
	batches := make([]Batch, len(payloads))
	for i, p := range payloads {
		batch, err := Decode(p) // back to events for Publish; the hashes change, consistently
		if err != nil {
			b.Fatal(err)
		}
		batches[i] = batch
	}
	pub, err := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, Queue: b.N + 1})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = pub.Close() }()
	m, _ := NewMetrics(nil)
	x := indexer.New(indexer.Options{})
	sub, err := NewSubscriber(Config{Endpoint: tcp(pub.Addr()), Worker: w0, BlockSize: bs, Sink: x, Metrics: m})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sub.Run(ctx) }()
	defer func() { cancel(); <-done }()
	for deadline := time.Now().Add(10 * time.Second); !pub.hasSubscriber(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			b.Fatal("no subscription")
		}
	}
	b.ResetTimer()
	for i := range b.N {
		if err := pub.Publish(batches[i%len(batches)].Events); err != nil {
			b.Fatal(err)
		}
	}
	last := float64(b.N - 1)
	for deadline := time.Now().Add(60 * time.Second); value(b, m.lastSeq) < last; time.Sleep(100 * time.Microsecond) {
		if time.Now().After(deadline) {
			b.Fatalf("subscriber stuck at %v of %v (publisher dropped %d)", value(b, m.lastSeq), last, pub.Dropped())
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N*perBatch)/b.Elapsed().Seconds(), "blocks/s")
	b.ReportMetric(value(b, m.missed), "missed")
}

// BenchmarkSnapshotEngineMaps copies one worker's map of a quarter of a million engine blocks,
// a full GPU cache, as an index snapshot does: "whole" is SnapshotEngineMaps, "held" the part
// of it that holds the run loop's turn (copying the slot array); the rest builds the map after
// letting go, while events flow.
func BenchmarkSnapshotEngineMaps(b *testing.B) {
	const blocks = 1 << 18
	m := make(map[uint64]uint64, blocks)
	for i := range uint64(blocks) {
		m[i*0x9e3779b97f4a7c15+1] = i / 4
	}
	sub, err := NewSubscriber(Config{Endpoint: "tcp://127.0.0.1:1", Worker: w0, BlockSize: bs, Sink: discard{}})
	if err != nil {
		b.Fatal(err)
	}
	if err := sub.RestoreEngineMaps(map[indexer.Worker]map[uint64]uint64{w0: m}); err != nil {
		b.Fatal(err)
	}
	b.Run("whole", func(b *testing.B) {
		for b.Loop() {
			got, err := sub.SnapshotEngineMaps(context.Background())
			if err != nil || len(got[w0]) != blocks {
				b.Fatalf("%d blocks, %v", len(got[w0]), err)
			}
		}
	})
	b.Run("held", func(b *testing.B) {
		for b.Loop() {
			sub.acquire()
			c := sub.streams[w0].tr.keys.clone()
			sub.release()
			if c.Len() != blocks {
				b.Fatalf("%d blocks", c.Len())
			}
		}
	})
}
