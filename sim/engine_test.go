package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// TestChunkedPrefillStepsSlowTheDecodesTheyShare drives the engine's steps by hand (no
// step goroutine, no clock): the step lengths and who advances in each are the model.
func TestChunkedPrefillStepsSlowTheDecodesTheyShare(t *testing.T) {
	const (
		dpt   = 10 * time.Millisecond
		ppt   = 50 * time.Microsecond
		chunk = 100
	)
	w, err := New(testConfig(Config{ChunkedPrefillTokens: chunk, DecodePerToken: dpt, PrefillPerToken: ppt}))
	if err != nil {
		t.Fatal(err)
	}
	e := w.engine
	newReq := func(prompt []uint32, total int) *engineReq {
		r := &engineReq{prompt: prompt, total: total, ready: make(chan struct{}, 1)}
		e.add(r) // never starts the step goroutine: the test steps
		return r
	}
	run := func() (decoders []*engineReq, d time.Duration) {
		e.mu.Lock()
		chunks, decoders, d := e.plan()
		e.mu.Unlock()
		e.step(chunks, decoders, d)
		return decoders, d
	}

	short := newReq(seqTokens(1, 20), 50)
	if _, d := run(); d != 20*ppt || short.produced != 1 {
		t.Fatalf("a lone 20-token prefill: step %v, %d produced; want %v and the first token", d, short.produced, 20*ppt)
	}
	if decs, d := run(); d != dpt || len(decs) != 1 || short.produced != 2 {
		t.Fatalf("a lone decode: step %v, %d produced; want %v", d, short.produced, dpt)
	}
	long := newReq(seqTokens(1000, 250), 1)
	// 250 uncached tokens in chunks of 100, 100 and 50, each step shared with the decode.
	for i, tokens := range []int{100, 100, 50} {
		decs, d := run()
		if want := dpt + time.Duration(tokens)*ppt; d != want || len(decs) != 1 || decs[0] != short {
			t.Fatalf("step %d of the long prefill: %v with %d decoders, want %v with the short request decoding", i, d, len(decs), want)
		}
	}
	if long.produced != 1 || short.produced != 5 || len(e.prefills) != 0 {
		t.Fatalf("after the long prefill: long produced %d, short %d, %d prefilling", long.produced, short.produced, len(e.prefills))
	}
	if _, d := run(); d != dpt {
		t.Fatalf("decode step after the prefill: %v, want %v", d, dpt)
	}
	// The decode's inter-token latencies: 1 alone, 3 shared with the prefill, 1 alone.
	want := 5*dpt + 250*ppt
	if got := time.Duration(w.interTokenNanos.Load()); w.interTokens.Load() != 5 || got != want {
		t.Fatalf("inter-token total %v over %d tokens, want %v over 5", got, w.interTokens.Load(), want)
	}
	// Two prompts prefill in one step when the budget allows, oldest first.
	a, b := newReq(seqTokens(5000, 60), 1), newReq(seqTokens(6000, 60), 1)
	if decs, d := run(); d != dpt+100*ppt || len(decs) != 1 || a.produced != 1 || b.produced != 0 || b.remaining != 20 {
		t.Fatalf("shared step: %v, a produced %d, b %d with %d left", d, a.produced, b.produced, b.remaining)
	}
	// The lookup happens when a prefill starts: a repeat of a stored prompt hits its blocks.
	c := newReq(seqTokens(1000, 250), 1)
	run() // b's last 20 tokens, then c's 10 uncached ones
	if c.cached != 240 || c.remaining != 0 || c.produced != 1 || b.produced != 1 {
		t.Fatalf("repeat of the long prompt: %d cached, %d left, %d produced (b %d); want 240 cached and both prefilled in one step",
			c.cached, c.remaining, c.produced, b.produced)
	}
}

