package benchreport

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/hints"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// The cost curves' workload, after routing's BenchmarkSelect8k and indexer's
// BenchmarkFindMatches512: an 8,192-token prompt (512 blocks) whose first 16 blocks every
// worker holds (a shared system prompt) and longer prefixes eight workers hold at eight
// depths, among other prompts' entries; and 512-block prompts each held by 1 to 16 workers at
// random depths. The indexes are in approximate mode (a 120 s TTL), as a replica runs them.
const (
	selectTokens   = 8192
	blockSize      = indexer.DefaultBlockSize
	lookupBlocks   = 512
	indexWorkers   = 64
	approxIndexTTL = 120 * time.Second
)

// WorkerPoint is one selection timed at a fleet size.
type WorkerPoint struct {
	Workers int    `json:"workers"`
	Entries int    `json:"entries"`
	Select  Timing `json:"select"`
}

// IndexPoint is a lookup and a selection timed at an index size, with the index's memory.
type IndexPoint struct {
	Entries int    `json:"entries"`
	Lookup  Timing `json:"lookup"`
	Select  Timing `json:"select"`
	// HeapBytes is the heap the index takes (after a GC, the workload's own prompts not
	// counted), and FillSeconds how long storing its entries took.
	HeapBytes   uint64  `json:"heap_bytes"`
	FillSeconds float64 `json:"fill_s"`
}

// SnapshotPoint is a joining replica's snapshot pull at an index size.
type SnapshotPoint struct {
	Entries int     `json:"entries"`
	Bytes   int     `json:"bytes"`
	Seconds float64 `json:"seconds"`
	// Loaded is how many entries the joining index held afterwards.
	Loaded int    `json:"loaded"`
	Error  string `json:"error,omitempty"`
}

// selectPrompt is the selection's prompt and its sequence hashes.
func selectPrompt() ([]uint32, []uint64) {
	p := make([]uint32, selectTokens)
	for i := range p {
		p[i] = uint32(1000 + i*7919%150000)
	}
	return p, indexer.SequenceHashes(p, blockSize, indexer.Seed("", ""), nil)
}

