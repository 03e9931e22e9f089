package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Worker is one simulated inference worker.
type Worker struct {
	cfg     Config
	log     *slog.Logger
	cache   *cache
	running *fifoSem
	prefill *fifoSem
	reg     *prometheus.Registry
	metrics *metrics
	handler http.Handler
	// engine is the stepped scheduler of chunked prefill; nil when it is off.
	engine *engine

	// engineID names this worker in kv_transfer_params (remote_engine_id): the worker's ID
	// and a random suffix, so that a restarted worker answers no pull meant for its
	// previous life.
	engineID   string
	transfers  kvTransfers
	pullClient *http.Client
	// responses are the Responses answers kept for a later previous_response_id.
	responses responseStore

	faultMu     sync.Mutex
	faults      Faults
	refuseUntil time.Time // zero while Refuse has no end
	rng         *rand.Rand

	nextID       atomic.Uint64
	served       atomic.Uint64
	aborted      atomic.Uint64
	failed       atomic.Uint64
	wrongModel   atomic.Uint64
	tokenized    atomic.Uint64
	promptTokens atomic.Uint64
	cachedTokens atomic.Uint64
	genTokens    atomic.Uint64

	interTokens      atomic.Uint64
	interTokenNanos  atomic.Int64 // simulated
	kvTransfers      atomic.Uint64
	kvTransferBlocks atomic.Uint64
	kvTransferNanos  atomic.Int64 // simulated
}

// Stats are a worker's request counters and queue depths.
type Stats struct {
	// Served counts requests that ran to their last token.
	Served uint64 `json:"served"`
	// Aborted counts requests whose client left before the end.
	Aborted uint64 `json:"aborted"`
	// Failed counts requests answered 500 by the error fault.
	Failed uint64 `json:"failed"`
	// WrongModel counts requests refused 404 model_not_found: a model this worker does not
	// serve.
	WrongModel uint64 `json:"wrong_model"`
	// Tokenized counts /tokenize requests answered.
	Tokenized uint64 `json:"tokenized"`
	// Running is how many requests hold an engine slot; Waiting how many queue for one.
	Running int `json:"running"`
	Waiting int `json:"waiting"`
	// PromptTokens and CachedTokens total the prompts that reached prefill and the part
	// of them found cached.
	PromptTokens uint64 `json:"prompt_tokens"`
	CachedTokens uint64 `json:"cached_tokens"`
	// GeneratedTokens totals the output tokens sent.
	GeneratedTokens uint64 `json:"generated_tokens"`
	// InterTokens counts the output tokens after each request's first, and
	// InterTokenSeconds totals their simulated inter-token latencies (their decode steps,
	// not divided by Speedup): InterTokenSeconds / InterTokens is the mean simulated ITL.
	InterTokens       uint64  `json:"inter_tokens"`
	InterTokenSeconds float64 `json:"inter_token_seconds"`
	// KVTransfers counts the decode legs whose KV transfer succeeded, KVTransferBlocks the
	// blocks they transferred (those not cached here already) and KVTransferSeconds their
	// simulated transfer time.
	KVTransfers       uint64  `json:"kv_transfers"`
	KVTransferBlocks  uint64  `json:"kv_transfer_blocks"`
	KVTransferSeconds float64 `json:"kv_transfer_seconds"`
	// KVTransfersHeld is how many prefill legs' blocks wait, pinned, for a decode worker.
	KVTransfersHeld int `json:"kv_transfers_held"`
}

// New returns a worker for cfg, with zero fields defaulted.
func New(cfg Config) (*Worker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	w := &Worker{
		cfg:     cfg,
		log:     cfg.Logger.With("worker", cfg.ID),
		cache:   newHybridCache(cfg.BlockSize, cfg.CapacityBlocks, cfg.SlidingWindow, cfg.OnEvent),
		running: newFIFOSem(cfg.MaxRunning),
		prefill: newFIFOSem(1),
		reg:     prometheus.NewRegistry(),
		faults:  Faults{ErrorRate: cfg.ErrorRate, StallRate: cfg.StallRate, Stall: cfg.Stall},
		rng:     rand.New(rand.NewPCG(uint64(cfg.Seed), 0x9e3779b97f4a7c15)),

		engineID:  fmt.Sprintf("%s-%016x", cfg.ID, rand.Uint64()),
		transfers: kvTransfers{byBlock: make(map[int64]*heldTransfer)},
		pullClient: &http.Client{Timeout: kvPullTimeout, Transport: &http.Transport{
			Proxy:               nil, // the fleet is on loopback
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
			MaxIdleConnsPerHost: 64,
			IdleConnTimeout:     30 * time.Second,
		}},
	}
	if cfg.ChunkedPrefillTokens > 0 {
		w.engine = &engine{w: w}
	}
	m, err := newMetrics(w)
	if err != nil {
		return nil, err
	}
	w.metrics = m
	w.handler = w.routes()
	return w, nil
}

