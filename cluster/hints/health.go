package hints

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
)

// HealthViewOptions tune the merged worker health view. Zero values take the defaults.
type HealthViewOptions struct {
	// FailThreshold consecutive failed probes of this replica take a worker out (3).
	FailThreshold int
	// RiseThreshold consecutive good probes of this replica are needed to put it back (2).
	RiseThreshold int
	// Confirm is how many other replicas must hold a worker down (their own checkers past
	// their fail threshold) to take it out here without our own probes agreeing (2).
	Confirm int
	// StaleAfter: a remote observation not refreshed for this long is ignored (5s).
	StaleAfter time.Duration
	// Resend is how often this replica repeats its observations of failing workers, which
	// keeps them fresh on the others (1s; keep it well under StaleAfter).
	Resend time.Duration
	// Alive tells whether a replica is a live member; observations of the others are
	// ignored (nil: every replica counts).
	Alive func(replica string) bool
	// Now is the clock (tests; nil: time.Now).
	Now func() time.Time
}

func (o *HealthViewOptions) defaults() {
	if o.FailThreshold <= 0 {
		o.FailThreshold = 3
	}
	if o.RiseThreshold <= 0 {
		o.RiseThreshold = 2
	}
	if o.Confirm <= 0 {
		o.Confirm = 2
	}
	if o.StaleAfter <= 0 {
		o.StaleAfter = 5 * time.Second
	}
	if o.Resend <= 0 {
		o.Resend = time.Second
	}
	if o.Now == nil {
		o.Now = time.Now
	}
}

// HealthView merges this replica's worker probes with the other replicas' gossiped ones
// and decides, per worker, whether this replica may route to it.
//
// The rule, per worker (a worker nobody has reported on is routable):
//
//   - Out when this replica's checker has seen FailThreshold failures in a row; or when it
//     has seen at least one failure in a row and at least one other replica reports a
//     current failure run (suspected here, confirmed there: a dead worker leaves every
//     replica within about one probe interval plus a gossip round); or when at least
//     Confirm other replicas hold it down (their checkers passed their thresholds).
//   - Back in only after this replica has seen RiseThreshold good probes in a row and
//     fewer than Confirm other replicas hold it down. A replica that has not probed the
//     worker itself takes it back once no other replica reports it failing.
//   - Only observations of alive replicas, refreshed within StaleAfter, count.
//
// The thresholds give the hysteresis: a single blip on one replica moves nothing; a
// worker that flaps goes out once and stays out until it has been healthy RiseThreshold
// probes in a row, rather than bouncing on each blip. One replica with a broken path to a
// worker cannot keep it out elsewhere (it is one report, under Confirm).
//
// Health is a hint: a wrong verdict costs a retry or a slightly worse choice, never a
// wrong binding (bindings change only through Raft).
type HealthView struct {
	self string
	opts HealthViewOptions
	// epoch tells this run's reports from a previous run's (a restart resets seq).
	epoch uint64

	// cbMu serializes OnChange callbacks so they arrive in the order decided.
	cbMu sync.Mutex
	// rejected counts reports that did not decode.
	rejected atomic.Uint64

	mu        sync.Mutex
	seq       uint64
	own       map[string]*ownHealth
	remote    map[string]*replicaHealth
	out       map[string]string // workers not routable here, with the reason
	listeners []func(worker string, routable bool, reason string)
}

// ownHealth is this replica's checker's run for one worker.
type ownHealth struct {
	fails, oks int
	down       bool
	cause      string // why MarkDown took it down ("" after probes)
	dirty      bool   // changed since last gossiped
	sent       time.Time
}

// replicaHealth is one other replica's latest reports.
type replicaHealth struct {
	epoch   uint64
	workers map[string]*remoteHealth
}

type remoteHealth struct {
	report healthEntry
	seq    uint64
	at     time.Time
}

// NewHealthView returns an empty view for replica self.
func NewHealthView(self string, opts HealthViewOptions) *HealthView {
	opts.defaults()
	return &HealthView{
		self:   self,
		opts:   opts,
		epoch:  uint64(opts.Now().UnixNano()),
		own:    map[string]*ownHealth{},
		remote: map[string]*replicaHealth{},
		out:    map[string]string{},
	}
}

