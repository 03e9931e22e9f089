package replica

// Integration tests of one router replica: real simulated workers on 127.0.0.1:0, a real
// replica from startReplica, and a plain net/http client over loopback. They check the
// contract of DESIGN.md section 2 end to end: KV-aware placement, load spreading, streaming,
// cancellation, retries, session affinity and bad input.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

const blockTokens = 16

func TestSharedPrefixGoesToTheWorkerHoldingIt(t *testing.T) {
	const followers = 8
	// The token case: a 64-block prompt, then the prompt plus a suffix shorter than a block.
	prefix := promptTokens(1, 64*blockTokens)
	// The chat case: a long system message shared by chats whose user turns differ. The
	// router hashes the text in chunks; the worker tokenizes it.
	system := wordsText(2, 4096)
	chat := func(user string) []byte {
		b, err := json.Marshal(map[string]any{"model": sim.DefaultModel, "max_tokens": 4, "messages": []map[string]string{
			{"role": "system", "content": system}, {"role": "user", "content": user},
		}})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	sharedChatTokens := len(sim.Tokenize(sim.RenderChat([]sim.ChatMessage{{Role: "system", Content: system}}, false), true))

	cases := []struct {
		name string
		path string
		// body is the first request (i < 0) or follower i.
		body func(i int) []byte
		// minOverlap is the router's least predicted overlap in blocks, minCached the least
		// cached prompt tokens the worker must report.
		minOverlap, minCached int
	}{
		{
			name: "token prompt", path: "/v1/completions",
			body: func(i int) []byte {
				if i < 0 {
					return completionBody(prefix, 4, false)
				}
				return completionBody(concat(prefix, promptTokens(uint64(100+i), 10)), 4, false)
			},
			minOverlap: 64, minCached: 64 * blockTokens,
		},
		{
			name: "chat messages", path: "/v1/chat/completions",
			body: func(i int) []byte {
				if i < 0 {
					return chat("hello")
				}
				return chat(fmt.Sprintf("question number %d", i))
			},
			// The router's text chunks are 4 bytes per token, 16 tokens each.
			minOverlap: len("system\n"+system+"\n") / (4 * blockTokens),
			minCached:  sharedChatTokens / blockTokens * blockTokens,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fleet := startWorkers(t, 4, simConfig(0))
			rep := startTestReplica(t, fleet, nil)
			c := newRouterClient(t, rep)

			holder := c.post(tc.path, tc.body(-1), nil).mustOK(t).worker()
			waitRouterIdle(t, rep)
			for i := range followers {
				a := c.post(tc.path, tc.body(i), nil).mustOK(t)
				if got := a.worker(); got != holder {
					t.Fatalf("request %d went to %s, want %s, the worker holding the prefix", i, got, holder)
				}
				if got := a.header.Get(openai.HeaderReplica); got != "it-replica" {
					t.Errorf("request %d: %s %q, want it-replica", i, openai.HeaderReplica, got)
				}
				if got := a.overlap(t); got < tc.minOverlap {
					t.Errorf("request %d: overlap header %d blocks, want >= %d", i, got, tc.minOverlap)
				}
				if got := a.cachedTokens(t); got < tc.minCached {
					t.Errorf("request %d: worker reports %d cached tokens, want >= %d", i, got, tc.minCached)
				}
				waitRouterIdle(t, rep)
			}
			if got := fleet.byID(t, holder).Stats().CachedTokens; got < uint64(followers*tc.minCached) {
				t.Errorf("holder %s counted %d cached tokens, want >= %d", holder, got, followers*tc.minCached)
			}
			for _, w := range fleet {
				if w.spec.ID != holder && !sawNothing(w) {
					t.Errorf("worker %s saw requests: %+v", w.spec.ID, w.Stats())
				}
			}
		})
	}
}

func TestDistinctPromptsSpreadLoad(t *testing.T) {
	const workers, streams = 4, 8
	// About 40 s of decode per stream: the streams stay open until the test closes them.
	fleet := startWorkers(t, workers, simConfig(10*time.Millisecond))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)

	perWorker := map[string]int{}
	var open []*sseStream
	for i := range streams {
		s := c.openStream(promptTokens(uint64(i+1), 4*blockTokens), 4000, nil)
		// After the first chunk the request's prefill is over and its decode load is counted,
		// so the next choice sees it.
		s.firstChunk(t)
		perWorker[s.worker()]++
		open = append(open, s)
	}
	lo, hi := streams, 0
	for _, w := range fleet {
		n := perWorker[w.spec.ID]
		lo, hi = min(lo, n), max(hi, n)
		if got := w.Stats().Running; got != n {
			t.Errorf("worker %s runs %d requests, router sent it %d", w.spec.ID, got, n)
		}
		if got := workerLoad(rep, w.spec.ID).Requests; got != int64(n) {
			t.Errorf("router accounts %d requests on %s, sent %d", got, w.spec.ID, n)
		}
	}
	if hi-lo > 1 {
		t.Errorf("streams per worker %v: max-min %d, want <= 1", perWorker, hi-lo)
	}

	for _, s := range open {
		s.close()
	}
	waitRouterIdle(t, rep)
	for _, w := range fleet {
		eventually(t, "worker "+w.spec.ID+" to run nothing", func() (bool, string) {
			s := w.Stats()
			return s.Running == 0, fmt.Sprintf("%+v", s)
		})
	}
}

