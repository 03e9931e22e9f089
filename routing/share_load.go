package routing

import (
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// RemoteLoad is a LoadView of the whole fleet's in-flight work: this replica's own load
// (a Tracker, read live) plus the shares other replicas last published for each worker.
// Behind a load balancer each replica sees only part of the traffic, and a worker busy with
// another replica's requests would otherwise look idle here, so every replica would herd
// onto it.
//
// A replica's share of a worker lasts TTL from the moment it arrived unless a newer report
// replaces it; Forget drops a replica at once (it died or left). Expiry happens in Set and
// Expire, not in Load (reading a clock per candidate would cost more than the lookup), so
// the owner calls Expire periodically; until it runs, an expired share still counts.
//
// Load is one more map lookup than the Tracker's, and none while no other replica has
// ever published load; a router can skip both lookups (see cellsOver).
type RemoteLoad struct {
	local LoadView
	ttl   time.Duration

	mu       sync.Mutex
	replicas map[string]map[indexer.Worker]remoteShare
	// cells hold every worker's total over live remote shares, updated in place on each
	// change and read without a lock. The map is copied on write and only when a worker
	// gets remote load for the first time, so a cell's address is stable and the router's
	// per-snapshot view may keep it, as it keeps the Tracker's counters.
	cells atomic.Pointer[map[indexer.Worker]*remoteCell]
}

// remoteCell is one worker's remote load; its fields are read without a lock, and a read
// racing an update may mix old and new figures, which a load estimate tolerates.
type remoteCell struct {
	requests, prefill, decode atomic.Int64
}

func (c *remoteCell) load() Load {
	if c == nil {
		return Load{}
	}
	return Load{Requests: c.requests.Load(), PrefillTokens: c.prefill.Load(), DecodeBlocks: c.decode.Load()}
}

func (c *remoteCell) store(l Load) {
	c.requests.Store(l.Requests)
	c.prefill.Store(l.PrefillTokens)
	c.decode.Store(l.DecodeBlocks)
}

type remoteShare struct {
	load Load
	at   time.Time
}

// NewRemoteLoad returns a view of local plus remote shares that last ttl (at least 1 ms).
func NewRemoteLoad(local LoadView, ttl time.Duration) *RemoteLoad {
	r := &RemoteLoad{local: local, ttl: max(ttl, time.Millisecond), replicas: map[string]map[indexer.Worker]remoteShare{}}
	empty := map[indexer.Worker]*remoteCell{}
	r.cells.Store(&empty)
	return r
}

// cellsOver returns the identity of r's cell map when r adds remote shares to t (so a
// routableView may read t's counters and r's cells directly), or nil.
func (r *RemoteLoad) cellsOver(t *Tracker) *map[indexer.Worker]*remoteCell {
	if lt, ok := r.local.(*Tracker); !ok || lt != t {
		return nil
	}
	return r.cells.Load()
}

// Load implements LoadView: the local load plus every live remote share of w.
func (r *RemoteLoad) Load(w indexer.Worker) Load {
	l := r.local.Load(w)
	if m := *r.cells.Load(); len(m) > 0 {
		l = l.plus(m[w].load())
	}
	return l
}

// plus adds two loads.
func (l Load) plus(o Load) Load {
	return Load{Requests: l.Requests + o.Requests, PrefillTokens: l.PrefillTokens + o.PrefillTokens, DecodeBlocks: l.DecodeBlocks + o.DecodeBlocks}
}

// Remote returns the sum of the other replicas' live shares of w, without the local load.
func (r *RemoteLoad) Remote(w indexer.Worker) Load {
	return (*r.cells.Load())[w].load()
}

// Set records replica's report, received at: each worker in loads gets that share. A
// worker the report leaves out keeps its previous share until it expires, so a replica may
// omit idle workers once it has reported them idle. Shares older than the TTL at `at` are
// dropped. Negative figures count as zero.
func (r *RemoteLoad) Set(replica string, loads map[indexer.Worker]Load, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := r.replicas[replica]
	if m == nil {
		m = make(map[indexer.Worker]remoteShare, len(loads))
		r.replicas[replica] = m
	}
	for w, l := range loads {
		l.Requests, l.PrefillTokens, l.DecodeBlocks = max(l.Requests, 0), max(l.PrefillTokens, 0), max(l.DecodeBlocks, 0)
		m[w] = remoteShare{load: l, at: at}
	}
	r.expireLocked(at)
	r.rebuildLocked()
}

// Forget drops every share of replica (it died or left).
func (r *RemoteLoad) Forget(replica string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.replicas[replica]; !ok {
		return
	}
	delete(r.replicas, replica)
	r.rebuildLocked()
}

// Expire drops the shares older than the TTL at now and returns how many it dropped.
func (r *RemoteLoad) Expire(now time.Time) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.expireLocked(now)
	if n > 0 {
		r.rebuildLocked()
	}
	return n
}

// Replicas returns the replicas with at least one live share, sorted.
func (r *RemoteLoad) Replicas() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, 0, len(r.replicas))
	for id := range r.replicas {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

func (r *RemoteLoad) expireLocked(now time.Time) int {
	n := 0
	for id, m := range r.replicas {
		for w, s := range m {
			if now.Sub(s.at) > r.ttl {
				delete(m, w)
				n++
			}
		}
		if len(m) == 0 {
			delete(r.replicas, id)
		}
	}
	return n
}

// rebuildLocked recomputes every cell from the live shares.
func (r *RemoteLoad) rebuildLocked() {
	sums := make(map[indexer.Worker]Load)
	for _, m := range r.replicas {
		for w, s := range m {
			sums[w] = sums[w].plus(s.load)
		}
	}
	cells := *r.cells.Load()
	grown := false
	for w, l := range sums {
		if cells[w] == nil && l != (Load{}) {
			if !grown {
				cells, grown = maps.Clone(cells), true
			}
			cells[w] = &remoteCell{}
		}
	}
	for w, c := range cells {
		c.store(sums[w])
	}
	if grown {
		r.cells.Store(&cells)
	}
	// Selections waiting for room wait on the tracker's releases; a remote share that
	// shrank may be the room they wait for.
	if t, ok := r.local.(*Tracker); ok {
		t.released()
	}
}
