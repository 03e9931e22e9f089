package hints

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// sharingPair runs a load share from a tracker on replica "a" (full reports an hour apart,
// change reports coalesced over coalesce, 0 for the default) and one on replica "b" whose
// view of a's load it returns. stop ends a's share and waits for it (also at t's cleanup).
func sharingPair(t *testing.T, coalesce time.Duration) (*routing.Tracker, *routing.RemoteLoad, *LoadShare, func()) {
	t.Helper()
	fn := newFakeNet()
	ma, mb := fn.join("a", ""), fn.join("b", "")
	tracker := routing.NewTracker()
	s, err := NewLoadShare(LoadShareConfig{Messenger: ma, Local: tracker, Changes: tracker.Changes(), Coalesce: coalesce,
		Remote: routing.NewRemoteLoad(tracker, time.Hour), Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	remote := routing.NewRemoteLoad(&fixedLoad{}, time.Hour)
	if _, err := NewLoadShare(LoadShareConfig{Messenger: mb, Local: &fixedLoad{}, Remote: remote, Interval: time.Hour}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	stop := func() { cancel(); <-done }
	t.Cleanup(stop)
	return tracker, remote, s, stop
}

// TestLoadChangesReachPeersAsTheyHappen: with full reports an hour apart, a request's start,
// its first token and its end each reach the peer's view by a change report: the end of a
// request must not stay counted there until the next full report, nor its prompt as
// prefill once its first token came.
func TestLoadChangesReachPeersAsTheyHappen(t *testing.T) {
	tracker, remote, _, _ := sharingPair(t, 0)

	w := indexer.Worker{ID: "w0"}
	var k *routing.Ticket
	for _, step := range []struct {
		name string
		do   func()
		want routing.Load
	}{
		{"start", func() { k = tracker.Start(w, 3000, 200) }, routing.Load{Requests: 1, PrefillTokens: 3000, DecodeBlocks: 200}},
		{"first token", func() { k.FirstToken() }, routing.Load{Requests: 1, DecodeBlocks: 200}},
		{"end", func() { k.Finish() }, routing.Load{}},
		{"next start", func() { k = tracker.Start(w, 10, 2) }, routing.Load{Requests: 1, PrefillTokens: 10, DecodeBlocks: 2}},
		{"next end before its first token", func() { k.Finish() }, routing.Load{}},
	} {
		step.do()
		if err := poll.Wait(10*time.Second, func() error {
			if got := remote.Remote(w); got != step.want {
				return fmt.Errorf("the peer sees %+v", got)
			}
			return nil
		}); err != nil {
			t.Fatalf("%s: %v, want %+v", step.name, err, step.want)
		}
	}
}

// TestChangeReportsCarryOnlyWhatChanged: a change report names the workers whose load
// differs from what was last sent (by either kind of report), and nothing is sent when
// nothing changed.
func TestChangeReportsCarryOnlyWhatChanged(t *testing.T) {
	fn := newFakeNet()
	ma := fn.join("a", "")
	var mu sync.Mutex
	var reports []string
	fn.join("b", "").Handle(gossip.KindLoad, func(_ string, p []byte) {
		m, err := decodeLoad(p)
		if err != nil {
			t.Errorf("undecodable report: %v", err)
			return
		}
		mu.Lock()
		defer mu.Unlock()
		var ws []string
		for _, wl := range m.loads {
			ws = append(ws, fmt.Sprintf("%s=%d", wl.w, wl.l.Requests))
		}
		reports = append(reports, fmt.Sprint(ws))
	})
	local := &fixedLoad{}
	s, err := NewLoadShare(LoadShareConfig{Messenger: ma, Local: local, Remote: routing.NewRemoteLoad(local, time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	w0, w1 := indexer.Worker{ID: "w0"}, indexer.Worker{ID: "w1"}
	for _, step := range []struct {
		name string
		do   func()
		want []string // every report so far
	}{
		{"two new workers", func() {
			local.set(w0, routing.Load{Requests: 1})
			local.set(w1, routing.Load{Requests: 1})
			s.PublishChanges()
		},
			[]string{"[w0=1 w1=1]"}},
		{"nothing changed", func() { s.PublishChanges() }, []string{"[w0=1 w1=1]"}},
		{"one changed", func() { local.set(w1, routing.Load{Requests: 2}); s.PublishChanges() }, []string{"[w0=1 w1=1]", "[w1=2]"}},
		{"one went idle", func() { local.set(w0, routing.Load{}); s.PublishChanges() }, []string{"[w0=1 w1=1]", "[w1=2]", "[w0=0]"}},
		{"a full report", func() { local.set(w1, routing.Load{Requests: 3}); s.Publish() },
			[]string{"[w0=1 w1=1]", "[w1=2]", "[w0=0]", "[w0=0 w1=3]"}},
		{"nothing changed since the full report", func() { s.PublishChanges() },
			[]string{"[w0=1 w1=1]", "[w1=2]", "[w0=0]", "[w0=0 w1=3]"}},
	} {
		step.do()
		mu.Lock()
		got := fmt.Sprint(reports)
		mu.Unlock()
		if got != fmt.Sprint(step.want) {
			t.Fatalf("%s: reports %s, want %v", step.name, got, step.want)
		}
	}
}

// TestChangeReportsAreCoalesced: requests arriving at a steady rate (each started, given its
// first token and ended while later ones arrive, over five workers) send at most one change
// report per Coalesce after the first, which goes at once, and the last state still reaches
// the peer. The bound is computed from the time the stream really took, so a slow machine
// only loosens it. The log gives the gossip cost to one peer at each rate.
func TestChangeReportsAreCoalesced(t *testing.T) {
	for _, tc := range []struct {
		rate     int // requests a second
		coalesce time.Duration
	}{
		{rate: 100, coalesce: DefaultLoadCoalesce},
		{rate: 1000, coalesce: DefaultLoadCoalesce},
		{rate: 1000, coalesce: 20 * time.Millisecond},
	} {
		t.Run(fmt.Sprintf("%d/s,%v", tc.rate, tc.coalesce), func(t *testing.T) {
			tracker, remote, s, stop := sharingPair(t, tc.coalesce)

			workers := []indexer.Worker{{ID: "w0"}, {ID: "w1"}, {ID: "w2"}, {ID: "w3"}, {ID: "w4"}}
			const stream = 500 * time.Millisecond
			requests := max(tc.rate*int(stream)/int(time.Second), 1)
			arrivals := time.NewTicker(time.Second / time.Duration(tc.rate))
			defer arrivals.Stop()
			var open []*routing.Ticket
			start := time.Now()
			n := 0
			for n < requests && time.Since(start) < 2*stream {
				<-arrivals.C
				open = append(open, tracker.Start(workers[n%len(workers)], int64(1000+n%97), int64(60+n%7)))
				n++
				open[len(open)/2].FirstToken()
				if len(open) > 8 {
					open[0].Finish()
					open = open[1:]
				}
			}
			took := time.Since(start)
			for _, k := range open {
				k.Finish()
			}
			if err := poll.Wait(10*time.Second, func() error {
				for _, w := range workers {
					if got := remote.Remote(w); got != (routing.Load{}) {
						return fmt.Errorf("the peer sees %s at %+v", w, got)
					}
				}
				return nil
			}); err != nil {
				t.Fatalf("the last state: %v", err)
			}
			stop()
			st := s.m.Stats()
			msgs, bytes := st.MessagesOut["load"], st.BytesOut["load"]
			// The first report at once, one per coalescing window of the stream, and the
			// last ends' (with the final window's own).
			if bound := 3 + uint64(took/tc.coalesce); msgs > bound {
				t.Fatalf("%d change reports for %d requests in %v, want at most %d (one per %v)", msgs, n, took, bound, tc.coalesce)
			}
			secs := took.Seconds()
			t.Logf("%d requests in %v (%.0f/s): %d change reports (%.0f/s), %d payload bytes (%.0f B/s) to one peer, about %.0f bytes each",
				n, took.Round(time.Millisecond), float64(n)/secs, msgs, float64(msgs)/secs, bytes, float64(bytes)/secs, float64(bytes)/float64(max(msgs, 1)))
		})
	}
}

// countedLoad is a fixedLoad that counts its snapshots, each the mark of a report.
type countedLoad struct {
	fixedLoad
	snapshots atomic.Int64
}

func (c *countedLoad) Snapshot() map[indexer.Worker]routing.Load {
	c.snapshots.Add(1)
	return c.fixedLoad.Snapshot()
}

// TestChangesWaitingForACoalescedReportDoNotWakeTheShare: once a change report is held back
// for Coalesce, the changes signalled meanwhile stay in the Changes channel for that report
// instead of waking the share one by one (a busy replica signals three times a request),
// while the share goes on with its full reports.
func TestChangesWaitingForACoalescedReportDoNotWakeTheShare(t *testing.T) {
	fn := newFakeNet()
	local := &countedLoad{}
	changes := make(chan struct{}, 1)
	s, err := NewLoadShare(LoadShareConfig{Messenger: fn.join("a", ""), Local: local, Changes: changes, Coalesce: time.Hour,
		Remote: routing.NewRemoteLoad(local, time.Hour), Interval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	taken := func() error {
		if len(changes) != 0 {
			return errors.New("the share has not taken the change")
		}
		return nil
	}
	// The first change is reported at once; the second, within Coalesce, starts the hold.
	for i := range 2 {
		changes <- struct{}{}
		if err := poll.Wait(10*time.Second, taken); err != nil {
			t.Fatalf("change %d: %v", i+1, err)
		}
	}
	changes <- struct{}{}
	// Two full reports later the share has been back at its select with the third change
	// ready more than once.
	from := local.snapshots.Load()
	if err := poll.Wait(10*time.Second, func() error {
		if n := local.snapshots.Load() - from; n < 2 {
			return fmt.Errorf("%d reports since", n)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(changes) != 1 {
		t.Fatal("the share took a change signalled while its report was held back: each such change wakes it")
	}
}