func TestStreamingPassesChunksThroughUnbuffered(t *testing.T) {
	// 60 tokens 40 ms apart: the worker is busy for about 2.4 s after the first one.
	const outputTokens = 60
	fleet := startWorkers(t, 2, simConfig(40*time.Millisecond))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)

	s := c.openStream(promptTokens(7, 3*blockTokens), outputTokens, nil)
	if ct := s.resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Errorf("Content-Type %q, want text/event-stream", ct)
	}
	w := fleet.byID(t, s.worker())
	s.firstChunk(t)
	// Had the router buffered the answer, the worker would be done before the first chunk.
	st := w.Stats()
	if st.Running != 1 || st.Served != 0 {
		t.Fatalf("first chunk arrived but the worker is no longer generating: %+v", st)
	}
	// Had it only failed to flush, net/http's 4 KiB response buffer would hold the first
	// ~25 chunks (about 160 bytes each) back; a flushed chunk arrives with about one
	// generated, and the bound leaves over 400 ms of slack for a slow scheduler.
	if st.GeneratedTokens > 12 {
		t.Fatalf("the first chunk arrived after the worker had generated %d tokens: the stream is held back", st.GeneratedTokens)
	}

	chunks, done := 1, false
	for !done {
		data, err := s.next()
		switch {
		case err != nil:
			t.Fatalf("stream ended without [DONE] after %d chunks: %v", chunks, err)
		case data == "[DONE]":
			done = true
		default:
			if chunkText(t, data) != "" {
				chunks++
			}
		}
		if chunks > outputTokens {
			t.Fatalf("more than %d text chunks", outputTokens)
		}
	}
	if chunks != outputTokens {
		t.Errorf("got %d text chunks, want %d", chunks, outputTokens)
	}
	if _, err := s.next(); !errors.Is(err, io.EOF) {
		t.Errorf("after [DONE]: %v, want the end of the body", err)
	}
	eventually(t, "the worker to count the stream served", func() (bool, string) {
		st := w.Stats()
		return st.Served == 1 && st.Running == 0, fmt.Sprintf("%+v", st)
	})
	waitRouterIdle(t, rep)
}

func TestClientCancelFreesWorkerLoad(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(10*time.Millisecond))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)
	session := hdr("X-Session-ID", "impatient")

	s := c.openStream(promptTokens(3, 4*blockTokens), 4000, session)
	s.firstChunk(t)
	id, rev := s.worker(), headerRevision(t, s.resp.Header)
	w := fleet.byID(t, id)
	inflight := fmt.Sprintf("kvrouter_worker_inflight_requests{worker=%q}", id)
	decode := fmt.Sprintf("kvrouter_worker_decode_blocks{worker=%q}", id)
	if m := c.scrapeMetrics(); m[inflight] != 1 || m[decode] == 0 {
		t.Fatalf("while streaming: %s = %v, %s = %v; want 1 and > 0", inflight, m[inflight], decode, m[decode])
	}

	s.close()
	eventually(t, "the router's load on "+id+" to return to zero", func() (bool, string) {
		m := c.scrapeMetrics()
		prefill := fmt.Sprintf("kvrouter_worker_prefill_tokens{worker=%q}", id)
		return m[inflight] == 0 && m[decode] == 0 && m[prefill] == 0,
			fmt.Sprintf("inflight %v, decode %v, prefill %v", m[inflight], m[decode], m[prefill])
	})
	eventually(t, "the worker to drop the request", func() (bool, string) {
		st := w.Stats()
		return st.Running == 0 && st.Aborted == 1, fmt.Sprintf("%+v", st)
	})
	if st := w.Stats(); st.Served != 0 {
		t.Errorf("worker finished the cancelled stream: %+v", st)
	}
	// A client leaving is no fault of the worker's: it stays healthy and keeps the session.
	for _, st := range rep.registry.List() {
		if st.Spec.ID == id && !st.Healthy {
			t.Errorf("a client cancel marked %s unhealthy: %s", id, st.Reason)
		}
	}
	after := c.complete(promptTokens(4, 4*blockTokens), 2, session).mustOK(t)
	if after.worker() != id || after.revision(t) != rev {
		t.Errorf("after the cancel the session is on %s revision %d, want %s revision %d", after.worker(), after.revision(t), id, rev)
	}
}

