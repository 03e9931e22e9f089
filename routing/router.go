package routing

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// workerKey is the index's name for a worker and rank.
type workerKey = indexer.Worker

// Request is what selection needs to know of one client request.
type Request struct {
	// PromptTokens is the prompt length in tokens (estimated for text prompts).
	PromptTokens int
	// Hashes are the sequence hashes of the prompt's full blocks.
	Hashes []uint64
	// Session is the session key, "" for none.
	Session string
	// Target is an explicit target worker (X-Target-Worker), nil for none.
	Target *indexer.Worker
	LoRA   string
	// Model is the request's model: only a worker that serves it is a candidate, and a
	// session bound to one that does not is rebound (see serves). "" is any. With Alias
	// set, Route replaces it with the alias's chosen target.
	Model string
	// Alias, when set, is the alias the client named, with the targets the fleet serves
	// (at least one of positive weight): a session whose binding records one of them keeps
	// it; any other request draws one by weight. The binding made records the target.
	Alias *Alias
	// Keys, when set with Alias, computes Hashes and PromptTokens for the target once it is
	// chosen, before selection: a target's tokenizer is the one to ask, not the alias's.
	Keys func(ctx context.Context, model string) (hashes []uint64, promptTokens int)
	// Role restricts candidates to workers of this role: RoleBoth, any but prefill-only;
	// RoleDecode, decode or aggregated workers; RolePrefill (a prefill leg), prefill-only
	// workers, chosen on prefill cost alone.
	Role Role
	// DPRank restricts candidates to one rank; -1 is any.
	DPRank int
	// QueryOnly returns a decision and changes nothing: no load, no binding, no record.
	QueryOnly bool
	// NoWait fails the selection with ErrBusy instead of queueing when every candidate is
	// busy.
	NoWait bool
	// Subset, when set, admits only the targets it accepts (a gateway's subset hint): a
	// session bound outside it is rebound inside it, and none accepted is ErrNoWorker.
	Subset func(Target) bool
	// AdmitNew, when set, is asked before a request that would bind its session afresh
	// (the session has no binding) is routed: its error fails the request before any
	// selection, load or record, and the session stays unbound. A session already bound is
	// never asked about, nor a binding replaced because its worker failed.
	AdmitNew func() error
	// Resume marks a session that names state a worker made (a Responses API response id):
	// its binding may have been made a moment ago on another replica, so a miss is
	// confirmed against every acknowledged binding (the store's Sync) before the request
	// is routed as new; and a bound request does not retry on another worker, where the
	// state is not.
	Resume bool
}

// Decision is the outcome of a selection.
type Decision struct {
	Target       Target
	Overlap      int // blocks the chosen worker is predicted to hold
	PromptBlocks int
	// Binding is the session's binding once known (Revision 0 until committed).
	Binding Binding
	// Bound reports that the worker came from an existing binding.
	Bound bool
	// Took is how long selection took, affinity wait excluded.
	Took time.Duration
	// Model is the model the request is sent as: an alias's chosen target, else the
	// request's own.
	Model string
}

// Config tunes selection.
type Config struct {
	// Policy is one of kv (default), round-robin, random, least-loaded, power-of-two,
	// session-hash, cache-aware.
	Policy        string
	BlockSize     int     // tokens per block (16)
	PrefillWeight float64 // kv cost weight of prefill blocks (1.0)
	// OverlapWeight is the kv cost's weight of each prompt block a worker does not cache,
	// against one block of prefill already queued there (DefaultOverlapWeight when 0).
	OverlapWeight float64
	Temperature   float64 // 0: argmin, ties to the longer overlap, then random; >0: softmax sampling
	// BusyDecodeFraction marks a worker busy when its decode blocks exceed this share of its
	// capacity; 0 disables.
	BusyDecodeFraction float64
	// BusyPrefillTokens marks a worker busy when its in-flight prefill tokens exceed it; 0 disables.
	BusyPrefillTokens int64
	QueueSize         int           // requests that may wait for a non-busy worker (64)
	QueueWait         time.Duration // how long they wait before ErrBusy (5s)
	MaxRetries        int           // retries on another worker before the first byte (2)
	// TextChunkBytes is the chunk size for hashing text prompts (BlockSize*4: about a block).
	TextChunkBytes int
	Seed           uint64 // random source seed; 0 = unseeded
	// RecordAtCommit records a decision when the worker first answers instead of at dispatch:
	// the behaviour before issue 14, kept only so that comparisons (demo --record-at) can
	// show what recording at dispatch buys; it hides a non-streaming prompt from every
	// selection while it generates.
	RecordAtCommit bool
	// NoRefreshAtEnd leaves a decision's prompt where its dispatch put it in the index's
	// recency instead of recording it again when the worker finishes the request (Complete):
	// the behaviour of the first dispatch-time recording, kept only for comparisons (demo
	// --record-at dispatch-only).
	NoRefreshAtEnd bool
	// Disagg says when a request's prefill goes to a prefill worker (Attempt.PlanPrefill).
	Disagg DisaggConfig
}

// Deps are the parts a Router reads.
type Deps struct {
	Index    PrefixIndex      // nil: no KV awareness
	Recorder DecisionRecorder // nil: decisions are not recorded
	Workers  Workers
	Tracker  *Tracker      // this replica's load accounting (required)
	Load     LoadView      // the load the policies read; nil = Tracker
	Affinity AffinityStore // nil: no session affinity
}

// Router selects workers. It is safe for concurrent use.
type Router struct {
	cfg    Config
	deps   Deps
	policy policy
	seed   uint64

	rngMu sync.Mutex
	rng   *rand.Rand // nil: the runtime's lock-free source

	queued  atomic.Int64
	scratch sync.Pool // *scratch
	// loadIsTracker: the LoadView is the Tracker itself, so views cache its counters.
	loadIsTracker bool
	viewCache     atomic.Pointer[routableView]
}