// Config returns the worker's configuration, defaults filled in.
func (w *Worker) Config() Config { return w.cfg }

// Handler returns the worker's HTTP API.
func (w *Worker) Handler() http.Handler { return w.handler }

// EngineID is the worker's remote_engine_id in the kv_transfer_params of its prefill
// answers; a pull names it. It is stable for the worker's life.
func (w *Worker) EngineID() string { return w.engineID }

// Serve serves the worker on ln until ctx ends, then shuts down: in-flight requests get up
// to ShutdownTimeout to finish before their connections are closed. It closes ln.
func (w *Worker) Serve(ctx context.Context, ln net.Listener) error {
	defer w.pullClient.CloseIdleConnections()
	return serveHTTP(ctx, ln, w.handler, w.refusing, w.cfg.ShutdownTimeout, w.log, "model", w.cfg.Model,
		"role", w.cfg.Role, "engine_id", w.engineID)
}

// serveHTTP serves h on ln until ctx ends, resetting new connections while refusing says
// so, then shuts down: in-flight requests get up to grace to finish before their
// connections are closed. It closes ln. attrs go on the "serving" log line. A Worker and a
// DataParallel front serve alike through it.
func serveHTTP(ctx context.Context, ln net.Listener, h http.Handler, refusing func() bool,
	grace time.Duration, log *slog.Logger, attrs ...any) error {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(refusingListener{Listener: ln, refusing: refusing}) }()
	log.Info("sim worker serving", append([]any{"addr", ln.Addr().String()}, attrs...)...)

	select {
	case err := <-errc:
		return fmt.Errorf("sim: serve %s: %w", ln.Addr(), err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), grace)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		log.Warn("sim worker: graceful shutdown timed out; closing connections", "err", err)
		_ = srv.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("sim: serve %s: %w", ln.Addr(), err)
	}
	log.Info("sim worker stopped")
	return nil
}

// SetFaults replaces the worker's faults.
func (w *Worker) SetFaults(f Faults) error {
	if err := f.Validate(); err != nil {
		return fmt.Errorf("sim: set faults: %w", err)
	}
	w.faultMu.Lock()
	defer w.faultMu.Unlock()
	w.setFaultsLocked(f)
	return nil
}

func (w *Worker) setFaultsLocked(f Faults) {
	w.faults = f
	w.refuseUntil = time.Time{}
	if f.Refuse && f.RefuseFor > 0 {
		w.refuseUntil = time.Now().Add(f.RefuseFor)
	}
}

// Faults returns the faults in force; a Refuse whose RefuseFor has run out reads as off.
func (w *Worker) Faults() Faults {
	w.faultMu.Lock()
	defer w.faultMu.Unlock()
	w.expireRefuseLocked()
	return w.faults
}

func (w *Worker) expireRefuseLocked() {
	if w.faults.Refuse && !w.refuseUntil.IsZero() && !time.Now().Before(w.refuseUntil) {
		w.faults.Refuse, w.faults.RefuseFor, w.refuseUntil = false, 0, time.Time{}
	}
}

func (w *Worker) refusing() bool {
	w.faultMu.Lock()
	defer w.faultMu.Unlock()
	w.expireRefuseLocked()
	return w.faults.Refuse
}

// drawFault decides one request's fault and returns the stall length with it.
func (w *Worker) drawFault() (faultKind, time.Duration) {
	w.faultMu.Lock()
	defer w.faultMu.Unlock()
	f := w.faults
	if f.ErrorRate == 0 && f.StallRate == 0 {
		return faultNone, 0
	}
	u := w.rng.Float64()
	switch {
	case u < f.ErrorRate:
		return faultError, 0
	case u < f.ErrorRate+f.StallRate:
		return faultStall, f.Stall
	default:
		return faultNone, 0
	}
}