func TestKilledWorkerRequestsRetryElsewhere(t *testing.T) {
	fault := func(f sim.Faults) func(t *testing.T, w *testWorker) {
		return func(t *testing.T, w *testWorker) {
			if err := w.SetFaults(f); err != nil {
				t.Fatal(err)
			}
		}
	}
	cases := []struct {
		name string
		kill func(t *testing.T, w *testWorker)
		tune func(cfg *Config)
	}{
		{"serve stopped", func(_ *testing.T, w *testWorker) { w.stop() }, nil},
		{"connections refused", fault(sim.Faults{Refuse: true}), nil},
		// A hung worker costs each request routed to it the first-byte timeout, then a retry.
		{"hangs before the first byte", fault(sim.Faults{StallRate: 1}),
			func(cfg *Config) { cfg.Proxy.FirstByteTimeout = 300 * time.Millisecond }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fleet := startWorkers(t, 3, simConfig(0))
			rep := startTestReplica(t, fleet, tc.tune)
			c := newRouterClient(t, rep)

			prefix := promptTokens(11, 32*blockTokens)
			victim := c.complete(prefix, 2, nil).mustOK(t).worker()
			waitRouterIdle(t, rep)
			tc.kill(t, fleet.byID(t, victim))

			// The prefix makes the victim the cheapest choice, and the router still thinks it
			// healthy: the request must fail over before its first byte.
			first := c.complete(concat(prefix, promptTokens(12, 5)), 2, nil).mustOK(t)
			if first.worker() == victim {
				t.Fatalf("answer claims the dead worker %s", victim)
			}
			if got := c.scrapeMetrics()["kvrouter_retries_total"]; got != 1 {
				t.Errorf("kvrouter_retries_total = %v after the first request, want 1", got)
			}
			for i := range 5 {
				a := c.complete(concat(prefix, promptTokens(uint64(20+i), 5)), 2, nil).mustOK(t)
				if a.worker() == victim {
					t.Fatalf("request %d answered by the dead worker %s", i, victim)
				}
			}
			s := c.openStream(concat(prefix, promptTokens(30, 5)), 3, nil)
			if s.worker() == victim {
				t.Fatalf("stream answered by the dead worker %s", victim)
			}
			for {
				data, err := s.next()
				if err != nil {
					t.Fatalf("stream after failover broke: %v", err)
				}
				if data == "[DONE]" {
					break
				}
			}
			for _, st := range rep.registry.List() {
				if st.Spec.ID == victim && !st.Healthy {
					t.Errorf("the router marked %s unhealthy; the test meant to exercise the retry alone", victim)
				}
			}
		})
	}
}

func TestSessionRequestsStayOnTheBoundWorker(t *testing.T) {
	fleet := startWorkers(t, 3, simConfig(10*time.Millisecond))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)
	session := hdr("X-Session-ID", "chat-42")

	// A long stream of the session keeps load on its worker, so balance alone would send
	// the session's next requests elsewhere.
	s := c.openStream(promptTokens(1, 4*blockTokens), 4000, session)
	s.firstChunk(t)
	bound, rev := s.worker(), headerRevision(t, s.resp.Header)
	if rev == 0 {
		t.Fatalf("first request of the session got no %s", openai.HeaderRevision)
	}
	control := c.complete(promptTokens(2, 4*blockTokens), 2, nil).mustOK(t)
	if control.worker() == bound {
		t.Fatalf("without a session the loaded worker %s was chosen; the test cannot tell affinity from balance", bound)
	}
	for i := range 5 {
		a := c.complete(promptTokens(uint64(10+i), 4*blockTokens), 2, session).mustOK(t)
		if a.worker() != bound || a.revision(t) != rev {
			t.Errorf("request %d: worker %s revision %d, want %s revision %d", i, a.worker(), a.revision(t), bound, rev)
		}
	}
	s.close()
	waitRouterIdle(t, rep)
}

func TestConcurrentFirstRequestsOfASessionBindOnce(t *testing.T) {
	const concurrent = 12
	fleet := startWorkers(t, 4, simConfig(0))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)

	for round := range 3 {
		key := fmt.Sprintf("race-%d", round)
		answers := make([]answer, concurrent)
		errs := make([]error, concurrent)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range concurrent {
			wg.Go(func() {
				<-start
				body := completionBody(promptTokens(uint64(1000*round+i), 4*blockTokens), 2, false)
				answers[i], errs[i] = c.do(t.Context(), http.MethodPost, "/v1/completions", bytes.NewReader(body), hdr("X-Session-ID", key))
			})
		}
		close(start)
		wg.Wait()
		workers, revs := map[string]int{}, map[uint64]int{}
		for i, a := range answers {
			if errs[i] != nil {
				t.Fatalf("session %s request %d: %v", key, i, errs[i])
			}
			a.mustOK(t)
			workers[a.worker()]++
			revs[a.revision(t)]++
		}
		if len(workers) != 1 || len(revs) != 1 || revs[0] != 0 {
			t.Errorf("session %s: workers %v, revisions %v; want one worker, one non-zero revision", key, workers, revs)
		}
	}
	if got := rep.affinity.Len(); got != 3 {
		t.Errorf("replica holds %d sessions, want 3", got)
	}
}