// scratch is one selection's reusable buffers.
type scratch struct {
	matches     []indexer.Match
	overlaps    []int
	cands, free []candidate
}

// New checks cfg and builds a Router.
func New(cfg Config, deps Deps) (*Router, error) {
	if cfg.BlockSize == 0 {
		cfg.BlockSize = indexer.DefaultBlockSize
	}
	if cfg.BlockSize < 1 || cfg.BlockSize > 4096 {
		return nil, fmt.Errorf("block size %d out of range 1..4096", cfg.BlockSize)
	}
	if cfg.PrefillWeight == 0 {
		cfg.PrefillWeight = 1
	}
	if cfg.OverlapWeight == 0 {
		cfg.OverlapWeight = DefaultOverlapWeight
	}
	if cfg.PrefillWeight < 0 || cfg.OverlapWeight < 0 || cfg.Temperature < 0 || cfg.BusyDecodeFraction < 0 || cfg.BusyPrefillTokens < 0 {
		return nil, errors.New("prefill and overlap weights, temperature and busy thresholds must not be negative")
	}
	if cfg.QueueSize == 0 {
		cfg.QueueSize = 64
	}
	if cfg.QueueWait == 0 {
		cfg.QueueWait = 5 * time.Second
	}
	if cfg.MaxRetries == 0 {
		cfg.MaxRetries = 2
	}
	if cfg.MaxRetries < 0 {
		cfg.MaxRetries = 0
	}
	if cfg.TextChunkBytes == 0 {
		cfg.TextChunkBytes = cfg.BlockSize * 4
	}
	if err := cfg.Disagg.setDefaults(); err != nil {
		return nil, err
	}
	if deps.Workers == nil || deps.Tracker == nil {
		return nil, errors.New("router needs Workers and a Tracker")
	}
	if deps.Load == nil {
		deps.Load = deps.Tracker
	}
	p, err := newPolicy(cfg.Policy)
	if err != nil {
		return nil, err
	}
	r := &Router{cfg: cfg, deps: deps, policy: p}
	if t, ok := deps.Load.(*Tracker); ok && t == deps.Tracker {
		r.loadIsTracker = true
	}
	if cfg.Seed != 0 {
		r.rng = rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))
	}
	r.scratch.New = func() any {
		return &scratch{
			matches: make([]indexer.Match, 0, 64), overlaps: make([]int, 0, 64),
			cands: make([]candidate, 0, 64), free: make([]candidate, 0, 64),
		}
	}
	return r, nil
}

func (r *Router) intn(n int) int {
	if r.rng == nil {
		return rand.IntN(n)
	}
	r.rngMu.Lock()
	defer r.rngMu.Unlock()
	return r.rng.IntN(n)
}

func (r *Router) float64() float64 {
	if r.rng == nil {
		return rand.Float64()
	}
	r.rngMu.Lock()
	defer r.rngMu.Unlock()
	return r.rng.Float64()
}

// BlockSize returns the block size in tokens.
func (r *Router) BlockSize() int { return r.cfg.BlockSize }

// Policy returns the policy's name.
func (r *Router) Policy() string {
	if r.cfg.Policy == "" {
		return "kv"
	}
	return r.cfg.Policy
}

// HashTokens returns the sequence hashes of a token prompt.
func (r *Router) HashTokens(tokens []uint32, lora string, dst []uint64) []uint64 {
	return indexer.SequenceHashes(tokens, r.cfg.BlockSize, indexer.Seed(lora, ""), hashBuffer(dst, len(tokens)/r.cfg.BlockSize))
}

// hashBuffer is dst, grown when it has no room for the n hashes of a prompt's full blocks,
// so that hashing allocates once at most instead of growing its result as it goes.
func hashBuffer(dst []uint64, n int) []uint64 {
	if n > 0 && cap(dst)-len(dst) < n {
		return slices.Grow(dst, n)
	}
	return dst
}

// HashTokensWithSalt returns the sequence hashes of a token prompt with vLLM's cache_salt:
// the salt keys the first block, as the engine's extra keys do, and the chain carries it on.
// An empty salt gives HashTokens' hashes.
func (r *Router) HashTokensWithSalt(tokens []uint32, lora, cacheSalt string, dst []uint64) []uint64 {
	if cacheSalt == "" {
		return r.HashTokens(tokens, lora, dst)
	}
	var buf [1]uint64
	extras := indexer.VLLMBlockExtras(min(len(tokens)/r.cfg.BlockSize, 1), r.cfg.BlockSize, cacheSalt, nil, buf[:0])
	if len(extras) == 0 {
		return r.HashTokens(tokens, lora, dst)
	}
	// Only the first block carries the salt; the others' digests are 0.
	all := make([]uint64, len(tokens)/r.cfg.BlockSize)
	all[0] = extras[0]
	return indexer.SequenceHashesExtra(tokens, r.cfg.BlockSize, indexer.Seed(lora, ""), all, dst)
}

// HashText returns the approximate sequence hashes of a text prompt; a cache salt (""
// for none) keeps salted prompts apart from unsalted ones (approximate keys meet only the
// router's own decisions, so any consistent mixing does).
func (r *Router) HashText(text string, lora string, dst []uint64) []uint64 {
	return r.HashTextWithSalt(text, lora, "", dst)
}

// HashTextWithSalt is HashText for a prompt with vLLM's cache_salt.
func (r *Router) HashTextWithSalt(text, lora, cacheSalt string, dst []uint64) []uint64 {
	return indexer.TextSequenceHashes(text, r.cfg.TextChunkBytes, indexer.Seed(lora, cacheSalt), hashBuffer(dst, len(text)/r.cfg.TextChunkBytes))
}

// errPreferredGone is a selection failure of a bound or explicit worker that is not routable.
var errPreferredGone = fmt.Errorf("bound worker is not routable: %w", ErrNoWorker)