// mix is splitmix64, for fresh block hashes.
func mix(s *uint64) uint64 {
	*s += 0x9e3779b97f4a7c15
	z := *s
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func workerNames(n int) []indexer.Worker {
	ws := make([]indexer.Worker, n)
	for i := range ws {
		ws[i] = indexer.Worker{ID: fmt.Sprintf("w%d", i)}
	}
	return ws
}

// storeSelectPrompt stores the selection prompt's prefixes: 16 blocks on every worker,
// longer ones on the first eight. It returns the entries stored.
func storeSelectPrompt(x *indexer.Index, ws []indexer.Worker, seq []uint64) int {
	n := 0
	for i, w := range ws {
		depth := 16
		if i < 8 {
			depth = (i + 1) * len(seq) / 8
		}
		x.Store(w, seq[:depth])
		n += depth
	}
	return n
}

// selector is a router over ws, reading x, with some load on every worker.
type selector struct {
	r      *routing.Router
	prompt []uint32
	hashes []uint64
	err    error
}

func newSelector(x *indexer.Index, ws []indexer.Worker, prompt []uint32) (*selector, error) {
	specs := make([]routing.WorkerSpec, len(ws))
	for i, w := range ws {
		specs[i] = routing.WorkerSpec{ID: w.ID, URL: fmt.Sprintf("http://127.0.0.1:%d", 10000+i), CapacityBlocks: 1 << 16}
	}
	reg, err := routing.NewRegistry(specs)
	if err != nil {
		return nil, err
	}
	tracker := routing.NewTracker()
	for i, w := range ws {
		tracker.Start(w, int64(i%64*100), int64(i%64*10))
	}
	r, err := routing.New(routing.Config{}, routing.Deps{Index: x, Workers: reg, Tracker: tracker})
	if err != nil {
		return nil, err
	}
	return &selector{r: r, prompt: prompt, hashes: make([]uint64, 0, len(prompt)/blockSize)}, nil
}

// route is one whole selection: hash the prompt, look it up, score, take and give back the
// load.
func (s *selector) route() {
	s.hashes = s.r.HashTokens(s.prompt, "", s.hashes[:0])
	a, err := s.r.Route(context.Background(), &routing.Request{PromptTokens: len(s.prompt), Hashes: s.hashes, DPRank: -1})
	if err != nil {
		if s.err == nil {
			s.err = err
		}
		return
	}
	a.Finish()
}

// workerCurve times one selection at each fleet size, over an index of about entries.
func workerCurve(ctx context.Context, cfg Config, progress func(string, ...any)) ([]WorkerPoint, error) {
	prompt, seq := selectPrompt()
	var out []WorkerPoint
	for _, n := range cfg.WorkerCounts {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		ws := workerNames(n)
		x := indexer.New(indexer.Options{TTL: approxIndexTTL})
		stored := storeSelectPrompt(x, ws, seq)
		// The rest of the entries are other prompts, spread evenly over the workers.
		per := max(0, cfg.WorkerCurveEntries-stored) / n
		state := uint64(n)
		chunk := make([]uint64, lookupBlocks)
		for _, w := range ws {
			for left := per; left > 0; left -= len(chunk) {
				c := chunk[:min(left, len(chunk))]
				for i := range c {
					c[i] = mix(&state)
				}
				x.Store(w, c)
			}
		}
		s, err := newSelector(x, ws, prompt)
		if err != nil {
			return out, err
		}
		t := measure(fmt.Sprintf("select, %d workers", n), cfg.measureOpts(), nil, s.route)
		if s.err != nil {
			return out, fmt.Errorf("selection over %d workers: %w", n, s.err)
		}
		out = append(out, WorkerPoint{Workers: n, Entries: x.Len(), Select: t})
		progress("  %4d workers: select p50 %s, p99 %s (floor p99 %s)", n, us(t.P50), us(t.P99), us(t.FloorP99))
		runtime.KeepAlive(x)
	}
	return out, nil
}

func (c Config) measureOpts() measureOpts {
	return measureOpts{rounds: max(1, c.Rounds), calls: max(1, c.RoundCalls), roundTime: c.RoundTime}
}

// fleet is the lookup workload, grown in place.
type fleet struct {
	ws      []indexer.Worker
	rng     *rand.Rand
	prompts [][]uint64
	stored  int
}

// grow stores prompts until the index holds about entries.
func (f *fleet) grow(x *indexer.Index, entries int) {
	for f.stored < entries {
		p := make([]uint64, lookupBlocks)
		for i := range p {
			p[i] = f.rng.Uint64()
		}
		f.prompts = append(f.prompts, p)
		holders := 1 + f.rng.IntN(16)
		for _, w := range f.rng.Perm(len(f.ws))[:holders] {
			d := min(1+f.rng.IntN(lookupBlocks), entries-f.stored)
			x.Store(f.ws[w], p[:d])
			f.stored += d
			if f.stored >= entries {
				break
			}
		}
	}
}

// heap is the live heap after a collection. It collects twice: a sync.Pool (each index has
// one) keeps what it holds, and the object it is part of, alive for one collection more; and
// it returns the freed memory to the system now, so that the runtime's background scavenger
// does not do it during the measurements that follow.
func heap() uint64 {
	runtime.GC()
	debug.FreeOSMemory()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// indexCurve grows one index of 64 workers through cfg.IndexSizes and, at each size, times a
// lookup and a selection, takes the heap, and at the sizes of cfg.SnapshotSizes times a
// joining replica's snapshot pull.
func indexCurve(ctx context.Context, cfg Config, progress func(string, ...any)) ([]IndexPoint, []SnapshotPoint, error) {
	base := heap()
	ws := workerNames(indexWorkers)
	x := indexer.New(indexer.Options{TTL: approxIndexTTL})
	prompt, seq := selectPrompt()
	f := &fleet{ws: ws, rng: rand.New(rand.NewPCG(1, 2))}
	f.stored = storeSelectPrompt(x, ws, seq)
	s, err := newSelector(x, ws, prompt)
	if err != nil {
		return nil, nil, err
	}
	var points []IndexPoint
	var snaps []SnapshotPoint
	buf := make([]uint64, lookupBlocks)
	dst := make([]indexer.Match, 0, indexWorkers)
	for _, size := range cfg.IndexSizes {
		if err := ctx.Err(); err != nil {
			return points, snaps, err
		}
		t0 := time.Now()
		f.grow(x, size)
		fill := time.Since(t0)
		promptBytes := uint64(len(f.prompts)) * (lookupBlocks*8 + 24)
		h := heap()
		p := IndexPoint{Entries: x.Len(), FillSeconds: fill.Seconds()}
		if h > base+promptBytes {
			p.HeapBytes = h - base - promptBytes
		}
		// Lookups cycle through every prompt, so most reads miss the processor's caches, as
		// BenchmarkFindMatches512/shared-fleet's do; the prompt's hashes are copied into one
		// buffer first, untimed (a router has just hashed them).
		i := 0
		p.Lookup = measure(fmt.Sprintf("lookup, %s entries", millions(p.Entries)), cfg.measureOpts(),
			func() { buf = append(buf[:0], f.prompts[i%len(f.prompts)]...); i++ },
			func() { dst = x.FindMatches(buf, dst[:0]) })
		p.Select = measure(fmt.Sprintf("select, %s entries", millions(p.Entries)), cfg.measureOpts(), nil, s.route)
		if s.err != nil {
			return points, snaps, fmt.Errorf("selection over %d entries: %w", p.Entries, s.err)
		}
		points = append(points, p)
		progress("  %s entries: lookup p50 %s p99 %s, select p50 %s p99 %s, heap %.0f MiB (%.1f B/entry), filled in %.1f s",
			millions(p.Entries), us(p.Lookup.P50), us(p.Lookup.P99), us(p.Select.P50), us(p.Select.P99),
			float64(p.HeapBytes)/(1<<20), float64(p.HeapBytes)/float64(max(1, p.Entries)), fill.Seconds())
		for _, want := range cfg.SnapshotSizes {
			if want == size {
				sp := pullSnapshot(ctx, x)
				snaps = append(snaps, sp)
				progress("  snapshot pull at %s entries: %.0f MiB in %.2f s %s", millions(sp.Entries), float64(sp.Bytes)/(1<<20), sp.Seconds, sp.Error)
			}
		}
	}
	runtime.KeepAlive(x)
	return points, snaps, nil
}

// pullSnapshot serves x's snapshot on a loopback peer port, as a replica's IndexSync does,
// and times a joining replica's IndexSync pulling and loading it into an empty index.
func pullSnapshot(ctx context.Context, x *indexer.Index) SnapshotPoint {
	sp := SnapshotPoint{Entries: x.Len()}
	fail := func(err error) SnapshotPoint { sp.Error = err.Error(); return sp }
	src, err := hints.NewIndexSync(hints.IndexSyncConfig{Self: "serving", Approx: x,
		Peers: func() []hints.SnapshotPeer { return nil },
		Fetch: func(context.Context, string) ([]byte, error) { return nil, errors.New("not used") },
		// No peer: it warms at once, as a cluster's first replica.
		DiscoveryWait: time.Millisecond, MinBackoff: time.Millisecond})
	if err != nil {
		return fail(err)
	}
	if err := src.Run(ctx); err != nil || !src.Warm() {
		return fail(fmt.Errorf("serving side did not warm: %v", err))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	srv := peer.NewServer(noHandler{}, peer.ServerOptions{Snapshots: src})
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.Serve(ln) }()
	defer func() { srv.Stop(); <-served }()
	pool := peer.NewPool(peer.ClientOptions{})
	defer pool.Close()

	joined := indexer.New(indexer.Options{TTL: approxIndexTTL})
	fetch := hints.PoolFetcher(pool, "joining", 0)
	sync, err := hints.NewIndexSync(hints.IndexSyncConfig{Self: "joining", Approx: joined,
		Peers: func() []hints.SnapshotPeer { return []hints.SnapshotPeer{{ID: "serving", Addr: ln.Addr().String()}} },
		Fetch: func(ctx context.Context, addr string) ([]byte, error) {
			b, err := fetch(ctx, addr)
			sp.Bytes = len(b)
			return b, err
		},
		AttemptTimeout: 2 * time.Minute})
	if err != nil {
		return fail(err)
	}
	// One attempt's worth: a pull that cannot succeed (over the size bound) would be retried
	// for ever.
	pctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	t0 := time.Now()
	err = sync.Run(pctx)
	sp.Seconds = time.Since(t0).Seconds()
	sp.Loaded = joined.Len()
	if err == nil && !sync.Warm() {
		err = errors.New("the joining replica did not load a snapshot")
	}
	if err != nil {
		return fail(err)
	}
	runtime.KeepAlive(joined)
	return sp
}

// noHandler answers every peer call but the snapshot with an error: the snapshot pull needs
// no Raft behind the port.
type noHandler struct{}

var errNotAReplica = errors.New("benchreport: only index snapshots are served here")

func (noHandler) Apply(context.Context, []byte) ([]byte, uint64, error) {
	return nil, 0, errNotAReplica
}
func (noHandler) ReadIndex(context.Context) (uint64, error)    { return 0, errNotAReplica }
func (noHandler) Touch(context.Context, []peer.Touch) error    { return errNotAReplica }
func (noHandler) Status(context.Context) (peer.Status, error)  { return peer.Status{}, errNotAReplica }
func (noHandler) Join(context.Context, peer.JoinRequest) error { return errNotAReplica }
func (noHandler) Leave(context.Context, string) error          { return errNotAReplica }

// us renders ns as microseconds.
func us(ns float64) string { return fmt.Sprintf("%.1f us", ns/1000) }

// millions renders an entry count (1M, 2.5M, 40k).
func millions(n int) string {
	switch {
	case n >= 1_000_000:
		return trimZero(fmt.Sprintf("%.1f", float64(n)/1e6)) + "M"
	case n >= 1000:
		return trimZero(fmt.Sprintf("%.1f", float64(n)/1e3)) + "k"
	}
	return fmt.Sprint(n)
}

func trimZero(s string) string {
	if len(s) > 2 && s[len(s)-2:] == ".0" {
		return s[:len(s)-2]
	}
	return s
}