func TestBoundWorkerFailureRebindsWithAHigherRevision(t *testing.T) {
	cases := []struct {
		name  string
		fault sim.Faults
		// probed: health checks run often and the router learns of the failure before the
		// next request; otherwise only the failed dispatch tells it.
		probed bool
	}{
		{"worker answers 500", sim.Faults{ErrorRate: 1}, false},
		{"worker refuses connections", sim.Faults{Refuse: true}, false},
		{"health checks take the worker out", sim.Faults{Refuse: true}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fleet := startWorkers(t, 3, simConfig(0))
			rep := startTestReplica(t, fleet, func(cfg *Config) {
				if tc.probed {
					cfg.Health = openai.HealthConfig{Interval: 20 * time.Millisecond, Timeout: 500 * time.Millisecond}
				}
			})
			c := newRouterClient(t, rep)
			session := hdr("X-Session-ID", "failover")

			first := c.complete(promptTokens(1, 2*blockTokens), 2, session).mustOK(t)
			old, oldRev := fleet.byID(t, first.worker()), first.revision(t)
			if err := old.SetFaults(tc.fault); err != nil {
				t.Fatal(err)
			}
			if tc.probed {
				waitHealth(t, rep, old.spec.ID, false)
			}

			moved := c.complete(promptTokens(2, 2*blockTokens), 2, session).mustOK(t)
			newWorker, newRev := moved.worker(), moved.revision(t)
			if newWorker == old.spec.ID {
				t.Fatalf("the faulted bound worker %s answered", newWorker)
			}
			if newRev <= oldRev {
				t.Fatalf("rebinding to %s has revision %d, not above the old %d", newWorker, newRev, oldRev)
			}
			if tc.fault.ErrorRate > 0 && old.Stats().Failed == 0 {
				t.Errorf("the bound worker was never tried: %+v", old.Stats())
			}

			// The old worker recovers; the binding changed once and stays.
			if err := old.SetFaults(sim.Faults{}); err != nil {
				t.Fatal(err)
			}
			if tc.probed {
				waitHealth(t, rep, old.spec.ID, true)
			}
			for i := range 4 {
				a := c.complete(promptTokens(uint64(10+i), 2*blockTokens), 2, session).mustOK(t)
				if a.worker() != newWorker || a.revision(t) != newRev {
					t.Errorf("request %d after failover: %s revision %d, want %s revision %d",
						i, a.worker(), a.revision(t), newWorker, newRev)
				}
			}
		})
	}
}

func TestConcurrentRequestsOfAFailedSessionRebindOnce(t *testing.T) {
	const concurrent = 8
	fleet := startWorkers(t, 4, simConfig(0))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)
	const key = "herd"

	first := c.complete(promptTokens(1, 2*blockTokens), 2, hdr("X-Session-ID", key)).mustOK(t)
	old, oldRev := fleet.byID(t, first.worker()), first.revision(t)
	if err := old.SetFaults(sim.Faults{ErrorRate: 1}); err != nil {
		t.Fatal(err)
	}
	answers := make([]answer, concurrent)
	errs := make([]error, concurrent)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range concurrent {
		wg.Go(func() {
			<-start
			body := completionBody(promptTokens(uint64(10+i), 2*blockTokens), 2, false)
			answers[i], errs[i] = c.do(t.Context(), http.MethodPost, "/v1/completions", bytes.NewReader(body), hdr("X-Session-ID", key))
		})
	}
	close(start)
	wg.Wait()
	workers, revs := map[string]int{}, map[uint64]int{}
	for i, a := range answers {
		if errs[i] != nil {
			t.Fatalf("request %d: %v", i, errs[i])
		}
		a.mustOK(t)
		workers[a.worker()]++
		revs[a.revision(t)]++
	}
	if len(workers) != 1 || len(revs) != 1 || workers[old.spec.ID] != 0 {
		t.Fatalf("after the failure: workers %v, revisions %v; want one new worker, not %s, at one revision", workers, revs, old.spec.ID)
	}
	for rev := range revs {
		if rev <= oldRev {
			t.Errorf("new revision %d is not above %d", rev, oldRev)
		}
	}
}

func TestExplicitTargetMustMatchTheBinding(t *testing.T) {
	fleet := startWorkers(t, 3, simConfig(0))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)

	first := c.complete(promptTokens(1, 2*blockTokens), 2, hdr("X-Session-ID", "s1")).mustOK(t)
	bound, rev := first.worker(), first.revision(t)
	other := fleet.other(bound)

	conflict := c.complete(promptTokens(2, 2*blockTokens), 2, hdr("X-Session-ID", "s1", "X-Target-Worker", other.spec.ID))
	e := conflict.wantError(t, http.StatusConflict)
	if e.Type != openai.TypeConflict || e.Code != "target_conflict" || e.Param != "X-Target-Worker" {
		t.Errorf("conflict error %+v, want type %s, code target_conflict, param X-Target-Worker", e, openai.TypeConflict)
	}
	if !sawNothing(other) {
		t.Errorf("the conflicting target %s received the request: %+v", other.spec.ID, other.Stats())
	}
	route := c.post("/v1/route", completionBody(promptTokens(2, 2*blockTokens), 2, false),
		hdr("X-Session-ID", "s1", "X-Target-Worker", other.spec.ID))
	route.wantError(t, http.StatusConflict)

	match := c.complete(promptTokens(3, 2*blockTokens), 2, hdr("X-Session-ID", "s1", "X-Target-Worker", bound)).mustOK(t)
	if match.worker() != bound || match.revision(t) != rev {
		t.Errorf("matching target: %s revision %d, want %s revision %d", match.worker(), match.revision(t), bound, rev)
	}

	// On a new session the target makes the binding, which later requests follow.
	created := c.complete(promptTokens(4, 2*blockTokens), 2, hdr("X-Session-ID", "s2", "X-Target-Worker", other.spec.ID)).mustOK(t)
	if created.worker() != other.spec.ID || created.revision(t) <= rev {
		t.Fatalf("new session with target %s: %s revision %d (previous revision %d)",
			other.spec.ID, created.worker(), created.revision(t), rev)
	}
	follow := c.complete(promptTokens(5, 2*blockTokens), 2, hdr("X-Session-ID", "s2")).mustOK(t)
	if follow.worker() != other.spec.ID || follow.revision(t) != created.revision(t) {
		t.Errorf("s2 without a target: %s revision %d, want %s revision %d",
			follow.worker(), follow.revision(t), other.spec.ID, created.revision(t))
	}
	c.complete(promptTokens(6, 2*blockTokens), 2, hdr("X-Session-ID", "s2", "X-Target-Worker", bound)).
		wantError(t, http.StatusConflict)
	if got := rep.affinity.Len(); got != 2 {
		t.Errorf("replica holds %d sessions, want 2", got)
	}
}