// Route selects a worker for req (with session affinity when req.Session is set) and starts
// its load accounting. The caller dispatches to Decision().Target and then calls Commit
// (worker accepted), FirstToken, and Finish; or Retry when the dispatch failed before any
// byte reached the client.
func (r *Router) Route(ctx context.Context, req *Request) (*Attempt, error) {
	return r.route(ctx, req, new(Attempt))
}

// ScratchKeys is how many block keys a Scratch holds: a short prompt's (at 16 tokens a
// block, up to 160 tokens) and the stand-ins of a short answer after them (outputBlocks). A
// longer prompt's keys, or a longer sequence at the end, get a slice of their own. 10 keeps
// openai's request memory (its recorder, with the runtime's 8-byte header of a large
// object) in the 1152-byte size class it had with room for 8 prompt keys only.
const ScratchKeys = 10

// Scratch is the memory of one request's routing, for a caller that keeps it in memory of
// the request's own: its Request, room for the Attempt that RouteScratch makes, and room
// for the prompt's block keys (Keys). It must not be copied once routed.
type Scratch struct {
	// Request is what RouteScratch routes.
	Request Request
	attempt Attempt
	// keys is Keys' memory: the prompt's keys from its start, then the stand-ins that the
	// scratch's own Attempt records after them when the request ends (recordEnd).
	keys [ScratchKeys]uint64
	used bool
}

// Keys returns the scratch's room for the prompt's block keys, empty, as the dst of
// HashTokensWithSalt or HashTextWithSalt for s.Request.Hashes. Nothing else may use it: the
// room after the prompt's keys is the scratch's Attempt's, for the sequence it records at
// the end.
func (s *Scratch) Keys() []uint64 { return s.keys[:0] }

// RouteScratch is Route for s.Request, whose Attempt is in s the first time (after that, one
// of its own): one allocation fewer a request. That first Attempt also records the
// sequence at the request's end in s's keys when it fits (one more fewer).
func (r *Router) RouteScratch(ctx context.Context, s *Scratch) (*Attempt, error) {
	a := &s.attempt
	if s.used {
		a = new(Attempt)
	} else {
		a.keys = &s.keys
	}
	s.used = true
	return r.route(ctx, &s.Request, a)
}

// route is Route into a, a zero Attempt.
func (r *Router) route(ctx context.Context, req *Request, a *Attempt) (*Attempt, error) {
	if req.Target != nil {
		spec, ok := r.deps.Workers.Lookup(req.Target.ID)
		if !ok || int(req.Target.DPRank) >= max(spec.DPSize, 1) {
			return nil, fmt.Errorf("%s: %w", req.Target, ErrUnknownTarget)
		}
	}
	a.router, a.req = r, req
	if req.QueryOnly {
		return a, r.routeQuery(ctx, a)
	}
	useAffinity := req.Session != "" && r.deps.Affinity != nil
	if useAffinity {
		lease, err := r.acquire(ctx, req)
		if err != nil {
			return nil, err
		}
		a.lease = lease
		a.resolveAlias(ctx)
		if _, bound := lease.Binding(); !bound && req.AdmitNew != nil {
			if err := req.AdmitNew(); err != nil {
				a.releaseLease()
				return nil, err
			}
		}
	}
	if !useAffinity {
		a.resolveAlias(ctx)
	}
	err := a.selectAndStart(ctx)
	if err == nil {
		return a, nil
	}
	if ctx.Err() != nil {
		// Cancellation during selection keeps an existing binding.
		a.releaseLease()
		return nil, ctx.Err()
	}
	if a.lease != nil {
		if b, bound := a.lease.Binding(); bound && req.Target == nil && r.deps.Workers.NotReady(b.Worker.ID) {
			// The bound worker is not ready for now and keeps its bindings: this request is
			// served elsewhere as one without a session, and the binding stays, so the
			// session's requests return to the worker (and its cache) once it is ready.
			a.releaseLease()
			if err = a.selectAndStart(ctx); err == nil {
				return a, nil
			}
			return nil, err
		}
		if _, bound := a.lease.Binding(); bound && req.Target == nil {
			// The bound worker cannot take it: the binding is replaced (one compare-and-set
			// when the worker accepts) and the worker chosen once more, freely.
			if aerr := a.reopen(ctx); aerr != nil {
				return nil, aerr
			}
			if err = a.selectAndStart(ctx); err == nil {
				return a, nil
			}
		}
		a.lease.Invalidate(ctx)
		a.lease = nil
	}
	return nil, err
}

// acquire takes the request's session lease; for a Resume session that this replica finds
// unbound, once more after the store has caught up with every acknowledged binding.
func (r *Router) acquire(ctx context.Context, req *Request) (Lease, error) {
	lease, err := r.deps.Affinity.Acquire(ctx, req.Session, req.Target)
	if err != nil || !req.Resume {
		return lease, err
	}
	s, ok := r.deps.Affinity.(Syncer)
	if _, bound := lease.Binding(); bound || !ok {
		return lease, nil
	}
	lease.Release()
	if err := s.Sync(ctx); err != nil && ctx.Err() != nil {
		return nil, ctx.Err()
	}
	// A Sync that failed otherwise (no leader within its wait) leaves the miss as it was.
	return r.deps.Affinity.Acquire(ctx, req.Session, req.Target)
}

// Pin binds session to w unless it is bound already, as a first request that chose w would,
// and releases it at once, so its idle TTL starts now: for state a worker made that later
// requests must find there (a Responses API answer, keyed by ResponseSession). A session
// bound to another worker is ErrTargetConflict, one bound by a concurrent request first
// ErrBoundElsewhere. Without an affinity store it binds nothing.
func (r *Router) Pin(ctx context.Context, session string, w indexer.Worker) (Binding, error) {
	if r.deps.Affinity == nil {
		return Binding{}, nil
	}
	lease, err := r.deps.Affinity.Acquire(ctx, session, &w)
	if err != nil {
		return Binding{}, err
	}
	defer lease.Release()
	if b, bound := lease.Binding(); bound {
		return b, nil
	}
	return lease.Commit(ctx, w, "")
}