// OnChange registers fn to run when a worker's routability changes here. Calls arrive in
// order, one at a time, with no lock of the view held; fn may read the view (Routable) but
// must not feed it (Observe, Merge).
func (v *HealthView) OnChange(fn func(worker string, routable bool, reason string)) {
	v.mu.Lock()
	v.listeners = append(v.listeners, fn)
	v.mu.Unlock()
}

// Routable reports whether this replica may route to worker, and why not.
func (v *HealthView) Routable(worker string) (bool, string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	reason, out := v.out[worker]
	return !out, reason
}

// OwnHealthy reports this replica's own verdict on worker: false only while its own checker
// holds it down (FailThreshold failed probes in a row, or MarkDown), whatever the other
// replicas say. A worker this replica has not probed is healthy by its own evidence.
func (v *HealthView) OwnHealthy(worker string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	o := v.own[worker]
	return o == nil || !o.down
}

// healthChange is one decided transition.
type healthChange struct {
	worker   string
	routable bool
	reason   string
}

// apply runs fn under the lock, then delivers the transitions it decided.
func (v *HealthView) apply(fn func() []healthChange) {
	v.cbMu.Lock()
	defer v.cbMu.Unlock()
	v.mu.Lock()
	changes := fn()
	fns := slices.Clone(v.listeners)
	v.mu.Unlock()
	for _, c := range changes {
		for _, f := range fns {
			f(c.worker, c.routable, c.reason)
		}
	}
}

// Observe records one probe of worker by this replica's checker.
func (v *HealthView) Observe(worker string, healthy bool) {
	v.apply(func() []healthChange {
		o := v.own[worker]
		if o == nil {
			o = &ownHealth{}
			v.own[worker] = o
		}
		before := v.wireOf(o)
		if healthy {
			o.oks++
			o.fails = 0
			o.cause = ""
			if o.oks >= v.opts.RiseThreshold {
				o.down = false
			}
		} else {
			o.fails++
			o.oks = 0
			if o.fails >= v.opts.FailThreshold {
				o.down = true
			}
		}
		// Only what the others' rule reads (the failure run and the verdict) is worth a
		// message; the success run rides along when something else is sent.
		if after := v.wireOf(o); after.fails != before.fails || after.down != before.down {
			o.dirty = true
		}
		return v.evaluateLocked(worker, nil)
	})
}

// MarkDown takes worker down on this replica at once, as if its probes had failed
// FailThreshold times: the proxy saw it answer garbage. It is back after RiseThreshold good
// probes, like any worker this replica holds down.
func (v *HealthView) MarkDown(worker, reason string) {
	v.apply(func() []healthChange {
		o := v.own[worker]
		if o == nil {
			o = &ownHealth{}
			v.own[worker] = o
		}
		o.fails = max(o.fails, v.opts.FailThreshold)
		o.oks = 0
		o.dirty = o.dirty || !o.down
		o.down = true
		o.cause = reason
		return v.evaluateLocked(worker, nil)
	})
}

// wireOf is what the others are told: runs capped at the thresholds, so a worker that
// stays dead (or healthy) stops generating traffic beyond the periodic refresh.
func (v *HealthView) wireOf(o *ownHealth) healthEntry {
	return healthEntry{
		fails: uint32(min(o.fails, v.opts.FailThreshold)),
		oks:   uint32(min(o.oks, v.opts.RiseThreshold)),
		down:  o.down,
	}
}