func TestUnknownTargetIs404(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(0))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)

	for _, target := range []string{"nope", "w0/1", "w0/x", "w9/0"} {
		for _, path := range []string{"/v1/completions", "/v1/route"} {
			t.Run(target+" "+path, func(t *testing.T) {
				c := c.with(t)
				a := c.post(path, completionBody(promptTokens(1, blockTokens), 2, false),
					hdr("X-Session-ID", "s", "X-Target-Worker", target))
				e := a.wantError(t, http.StatusNotFound)
				if e.Type != openai.TypeNotFound || e.Param != "X-Target-Worker" || !strings.Contains(e.Message, target) {
					t.Errorf("error %+v, want a not-found error naming %q and X-Target-Worker", e, target)
				}
			})
		}
	}
	requireNoTrace(t, rep, fleet, "rejected requests")
	// A rank suffix of a real worker is a valid target.
	a := c.complete(promptTokens(2, blockTokens), 2, hdr("X-Target-Worker", "w1/0")).mustOK(t)
	if a.worker() != "w1" {
		t.Errorf("target w1/0 answered by %s", a.worker())
	}
}

// routeAnswerWire is /v1/route's reply as a client reads it.
type routeAnswerWire struct {
	Worker          string `json:"worker"`
	URL             string `json:"url"`
	OverlapBlocks   int    `json:"overlap_blocks"`
	PromptBlocks    int    `json:"prompt_blocks"`
	Session         string `json:"session"`
	BindingRevision uint64 `json:"binding_revision"`
	Bound           bool   `json:"bound"`
}

func (c *routerClient) route(tokens []uint32, h http.Header) routeAnswerWire {
	c.t.Helper()
	a := c.post("/v1/route", completionBody(tokens, 2, false), h).mustOK(c.t)
	var ans routeAnswerWire
	if err := json.Unmarshal(a.body, &ans); err != nil {
		c.t.Fatalf("route answer: %v: %s", err, a.body)
	}
	return ans
}

func TestRouteQueryChangesNothing(t *testing.T) {
	const promptBlocks = 8
	fleet := startWorkers(t, 3, simConfig(0))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)
	session := hdr("X-Session-ID", "query-only")
	prompt := promptTokens(5, promptBlocks*blockTokens)

	for i := range 3 {
		ans := c.route(prompt, session)
		w := fleet.byID(t, ans.Worker)
		if ans.URL != w.spec.URL || ans.PromptBlocks != promptBlocks || ans.Session != "query-only" {
			t.Errorf("query %d: %+v; want url %s, %d prompt blocks, the session echoed", i, ans, w.spec.URL, promptBlocks)
		}
		if ans.Bound || ans.BindingRevision != 0 || ans.OverlapBlocks != 0 {
			t.Errorf("query %d found state a query should not have made: %+v", i, ans)
		}
	}
	requireNoTrace(t, rep, fleet, "queries")

	// The first real request of the session initialises its binding.
	real := c.complete(prompt, 2, session).mustOK(t)
	rev := real.revision(t)
	if rev == 0 || real.overlap(t) != 0 {
		t.Fatalf("first real request: revision %d overlap %d, want a new binding and no recorded prefix", rev, real.overlap(t))
	}
	waitRouterIdle(t, rep)
	ans := c.route(prompt, session)
	// All but the last block: the engine computes the prompt's last token anyway.
	if !ans.Bound || ans.Worker != real.worker() || ans.BindingRevision != rev || ans.OverlapBlocks != promptBlocks-1 {
		t.Errorf("query of the bound session: %+v, want bound to %s at revision %d with %d blocks overlap",
			ans, real.worker(), rev, promptBlocks-1)
	}
	again := c.complete(prompt, 2, session).mustOK(t)
	if again.worker() != real.worker() || again.revision(t) != rev {
		t.Errorf("after the query: %s revision %d, want %s revision %d", again.worker(), again.revision(t), real.worker(), rev)
	}
}