// resolveAlias sets the request's model to its alias's target: the one its session's
// binding records, when that is still a target, else one drawn by weight; then the keys for
// that target.
func (a *Attempt) resolveAlias(ctx context.Context) {
	al := a.req.Alias
	if al == nil {
		return
	}
	bound := false
	if a.lease != nil {
		if b, ok := a.lease.Binding(); ok && b.Model != "" && al.has(b.Model) {
			a.req.Model, bound = b.Model, true
		}
	}
	if !bound {
		a.req.Model = a.router.drawTarget(al)
	}
	a.req.keysFor(ctx)
}

// keysFor fills the request's keys for its model, when Keys is set.
func (req *Request) keysFor(ctx context.Context) {
	if req.Keys != nil {
		req.Hashes, req.PromptTokens = req.Keys(ctx, req.Model)
	}
}

// drawTarget picks one of al's targets with probability proportional to its weight.
func (r *Router) drawTarget(al *Alias) string {
	total := 0
	for _, t := range al.Targets {
		total += int(t.Weight)
	}
	if total == 0 {
		return al.Targets[0].Model
	}
	n := r.intn(total)
	for _, t := range al.Targets {
		if n < int(t.Weight) {
			return t.Model
		}
		n -= int(t.Weight)
	}
	return al.Targets[len(al.Targets)-1].Model
}

// routeQuery fills a query-only decision: the binding is read, never taken or changed.
func (r *Router) routeQuery(ctx context.Context, a *Attempt) error {
	req := a.req
	var pref *indexer.Worker
	if req.Target != nil {
		pref = req.Target
	}
	if req.Session != "" && r.deps.Affinity != nil {
		b, ok, err := r.deps.Affinity.Peek(ctx, req.Session)
		if err != nil {
			return err
		}
		if ok {
			if req.Target != nil && *req.Target != b.Worker {
				return fmt.Errorf("session bound to %s: %w", b.Worker, ErrTargetConflict)
			}
			a.decision.Binding, pref = b, &b.Worker
		}
		if req.Alias != nil && ok && b.Model != "" && req.Alias.has(b.Model) {
			req.Model = b.Model
			req.Alias = nil
			req.keysFor(ctx)
		}
	}
	if req.Alias != nil {
		req.Model = r.drawTarget(req.Alias)
		req.keysFor(ctx)
	}
	d, err := r.selectWorker(ctx, req, pref, nil)
	if errors.Is(err, errPreferredGone) && req.Target == nil {
		d, err = r.selectWorker(ctx, req, nil, nil)
	}
	if err != nil {
		return err
	}
	d.Binding = a.decision.Binding
	d.Bound = d.Binding.Revision != 0 && d.Binding.Worker == d.Target.Worker
	a.decision = d
	a.finished = true
	return nil
}

// selectWorker picks a target. A preferred worker (bound or explicit) is taken if routable,
// busy or not: affinity outranks balance.
func (r *Router) selectWorker(ctx context.Context, req *Request, pref *indexer.Worker, exclude []indexer.Worker) (Decision, error) {
	// Selection races the request's cancellation, as the reference router's does: a request
	// whose client has gone is not placed (and an existing binding is kept, see Route).
	if err := ctx.Err(); err != nil {
		return Decision{}, err
	}
	start := time.Now()
	promptBlocks := max(len(req.Hashes), (req.PromptTokens+r.cfg.BlockSize-1)/r.cfg.BlockSize)
	sc := r.scratch.Get().(*scratch)
	defer r.scratch.Put(sc)
	matches := sc.matches[:0]
	if r.deps.Index != nil && len(req.Hashes) > 0 {
		matches = r.deps.Index.FindMatches(req.Hashes, matches)
		sc.matches = matches
	}
	routable := r.deps.Workers.Routable()
	// Each match lands on its target's position, found through a view built once per routable
	// set and tracker generation (see routableView), not per request.
	view := r.view(routable)
	overlaps := sc.overlaps[:0]
	for range routable {
		overlaps = append(overlaps, 0)
	}
	sc.overlaps = overlaps
	for i := range matches {
		if p, ok := view.matchPosition(&matches[i], routable); ok {
			overlaps[p] = matches[i].Blocks
		}
	}
	// The decision predicts what the engine will report (hitLimit); the candidates' costs
	// keep the index's overlap, which is the policy's to weigh.
	limit := r.hitLimit(req.PromptTokens)
	if pref != nil {
		for i, t := range routable {
			if t.Worker == *pref && (req.Subset == nil || req.Subset(t)) && serves(req, &view.meta[i]) {
				return Decision{Target: t, Overlap: min(overlaps[i], limit), PromptBlocks: promptBlocks, Took: time.Since(start)}, nil
			}
		}
		return Decision{}, fmt.Errorf("%s: %w", pref, errPreferredGone)
	}
	cands := sc.cands[:0]
	for i := range routable {
		t := &routable[i]
		if !eligible(req, t, &view.meta[i], exclude) {
			continue
		}
		// Filled in place: appending a composite literal builds it on the stack and copies
		// it with wider loads than its stores, which the processor cannot forward (about 12
		// cycles per word), several hundred nanoseconds over 64 candidates.
		cands = append(cands, candidate{})
		c := &cands[len(cands)-1]
		c.target, c.overlap, c.pos = t, overlaps[i], i
	}
	sc.cands = cands
	if len(cands) == 0 {
		return Decision{}, ErrNoWorker
	}
	waited := time.Duration(0)
	for {
		// Candidates take their load in place; only when some are busy do the others move
		// to a list of their own.
		busy := 0
		for i := range cands {
			c := &cands[i]
			c.load = r.load(view, c.pos, c.target.Worker)
			if r.busy(c) {
				busy++
			}
		}
		free := cands
		if busy > 0 {
			free = sc.free[:0]
			for i := range cands {
				if !r.busy(&cands[i]) {
					free = append(free, cands[i])
				}
			}
			sc.free = free
		}
		if len(free) > 0 {
			c := &free[r.policy.choose(req, promptBlocks, free, r)]
			return Decision{Target: *c.target, Overlap: min(c.overlap, limit), PromptBlocks: promptBlocks, Took: time.Since(start) - waited}, nil
		}
		if req.NoWait {
			return Decision{}, fmt.Errorf("every candidate is busy: %w", ErrBusy)
		}
		w, err := r.waitForRoom(ctx, start.Add(r.cfg.QueueWait+waited))
		if err != nil {
			return Decision{}, err
		}
		waited += w
	}
}

