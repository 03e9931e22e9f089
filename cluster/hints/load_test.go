package hints

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// fixedLoad is a settable load snapshot.
type fixedLoad struct {
	mu sync.Mutex
	m  map[indexer.Worker]routing.Load
}

func (f *fixedLoad) set(w indexer.Worker, l routing.Load) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.m == nil {
		f.m = map[indexer.Worker]routing.Load{}
	}
	f.m[w] = l
}

// Load implements routing.LoadView.
func (f *fixedLoad) Load(w indexer.Worker) routing.Load {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.m[w]
}

func (f *fixedLoad) Snapshot() map[indexer.Worker]routing.Load {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[indexer.Worker]routing.Load, len(f.m))
	for w, l := range f.m {
		out[w] = l
	}
	return out
}

// TestIdleWorkersAreReportedThenOmitted: a busy worker is in every report; one that goes
// idle is reported idle a few times (so a lost packet does not leave its old load
// standing), then left out; an idle fleet sends nothing.
func TestIdleWorkersAreReportedThenOmitted(t *testing.T) {
	fn := newFakeNet()
	ma := fn.join("a", "")
	var mu sync.Mutex
	var reports [][]string
	fn.join("b", "").Handle(gossip.KindLoad, func(_ string, p []byte) {
		m, err := decodeLoad(p)
		if err != nil {
			t.Errorf("undecodable report: %v", err)
			return
		}
		var ws []string
		for _, wl := range m.loads {
			ws = append(ws, fmt.Sprintf("%s=%d", wl.w, wl.l.Requests))
		}
		mu.Lock()
		reports = append(reports, ws)
		mu.Unlock()
	})
	local := &fixedLoad{}
	s, err := NewLoadShare(LoadShareConfig{Messenger: ma, Local: local, Remote: routing.NewRemoteLoad(local, time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	w0, w1 := indexer.Worker{ID: "w0"}, indexer.Worker{ID: "w1"}
	local.set(w0, routing.Load{Requests: 2})
	local.set(w1, routing.Load{Requests: 1})
	s.Publish()
	local.set(w1, routing.Load{})
	for range 5 {
		s.Publish()
	}
	local.set(w0, routing.Load{})
	for range 5 {
		s.Publish()
	}
	want := [][]string{
		{"w0=2", "w1=1"},
		{"w0=2", "w1=0"}, {"w0=2", "w1=0"}, {"w0=2", "w1=0"}, {"w0=2"}, {"w0=2"},
		{"w0=0"}, {"w0=0"}, {"w0=0"},
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(reports) != fmt.Sprint(want) {
		t.Fatalf("reports\n%v\nwant\n%v", reports, want)
	}
}

// TestLoadReportsSplitAcrossPackets: a fleet too large for one packet is reported in
// several, each within the packet bound, and the receiver gets every worker.
func TestLoadReportsSplitAcrossPackets(t *testing.T) {
	fn := newFakeNet()
	ma, mb := fn.join("a", ""), fn.join("b", "")
	local := &fixedLoad{}
	var ws []indexer.Worker
	for i := range 300 {
		w := indexer.Worker{ID: fmt.Sprintf("worker-with-a-long-name-%03d", i), DPRank: uint32(i % 4)}
		ws = append(ws, w)
		local.set(w, routing.Load{Requests: int64(i + 1), PrefillTokens: 1 << 20, DecodeBlocks: 4096})
	}
	s, err := NewLoadShare(LoadShareConfig{Messenger: ma, Local: local, Remote: routing.NewRemoteLoad(local, time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	remote := routing.NewRemoteLoad(&fixedLoad{}, time.Minute)
	rs, err := NewLoadShare(LoadShareConfig{Messenger: mb, Local: &fixedLoad{}, Remote: remote})
	if err != nil {
		t.Fatal(err)
	}
	s.Publish()
	if n := s.m.Stats().MessagesOut["load"]; n < 2 {
		t.Fatalf("300 workers went in %d packet(s)", n)
	}
	for i, w := range ws {
		if got := remote.Remote(w); got.Requests != int64(i+1) {
			t.Fatalf("%s: remote %+v", w, got)
		}
	}
	if d := rs.m.Stats().Dropped["load"]; len(d) != 0 {
		t.Fatalf("parts of one report dropped: %v", d)
	}
}

func validLoad(sender string, epoch, seq uint64) []byte {
	parts := encodeLoad(nil, sender, epoch, seq, []workerLoad{{indexer.Worker{ID: "w0"}, routing.Load{Requests: 3, PrefillTokens: 100, DecodeBlocks: 7}}}, 1300)
	return parts[0]
}

func TestBadLoadReportsAreDroppedAndCounted(t *testing.T) {
	good := validLoad("r1", 5, 10)
	head := binary.AppendUvarint(binary.AppendUvarint(appendHeader(nil, "r1"), 5), 11)
	tests := []struct {
		name    string
		from    string
		payload []byte
		reason  string
	}{
		{"garbage", "r1", []byte{0xff, 0xff, 0xff}, DropShareVersion},
		{"empty", "r1", nil, DropShareDecode},
		{"truncated", "r1", good[:len(good)-2], DropShareDecode},
		{"claims a million workers", "r1", binary.AppendUvarint(slices.Clone(head), 1e6), DropShareSize},
		{"impossible figures", "r1", binary.AppendUvarint(binary.AppendUvarint(binary.AppendUvarint(appendWorker(binary.AppendUvarint(slices.Clone(head), 1), indexer.Worker{ID: "w0"}), 1<<62), 0), 0), DropShareSize},
		{"over 4 MiB", "r1", append(slices.Clone(good), make([]byte, 4<<20)...), DropShareSize},
		{"from a non-member", "stranger", validLoad("stranger", 1, 1), DropShareNonMember},
		{"names another sender", "r1", validLoad("r2", 1, 1), DropShareSender},
		{"older than the last", "r1", validLoad("r1", 5, 9), DropShareStale},
		{"about an unknown worker", "r1", encodeLoad(nil, "r1", 5, 11, []workerLoad{{indexer.Worker{ID: "nobody"}, routing.Load{Requests: 1}}}, 1300)[0], DropShareUnknownWorker},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fn := newFakeNet()
			m0 := fn.join("r0", "")
			fn.join("r1", "")
			fn.join("r2", "")
			remote := routing.NewRemoteLoad(&fixedLoad{}, time.Minute)
			s, err := NewLoadShare(LoadShareConfig{Messenger: m0, Local: &fixedLoad{}, Remote: remote,
				Known: func(w indexer.Worker) bool { return w.ID == "w0" }})
			if err != nil {
				t.Fatal(err)
			}
			fn.inject("r1", "r0", gossip.KindLoad, good)
			fn.inject(tc.from, "r0", gossip.KindLoad, tc.payload)
			st := s.m.Stats()
			if n := st.Dropped["load"][tc.reason]; n != 1 {
				t.Fatalf("dropped %v, want one %q", st.Dropped["load"], tc.reason)
			}
			if got := remote.Remote(indexer.Worker{ID: "w0"}); got != (routing.Load{Requests: 3, PrefillTokens: 100, DecodeBlocks: 7}) {
				t.Fatalf("the good report's share changed to %+v", got)
			}
		})
	}
}

func TestRestartedPeerIsNotTakenForStale(t *testing.T) {
	fn := newFakeNet()
	m0 := fn.join("r0", "")
	fn.join("r1", "")
	remote := routing.NewRemoteLoad(&fixedLoad{}, time.Minute)
	if _, err := NewLoadShare(LoadShareConfig{Messenger: m0, Local: &fixedLoad{}, Remote: remote}); err != nil {
		t.Fatal(err)
	}
	fn.inject("r1", "r0", gossip.KindLoad, validLoad("r1", 500, 90))
	// The restarted r1's clock went back: a lower epoch, and its sequence starts over.
	restarted := encodeLoad(nil, "r1", 400, 1, []workerLoad{{indexer.Worker{ID: "w0"}, routing.Load{Requests: 9}}}, 1300)[0]
	fn.inject("r1", "r0", gossip.KindLoad, restarted)
	if got := remote.Remote(indexer.Worker{ID: "w0"}); got.Requests != 9 {
		t.Fatalf("the restarted peer's report was not applied: %+v", got)
	}
}

func FuzzLoadDecode(f *testing.F) {
	f.Add(validLoad("r1", 1, 2))
	f.Add(encodeLoad(nil, "r", 0, 0, []workerLoad{{indexer.Worker{ID: "a", DPRank: 7}, routing.Load{}}, {indexer.Worker{ID: "b"}, routing.Load{Requests: 1 << 30}}}, 1300)[0])
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeLoad(b)
		if err != nil {
			return
		}
		for _, wl := range m.loads {
			if wl.l.Requests < 0 || wl.l.PrefillTokens < 0 || wl.l.DecodeBlocks < 0 {
				t.Fatalf("negative load decoded: %+v", wl)
			}
		}
		// What decodes re-encodes to a report that decodes the same (varints may have
		// come padded, so the bytes may differ).
		again := encodeLoad(nil, m.replica, m.epoch, m.seq, m.loads, 1<<30)
		if len(m.loads) > 0 {
			m2, err := decodeLoad(again[0])
			if err != nil || fmt.Sprint(m2) != fmt.Sprint(m) {
				t.Fatalf("re-encoded report: %v\n%+v\n%+v", err, m2, m)
			}
		}
	})
}

func BenchmarkLoadReport(b *testing.B) {
	report := make([]workerLoad, 64)
	for i := range report {
		report[i] = workerLoad{indexer.Worker{ID: fmt.Sprintf("worker-%02d", i)}, routing.Load{Requests: 12, PrefillTokens: 20_000, DecodeBlocks: 900}}
	}
	parts := encodeLoad(nil, "replica-1", 1, 1, report, 1300)
	size := 0
	for _, p := range parts {
		size += len(p)
	}
	b.Run("encode", func(b *testing.B) {
		var buf [][]byte
		for b.Loop() {
			buf = encodeLoad(buf[:0], "replica-1", 1, 1, report, 1300)
		}
		b.ReportMetric(float64(size), "bytes/report")
		b.ReportMetric(float64(len(parts)), "packets/report")
	})
	b.Run("decode", func(b *testing.B) {
		for b.Loop() {
			for _, p := range parts {
				if _, err := decodeLoad(p); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
}
