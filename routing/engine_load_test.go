package routing

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// fixedLoad is a LoadView of set figures.
type fixedLoad map[indexer.Worker]Load

func (f fixedLoad) Load(w indexer.Worker) Load { return f[w] }

func TestEngineLoadCountsWhatTheEngineHasBeyondTheCluster(t *testing.T) {
	w0 := indexer.Worker{ID: "w0"}
	spec := WorkerSpec{ID: "w0", CapacityBlocks: 1000}
	tests := []struct {
		name   string
		ours   Load
		sample EngineSample
		spec   WorkerSpec
		want   Load // external
	}{
		{"idle engine", Load{}, EngineSample{KVUsage: 0}, spec, Load{}},
		{"the engine runs only the cluster's requests", Load{Requests: 3, DecodeBlocks: 12},
			EngineSample{Running: 3, KVUsage: 0.5}, spec, Load{}},
		{"the cluster counts requests the engine has not admitted yet", Load{Requests: 5, PrefillTokens: 64, DecodeBlocks: 20},
			EngineSample{Running: 2, KVUsage: 0.01}, spec, Load{}},
		// 4 running hold 40% of 1000 blocks: 100 each; 2 of the 6 are the cluster's.
		{"external running requests take the engine's blocks per request", Load{Requests: 2, DecodeBlocks: 8},
			EngineSample{Running: 4, KVUsage: 0.4}, spec, Load{Requests: 2, DecodeBlocks: 200}},
		// 6 external of 8 in the engine, half of which wait: 3 wait with 50 blocks of 16 tokens.
		{"the queue's share of them is prefill", Load{Requests: 2},
			EngineSample{Running: 4, Waiting: 4, KVUsage: 0.2}, spec, Load{Requests: 6, PrefillTokens: 3 * 50 * 16, DecodeBlocks: 300}},
		{"cache_config_info's capacity, in the engine's block size, outranks the spec", Load{},
			EngineSample{Running: 1, KVUsage: 0.5, KVBlocks: 100, KVBlockSize: 32}, spec, Load{Requests: 1, DecodeBlocks: 100}},
		{"without usage the cluster's own requests there give the size", Load{Requests: 1, DecodeBlocks: 7},
			EngineSample{Running: 3, KVUsage: -1}, spec, Load{Requests: 2, DecodeBlocks: 14}},
		{"without usage or own requests the default size", Load{},
			EngineSample{Running: 0, Waiting: 2, KVUsage: -1}, spec, Load{Requests: 2, PrefillTokens: 2 * 1024, DecodeBlocks: 2 * 64}},
		{"usage without a known capacity", Load{},
			EngineSample{Running: 1, KVUsage: 0.3}, WorkerSpec{ID: "w0"}, Load{Requests: 1, DecodeBlocks: 64}},
		{"nonsense figures are bounded or ignored", Load{},
			EngineSample{Running: -5, Waiting: 1e300, KVUsage: 7}, spec, Load{Requests: maxEngineRequests, PrefillTokens: maxEngineRequests * 1024, DecodeBlocks: maxEngineRequests * 64}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			inner := fixedLoad{w0: tc.ours}
			e := NewEngineLoad(inner, EngineLoadConfig{BlockSize: 16})
			e.Observe(tc.spec, EngineReport{Whole: &tc.sample}, time.Unix(10, 0))
			if got := e.External(w0); got != tc.want {
				t.Errorf("external %+v, want %+v", got, tc.want)
			}
			if got, want := e.Load(w0), tc.ours.plus(tc.want); got != want {
				t.Errorf("Load %+v, want the cluster's plus the external %+v", got, want)
			}
		})
	}
}

func TestEngineLoadFixesExternalAtTheScrape(t *testing.T) {
	// The cluster's requests sent after a scrape add to the external load; they do not
	// cancel it (which would let the router pile onto a worker loaded from outside).
	w0 := indexer.Worker{ID: "w0"}
	tr := NewTracker()
	e := NewEngineLoad(tr, EngineLoadConfig{BlockSize: 16})
	e.Observe(WorkerSpec{ID: "w0", CapacityBlocks: 100}, EngineReport{Whole: &EngineSample{Running: 4, KVUsage: 0.4}}, time.Unix(1, 0))
	k := tr.Start(w0, 32, 2)
	defer k.Finish()
	if got, want := e.Load(w0), (Load{Requests: 5, PrefillTokens: 32, DecodeBlocks: 42}); got != want {
		t.Errorf("Load %+v, want %+v", got, want)
	}
}