// eligible reports whether target t, whose filter data is m, passes req's filters.
func eligible(req *Request, t *Target, m *targetMeta, exclude []indexer.Worker) bool {
	for _, x := range exclude {
		if x == t.Worker {
			return false
		}
	}
	switch req.Role {
	case RoleBoth:
		if m.role == RolePrefill {
			return false
		}
	case RolePrefill:
		// A prefill leg goes to prefill workers only: an aggregated worker is where
		// requests decode.
		if m.role != RolePrefill {
			return false
		}
	default:
		if m.role != RoleBoth && m.role != req.Role {
			return false
		}
	}
	if req.DPRank >= 0 && int(t.Worker.DPRank) != req.DPRank {
		return false
	}
	if req.Subset != nil && !req.Subset(*t) {
		return false
	}
	return serves(req, m)
}

// ServesModel reports whether t answers to model, as a base model or a LoRA adapter, as
// selection judges it ("" and a worker whose models are not known: any).
func (t *Target) ServesModel(model string) bool {
	m := metaOf(t)
	return serves(&Request{Model: model}, &m) || (model != "" && serves(&Request{LoRA: model}, &m))
}

// serves reports whether the target whose filter data is m serves req's adapter or model:
// an adapter (req.LoRA) must be among its LoRAs (or "*"); any other model among its
// models, unless those are not known. It is asked of a bound or explicit worker too, so
// that a session bound to a worker of another model is rebound within the model's workers
// as one whose worker left would be.
func serves(req *Request, m *targetMeta) bool {
	if req.LoRA != "" {
		for _, l := range m.loras {
			if l == req.LoRA || l == "*" {
				return true
			}
		}
		return false
	}
	return req.Model == "" || m.models == nil || slices.Contains(m.models, req.Model)
}

func (r *Router) busy(c *candidate) bool {
	if r.cfg.BusyPrefillTokens > 0 && c.load.PrefillTokens > r.cfg.BusyPrefillTokens {
		return true
	}
	if r.cfg.BusyDecodeFraction <= 0 {
		return false
	}
	capacity := c.target.Spec.CapacityBlocks
	return capacity > 0 && float64(c.load.DecodeBlocks) > r.cfg.BusyDecodeFraction*float64(capacity)
}