func TestSessionExpiresAfterItsTTLIdle(t *testing.T) {
	fleet := startWorkers(t, 3, simConfig(10*time.Millisecond))
	rep := startTestReplica(t, fleet, func(cfg *Config) { cfg.SessionTTL = 200 * time.Millisecond })
	c := newRouterClient(t, rep)
	session := hdr("X-Session-ID", "short-lived")

	// A stream of the session keeps it active (an active session never idles out) while
	// the test sets the fleet up.
	s := c.openStream(promptTokens(1, 4*blockTokens), 4000, session)
	s.firstChunk(t)
	first, rev := s.worker(), headerRevision(t, s.resp.Header)

	// A prefix held by another worker: the loaded bound worker is avoided without a session.
	shared := promptTokens(2, 16*blockTokens)
	holder := c.complete(shared, 2, nil).mustOK(t).worker()
	if holder == first {
		t.Fatalf("the prefix went to the loaded worker %s; cannot set up a competing cache", holder)
	}
	// While bound, the session stays put even where another worker holds the prefix.
	stay := c.complete(concat(shared[:4*blockTokens], promptTokens(3, blockTokens)), 2, session).mustOK(t)
	if stay.worker() != first || stay.revision(t) != rev {
		t.Fatalf("bound session went to %s revision %d, want %s revision %d", stay.worker(), stay.revision(t), first, rev)
	}
	s.close()
	waitRouterIdle(t, rep)

	eventually(t, "the session to idle out", func() (bool, string) {
		ans := c.route(shared, session)
		return !ans.Bound && ans.BindingRevision == 0, fmt.Sprintf("%+v", ans)
	})
	moved := c.complete(concat(shared, promptTokens(4, 5)), 2, session).mustOK(t)
	if moved.revision(t) <= rev {
		t.Fatalf("after expiry: revision %d, want above %d", moved.revision(t), rev)
	}
	if moved.worker() != holder {
		t.Errorf("after expiry the session went to %s, want %s which holds its prefix", moved.worker(), holder)
	}
	next := c.complete(promptTokens(5, 2*blockTokens), 2, session).mustOK(t)
	if next.worker() != moved.worker() || next.revision(t) != moved.revision(t) {
		t.Errorf("the new binding did not hold: %s revision %d, want %s revision %d",
			next.worker(), next.revision(t), moved.worker(), moved.revision(t))
	}
}

func TestBadSessionKeyIs400(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(0))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)

	cases := []struct {
		name   string
		header http.Header
	}{
		{"257 bytes", hdr("X-Session-ID", strings.Repeat("k", 257))},
		{"a space", hdr("X-Session-ID", "two words")},
		{"a tab", hdr("X-Session-ID", "tab\there")},
		{"non-ASCII", hdr("X-Session-ID", "café")},
		{"given twice", hdr("X-Session-ID", "a", "X-Session-ID", "b")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := c.with(t)
			for _, path := range []string{"/v1/completions", "/v1/route"} {
				e := c.post(path, completionBody(promptTokens(1, blockTokens), 2, false), tc.header).
					wantError(t, http.StatusBadRequest)
				if e.Type != openai.TypeInvalidRequest || e.Param != "X-Session-ID" {
					t.Errorf("%s: error %+v, want invalid_request_error on X-Session-ID", path, e)
				}
			}
		})
	}
	requireNoTrace(t, rep, fleet, "rejected keys")
	// The bound is inclusive: 256 printable bytes are a valid key.
	a := c.complete(promptTokens(2, blockTokens), 2, hdr("X-Session-ID", strings.Repeat("k", 256))).mustOK(t)
	if a.revision(t) == 0 {
		t.Errorf("a 256-byte key got no binding")
	}
}

