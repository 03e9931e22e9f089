package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

func TestHybridCacheStoresTwinsAndSlidesTheWindow(t *testing.T) {
	var events []CacheEvent
	// Blocks of 4, a window of 6 tokens: a 14-token prompt computes 3 blocks, and tokens
	// before 14-6+1 = 9 are out of the window: blocks 0 and 1 (tokens 0..8).
	c := newHybridCache(4, 100, 6, func(e CacheEvent) { events = append(events, e) })
	prompt := seqTokens(1, 14)
	storeAndRelease(c, prompt)
	kinds := func() (out []string) {
		for _, e := range events {
			out = append(out, fmt.Sprintf("%v/%d/%d", e.Kind, e.Group, len(e.Blocks)))
		}
		return out
	}
	want := []string{"BlockStored/0/3", "BlockStored/1/3", "BlockRemoved/1/2"}
	if got := kinds(); !slices.Equal(got, want) {
		t.Fatalf("events %v, want %v", got, want)
	}
	for _, e := range events {
		if e.Window != 6 {
			t.Fatalf("event %+v without the window", e)
		}
	}
	// The full-attention group keeps the prefix: the whole prompt still hits.
	if got := matchBlocks(c, prompt); got != 3 {
		t.Fatalf("matched %d blocks, want 3", got)
	}

	// Eviction takes a block out of both groups, or of the full-attention group alone when
	// its twin already slid out.
	events = nil
	small := newHybridCache(4, 3, 6, func(e CacheEvent) { events = append(events, e) })
	storeAndRelease(small, prompt)
	events = nil
	storeAndRelease(small, seqTokens(100, 4)) // one new block: the LRU block (2, twin alive) goes
	if got := kinds(); !slices.Equal(got, []string{"BlockRemoved/0/1", "BlockRemoved/1/1", "BlockStored/0/1", "BlockStored/1/1"}) {
		t.Fatalf("eviction events %v", got)
	}
}

func TestCacheSaltKeysThePrefix(t *testing.T) {
	var events []CacheEvent
	c := newCache(4, 100, func(e CacheEvent) { events = append(events, e) })
	prompt := seqTokens(1, 13)
	s := c.acquireSalted(prompt, "tenant-a")
	c.store(s, prompt)
	c.release(s)
	if got := len(c.acquireSalted(prompt, "tenant-a").blocks); got != 3 {
		t.Fatalf("same salt: %d blocks, want 3", got)
	}
	for _, salt := range []string{"tenant-b", ""} {
		if got := len(c.acquireSalted(prompt, salt).blocks); got != 0 {
			t.Fatalf("salt %q: %d blocks hit, want none", salt, got)
		}
	}
	if got := c.cachedBlocks(prompt, "tenant-a"); got != 3 {
		t.Fatalf("cachedBlocks %d", got)
	}
	evs := translateCacheEvent(events[0], 4)
	if len(evs) != 1 || !slices.EqualFunc(evs[0].ExtraKeys, [][]any{{"tenant-a"}, nil, nil}, func(a, b []any) bool { return slices.Equal(a, b) }) {
		t.Fatalf("events %+v: want the salt in the first block's extra_keys only", evs)
	}
}

func TestCacheSaltIsValidated(t *testing.T) {
	for body, ok := range map[string]bool{
		`{"prompt":"hi","cache_salt":"x"}`:  true,
		`{"prompt":"hi","cache_salt":null}`: true,
		`{"prompt":"hi","cache_salt":""}`:   false,
		`{"prompt":"hi","cache_salt":5}`:    false,
	} {
		req, aerr := decodeRequest([]byte(body), false, 1000)
		if (aerr == nil) != ok {
			t.Errorf("%s: error %v", body, aerr)
		}
		if ok && body == `{"prompt":"hi","cache_salt":"x"}` && req.cacheSalt != "x" {
			t.Errorf("salt %q", req.cacheSalt)
		}
	}
}

// countingPublisher counts the batches it passed on.
type countingPublisher struct {
	pub *kvevents.Publisher
	n   atomic.Int64
}

func (p *countingPublisher) Publish(events []kvevents.Event) error {
	err := p.pub.Publish(events)
	p.n.Add(1)
	return err
}

// gaugeValue reads one gauge (or counter) of reg, summed over its labels.
func gaugeValue(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var v float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			v += m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
	}
	return v
}