// TestChunkedPrefillSlowsConcurrentDecodes runs a decode-only request (a short prompt, a
// long answer) while the same worker prefills a long prompt. With chunked prefill off the
// decode keeps its pace; on, each of its steps that shares a chunk of the prefill takes
// that chunk's prefill time longer, so its inter-token latencies total exactly the long
// prompt's prefill time more. The totals are in simulated time, so they do not depend on
// how fast the machine runs the test.
func TestChunkedPrefillSlowsConcurrentDecodes(t *testing.T) {
	const promptLen = 4096
	tests := []struct {
		name      string
		chunk     int
		wantExtra time.Duration
	}{
		{"off", 0, 0},
		{"on", 512, promptLen * DefaultPrefillPerToken},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Speedup 4: a decode step is 2.5 ms of wall clock, so the decode (4096 tokens)
			// outlasts the long prefill (about 70 ms) by seconds; the test ends with the
			// prefill, so it costs no more than that.
			w, srv := newTestWorker(t, Config{Speedup: 4, ChunkedPrefillTokens: tt.chunk, MaxModelLen: 16384})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			resp := openStream(t, ctx, srv, seqTokens(10, 20), 4096)
			// The decode is under way once its first token has come.
			if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
				t.Fatalf("first stream line %q: %v", line, err)
			}
			_, _, data := post(t, context.Background(), srv.Client(), srv.URL+"/v1/completions",
				map[string]any{"prompt": seqTokens(100000, promptLen), "max_tokens": 1})
			var r testResponse
			if err := json.Unmarshal(data, &r); err != nil || r.Usage == nil || r.Usage.PromptTokens != promptLen {
				t.Fatalf("long prefill answer %s: %v", data, err)
			}
			if st := w.Stats(); st.Served != 1 {
				t.Fatalf("the decode finished before the long prefill did (%+v): the machine is too slow for this test", st)
			}
			cancel()
			poll.Holds(t, 10*time.Second, "decode aborted", func() bool { st := w.Stats(); return st.Aborted == 1 && st.Running == 0 })

			n, total := w.interTokens.Load(), time.Duration(w.interTokenNanos.Load())
			if n == 0 {
				t.Fatal("no inter-token latency recorded")
			}
			extra := total - time.Duration(n)*DefaultDecodePerToken
			if extra != tt.wantExtra {
				t.Fatalf("decode's %d inter-token latencies total %v: %v over %v each, want %v over", n, total, extra, DefaultDecodePerToken, tt.wantExtra)
			}
			t.Logf("mean simulated inter-token latency %v over %d tokens (decode per token %v)", total/time.Duration(n), n, DefaultDecodePerToken)
			if st := w.Stats(); st.InterTokens != n || st.InterTokenSeconds != total.Seconds() {
				t.Fatalf("stats %+v disagree with the counters", st)
			}
		})
	}
}

// TestChunkedPrefillServesLikeTheFIFOEngine runs the caching scenarios with chunked
// prefill on: the lookups, stores and answers are the same.
func TestChunkedPrefillServesLikeTheFIFOEngine(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(map[bool]string{false: "whole", true: "stream"}[stream], func(t *testing.T) {
			w, srv := newTestWorker(t, Config{ChunkedPrefillTokens: 7})
			testCompletionCaching(t, w, srv.URL, srv.Client(), stream)
			w, srv = newTestWorker(t, Config{ChunkedPrefillTokens: 7})
			testChatCaching(t, w, srv.URL, srv.Client(), stream)
		})
	}
	// A client that leaves frees its slot and pins, and the step goroutine stops.
	w, srv := newTestWorker(t, Config{Speedup: 1, ChunkedPrefillTokens: 16, DecodePerToken: time.Second,
		Overhead: time.Microsecond, PrefillPerToken: time.Microsecond})
	ctx, cancel := context.WithCancel(context.Background())
	resp := openStream(t, ctx, srv, seqTokens(7, 40), 1000)
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if cs := w.Cache(); cs.Pinned != 2 {
		t.Fatalf("pinned %d, want the prompt's 2 blocks", cs.Pinned)
	}
	cancel()
	poll.Holds(t, 10*time.Second, "slot, pins and engine freed", func() bool {
		w.engine.mu.Lock()
		idle := !w.engine.running && len(w.engine.decodes) == 0
		w.engine.mu.Unlock()
		st, cs := w.Stats(), w.Cache()
		return idle && st.Running == 0 && cs.Pinned == 0 && st.Aborted == 1
	})
}

// TestStepClockForgetsLatenessBeyondAStep: a step due on time, or a little late, keeps the
// engine's clock (timer lateness does not add up); one more than a step late restarts it
// from now, so the steps after it do not run back to back and send their tokens in a burst.
func TestStepClockForgetsLatenessBeyondAStep(t *testing.T) {
	t0 := time.Unix(1000, 0)
	span := 10 * time.Millisecond
	cases := []struct {
		name string
		now  time.Time
		want time.Time
	}{
		{"early", t0, t0.Add(span)},
		{"on time", t0.Add(span), t0.Add(span)},
		{"late by less than a step", t0.Add(span + 9*time.Millisecond), t0.Add(span)},
		{"late by a step", t0.Add(2 * span), t0.Add(span)},
		{"late by more than a step", t0.Add(5 * span), t0.Add(5 * span)},
	}
	for _, tc := range cases {
		if got := stepClock(t0, tc.now, span); !got.Equal(tc.want) {
			t.Errorf("%s: next step at %v, want %v", tc.name, got.Sub(t0), tc.want.Sub(t0))
		}
	}
}
