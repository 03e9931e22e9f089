package routing

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

func TestRemoteLoadAddsLiveSharesToTheLocalLoad(t *testing.T) {
	w0, w1 := indexer.Worker{ID: "w0"}, indexer.Worker{ID: "w1"}
	tr := NewTracker()
	tk := tr.Start(w0, 100, 4)
	defer tk.Finish()
	rl := NewRemoteLoad(tr, time.Second)
	t0 := time.Unix(100, 0)

	rl.Set("r2", map[indexer.Worker]Load{w0: {1, 10, 2}, w1: {2, 0, 3}}, t0)
	rl.Set("r3", map[indexer.Worker]Load{w0: {1, 5, 1}, w1: {-7, -1, -1}}, t0.Add(500*time.Millisecond))
	tests := []struct {
		name string
		got  Load
		want Load
	}{
		{"local plus both replicas", rl.Load(w0), Load{3, 115, 7}},
		{"negative figures count as zero", rl.Load(w1), Load{2, 0, 3}},
		{"remote share only", rl.Remote(w0), Load{2, 15, 3}},
	}
	for _, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("%s: got %+v, want %+v", tc.name, tc.got, tc.want)
		}
	}

	// A report that leaves a worker out keeps its old share; one that names it replaces it.
	rl.Set("r2", map[indexer.Worker]Load{w0: {0, 0, 0}}, t0.Add(600*time.Millisecond))
	if got := rl.Remote(w0); got != (Load{1, 5, 1}) {
		t.Errorf("after r2 reported w0 idle: remote %+v", got)
	}
	if got := rl.Remote(w1); got != (Load{2, 0, 3}) {
		t.Errorf("r2's share of w1 should stand until it expires: %+v", got)
	}

	// r2's share of w1 (from t0) expires; r3's (t0+0.5 s) does not yet.
	if n := rl.Expire(t0.Add(1200 * time.Millisecond)); n != 1 {
		t.Errorf("Expire dropped %d shares, want 1", n)
	}
	if got := rl.Remote(w1); got != (Load{}) {
		t.Errorf("after expiry w1 remote = %+v", got)
	}
	rl.Forget("r3")
	if got := rl.Load(w0); got != (Load{1, 100, 4}) {
		t.Errorf("after Forget(r3): %+v, want the local load only", got)
	}
	if got := rl.Replicas(); len(got) != 1 || got[0] != "r2" {
		t.Errorf("Replicas = %v, want [r2] (its idle report is still live)", got)
	}
}

// TestRemoteLoadSteersTheKVPolicy: with no KV overlap and no local load the kv policy has
// a tie; another replica's published load on one worker breaks it towards the other.
func TestRemoteLoadSteersTheKVPolicy(t *testing.T) {
	reg, err := NewRegistry(specs(2))
	if err != nil {
		t.Fatal(err)
	}
	tr := NewTracker()
	rl := NewRemoteLoad(tr, time.Minute)
	r, err := New(Config{Policy: "kv"}, Deps{Workers: reg, Tracker: tr, Load: rl})
	if err != nil {
		t.Fatal(err)
	}
	choose := func() map[string]int {
		got := map[string]int{}
		for range 40 {
			a, err := r.Route(context.Background(), &Request{PromptTokens: 64, DPRank: -1, QueryOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			got[a.Decision().Target.Worker.ID]++
		}
		return got
	}
	if got := choose(); got["w0"] == 0 || got["w1"] == 0 {
		t.Fatalf("without load both workers should win some ties: %v", got)
	}
	now := time.Now()
	rl.Set("r2", map[indexer.Worker]Load{{ID: "w0"}: {Requests: 8, PrefillTokens: 4096, DecodeBlocks: 64}}, now)
	if got := choose(); got["w1"] != 40 {
		t.Fatalf("w0 is busy with r2's requests, yet: %v", got)
	}
	rl.Forget("r2")
	rl.Set("r3", map[indexer.Worker]Load{{ID: "w1"}: {Requests: 8, PrefillTokens: 4096, DecodeBlocks: 64}}, now)
	if got := choose(); got["w0"] != 40 {
		t.Fatalf("w1 is busy with r3's requests, yet: %v", got)
	}
}

// TestRemoteReleaseWakesWaitingSelections: a request waiting because every worker is busy
// with other replicas' work proceeds when their published load drops.
func TestRemoteReleaseWakesWaitingSelections(t *testing.T) {
	reg, err := NewRegistry(specs(1))
	if err != nil {
		t.Fatal(err)
	}
	tr := NewTracker()
	rl := NewRemoteLoad(tr, time.Minute)
	r, err := New(Config{Policy: "kv", BusyPrefillTokens: 1000, QueueWait: time.Minute}, Deps{Workers: reg, Tracker: tr, Load: rl})
	if err != nil {
		t.Fatal(err)
	}
	w0 := indexer.Worker{ID: "w0"}
	rl.Set("r2", map[indexer.Worker]Load{w0: {Requests: 1, PrefillTokens: 5000}}, time.Now())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		a, err := r.Route(ctx, &Request{PromptTokens: 16, DPRank: -1})
		if err == nil {
			a.Finish()
		}
		done <- err
	}()
	// Keep lowering the share until the waiter has gone through: Set may run before the
	// selection starts waiting, and a wake-up before the wait is not a wake-up.
	for i := 0; ; i++ {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("Route: %v", err)
			}
			return
		case <-ctx.Done():
			t.Fatal("the waiting selection never woke")
		case <-time.After(10 * time.Millisecond):
			rl.Set("r2", map[indexer.Worker]Load{w0: {Requests: 1, PrefillTokens: int64(10 - i%2)}}, time.Now())
		}
	}
}

func BenchmarkRemoteLoad(b *testing.B) {
	tr := NewTracker()
	ws := make([]indexer.Worker, 64)
	remote := map[indexer.Worker]Load{}
	for i := range ws {
		ws[i] = indexer.Worker{ID: specs(64)[i].ID}
		tr.Start(ws[i], 10, 1)
		remote[ws[i]] = Load{Requests: 1}
	}
	for _, bc := range []struct {
		name string
		view LoadView
	}{
		{"tracker", tr},
		{"remote-idle", NewRemoteLoad(tr, time.Second)},
		{"remote-2-replicas", func() LoadView {
			rl := NewRemoteLoad(tr, time.Minute)
			rl.Set("r2", remote, time.Now())
			rl.Set("r3", remote, time.Now())
			return rl
		}()},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var sink int64
			for b.Loop() {
				for _, w := range ws {
					sink += bc.view.Load(w).Requests
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(ws)), "ns/load")
			_ = sink
		})
	}
}