// waitForRoom waits in the bounded queue until some load is released, and returns how long.
func (r *Router) waitForRoom(ctx context.Context, deadline time.Time) (time.Duration, error) {
	if r.queued.Add(1) > int64(r.cfg.QueueSize) {
		r.queued.Add(-1)
		return 0, fmt.Errorf("wait queue full: %w", ErrBusy)
	}
	defer r.queued.Add(-1)
	t := r.deps.Tracker
	t.waiters.Add(1)
	defer t.waiters.Add(-1)
	ch := t.changed()
	start := time.Now()
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case <-ch:
		return time.Since(start), nil
	case <-timer.C:
		return 0, fmt.Errorf("waited %s: %w", r.cfg.QueueWait, ErrBusy)
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// Attempt is one request's routing in flight: the decision, its load accounting and its
// session lease. Finish, or a Retry that fails, ends it.
type Attempt struct {
	router   *Router
	req      *Request
	decision Decision
	lease    Lease
	ticket   *Ticket
	// firstTicket is the first ticket's storage, so the common attempt allocates none. A
	// retry's ticket is allocated rather than this one reset: a finished ticket then stays
	// finished, which is what makes its methods idempotent.
	firstTicket Ticket
	tried       []indexer.Worker
	retries     int
	finished    bool
	recorded    bool // under RecordAtCommit: the decision was recorded
	completed   bool // Complete ran
	// pending is a new session's binding proposed at dispatch (Propose) whose outcome no
	// method has taken yet; while it is set, only its goroutine touches the lease.
	pending *proposal
	// keys is the Scratch's key room of the Attempt that RouteScratch put in it (nil for any
	// other): recordEnd writes the stand-ins after the prompt's keys there, when the prompt's
	// keys are at its start. Only this Attempt writes past the prompt, once (completed).
	keys *[ScratchKeys]uint64
}

// proposal is a new session's binding in flight beside the worker's prefill.
type proposal struct {
	done    chan struct{} // closed when the lease's Commit returned
	binding Binding
	err     error
}

// Decision returns the attempt's current decision.
func (a *Attempt) Decision() Decision {
	d := a.decision
	d.Model = a.req.Model
	return d
}

// selectAndStart selects a target (the lease's bound worker when there is one) and starts
// its load accounting.
func (a *Attempt) selectAndStart(ctx context.Context) error {
	var pref *indexer.Worker
	var binding Binding
	if a.lease != nil {
		if b, ok := a.lease.Binding(); ok {
			binding, pref = b, &b.Worker
		}
	}
	if pref == nil && a.req.Target != nil {
		pref = a.req.Target
	}
	d, err := a.router.selectWorker(ctx, a.req, pref, a.tried)
	if err != nil {
		return err
	}
	d.Binding = binding
	d.Bound = binding.Revision != 0
	if a.lease != nil && !d.Bound {
		d.Binding = Binding{Session: a.req.Session}
	}
	a.decision = d
	a.startDispatch()
	return nil
}

// startDispatch is called as the request is about to go to the decision's target: it starts
// the target's load accounting (the prompt's uncached tokens to prefill, its blocks to
// decode) and records the decision in the index (and, through the recorder, on the other
// replicas), as the reference router's track_selection does before dispatch_selection. For
// a non-streaming request the worker's first answer comes only at the end of generation, and
// its prompt must be visible to every selection meanwhile. A dispatch that fails before the
// worker accepts it stays recorded on that worker: it ages out with the index's TTL, and
// the retry records where the request went instead.
func (a *Attempt) startDispatch() {
	if !a.router.cfg.RecordAtCommit {
		a.record()
	}
	d := a.decision
	prefill := int64(a.req.PromptTokens) - int64(d.Overlap)*int64(a.router.cfg.BlockSize)
	// The prompt's cached blocks are in the worker's cache already: only the others take
	// room there.
	decode := max(int64(d.PromptBlocks)-int64(d.Overlap), 0)
	if a.ticket == nil {
		a.ticket = &a.firstTicket
		a.router.deps.Tracker.startInto(a.ticket, d.Target.Worker, max(prefill, 0), decode)
		return
	}
	a.ticket = a.router.deps.Tracker.Start(d.Target.Worker, max(prefill, 0), decode)
}

// Retry handles a dispatch that failed before the first byte: it invalidates a bound binding
// (revision-guarded), releases the failed worker's load and selects another worker, excluding
// those tried. It returns ErrRetriesExhausted (or a selection error) when no retry is
// possible; the attempt is then finished.
func (a *Attempt) Retry(ctx context.Context, cause error) error { return a.retry(ctx, cause, true) }

// Move is Retry for a request whose answer had started when its worker failed, which the
// caller continues on another worker (transport/openai's request migration): the binding
// moves with it in one compare-and-set, as Retry's does. The caller bounds how often a
// request moves; a move does not spend the retries before the first byte.
func (a *Attempt) Move(ctx context.Context, cause error) error { return a.retry(ctx, cause, false) }

// retry is Retry, counted against MaxRetries when bounded.
func (a *Attempt) retry(ctx context.Context, cause error, bounded bool) error {
	if a.finished {
		return fmt.Errorf("retry of a finished attempt: %w", cause)
	}
	a.ticket.Finish()
	// A binding proposed at dispatch has its outcome first. Bound to the failed worker, it
	// is replaced below by a compare-and-set, as any binding of a failed worker; bound
	// elsewhere by a concurrent request, the retry goes there; refused because the worker
	// began draining, the lease is still the initializer. Any other failure ends the
	// request as a failed Commit would.
	if _, ok, err := a.settle(); ok && err != nil && !errors.Is(err, ErrBoundElsewhere) && !errors.Is(err, ErrWorkerDraining) {
		a.fail(ctx)
		return fmt.Errorf("bind session: %w", err)
	}
	a.tried = append(a.tried, a.decision.Target.Worker)
	if a.req.Target != nil || bounded && a.retries >= a.router.cfg.MaxRetries || a.req.Resume && a.decision.Bound {
		a.fail(ctx)
		return fmt.Errorf("%w after %d tries: %w", ErrRetriesExhausted, len(a.tried), cause)
	}
	if bounded {
		a.retries++
	}
	// The bound worker failed: its binding is replaced, and the session chosen afresh. A
	// racing request may meanwhile have bound the session to a worker this request already
	// saw fail; that binding is replaced too (once), rather than spending the retry on it.
	// A binding to a worker not tried yet (a concurrent request's) stays: the retry goes there.
	for round := 0; a.lease != nil && round < 2; round++ {
		b, bound := a.lease.Binding()
		if !bound || !slices.Contains(a.tried, b.Worker) {
			break
		}
		if err := a.reopen(ctx); err != nil {
			a.finished = true
			return err
		}
	}
	if err := a.selectAndStart(ctx); err != nil {
		if errors.Is(err, errPreferredGone) && a.lease != nil {
			// Someone rebound the session meanwhile to a worker that is gone too.
			a.lease.Invalidate(ctx)
			a.lease = nil
		}
		a.fail(ctx)
		return err
	}
	return nil
}

// reopen makes the attempt's bound lease the initializer of its binding's replacement. When
// another request of this replica is replacing it already, the lease waits for that one's
// outcome instead (a new Acquire), and the loop in Retry looks again.
func (a *Attempt) reopen(ctx context.Context) error {
	if a.lease.Reopen() {
		return nil
	}
	a.lease.Release()
	lease, err := a.router.deps.Affinity.Acquire(ctx, a.req.Session, nil)
	if err != nil {
		a.lease = nil
		return err
	}
	a.lease = lease
	return nil
}

// fail ends an attempt whose request will not be served: an initializer gives up, a bound
// lease is released (its binding stays unless Retry invalidated it).
func (a *Attempt) fail(ctx context.Context) {
	a.finished = true
	if a.lease == nil {
		return
	}
	if _, bound := a.lease.Binding(); !bound {
		a.lease.Invalidate(ctx)
	} else {
		a.lease.Release()
	}
	a.lease = nil
}

// Propose starts binding a new session to the decision's worker as the request is
// dispatched, so that the Raft commit runs beside the worker's prefill instead of after its
// answer; Commit then waits only for what is left of it. It does nothing for a request
// without a session, for a bound session, or when a proposal is in flight already. ctx
// (the request's) bounds the proposal. Until a later method of the attempt has taken the
// proposal's outcome (Commit, Retry and Finish wait for it), nothing else touches the
// lease. The first byte must still wait for Commit: no byte may leave from a worker the
// session is not bound to.
//
// A lease that says the binding must come first (bindFirster: the replica's contact with
// its quorum is not fresh) has it committed here, before the request is sent, and Propose
// returns the outcome's error: ErrBoundElsewhere and ErrWorkerDraining stay for Commit to
// take, as after a dispatch (the caller moves the request, or tries its next choice);
// ErrTooManySessions and the request's own cancellation end the attempt as a failed Route
// does; any other failure ends it as a *Refusal (reason "bind_failed"), since no worker has
// been asked, so the load balancer may retry the request on another replica.
func (a *Attempt) Propose(ctx context.Context) error {
	if a.finished || a.pending != nil || a.lease == nil || a.decision.Bound {
		return nil
	}
	if g, ok := a.lease.(gateHolder); ok {
		g.HoldGate()
	}
	p := &proposal{done: make(chan struct{})}
	lease, w, model := a.lease, a.decision.Target.Worker, a.bindingModel()
	a.pending = p
	if f, ok := lease.(bindFirster); ok && f.BindFirst() {
		p.binding, p.err = lease.Commit(ctx, w, model)
		close(p.done)
		return a.boundFirst(ctx, p.err)
	}
	go func() {
		defer close(p.done)
		p.binding, p.err = lease.Commit(ctx, w, model)
	}()
	return nil
}

// bindFirster is a Lease that can say a new session's binding must be committed before its
// request is sent to a worker (the cluster's, while the replica's contact with its quorum
// is not fresh: a replica cut off while its read lease still holds would otherwise have a
// worker run a request it then fails). It is asked once per new binding, and must answer
// without waiting.
type bindFirster interface {
	BindFirst() bool
}

// boundFirst is Propose's outcome for a binding committed before dispatch (err, nil when it
// was made): see Propose.
func (a *Attempt) boundFirst(ctx context.Context, err error) error {
	if err == nil || errors.Is(err, ErrBoundElsewhere) || errors.Is(err, ErrWorkerDraining) {
		return err
	}
	a.settle()
	a.fail(ctx)
	var refusal *Refusal
	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case errors.Is(err, ErrTooManySessions), errors.As(err, &refusal):
		return err
	}
	return &Refusal{Reason: "bind_failed", Err: fmt.Errorf("%w: could not bind the new session before asking a worker: %w", ErrUnavailable, err)}
}

