package routing

import (
	"sync"
	"sync/atomic"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// Tracker is this replica's per-worker load accounting. It implements LoadView.
//
// A request counts as one in-flight request and its uncached prompt tokens as prefill work
// until its first token arrives; the KV blocks it occupies count as decode blocks from start
// to finish, because the engine allocates them at admission.
type Tracker struct {
	// workers is copied on write: workers are added rarely, and read for every candidate of
	// every selection, so reads take no lock.
	mu      sync.Mutex
	workers atomic.Pointer[map[indexer.Worker]*counters]

	// waiters is how many selections wait for load to drop; only then does a release
	// pay for waking them.
	waiters atomic.Int64
	wakeMu  sync.Mutex
	wake    chan struct{}

	// changes holds one token while a change of the counters is unread (Changes).
	changes chan struct{}
}

type counters struct {
	requests, prefill, decode atomic.Int64
}

// NewTracker returns an empty tracker.
func NewTracker() *Tracker {
	t := &Tracker{changes: make(chan struct{}, 1)}
	m := make(map[indexer.Worker]*counters)
	t.workers.Store(&m)
	return t
}

func (t *Tracker) counters(w indexer.Worker) *counters {
	if c := (*t.workers.Load())[w]; c != nil {
		return c
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	old := *t.workers.Load()
	if c := old[w]; c != nil {
		return c
	}
	m := make(map[indexer.Worker]*counters, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	c := &counters{}
	m[w] = c
	t.workers.Store(&m)
	return c
}

// Load implements LoadView.
func (t *Tracker) Load(w indexer.Worker) Load {
	return (*t.workers.Load())[w].load()
}

// load reads the counters; nil counters (a worker never seen) are no load.
func (c *counters) load() Load {
	if c == nil {
		return Load{}
	}
	return Load{Requests: c.requests.Load(), PrefillTokens: c.prefill.Load(), DecodeBlocks: c.decode.Load()}
}

// Snapshot returns every worker's load (for metrics and gossip).
func (t *Tracker) Snapshot() map[indexer.Worker]Load {
	m := *t.workers.Load()
	out := make(map[indexer.Worker]Load, len(m))
	for w, c := range m {
		out[w] = c.load()
	}
	return out
}

// Forget drops a worker's counters (it was removed). In-flight tickets still release safely.
func (t *Tracker) Forget(w indexer.Worker) {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := *t.workers.Load()
	m := make(map[indexer.Worker]*counters, len(old))
	for k, v := range old {
		if k != w {
			m[k] = v
		}
	}
	t.workers.Store(&m)
}

// Start counts a request on w: prefillTokens until its first token, decodeBlocks until it ends.
func (t *Tracker) Start(w indexer.Worker, prefillTokens, decodeBlocks int64) *Ticket {
	k := new(Ticket)
	t.startInto(k, w, prefillTokens, decodeBlocks)
	return k
}

// startInto is Start filling a Ticket the caller owns, which must be fresh (its zero value),
// so that an Attempt's first ticket lives inside the Attempt rather than in an allocation of
// its own.
func (t *Tracker) startInto(k *Ticket, w indexer.Worker, prefillTokens, decodeBlocks int64) {
	c := t.counters(w)
	c.requests.Add(1)
	c.prefill.Add(prefillTokens)
	c.decode.Add(decodeBlocks)
	k.tracker, k.c, k.prefill, k.decode = t, c, prefillTokens, decodeBlocks
	t.notify()
}

// Changes returns a channel that holds a token whenever the counters changed (a request
// started, had its first token or finished) since the token was last taken: what a sharer
// of this load waits on to publish a change as it happens. Tokens do not queue up: one
// stands for every change since the last was taken.
func (t *Tracker) Changes() <-chan struct{} { return t.changes }

// notify notes a change for Changes. A full channel (a token already waiting) costs no lock.
func (t *Tracker) notify() {
	select {
	case t.changes <- struct{}{}:
	default:
	}
}

// changed returns a channel closed at the next release of load.
func (t *Tracker) changed() <-chan struct{} {
	t.wakeMu.Lock()
	defer t.wakeMu.Unlock()
	if t.wake == nil {
		t.wake = make(chan struct{})
	}
	return t.wake
}

func (t *Tracker) released() {
	if t.waiters.Load() == 0 {
		return
	}
	t.wakeMu.Lock()
	if t.wake != nil {
		close(t.wake)
		t.wake = nil
	}
	t.wakeMu.Unlock()
}

// Ticket is one request's share of a worker's load. Its methods are idempotent and safe to
// call from several goroutines.
type Ticket struct {
	tracker         *Tracker
	c               *counters
	prefill, decode int64
	state           atomic.Int32 // 0 prefill, 1 decoding, 2 done
}

// FirstToken ends the request's prefill: its prefill tokens no longer count.
func (k *Ticket) FirstToken() {
	if k == nil || !k.state.CompareAndSwap(0, 1) {
		return
	}
	k.c.prefill.Add(-k.prefill)
	k.tracker.notify()
	k.tracker.released()
}

// Finish releases everything the request still holds.
func (k *Ticket) Finish() {
	if k == nil {
		return
	}
	for {
		s := k.state.Load()
		if s == 2 {
			return
		}
		if k.state.CompareAndSwap(s, 2) {
			if s == 0 {
				k.c.prefill.Add(-k.prefill)
			}
			k.c.decode.Add(-k.decode)
			k.c.requests.Add(-1)
			k.tracker.notify()
			k.tracker.released()
			return
		}
	}
}