func TestBadInputGetsClearErrors(t *testing.T) {
	const bodyLimit = 64 << 10
	fleet := startWorkers(t, 2, simConfig(0))
	rep := startTestReplica(t, fleet, func(cfg *Config) {
		cfg.Proxy.MaxBodyBytes = bodyLimit
		cfg.Health = openai.HealthConfig{Interval: 20 * time.Millisecond, Timeout: 500 * time.Millisecond}
	})
	c := newRouterClient(t, rep)
	session := hdr("X-Session-ID", "bad-input")

	cases := []struct {
		name, path, body, param string
	}{
		{"malformed JSON", "/v1/completions", `{"model": "m", "prompt": `, ""},
		{"not an object", "/v1/chat/completions", `[1, 2]`, ""},
		{"missing model", "/v1/completions", `{"prompt": "hi"}`, "model"},
		{"model not a string", "/v1/completions", `{"model": 5, "prompt": "hi"}`, "model"},
		{"empty model", "/v1/chat/completions", `{"model": "", "messages": [{"role": "user", "content": "hi"}]}`, "model"},
		{"stream not a boolean", "/v1/completions", `{"model": "m", "prompt": "hi", "stream": "yes"}`, "stream"},
		{"missing messages", "/v1/chat/completions", `{"model": "m"}`, "messages"},
		{"messages not an array", "/v1/chat/completions", `{"model": "m", "messages": "hi"}`, "messages"},
		{"empty messages", "/v1/chat/completions", `{"model": "m", "messages": []}`, "messages"},
		{"message not an object", "/v1/chat/completions", `{"model": "m", "messages": [7]}`, "messages[0]"},
		{"role not a string", "/v1/chat/completions", `{"model": "m", "messages": [{"role": 1, "content": "x"}]}`, "messages[0].role"},
		{"content wrong type", "/v1/chat/completions", `{"model": "m", "messages": [{"role": "user", "content": 3}]}`, "messages[0].content"},
		{"missing prompt", "/v1/completions", `{"model": "m"}`, "prompt"},
		{"prompt an object", "/v1/completions", `{"model": "m", "prompt": {}}`, "prompt"},
		{"negative token id", "/v1/completions", `{"model": "m", "prompt": [1, -2]}`, "prompt"},
		{"fractional token id", "/v1/completions", `{"model": "m", "prompt": [1, 2.5]}`, "prompt"},
		{"empty token array", "/v1/completions", `{"model": "m", "prompt": []}`, "prompt"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := c.with(t)
			e := c.post(tc.path, []byte(tc.body), session).wantError(t, http.StatusBadRequest)
			if e.Type != openai.TypeInvalidRequest || e.Param != tc.param {
				t.Errorf("error %+v, want invalid_request_error with param %q", e, tc.param)
			}
			if tc.param != "" && !strings.Contains(e.Message, tc.param) {
				t.Errorf("message %q does not name %q", e.Message, tc.param)
			}
		})
	}

	big := completionBody(promptTokens(1, bodyLimit/4), 2, false)
	if len(big) <= bodyLimit {
		t.Fatalf("test body of %d bytes is not over the %d limit", len(big), bodyLimit)
	}
	for _, chunked := range []bool{false, true} {
		t.Run(fmt.Sprintf("over the body limit, chunked=%v", chunked), func(t *testing.T) {
			var body io.Reader = bytes.NewReader(big)
			if chunked {
				// Hiding the length makes the client send it chunked.
				body = io.MultiReader(body)
			}
			a, err := c.do(t.Context(), http.MethodPost, "/v1/completions", body, session)
			if err != nil {
				t.Fatalf("POST: %v", err)
			}
			if e := a.wantError(t, http.StatusRequestEntityTooLarge); e.Type != openai.TypeInvalidRequest {
				t.Errorf("413 error type %q", e.Type)
			}
		})
	}
	a, err := c.do(t.Context(), http.MethodGet, "/v1/completions", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	a.wantError(t, http.StatusMethodNotAllowed)

	requireNoTrace(t, rep, fleet, "bad requests")

	// A model no worker serves, once the replica has learned the workers' models, is the
	// router's own 404: no worker is asked, no session bound.
	eventually(t, "the workers' models learned", func() (bool, string) {
		return !rep.registry.Catalog().Open(), "some worker's models not known yet"
	})
	if a := c.post("/v1/completions", []byte(`{"model": "no-such-model", "prompt": [1, 2, 3]}`), session); a.wantError(t, http.StatusNotFound).Code != "model_not_found" || a.worker() != "" {
		t.Errorf("unknown model: worker %q; want the router's own 404 model_not_found", a.worker())
	}

	// Requests the router cannot judge reach a worker, whose refusal the client sees as is;
	// the session is not bound to a worker that refused its first request.
	for _, tc := range []struct {
		name   string
		body   string
		status int
	}{
		{"max_tokens 0", `{"model": "` + sim.DefaultModel + `", "prompt": [1, 2, 3], "max_tokens": 0}`, http.StatusBadRequest},
	} {
		a := c.post("/v1/completions", []byte(tc.body), session)
		a.wantError(t, tc.status)
		if a.worker() == "" || a.revision(t) != 0 {
			t.Errorf("%s: worker %q revision %d; want the worker named and no binding", tc.name, a.worker(), a.revision(t))
		}
	}
	if got := rep.affinity.Len(); got != 0 {
		t.Errorf("requests refused by a worker left %d sessions", got)
	}
	for _, st := range rep.registry.List() {
		if !st.Healthy {
			t.Errorf("a client's bad request marked worker %s unhealthy: %s", st.Spec.ID, st.Reason)
		}
	}

	// No healthy worker: every worker refuses, and the health checker takes them out.
	for _, w := range fleet {
		if err := w.SetFaults(sim.Faults{Refuse: true}); err != nil {
			t.Fatal(err)
		}
	}
	waitReady(t, c, http.StatusServiceUnavailable)
	unavailable := c.complete(promptTokens(2, blockTokens), 2, session)
	if e := unavailable.wantError(t, http.StatusServiceUnavailable); e.Type != openai.TypeUnavailable {
		t.Errorf("503 error type %q, want %s", e.Type, openai.TypeUnavailable)
	}
	if unavailable.header.Get("Retry-After") == "" {
		t.Errorf("503 without Retry-After")
	}
	if got := rep.affinity.Len(); got != 0 {
		t.Errorf("a request with no worker left %d sessions", got)
	}

	for _, w := range fleet {
		if err := w.SetFaults(sim.Faults{}); err != nil {
			t.Fatal(err)
		}
	}
	waitReady(t, c, http.StatusOK)
	good := c.complete(promptTokens(3, 2*blockTokens), 2, session).mustOK(t)
	if good.revision(t) == 0 {
		t.Errorf("the good request after all the bad ones got no binding")
	}
}

func TestSessionCapIs429(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(0))
	rep := startTestReplica(t, fleet, func(cfg *Config) { cfg.MaxSessions = 2 })
	c := newRouterClient(t, rep)

	revs := map[string]uint64{}
	for _, key := range []string{"first", "second"} {
		revs[key] = c.complete(promptTokens(1, blockTokens), 2, hdr("X-Session-ID", key)).mustOK(t).revision(t)
	}
	e := c.complete(promptTokens(2, blockTokens), 2, hdr("X-Session-ID", "third")).wantError(t, http.StatusTooManyRequests)
	if e.Type != openai.TypeRateLimit || e.Param != "X-Session-ID" {
		t.Errorf("error %+v, want a rate-limit error on X-Session-ID", e)
	}
	// Over the cap nothing is evicted: the bound sessions keep their bindings.
	for key, rev := range revs {
		if got := c.complete(promptTokens(3, blockTokens), 2, hdr("X-Session-ID", key)).mustOK(t).revision(t); got != rev {
			t.Errorf("session %s: revision %d, want %d", key, got, rev)
		}
	}
	c.complete(promptTokens(4, blockTokens), 2, nil).mustOK(t)
}