// Merge applies a report gossiped by replica from. A payload that does not decode is an
// error and changes nothing.
func (v *HealthView) Merge(from string, payload []byte) error {
	rep, err := decodeHealth(payload)
	if err != nil {
		v.rejected.Add(1)
		return fmt.Errorf("health report from %s: %w", from, err)
	}
	if from == v.self {
		return nil
	}
	v.apply(func() []healthChange {
		now := v.opts.Now()
		r := v.remote[from]
		if r == nil {
			if len(v.remote) >= maxHealthReplicas {
				return nil
			}
			r = &replicaHealth{epoch: rep.epoch, workers: map[string]*remoteHealth{}}
			v.remote[from] = r
		}
		switch {
		case rep.epoch < r.epoch:
			return nil // a previous run's report, late
		case rep.epoch > r.epoch:
			r.epoch, r.workers = rep.epoch, map[string]*remoteHealth{}
		}
		touched := map[string]bool{}
		for _, e := range rep.entries {
			cur := r.workers[e.worker]
			if cur == nil && len(r.workers) >= maxHealthEntries {
				continue
			}
			if cur != nil && cur.seq > rep.seq {
				continue // a newer report of this worker arrived first
			}
			r.workers[e.worker] = &remoteHealth{report: e, seq: rep.seq, at: now}
			touched[e.worker] = true
		}
		if rep.full {
			for w, cur := range r.workers {
				if !touched[w] && cur.seq < rep.seq {
					delete(r.workers, w) // not failing there any more
					touched[w] = true
				}
			}
		}
		var changes []healthChange
		for w := range touched {
			changes = append(changes, v.evaluateLocked(w, nil)...)
		}
		return changes
	})
	return nil
}

// Rejected is how many gossiped reports failed to decode and were dropped.
func (v *HealthView) Rejected() uint64 { return v.rejected.Load() }

// Refresh re-decides every worker: remote observations age out and replicas die without
// any new report arriving. Call it periodically (Run does).
func (v *HealthView) Refresh() {
	v.apply(func() []healthChange {
		now := v.opts.Now()
		workers := map[string]bool{}
		for w := range v.own {
			workers[w] = true
		}
		for w := range v.out {
			workers[w] = true
		}
		for id, r := range v.remote {
			for w, e := range r.workers {
				if now.Sub(e.at) > 2*v.opts.StaleAfter {
					delete(r.workers, w)
				}
				workers[w] = true
			}
			if len(r.workers) == 0 {
				delete(v.remote, id)
			}
		}
		var changes []healthChange
		for w := range workers {
			changes = append(changes, v.evaluateLocked(w, nil)...)
		}
		return changes
	})
}

// ForgetReplica drops a replica's reports (it died or left).
func (v *HealthView) ForgetReplica(id string) {
	v.apply(func() []healthChange {
		r := v.remote[id]
		delete(v.remote, id)
		if r == nil {
			return nil
		}
		var changes []healthChange
		for w := range r.workers {
			changes = append(changes, v.evaluateLocked(w, nil)...)
		}
		return changes
	})
}

// ForgetWorker drops everything known about a worker (it was removed); no change is
// reported for it.
func (v *HealthView) ForgetWorker(worker string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	delete(v.own, worker)
	delete(v.out, worker)
	for _, r := range v.remote {
		delete(r.workers, worker)
	}
}

// evaluateLocked applies the rule to one worker and appends the transition, if any.
func (v *HealthView) evaluateLocked(w string, acc []healthChange) []healthChange {
	now := v.opts.Now()
	var failing, down []string
	for id, r := range v.remote {
		if id == v.self || v.opts.Alive != nil && !v.opts.Alive(id) {
			continue
		}
		e := r.workers[w]
		if e == nil || now.Sub(e.at) > v.opts.StaleAfter {
			continue
		}
		if e.report.fails > 0 {
			failing = append(failing, id)
		}
		if e.report.down {
			down = append(down, id)
		}
	}
	slices.Sort(failing)
	slices.Sort(down)
	own := v.own[w]
	_, isOut := v.out[w]
	if !isOut {
		var reason string
		switch {
		case own != nil && own.down && own.cause != "":
			reason = own.cause + " (on " + v.self + ")"
		case own != nil && own.down:
			reason = fmt.Sprintf("health check failed %d times in a row on %s", own.fails, v.self)
		case own != nil && own.fails > 0 && len(failing) > 0:
			reason = fmt.Sprintf("health check failing on %s and on %s", v.self, strings.Join(failing, ", "))
		case len(down) >= v.opts.Confirm:
			reason = fmt.Sprintf("down on %s", strings.Join(down, ", "))
		default:
			return acc
		}
		v.out[w] = reason
		return append(acc, healthChange{worker: w, routable: false, reason: reason})
	}
	back := false
	if own != nil {
		back = !own.down && own.oks >= v.opts.RiseThreshold && len(down) < v.opts.Confirm
	} else {
		back = len(failing) == 0 && len(down) == 0
	}
	if !back {
		return acc
	}
	delete(v.out, w)
	return append(acc, healthChange{worker: w, routable: true})
}