// gateHolder is a Lease whose initializer gate can stay closed past a Commit that binds
// (both stores' leases are): after HoldGate, the session's other requests on this replica
// see the binding only once OpenGate, or the lease's end, opens the gate. A binding
// proposed at dispatch is so seen only once its worker has accepted the request, as when
// Commit ran after the worker's answer; one for a worker that refused it is dropped unseen
// (Refused), and one for a worker that failed is replaced (Retry) unseen.
type gateHolder interface {
	HoldGate()
	OpenGate()
}

// openGate opens the gate a proposal's Commit kept.
func (a *Attempt) openGate() {
	if g, ok := a.lease.(gateHolder); ok {
		g.OpenGate()
	}
}

// Refused is for a worker that refused the request itself (a 4xx: the client's fault): a
// binding proposed for it at dispatch is dropped again (revision-guarded), so that a
// refused first request leaves no session, as when the binding was made only after the
// worker's answer. Nothing else of the attempt changes; Finish still ends it.
func (a *Attempt) Refused(ctx context.Context) {
	if _, ok, err := a.settle(); !ok || err != nil || a.lease == nil {
		return
	}
	a.lease.Invalidate(ctx)
	a.lease = nil
}

// settle waits for a pending proposal and takes its outcome; ok is false when none was
// pending.
func (a *Attempt) settle() (b Binding, ok bool, err error) {
	p := a.pending
	if p == nil {
		return Binding{}, false, nil
	}
	<-p.done
	a.pending = nil
	return p.binding, true, p.err
}

// bindingModel is the model a new binding records: the alias's target, "" without an alias.
func (a *Attempt) bindingModel() string {
	if a.req.Alias != nil {
		return a.req.Model
	}
	return ""
}

// Commit records that the worker accepted the request; for a new session it binds the
// session to the worker (or takes the outcome of the binding Propose started) and returns
// the binding with its revision. Without a session it returns a zero Binding. (The
// decision entered the index at dispatch, startDispatch.)
func (a *Attempt) Commit(ctx context.Context) (Binding, error) {
	if a.finished {
		return a.decision.Binding, errors.New("commit of a finished attempt")
	}
	b, proposed, err := a.settle()
	if proposed {
		// The worker accepted the request: the session's other requests may see the binding.
		a.openGate()
	}
	if a.router.cfg.RecordAtCommit && !a.recorded {
		a.record()
		a.recorded = true
	}
	if a.lease == nil || a.decision.Bound {
		return a.decision.Binding, nil
	}
	if !proposed {
		b, err = a.lease.Commit(ctx, a.decision.Target.Worker, a.bindingModel())
	}
	if errors.Is(err, ErrBoundElsewhere) {
		if a.req.Alias != nil && b.Model != "" {
			// The concurrent request's target is the session's.
			a.req.Model = b.Model
		}
		// A concurrent first request (on another replica) bound the session to another
		// worker: this request moves there, with its load, before any byte reaches the client.
		spec, ok := a.router.deps.Workers.Lookup(b.Worker.ID)
		if !ok || int(b.Worker.DPRank) >= max(spec.DPSize, 1) {
			return Binding{}, fmt.Errorf("bind session: bound to unknown worker %s: %w", b.Worker, ErrNoWorker)
		}
		a.ticket.Finish()
		a.decision.Target = Target{Worker: b.Worker, Spec: &spec}
		a.decision.Binding, a.decision.Bound = b, true
		// What the router predicts is what the request will find where it goes now: the
		// overlap on the worker the session is bound to, not on the one first chosen.
		a.decision.Overlap = a.router.overlapOn(b.Worker, a.req.Hashes, a.req.PromptTokens)
		a.startDispatch()
		return b, err
	}
	if err != nil {
		return Binding{}, fmt.Errorf("bind session: %w", err)
	}
	a.decision.Binding = b
	return b, nil
}

// overlapOn is how many leading blocks of hashes, a prompt of promptTokens, w will hit: what
// the index credits it with, up to hitLimit.
func (r *Router) overlapOn(w indexer.Worker, hashes []uint64, promptTokens int) int {
	if r.deps.Index == nil || len(hashes) == 0 {
		return 0
	}
	for _, m := range r.deps.Index.FindMatches(hashes, nil) {
		if m.Worker == w {
			return min(m.Blocks, r.hitLimit(promptTokens))
		}
	}
	return 0
}