// Cache returns a snapshot of the prefix cache's state.
func (w *Worker) Cache() CacheStats { return w.cache.snapshot() }

// Stats returns a snapshot of the worker's counters.
func (w *Worker) Stats() Stats {
	running, waiting := w.running.counts()
	return Stats{
		Served:          w.served.Load(),
		Aborted:         w.aborted.Load(),
		Failed:          w.failed.Load(),
		WrongModel:      w.wrongModel.Load(),
		Tokenized:       w.tokenized.Load(),
		Running:         running,
		Waiting:         waiting,
		PromptTokens:    w.promptTokens.Load(),
		CachedTokens:    w.cachedTokens.Load(),
		GeneratedTokens: w.genTokens.Load(),

		InterTokens:       w.interTokens.Load(),
		InterTokenSeconds: time.Duration(w.interTokenNanos.Load()).Seconds(),
		KVTransfers:       w.kvTransfers.Load(),
		KVTransferBlocks:  w.kvTransferBlocks.Load(),
		KVTransferSeconds: time.Duration(w.kvTransferNanos.Load()).Seconds(),
		KVTransfersHeld:   w.heldTransfers(),
	}
}

// ClearCache drops every cached block and emits a Cleared event. Prefill legs' blocks
// waiting for a pull go too: their pulls fail.
func (w *Worker) ClearCache() {
	w.dropTransfers()
	w.cache.clear()
}

// scale turns a simulated duration of n units of d into wall time.
func (w *Worker) scale(d time.Duration, n int) time.Duration {
	v := float64(d) * float64(n) / w.cfg.Speedup
	if v >= math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(v)
}

// fillerWords are single-token words the worker "generates".
var fillerWords = [...]string{
	"the", "model", "cache", "token", "block", "prefix", "route", "worker",
	"fleet", "graph", "signal", "river", "stone", "light", "amber", "cobalt",
	"delta", "ember", "forest", "harbor", "island", "jasmine", "kernel", "lantern",
	"meadow", "nectar", "orbit", "pebble", "quartz", "raven", "summit", "timber",
	"umber", "valley", "willow", "yonder", "zephyr", "anchor", "beacon", "canyon",
	"dune", "echo", "falcon", "glacier", "horizon", "ivory", "juniper", "kestrel",
	"lagoon", "mosaic", "nimbus", "opal", "prairie", "quiver", "ripple", "saffron",
	"tundra", "upland", "vortex", "wander", "yarrow", "zenith", "and", "of",
}

// output is what a request will generate: words, the text pieces sent per token, and
// their token ids.
type output struct {
	pieces []string
	tokens []uint32
}

// newOutput picks n filler words. Word i is picked by a hash of every token before it, the
// prompt's and the i words generated before it, so equal prompts get equal text, and a
// continuation (the prompt followed by the first k words, as a router sends it when it moves a
// stream to another worker) generates exactly the words k, k+1, ... of the uninterrupted run.
// bare leaves the first word without its leading space (a chat answer's start).
func newOutput(prompt []uint32, n int, bare bool) output {
	h := fnvTokens(fnvOffset, prompt)
	out := output{pieces: make([]string, n), tokens: make([]uint32, n)}
	for i := range n {
		word := fillerWords[mix64(h)>>58%uint64(len(fillerWords))]
		out.tokens[i] = pieceToken(word)
		h = fnvTokens(h, out.tokens[i:i+1])
		if i > 0 || !bare {
			word = " " + word
		}
		out.pieces[i] = word
	}
	return out
}

// FNV-1a-64's starting state and prime.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// fnvTokens continues FNV-1a-64 state h over tokens (4 bytes little endian each), so that
// fnvTokens(fnvTokens(h, a), b) is fnvTokens(h, a followed by b).
func fnvTokens(h uint64, tokens []uint32) uint64 {
	for _, t := range tokens {
		for i := range 4 {
			h ^= uint64(t>>(8*i)) & 0xff
			h *= fnvPrime
		}
	}
	return h
}

// mix64 spreads h's bits (SplitMix64's finalizer): FNV's high bits alone are poorly mixed.
func mix64(h uint64) uint64 {
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	return h ^ h>>31
}

