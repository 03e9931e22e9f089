package routing

import "testing"

// TestKVCostWeighsBlocksInUseByHowFullTheCacheIs: a conversation's next turn (60 blocks, 50
// of them cached on w1) stays on w1 while another request decodes there in a cache a tenth
// full, and leaves it only when w1's cache is nearly full or its prefill queue outweighs the
// prefill it saves. The reference cost, which weighs each block in use as one block of
// prefill, sent the turn to the idle w0 in the first case.
func TestKVCostWeighsBlocksInUseByHowFullTheCacheIs(t *testing.T) {
	for _, tc := range []struct {
		name          string
		prefillBlocks int64 // queued on w1
		decodeBlocks  int64 // in use on w1 (capacity 1000)
		want          string
	}{
		{"another request decodes in a cache a tenth full", 0, 100, "w1"},
		{"the cache is four fifths full", 0, 800, "w0"},
		{"a short prefill queue costs less than the prefix saves", 30, 0, "w1"},
		{"a long prefill queue costs more than the prefix saves", 200, 0, "w0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rg := newRig(t, 2, Config{})
			prefix := hashes(100, 60)
			rg.index.Record(worker("w1"), prefix[:50])
			rg.tracker.Start(worker("w1"), tc.prefillBlocks*16, tc.decodeBlocks)
			a := route(t, rg.router, Request{PromptTokens: 60 * 16, Hashes: prefix})
			defer a.Finish()
			if got := a.Decision().Target.Worker.ID; got != tc.want {
				t.Fatalf("went to %s, want %s", got, tc.want)
			}
		})
	}
}

// TestATicketCountsOnlyTheBlocksItsWorkerDoesNotCache: a request whose prompt is partly
// cached on its worker adds only its other blocks to the worker's blocks in use.
func TestATicketCountsOnlyTheBlocksItsWorkerDoesNotCache(t *testing.T) {
	rg := newRig(t, 1, Config{})
	prefix := hashes(300, 40)
	rg.index.Record(worker("w0"), prefix[:30])
	a := route(t, rg.router, Request{PromptTokens: 40 * 16, Hashes: prefix})
	defer a.Finish()
	if got := rg.tracker.Load(worker("w0")).DecodeBlocks; got != 10 {
		t.Fatalf("decode blocks %d, want the 10 uncached", got)
	}
}