// Encode is this replica's full report: every worker its checker currently sees failing
// or holds down (absent workers are healthy). It is the push/pull state.
func (v *HealthView) Encode() []byte {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.seq++
	rep := healthReport{epoch: v.epoch, seq: v.seq, full: true}
	for w, o := range v.own {
		if e := v.wireOf(o); e.fails > 0 || e.down {
			e.worker = w
			rep.entries = append(rep.entries, e)
		}
	}
	return rep.encode()
}

// Changes returns the deltas to broadcast, each payload at most maxBytes: the entries
// that changed since the last call, and the failing ones not sent for Resend.
func (v *HealthView) Changes(maxBytes int) [][]byte {
	v.mu.Lock()
	defer v.mu.Unlock()
	now := v.opts.Now()
	var due []healthEntry
	for w, o := range v.own {
		e := v.wireOf(o)
		if o.dirty || (e.fails > 0 || e.down) && now.Sub(o.sent) >= v.opts.Resend {
			e.worker = w
			due = append(due, e)
			o.dirty, o.sent = false, now
		}
	}
	slices.SortFunc(due, func(a, b healthEntry) int { return strings.Compare(a.worker, b.worker) })
	var out [][]byte
	for len(due) > 0 {
		v.seq++
		rep := healthReport{epoch: v.epoch, seq: v.seq}
		size := len(rep.encode())
		n := 0
		for n < len(due) && (n == 0 || size+due[n].size() <= maxBytes) {
			size += due[n].size()
			n++
		}
		rep.entries = due[:n]
		if b := rep.encode(); len(b) <= maxBytes {
			out = append(out, b)
		}
		due = due[n:]
	}
	return out
}

// requeue marks every own entry for sending again (a broadcast was refused).
func (v *HealthView) requeue() {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, o := range v.own {
		o.dirty = true
	}
}

// HealthChannel is what the view needs of the gossip layer (*gossip.Gossip has it).
type HealthChannel interface {
	Handle(kind gossip.Kind, fn func(from string, payload []byte))
	ShareState(kind gossip.Kind, fn func() []byte)
	Broadcast(kind gossip.Kind, payload []byte) error
	MaxBroadcastPayload() int
}

// Run connects the view to the gossip channel until ctx ends: reports from the others are
// merged, this replica's full report rides every push/pull exchange, and every interval
// the changes are broadcast and the view refreshed. Undecodable reports are dropped and
// counted (Rejected). A broadcast refused by the budget is retried at the next interval.
func (v *HealthView) Run(ctx context.Context, ch HealthChannel, interval time.Duration) {
	if interval <= 0 {
		interval = 200 * time.Millisecond
	}
	ch.Handle(gossip.KindHealth, func(from string, p []byte) { _ = v.Merge(from, p) })
	ch.ShareState(gossip.KindHealth, v.Encode)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, p := range v.Changes(ch.MaxBroadcastPayload()) {
			if err := ch.Broadcast(gossip.KindHealth, p); err != nil {
				v.requeue()
				break
			}
		}
		v.Refresh()
	}
}

// Limits on a decoded report.
const (
	healthVersion     = 1
	maxHealthEntries  = 4096
	maxHealthReplicas = 256
	maxWorkerIDLen    = 128
	maxHealthRun      = 1 << 20
)

// healthReport is one replica's gossiped observations.
//
//	[0] version  [1] flags (bit 0: full)  [2:10] epoch (big-endian)  seq (uvarint)
//	count (uvarint), then per entry: id length (uvarint) and id, fails (uvarint),
//	oks (uvarint), down (0 or 1). Nothing may follow.
type healthReport struct {
	epoch, seq uint64
	full       bool
	entries    []healthEntry
}