// waitHealth polls the registry until worker id's health is healthy.
func waitHealth(t *testing.T, rep *Replica, id string, healthy bool) {
	t.Helper()
	eventually(t, fmt.Sprintf("worker %s healthy=%v", id, healthy), func() (bool, string) {
		for _, st := range rep.registry.List() {
			if st.Spec.ID == id {
				return st.Healthy == healthy, fmt.Sprintf("%+v", st)
			}
		}
		return false, "not in the registry"
	})
}

// waitReady polls /readyz until it answers status.
func waitReady(t *testing.T, c *routerClient, status int) {
	t.Helper()
	eventually(t, fmt.Sprintf("/readyz to answer %d", status), func() (bool, string) {
		a, err := c.do(t.Context(), http.MethodGet, "/readyz", nil, nil)
		if err != nil {
			return false, err.Error()
		}
		return a.status == status, fmt.Sprintf("%d %s", a.status, a.body)
	})
}

// waitInFlight polls until rep has n requests in flight on its workers.
func waitInFlight(t *testing.T, rep *Replica, n int64) {
	t.Helper()
	eventually(t, fmt.Sprintf("%d requests in flight", n), func() (bool, string) {
		var total int64
		for _, l := range rep.tracker.Snapshot() {
			total += l.Requests
		}
		return total == n, fmt.Sprintf("%d", total)
	})
}

// TestNonStreamingSiblingSentDuringGenerationGoesToTheSameWorker: a non-streaming request's
// prompt enters the index when it is sent, not when its answer (at the end of generation)
// comes back, so a sibling sent while it generates is predicted cached on its worker. Two
// workers: A runs the first request (20 blocks, non-streaming, a long decode), B a busy one
// of 15 blocks. The kv cost of the sibling is then 20+20+20 = 60 on A with the 20 blocks
// predicted (the first's prefill and decode load, no prefill of its own) against 15+15+20+20
// = 70 on B: A. Recorded at the worker's first answer, the sibling saw an overlap of 0 on A
// (cost 80) and went to B.
func TestNonStreamingSiblingSentDuringGenerationGoesToTheSameWorker(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(20*time.Millisecond))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)
	prompt := promptTokens(41, 20*blockTokens)
	first := make(chan answer, 1)
	go func() { first <- c.complete(prompt, 40, nil) }()
	waitInFlight(t, rep, 1)
	busy := make(chan answer, 1)
	go func() { busy <- c.complete(promptTokens(42, 15*blockTokens), 40, nil) }()
	waitInFlight(t, rep, 2)
	second := c.complete(prompt, 2, nil).mustOK(t)
	a, b := (<-first).mustOK(t), (<-busy).mustOK(t)
	if a.worker() == b.worker() {
		t.Fatalf("the first and the busy request both went to %s", a.worker())
	}
	// 19 of the 20 blocks predicted: the engine computes a prompt's last token even when all
	// of it is cached, so it reports 19 blocks' tokens.
	if second.worker() != a.worker() || second.overlap(t) != 19 {
		t.Fatalf("the sibling went to %s with %d blocks predicted (want 19); the first is on %s (20 blocks), the busy one on %s",
			second.worker(), second.overlap(t), a.worker(), b.worker())
	}
}

// TestAPromptFinishedLastIsEvictedLast: the index's recency follows the worker's cache,
// which uses a request's blocks last when the request ends. One worker caching 64 blocks,
// the router remembering 60: A (20 blocks, a long non-streaming decode) is sent first, B and
// C (20 each) are sent and finish while A generates, then A finishes and D (20) comes. The
// worker evicts B, released first, and keeps A; the router, which records A again when it
// ends, evicts B too and predicts A whole. Recorded only at dispatch, A was the router's
// oldest and D evicted it: A predicted 0 while the worker held all of it.
func TestAPromptFinishedLastIsEvictedLast(t *testing.T) {
	sc := simConfig(20 * time.Millisecond)
	sc.CapacityBlocks = 64
	fleet := startWorkers(t, 1, sc)
	rep := startTestReplica(t, fleet, func(c *Config) { c.ApproxMaxBlocks = 60 })
	c := newRouterClient(t, rep)
	a := promptTokens(51, 20*blockTokens)
	first := make(chan answer, 1)
	go func() { first <- c.complete(a, 40, nil) }()
	waitInFlight(t, rep, 1)
	c.complete(promptTokens(52, 20*blockTokens), 2, nil).mustOK(t)
	c.complete(promptTokens(53, 20*blockTokens), 2, nil).mustOK(t)
	(<-first).mustOK(t)
	c.complete(promptTokens(54, 20*blockTokens), 2, nil).mustOK(t)
	// The worker leaves the last prompt token to compute, so the router predicts, and the
	// worker reports, one block less than A's 20.
	if got := c.route(a, nil).OverlapBlocks; got != 19 {
		t.Fatalf("A, finished after B and C, is predicted %d blocks cached, want 19", got)
	}
	again := c.complete(a, 2, nil).mustOK(t)
	if got := again.cachedTokens(t); got != 19*blockTokens {
		t.Fatalf("the worker had %d tokens of A cached, want %d", got, 19*blockTokens)
	}
}