func TestEngineLoadRanks(t *testing.T) {
	r0, r1, r2 := indexer.Worker{ID: "dp", DPRank: 0}, indexer.Worker{ID: "dp", DPRank: 1}, indexer.Worker{ID: "dp", DPRank: 2}
	spec := WorkerSpec{ID: "dp", DPSize: 3, CapacityBlocks: 100}
	tests := []struct {
		name string
		ours fixedLoad
		rep  EngineReport
		want map[indexer.Worker]Load
	}{
		{"per-rank samples go to their rank; a rank out of range is ignored", fixedLoad{r1: {Requests: 1, DecodeBlocks: 5}},
			EngineReport{Ranks: map[int]EngineSample{0: {Running: 2, KVUsage: 0.2}, 1: {Running: 1, KVUsage: 0.05}, 7: {Running: 9, KVUsage: 1}}},
			map[indexer.Worker]Load{r0: {Requests: 2, DecodeBlocks: 20}}},
		{"a whole-worker sample is spread over the ranks after the cluster's load on all of them", fixedLoad{r0: {Requests: 2, DecodeBlocks: 2}, r2: {Requests: 1, DecodeBlocks: 1}},
			// 9 in the engine, 3 the cluster's: 6 external, 2 a rank; 9 use 30% of 300 blocks.
			EngineReport{Whole: &EngineSample{Running: 9, KVUsage: 0.3}},
			map[indexer.Worker]Load{r0: {Requests: 2, DecodeBlocks: 20}, r1: {Requests: 2, DecodeBlocks: 20}, r2: {Requests: 2, DecodeBlocks: 20}}},
		{"per-rank samples outrank a whole one", fixedLoad{},
			EngineReport{Ranks: map[int]EngineSample{2: {Running: 1, KVUsage: 0.1}}, Whole: &EngineSample{Running: 50, KVUsage: 1}},
			map[indexer.Worker]Load{r2: {Requests: 1, DecodeBlocks: 10}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := NewEngineLoad(tc.ours, EngineLoadConfig{})
			e.Observe(spec, tc.rep, time.Unix(1, 0))
			for _, w := range []indexer.Worker{r0, r1, r2} {
				if got := e.External(w); got != tc.want[w] {
					t.Errorf("rank %d: external %+v, want %+v", w.DPRank, got, tc.want[w])
				}
			}
		})
	}
}

func TestEngineLoadExpiresReplacesAndForgets(t *testing.T) {
	w0, w1 := indexer.Worker{ID: "w0"}, indexer.Worker{ID: "w1"}
	e := NewEngineLoad(fixedLoad{}, EngineLoadConfig{})
	busy := EngineReport{Whole: &EngineSample{Running: 2, KVUsage: -1}}
	t0 := time.Unix(100, 0)
	e.Observe(WorkerSpec{ID: "w0"}, busy, t0)
	e.Observe(WorkerSpec{ID: "w1"}, busy, t0.Add(time.Second))
	if e.External(w0).Requests != 2 || e.External(w1).Requests != 2 {
		t.Fatalf("external w0 %+v, w1 %+v: want 2 requests each", e.External(w0), e.External(w1))
	}
	if n := e.Expire(t0.Add(500 * time.Millisecond)); n != 1 {
		t.Errorf("Expire dropped %d workers, want 1 (w0's scrape is the only one before the cutoff)", n)
	}
	if got := e.External(w0); got != (Load{}) {
		t.Errorf("a stale scrape still counts: %+v", got)
	}
	e.Observe(WorkerSpec{ID: "w1"}, EngineReport{}, t0.Add(2*time.Second))
	if got := e.External(w1); got != (Load{}) {
		t.Errorf("a scrape that reports nothing must replace the last one: %+v", got)
	}
	e.Observe(WorkerSpec{ID: "w1"}, busy, t0.Add(3*time.Second))
	e.Forget("w1")
	if got := e.External(w1); got != (Load{}) || len(e.Snapshot()) != 0 {
		t.Errorf("after Forget: external %+v, snapshot %v", got, e.Snapshot())
	}
}

func TestEngineLoadFeedsTheRouter(t *testing.T) {
	// The kv policy and the busy threshold read the external load: a worker loaded from
	// outside is passed over, and one full from outside is busy.
	reg, err := NewRegistry([]WorkerSpec{{ID: "w0", URL: "http://a", CapacityBlocks: 100}, {ID: "w1", URL: "http://b", CapacityBlocks: 100}})
	if err != nil {
		t.Fatal(err)
	}
	tr := NewTracker()
	e := NewEngineLoad(NewRemoteLoad(tr, time.Second), EngineLoadConfig{})
	r, err := New(Config{Policy: "kv", BusyDecodeFraction: 0.9, QueueWait: time.Millisecond}, Deps{Workers: reg, Tracker: tr, Load: e})
	if err != nil {
		t.Fatal(err)
	}
	spec0, _ := reg.Lookup("w0")
	e.Observe(spec0, EngineReport{Whole: &EngineSample{Running: 4, KVUsage: 0.4}}, time.Now())
	for i := range 20 {
		a, err := r.Route(context.Background(), &Request{PromptTokens: 64, DPRank: -1})
		if err != nil {
			t.Fatal(err)
		}
		if got := a.Decision().Target.Worker.ID; got != "w1" {
			t.Fatalf("request %d went to %s, loaded from outside", i, got)
		}
		a.Finish()
	}
	spec1, _ := reg.Lookup("w1")
	e.Observe(spec1, EngineReport{Whole: &EngineSample{Running: 10, KVUsage: 0.95}}, time.Now())
	e.Observe(spec0, EngineReport{Whole: &EngineSample{Running: 10, KVUsage: 0.95}}, time.Now())
	if _, err := r.Route(context.Background(), &Request{PromptTokens: 64, DPRank: -1, NoWait: true}); err == nil {
		t.Error("both workers are full from outside: want ErrBusy")
	}
}
