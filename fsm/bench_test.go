package fsm

import (
	"bytes"
	"fmt"
	"io"
	"runtime"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// Run the big ones with: go test -run '^$' -bench . -benchtime 1x -cpu 1 ./fsm/

const (
	benchBindings = 1_000_000
	benchWorkers  = 64
	keyLen        = 36
)

// uuidKey writes a 36-byte UUID-shaped key for i into dst.
func uuidKey(dst []byte, i uint64) {
	const hexdigits = "0123456789abcdef"
	a := i*0x9e3779b97f4a7c15 + 0x632be59bd9b4e019
	b := (i ^ 0xd1b54a32d192ed03) * 0xbf58476d1ce4e5b9
	k := 0
	for pos := 0; pos < keyLen; pos++ {
		if pos == 8 || pos == 13 || pos == 18 || pos == 23 {
			dst[pos] = '-'
			continue
		}
		v := &a
		if k >= 16 {
			v = &b
		}
		dst[pos] = hexdigits[(*v>>(4*(k%16)))&0xf]
		k++
	}
}

// bindTemplate is an encoded Bind whose session bytes sit at off, to be overwritten.
type bindTemplate struct {
	data []byte
	off  int
}

func bindTemplates(tb testing.TB) []bindTemplate {
	placeholder := string(bytes.Repeat([]byte{'k'}, keyLen))
	out := make([]bindTemplate, benchWorkers)
	for w := range out {
		b, err := Encode(&Bind{Session: placeholder, Worker: fmt.Sprintf("worker-%02d", w), DPRank: uint32(w % 4), TTL: 10 * time.Minute, MaxBindings: 2 * benchBindings})
		if err != nil {
			tb.Fatal(err)
		}
		out[w] = bindTemplate{data: b, off: bytes.Index(b, []byte(placeholder))}
	}
	return out
}

// fill applies n fresh binds (in batches, as raft's BatchingFSM would get them).
func fill(tb testing.TB, f *FSM, n int) {
	tpl := bindTemplates(tb)
	const batch = 256
	logs := make([]*raft.Log, 0, batch)
	bufs := make([][]byte, batch)
	for i := 0; i < n; i++ {
		t := tpl[i%benchWorkers]
		j := len(logs)
		bufs[j] = append(bufs[j][:0], t.data...)
		uuidKey(bufs[j][t.off:], uint64(i))
		logs = append(logs, &raft.Log{Index: uint64(i + 1), Type: raft.LogCommand, Data: bufs[j]})
		if len(logs) == batch || i == n-1 {
			for k, r := range f.ApplyBatch(logs) {
				if r.(*Result).Status != Created {
					tb.Fatalf("bind %d: %v", logs[k].Index, r.(*Result).Status)
				}
			}
			logs = logs[:0]
		}
	}
}

func BenchmarkApplyBind(b *testing.B) {
	f := New(Options{OnChange: func(Change) {}})
	tpl := bindTemplates(b)
	buf := make([]byte, 0, 128)
	l := &raft.Log{Type: raft.LogCommand}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		t := tpl[i%benchWorkers]
		buf = append(buf[:0], t.data...)
		uuidKey(buf[t.off:], uint64(i))
		l.Index, l.Data = uint64(i+1), buf
		if r := f.Apply(l).(*Result); r.Status != Created {
			b.Fatalf("bind %d: %v", i, r.Status)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "ops/s")
}

func BenchmarkGet(b *testing.B) {
	f := New(Options{})
	fill(b, f, benchBindings)
	keys := make([]string, 1<<16)
	buf := make([]byte, keyLen)
	for i := range keys {
		uuidKey(buf, uint64(i*15))
		keys[i] = string(buf)
	}
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		for i := range b.N {
			if _, ok := f.Get(keys[i&(len(keys)-1)]); !ok {
				b.Fatal("missing")
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			i := 0
			for pb.Next() {
				if _, ok := f.Get(keys[i&(len(keys)-1)]); !ok {
					panic("missing")
				}
				i += 7
			}
		})
	})
}

func heapInUse() uint64 {
	var ms runtime.MemStats
	for range 2 {
		runtime.GC()
	}
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkMemoryPerBinding reports the live heap per binding: 1,000,000 bindings of
// 36-byte keys over 64 workers.
func BenchmarkMemoryPerBinding(b *testing.B) {
	for range b.N {
		before := heapInUse()
		f := New(Options{})
		fill(b, f, benchBindings)
		after := heapInUse()
		b.ReportMetric(float64(after-before)/benchBindings, "B/binding")
		runtime.KeepAlive(f)
	}
}

type countingSink struct{ n int64 }

func (s *countingSink) Write(p []byte) (int, error) { s.n += int64(len(p)); return len(p), nil }
func (s *countingSink) ID() string                  { return "count" }
func (s *countingSink) Close() error                { return nil }
func (s *countingSink) Cancel() error               { return nil }

func BenchmarkSnapshotPersist(b *testing.B) {
	f := New(Options{})
	fill(b, f, benchBindings)
	var size int64
	b.ResetTimer()
	for range b.N {
		snap, err := f.Snapshot()
		if err != nil {
			b.Fatal(err)
		}
		sink := &countingSink{}
		if err := snap.Persist(sink); err != nil {
			b.Fatal(err)
		}
		snap.Release()
		size = sink.n
	}
	b.ReportMetric(float64(size)/benchBindings, "B/binding-on-disk")
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/snapshot")
}

// BenchmarkSnapshotCall is the part of a snapshot that blocks Apply: O(shards).
func BenchmarkSnapshotCall(b *testing.B) {
	f := New(Options{})
	fill(b, f, 100_000)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		snap, _ := f.Snapshot()
		snap.Release()
	}
}

func BenchmarkRestore(b *testing.B) {
	f := New(Options{})
	fill(b, f, benchBindings)
	snap, _ := f.Snapshot()
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		b.Fatal(err)
	}
	stream := sink.Bytes()
	f = nil
	b.ResetTimer()
	for range b.N {
		r := New(Options{})
		if err := r.Restore(io.NopCloser(bytes.NewReader(stream))); err != nil {
			b.Fatal(err)
		}
		if r.Len() != benchBindings {
			b.Fatalf("restored %d", r.Len())
		}
	}
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/restore")
}
