package sim

import (
	"context"
	"slices"
	"sync"
	"time"
)

// engine is the stepped scheduler of chunked prefill (Config.ChunkedPrefillTokens > 0), as
// vLLM's scheduler with chunked prefill: every step takes up to ChunkedPrefillTokens prompt
// tokens from the requests still prefilling, oldest first, and one output token from each
// request that is decoding. A step lasts DecodePerToken when anything decodes in it, plus
// PrefillPerToken for each prompt token it prefills; so a decode that shares its steps with
// a prefill slows down by the prefill's time. One goroutine runs the steps while there is
// work and exits when there is none.
type engine struct {
	w *Worker

	mu       sync.Mutex
	prefills []*engineReq // still prefilling, in arrival order
	decodes  []*engineReq // prefilled, with output tokens left to produce
	running  bool         // the step goroutine runs
}

// engineReq is one request in the engine. The step goroutine changes it under engine.mu;
// the request's own goroutine reads it there and emits the tokens produced.
type engineReq struct {
	prompt []uint32
	salt   string // the request's cache_salt
	// seq is the request's hold on the cache: given (a decode leg) or taken at the lookup
	// when its first chunk is scheduled.
	seq       *sequence
	cached    int
	remaining int // prompt tokens left to prefill; set with seq
	total     int // output tokens to produce
	produced  int
	started   bool // its prefill has been scheduled
	gone      bool
	// ready is signalled (without blocking) whenever produced grows.
	ready chan struct{}
}

// chunk is the part of one request's prefill a step computes.
type chunk struct {
	r      *engineReq
	tokens int
}

// generate runs req through the engine: the stepped counterpart of Worker.generate, with
// the same contract.
func (e *engine) generate(ctx context.Context, req *genRequest, out output, seq *sequence, emit func(i int) error, res *runResult) (*sequence, error) {
	r := &engineReq{prompt: req.prompt, salt: req.cacheSalt, seq: seq, cached: res.cached, total: len(out.tokens), ready: make(chan struct{}, 1)}
	if seq != nil {
		r.remaining = e.w.prefillTokens(req.prompt, seq)
	}
	if e.add(r) {
		go e.loop()
	}

	for emitted := 0; emitted < r.total; {
		select {
		case <-r.ready:
		case <-ctx.Done():
			return e.leave(r), ctx.Err()
		}
		e.mu.Lock()
		produced, cached := r.produced, r.cached
		e.mu.Unlock()
		res.cached = cached
		for ; emitted < produced; emitted++ {
			if err := emit(emitted); err != nil {
				return e.leave(r), err
			}
			e.w.genTokens.Add(1)
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return r.seq, nil
}

// add queues r for prefill; true means no step goroutine runs and the caller must start one.
func (e *engine) add(r *engineReq) (start bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.prefills = append(e.prefills, r)
	start = !e.running
	e.running = true
	return start
}

// leave takes a request out of the engine for good and returns its hold on the cache.
func (e *engine) leave(r *engineReq) *sequence {
	e.mu.Lock()
	defer e.mu.Unlock()
	r.gone = true
	e.prefills = slices.DeleteFunc(e.prefills, func(x *engineReq) bool { return x == r })
	e.decodes = slices.DeleteFunc(e.decodes, func(x *engineReq) bool { return x == r })
	return r.seq
}

// plan picks the next step's work: the prefill chunks and the requests that decode in it,
// and the step's simulated length. It runs with e.mu held.
func (e *engine) plan() (chunks []chunk, decoders []*engineReq, d time.Duration) {
	w := e.w
	budget := w.cfg.ChunkedPrefillTokens
	prefilled := 0
	for _, r := range e.prefills {
		if budget == 0 {
			break
		}
		if !r.started {
			if r.seq == nil {
				// The lookup happens when the request's prefill starts, so that it finds
				// what the prefills before it stored.
				r.seq, r.cached = w.lookup(r.prompt, r.salt)
				r.remaining = w.prefillTokens(r.prompt, r.seq)
			}
			r.started = true
			w.prefillStarts(r.prompt, r.cached)
		}
		n := min(budget, r.remaining)
		chunks = append(chunks, chunk{r, n})
		budget -= n
		prefilled += n
	}
	decoders = slices.Clone(e.decodes)
	d = time.Duration(prefilled) * w.cfg.PrefillPerToken
	if len(decoders) > 0 {
		d += w.cfg.DecodePerToken
	}
	return chunks, decoders, d
}

// loop runs steps until the engine is empty. Steps follow a clock kept from the loop's
// start, so a timer's lateness does not add up; but a loop more than a step behind (a
// starved CPU) forgets the lateness rather than run steps back to back to catch up, which
// would send their tokens in bursts: a late engine is a slower one, as a saturated GPU is.
func (e *engine) loop() {
	w := e.w
	clock := time.Now()
	for {
		e.mu.Lock()
		if len(e.prefills) == 0 && len(e.decodes) == 0 {
			e.running = false
			e.mu.Unlock()
			return
		}
		chunks, decoders, d := e.plan()
		e.mu.Unlock()

		clock = stepClock(clock, time.Now(), w.scale(d, 1))
		if wait := time.Until(clock); wait > 0 {
			time.Sleep(wait)
		}

		e.step(chunks, decoders, d)
	}
}

// stepClock is when the next step, span long, is due after the one due at clock, seen at
// now: a span later, unless that is more than a span past already, and then now (the
// lateness is forgotten, not caught up with steps back to back).
func stepClock(clock, now time.Time, span time.Duration) time.Time {
	next := clock.Add(span)
	if now.Sub(next) > span {
		return now
	}
	return next
}

// step applies a planned step once its time d has passed: each decoder gets a token, the
// chunks are computed, and the requests whose prefill they end store their prompt blocks
// and get their first token.
func (e *engine) step(chunks []chunk, decoders []*engineReq, d time.Duration) {
	w := e.w
	e.mu.Lock()
	for _, r := range decoders {
		if r.gone {
			continue
		}
		r.produced++
		w.interTokens.Add(1)
		w.interTokenNanos.Add(int64(d))
		signal(r)
		if r.produced == r.total {
			e.decodes = slices.DeleteFunc(e.decodes, func(x *engineReq) bool { return x == r })
		}
	}
	var prefilled []*engineReq
	for _, c := range chunks {
		if c.r.gone {
			continue
		}
		if c.r.remaining -= c.tokens; c.r.remaining == 0 {
			prefilled = append(prefilled, c.r)
		}
	}
	e.prefills = slices.DeleteFunc(e.prefills, func(x *engineReq) bool { return x.started && x.remaining == 0 })
	e.mu.Unlock()

	// Stored before the next step is planned, so that its lookups find these blocks. A
	// store into the hold of a request that left meanwhile does nothing.
	for _, r := range prefilled {
		w.cache.store(r.seq, r.prompt)
	}

	e.mu.Lock()
	defer e.mu.Unlock()
	for _, r := range prefilled {
		if r.gone {
			continue
		}
		r.produced = 1 // the first token comes with the end of the prefill
		signal(r)
		if r.total > 1 {
			e.decodes = append(e.decodes, r)
		}
	}
}

// signal wakes a request's goroutine without waiting for it.
func signal(r *engineReq) {
	select {
	case r.ready <- struct{}{}:
	default:
	}
}