// healthEntry is one worker's observation as gossiped.
type healthEntry struct {
	worker     string
	fails, oks uint32
	down       bool
}

func (e healthEntry) size() int {
	return uvarintLen(uint64(len(e.worker))) + len(e.worker) + uvarintLen(uint64(e.fails)) + uvarintLen(uint64(e.oks)) + 1
}

func uvarintLen(x uint64) int {
	var b [binary.MaxVarintLen64]byte
	return binary.PutUvarint(b[:], x)
}

func (r healthReport) encode() []byte {
	var flags byte
	if r.full {
		flags = 1
	}
	out := []byte{healthVersion, flags}
	out = binary.BigEndian.AppendUint64(out, r.epoch)
	out = binary.AppendUvarint(out, r.seq)
	out = binary.AppendUvarint(out, uint64(len(r.entries)))
	for _, e := range r.entries {
		out = binary.AppendUvarint(out, uint64(len(e.worker)))
		out = append(out, e.worker...)
		out = binary.AppendUvarint(out, uint64(e.fails))
		out = binary.AppendUvarint(out, uint64(e.oks))
		if e.down {
			out = append(out, 1)
		} else {
			out = append(out, 0)
		}
	}
	return out
}

var errHealthTruncated = errors.New("truncated")

// decodeHealth parses a report, refusing anything malformed or out of range.
func decodeHealth(b []byte) (healthReport, error) {
	var r healthReport
	if len(b) < 10 {
		return r, fmt.Errorf("%d bytes is shorter than a header", len(b))
	}
	if b[0] != healthVersion {
		return r, fmt.Errorf("unknown version %d", b[0])
	}
	if b[1]&^1 != 0 {
		return r, fmt.Errorf("unknown flags %#x", b[1])
	}
	r.full = b[1]&1 != 0
	r.epoch = binary.BigEndian.Uint64(b[2:10])
	b = b[10:]
	uv := func(limit uint64, what string) (uint64, error) {
		x, n := binary.Uvarint(b)
		if n <= 0 {
			return 0, fmt.Errorf("%s: %w", what, errHealthTruncated)
		}
		if x > limit {
			return 0, fmt.Errorf("%s %d exceeds %d", what, x, limit)
		}
		b = b[n:]
		return x, nil
	}
	var err error
	if r.seq, err = uv(^uint64(0), "sequence"); err != nil {
		return r, err
	}
	count, err := uv(maxHealthEntries, "entry count")
	if err != nil {
		return r, err
	}
	// Each entry takes at least 5 bytes: refuse a count the payload cannot hold before
	// allocating for it.
	if count*5 > uint64(len(b)) {
		return r, fmt.Errorf("claims %d entries in %d bytes", count, len(b))
	}
	r.entries = make([]healthEntry, 0, count)
	seen := make(map[string]bool, count)
	for range count {
		n, err := uv(maxWorkerIDLen, "worker id length")
		if err != nil {
			return r, err
		}
		if n == 0 || n > uint64(len(b)) {
			return r, fmt.Errorf("worker id length %d: %w", n, errHealthTruncated)
		}
		id := string(b[:n])
		b = b[n:]
		for _, c := range []byte(id) {
			if c <= 0x20 || c >= 0x7f || c == '/' {
				return r, fmt.Errorf("worker id %q: only printable ASCII without spaces or '/'", id)
			}
		}
		if seen[id] {
			return r, fmt.Errorf("worker %s listed twice", id)
		}
		seen[id] = true
		fails, err := uv(maxHealthRun, "failure run")
		if err != nil {
			return r, err
		}
		oks, err := uv(maxHealthRun, "success run")
		if err != nil {
			return r, err
		}
		if len(b) == 0 {
			return r, fmt.Errorf("down flag: %w", errHealthTruncated)
		}
		if b[0] > 1 {
			return r, fmt.Errorf("down flag %d", b[0])
		}
		r.entries = append(r.entries, healthEntry{worker: id, fails: uint32(fails), oks: uint32(oks), down: b[0] == 1})
		b = b[1:]
	}
	if len(b) != 0 {
		return r, fmt.Errorf("%d bytes after the last entry", len(b))
	}
	return r, nil
}