// hitLimit is the most blocks an engine hits for a prompt of promptTokens tokens: vLLM leaves
// the last prompt token to compute even when the whole prompt is cached (it needs that token's
// logits), so a 128-token prompt in 16-token blocks reports at most 112 cached tokens, 7
// blocks. A decision's Overlap is capped there, so that the prediction (the prefill load, the
// overlap header, the replay's prediction error) says what the engine will report. Unknown
// length (0): no cap.
func (r *Router) hitLimit(promptTokens int) int {
	if promptTokens <= 0 {
		return math.MaxInt
	}
	return (promptTokens - 1) / r.cfg.BlockSize
}

// record puts the decision's prompt into the index on its target.
func (a *Attempt) record() {
	if r := a.router.deps.Recorder; r != nil && len(a.req.Hashes) > 0 {
		r.Record(a.decision.Target.Worker, a.req.Hashes)
	}
}

// Complete says the worker has finished the request whole (the last byte of its answer is
// in), having generated outputTokens tokens (0 when unknown); call it after a successful
// Commit, before Finish. It records the prompt on the worker again, followed by stand-ins for
// the blocks of the generated tokens (outputBlocks), because that is what the worker's cache
// holds now and when it used it last: an engine caches the generated tokens' blocks after the
// prompt's, pins a running request's blocks, and hands them to its LRU when the request ends.
// So the index's recency, and the room its per-worker cap leaves, follow the worker's.
// Recorded only at dispatch, a long generation's prompt aged from its dispatch and the cap
// dropped it first; and without the generated blocks the index held more than the worker
// could. Through the recorder the record reaches the other replicas too (the stand-ins, or
// one block when they hold the rest). A request that failed, or whose client left, is not
// recorded again.
//
// Complete also ends the request's load: the worker runs it no more. The caller calls it
// before the last bytes of the answer reach the client, so that a client's next request,
// sent the moment this answer ends, finds the worker free on this replica, and (through the
// load sharing that Tracker.Changes wakes) on the others.
func (a *Attempt) Complete(outputTokens int) {
	a.recordEnd(outputTokens)
	a.ticket.Finish()
}

// recordEnd is Complete's record of the prompt and its answer's stand-ins.
func (a *Attempt) recordEnd(outputTokens int) {
	cfg := &a.router.cfg
	if a.finished || a.completed || cfg.RecordAtCommit || cfg.NoRefreshAtEnd {
		return
	}
	a.completed = true
	r := a.router.deps.Recorder
	if r == nil || len(a.req.Hashes) == 0 {
		return
	}
	seq := a.req.Hashes
	if n := outputBlockCount(a.req.PromptTokens, outputTokens, cfg.BlockSize); n > 0 {
		seq = outputBlocks(seq, a.req.PromptTokens, n, a.endRoom(n))
	}
	// Record does not keep seq (indexer.Index and cluster/hints.Decisions copy what they
	// keep), so the scratch's room is free again, for nobody, once it returns.
	r.Record(a.decision.Target.Worker, seq)
}

// endRoom is the scratch's key room for recordEnd's sequence of the prompt and n stand-ins:
// the prompt's own keys at its start and room after them for n more; nil when the attempt
// has no room, the prompt's keys are elsewhere, or they do not fit.
func (a *Attempt) endRoom(n int) []uint64 {
	prompt := a.req.Hashes
	if a.keys == nil || len(prompt) == 0 || len(prompt)+n > len(a.keys) || &prompt[0] != &a.keys[0] {
		return nil
	}
	return a.keys[:len(prompt)]
}

// maxOutputBlocks bounds the stand-ins one answer adds (a worker's usage is not trusted
// further: 2^14 blocks is 262,144 tokens at 16 a block).
const maxOutputBlocks = 1 << 14

// outputBlockCount is how many full blocks the generated tokens complete after the prompt's
// full blocks (the first of them holds the prompt's partial last block too).
func outputBlockCount(promptTokens, outputTokens, blockSize int) int {
	if outputTokens <= 0 || promptTokens < 0 || blockSize < 1 {
		return 0
	}
	return min((promptTokens%blockSize+outputTokens)/blockSize, maxOutputBlocks)
}

// outputBlocks returns prompt (a prompt's sequence hashes, left as it is) followed by n
// stand-ins for the blocks of its generated tokens, chained after it: in room, when it is
// not nil (the prompt itself, with room for n more after it that no one else uses), else in
// a new slice. The router never sees those tokens' ids, so the stand-ins never match a later
// prompt; they only take the room in the worker's cache that the real blocks take. They
// depend on the prompt and the block's place only, so a prompt sent again (whose answer a
// greedy engine repeats) refreshes them instead of adding more.
func outputBlocks(prompt []uint64, promptTokens, n int, room []uint64) []uint64 {
	seq := room
	if seq == nil {
		seq = slices.Grow(slices.Clip(prompt), n)
	}
	tail := seq[len(seq) : len(seq)+n]
	for i := range tail {
		tail[i] = mix64(uint64(promptTokens)<<20 ^ uint64(i) ^ 0x6f75747075740000)
	}
	indexer.Chain(prompt[len(prompt)-1], true, tail, tail) // in place
	return seq[:len(seq)+n]
}

// FirstToken moves the request's load from prefill to decode.
func (a *Attempt) FirstToken() { a.ticket.FirstToken() }

// Finish ends the attempt: releases load and the session lease, after waiting for a binding
// still being proposed (a binding it made stays, and idles out with the TTL). It is
// idempotent.
func (a *Attempt) Finish() {
	a.settle()
	if a.ticket != nil {
		a.ticket.Finish()
	}
	if a.finished {
		return
	}
	a.finished = true
	a.releaseLease()
}

func (a *Attempt) releaseLease() {
	if a.lease != nil {
		a.lease.Release()
		a.lease = nil
	}
}