// runResult is what a request's run tells its answer besides the tokens.
type runResult struct {
	// cached is the prompt tokens found cached here at the lookup (for a decode leg,
	// before its transfer).
	cached int
	// remotePrefill: the request was a decode leg; transfer is its simulated transfer time.
	remotePrefill bool
	transfer      time.Duration
	// held is a prefill leg's prompt blocks, pinned for a decode worker to pull.
	held *sequence
}

// run takes req through the engine, calling emit for each output token in order. An error
// means ctx ended, emit failed, or (an *apiError) a decode leg's transfer failed.
func (w *Worker) run(ctx context.Context, req *genRequest, out output, emit func(i int) error, res *runResult) error {
	if err := w.running.acquire(ctx); err != nil {
		return err
	}
	defer w.running.release()
	if err := sleepUntil(ctx, time.Now().Add(w.scale(w.cfg.Overhead, 1))); err != nil {
		return err
	}
	var seq *sequence
	defer func() {
		if seq != nil {
			w.cache.release(seq)
		}
	}()
	if req.kv != nil && req.kv.remotePrefill {
		// The local hit is looked up before the transfer, which then fills in the rest.
		seq, res.cached = w.lookup(req.prompt, req.cacheSalt)
		if err := w.pullKV(ctx, req, seq, res); err != nil {
			return err
		}
	}
	var err error
	if w.engine != nil {
		seq, err = w.engine.generate(ctx, req, out, seq, emit, res)
	} else {
		seq, err = w.generate(ctx, req, out, seq, emit, res)
	}
	if err != nil {
		return err
	}
	full := make([]uint32, 0, len(req.prompt)+len(out.tokens))
	w.cache.store(seq, append(append(full, req.prompt...), out.tokens...))
	if req.kv != nil && req.kv.remoteDecode {
		res.held = w.cache.fork(seq, len(req.prompt)/w.cfg.BlockSize)
	}
	return nil
}

// lookup pins the longest cached prefix of prompt (stored under cache_salt salt) and returns
// it with its length in tokens.
func (w *Worker) lookup(prompt []uint32, salt string) (*sequence, int) {
	seq := w.cache.acquireSalted(prompt, salt)
	return seq, len(seq.blocks) * w.cfg.BlockSize
}

// prefillStarts counts a prompt that reached prefill, and the part of it that was cached.
func (w *Worker) prefillStarts(prompt []uint32, cached int) {
	w.promptTokens.Add(uint64(len(prompt)))
	w.cachedTokens.Add(uint64(cached))
}

// prefillTokens is how many prompt tokens are left to compute with seq held: at least the
// last block's worth past the longest prefix a lookup would take, as vLLM computes the last
// prompt token even when everything is cached.
func (w *Worker) prefillTokens(prompt []uint32, seq *sequence) int {
	limit := (len(prompt) - 1) / w.cfg.BlockSize
	return len(prompt) - min(len(seq.blocks), limit)*w.cfg.BlockSize
}

// generate is the engine without chunked prefill: a FIFO prefill stage serving one request
// at a time, then one token every DecodePerToken. seq is the request's hold on the cache
// when it has one already (a decode leg), else the lookup happens as its prefill starts;
// the hold is returned, for the caller to release, even with an error.
func (w *Worker) generate(ctx context.Context, req *genRequest, out output, seq *sequence, emit func(i int) error, res *runResult) (*sequence, error) {
	if err := w.prefill.acquire(ctx); err != nil {
		return seq, err
	}
	if seq == nil {
		seq, res.cached = w.lookup(req.prompt, req.cacheSalt)
	}
	w.prefillStarts(req.prompt, res.cached)
	err := sleepUntil(ctx, time.Now().Add(w.scale(w.cfg.PrefillPerToken, w.prefillTokens(req.prompt, seq))))
	if err == nil {
		w.cache.store(seq, req.prompt)
	}
	w.prefill.release()
	if err != nil {
		return seq, err
	}

	// Tokens follow a fixed schedule from the first one, so timer lateness does not add up.
	start := time.Now()
	for i := range out.tokens {
		if i > 0 {
			if err := sleepUntil(ctx, start.Add(w.scale(w.cfg.DecodePerToken, i))); err != nil {
				return seq, err
			}
			w.interTokens.Add(1)
			w.interTokenNanos.Add(int64(w.cfg.DecodePerToken))
		}
		if err := emit(i); err != nil {
			return seq, err
		}
		w.genTokens.Add(1)
	}
	return seq, nil
}