// TestHybridReplayPredictsTheCachedTokens replays conversations through a hybrid simulated
// worker (a sliding window of 48 tokens, a cache small enough to evict) whose events reach a
// real index through a real subscriber over ZMQ on loopback, and checks, request by request,
// that the overlap the index predicts (times the block size) is the worker's cached_tokens:
// the sliding-window group's removals flow all along and must take nothing from the prefix
// the full-attention group holds. Some conversations carry a cache_salt; the same tokens
// under another salt must predict, and get, no hit.
func TestHybridReplayPredictsTheCachedTokens(t *testing.T) {
	const bs, window = 16, 48
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true, MapEncoding: true})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = pub.Close() }()
	counted := &countingPublisher{pub: pub}
	var enqueued atomic.Int64
	hook := PublishEvents(ctx, counted, bs, nil)
	cfg := Config{ID: "hybrid", BlockSize: bs, CapacityBlocks: 96, SlidingWindow: window,
		OnEvent: func(ce CacheEvent) { enqueued.Add(1); hook(ce) }}
	w, srv := newTestWorker(t, cfg)

	reg := prometheus.NewRegistry()
	m, err := kvevents.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	index := indexer.New(indexer.Options{})
	worker := indexer.Worker{ID: "hybrid"}
	sub, err := kvevents.NewSubscriber(kvevents.Config{Endpoint: "tcp://" + pub.Addr().String(), Worker: worker,
		BlockSize: bs, Sink: index, Metrics: m, MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	subDone := make(chan error, 1)
	go func() { subDone <- sub.Run(ctx) }()
	defer func() { cancel(); <-subDone }()

	// The subscription is up once a probe batch (a clear of nothing) arrives.
	poll.Holds(t, 15*time.Second, "the subscription", func() bool {
		if gaugeValue(t, reg, "kvrouter_kvevents_events_applied_total") > 0 {
			return true
		}
		_ = pub.Publish([]kvevents.Event{{Kind: indexer.Cleared}})
		return false
	})
	// synced waits until every cache event so far has been published and applied.
	synced := func() {
		t.Helper()
		poll.Holds(t, 15*time.Second, "the events applied", func() bool {
			return enqueued.Load() == counted.n.Load() &&
				gaugeValue(t, reg, "kvrouter_kvevents_last_sequence") == float64(pub.NextSeq()-1)
		})
	}

	rng := rand.New(rand.NewPCG(17, 4))
	system := seqTokens(50000, 70) // a shared system prompt, not block-aligned
	type conv struct {
		salt   string
		tokens []uint32
	}
	convs := make([]conv, 6)
	for i := range convs {
		if i%3 == 2 {
			convs[i].salt = fmt.Sprintf("tenant-%d", i)
		}
		convs[i].tokens = append(slices.Clone(system), seqTokens(60000+1000*i, 20+rng.IntN(40))...)
	}
	var absErr, requests, hits, slid int
	for turn := range 5 {
		for i := range convs {
			c := &convs[i]
			if turn > 0 {
				c.tokens = append(c.tokens, seqTokens(70000+rng.IntN(50000), 10+rng.IntN(30))...)
			}
			salts := []string{c.salt}
			if c.salt != "" {
				salts = append(salts, "other-"+c.salt) // the same tokens under another salt
			}
			for _, salt := range salts {
				synced()
				n := len(c.tokens) / bs
				extras := indexer.VLLMBlockExtras(n, bs, salt, nil, nil)
				seq := indexer.SequenceHashesExtra(c.tokens, bs, indexer.BaseSeed, extras, nil)
				predicted := 0
				for _, mt := range index.FindMatches(seq, nil) {
					if mt.Worker == worker {
						predicted = min(mt.Blocks, (len(c.tokens)-1)/bs) * bs
					}
				}
				body := map[string]any{"prompt": c.tokens, "max_tokens": 8}
				if salt != "" {
					body["cache_salt"] = salt
				}
				status, _, data := post(t, ctx, srv.Client(), srv.URL+"/v1/completions", body)
				if status != http.StatusOK {
					t.Fatalf("status %d: %s", status, data)
				}
				var resp testResponse
				if err := json.Unmarshal(data, &resp); err != nil || resp.Usage == nil {
					t.Fatalf("answer %s: %v", data, err)
				}
				cached := resp.Usage.PromptTokensDetails.CachedTokens
				if cached != predicted {
					t.Errorf("turn %d, conversation %d, salt %q: predicted %d cached tokens, the worker had %d",
						turn, i, salt, predicted, cached)
				}
				absErr += max(cached-predicted, predicted-cached)
				requests++
				if cached > 0 {
					hits++
				}
			}
			// The conversation goes on from the whole exchange, as a chat client's does.
			c.tokens = append(c.tokens, newOutput(c.tokens, 8, false).tokens...)
		}
	}
	synced()
	slid = int(gaugeValue(t, reg, "kvrouter_kvevents_other_group_events_total"))
	t.Logf("%d requests, %d with a hit, mean absolute error %.2f tokens; %d sliding-window events, %d blocks evicted",
		requests, hits, float64(absErr)/float64(requests), slid, w.Cache().EvictedBlocks)
	if absErr != 0 {
		t.Fatalf("mean absolute error %.2f tokens, want 0", float64(absErr)/float64(requests))
	}
	if hits < requests/2 || slid == 0 || w.Cache().EvictedBlocks == 0 {
		t.Fatalf("the replay did not exercise hits (%d of %d), sliding-window events (%d) and evictions (%d)",
			hits, requests, slid, w.Cache().EvictedBlocks)
	}
}
