package sim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

// DPRankHeader names the data-parallel rank: in a request, the rank that must serve it; in
// a DataParallel front's response, the rank that did.
const DPRankHeader = "X-Data-Parallel-Rank"

// DataParallel is one HTTP API in front of several ranks, as a vLLM deployment with
// data parallelism is: each rank is a Worker with its own cache, queue, faults and KV
// events, and a request goes to the rank its X-Data-Parallel-Rank header names, or to the
// least busy rank without one. See the package documentation for each endpoint.
type DataParallel struct {
	ranks   []*Worker
	log     *slog.Logger
	handler http.Handler

	mu sync.Mutex
	// inFlight counts the generation requests each rank has been handed and not finished.
	// The balancer reads it rather than the ranks' running and waiting counts, because a
	// request enters those only after its body is read: a burst would all see the same idle
	// rank.
	inFlight []int
}

// NewDataParallel returns a front over ranks, rank r being ranks[r]. The ranks must be
// distinct and share an ID, a model and a role (one worker serving one model); at most
// kvevents.MaxDPRank+1 of them.
func NewDataParallel(ranks ...*Worker) (*DataParallel, error) {
	if len(ranks) == 0 || len(ranks) > kvevents.MaxDPRank+1 {
		return nil, fmt.Errorf("sim: data parallel: %d ranks: must be in [1, %d]", len(ranks), kvevents.MaxDPRank+1)
	}
	seen := make(map[*Worker]int, len(ranks))
	for r, w := range ranks {
		if w == nil {
			return nil, fmt.Errorf("sim: data parallel: rank %d is nil", r)
		}
		if prev, dup := seen[w]; dup {
			return nil, fmt.Errorf("sim: data parallel: ranks %d and %d are the same worker", prev, r)
		}
		seen[w] = r
		if w.cfg.ID != ranks[0].cfg.ID || w.cfg.Model != ranks[0].cfg.Model {
			return nil, fmt.Errorf("sim: data parallel: rank %d is %s serving %s, rank 0 is %s serving %s",
				r, w.cfg.ID, w.cfg.Model, ranks[0].cfg.ID, ranks[0].cfg.Model)
		}
		if w.cfg.Role != ranks[0].cfg.Role {
			return nil, fmt.Errorf("sim: data parallel: rank %d has role %s, rank 0 %s", r, w.cfg.Role, ranks[0].cfg.Role)
		}
	}
	d := &DataParallel{
		ranks:    append([]*Worker(nil), ranks...),
		log:      ranks[0].cfg.Logger.With("worker", ranks[0].cfg.ID, "dp_size", len(ranks)),
		inFlight: make([]int, len(ranks)),
	}
	d.handler = d.routes()
	return d, nil
}

// Size is the number of ranks.
func (d *DataParallel) Size() int { return len(d.ranks) }

// Rank returns rank r's Worker; it panics when r is out of [0, Size()).
func (d *DataParallel) Rank(r int) *Worker { return d.ranks[r] }

// Handler returns the front's HTTP API.
func (d *DataParallel) Handler() http.Handler { return d.handler }

// Serve serves the front on ln until ctx ends, then shuts down as Worker.Serve does, with
// the longest ShutdownTimeout of the ranks. New connections are refused only while every
// rank refuses; a request for a refusing rank has its connection dropped. It closes ln.
func (d *DataParallel) Serve(ctx context.Context, ln net.Listener) error {
	grace := d.ranks[0].cfg.ShutdownTimeout
	for _, w := range d.ranks[1:] {
		grace = max(grace, w.cfg.ShutdownTimeout)
	}
	return serveHTTP(ctx, ln, d.handler, d.allRefusing, grace, d.log, "model", d.ranks[0].cfg.Model)
}

// allRefusing reports whether every rank refuses, which is when the front as a whole looks
// dead.
func (d *DataParallel) allRefusing() bool {
	for _, w := range d.ranks {
		if !w.refusing() {
			return false
		}
	}
	return true
}

// routes builds the front's HTTP API: a valid rank header hands the request to that rank's
// own API, a bad one is answered 400, and without one the request is balanced (generation),
// answered about every rank (stats, faults, cache reset) or served by rank 0.
func (d *DataParallel) routes() http.Handler {
	anyRank := http.NewServeMux()
	anyRank.HandleFunc("POST /v1/completions", d.serveBalanced)
	anyRank.HandleFunc("POST /v1/chat/completions", d.serveBalanced)
	anyRank.HandleFunc("GET /sim/stats", d.whole(d.handleStats))
	anyRank.HandleFunc("GET /sim/faults", d.whole(d.handleGetFaults))
	anyRank.HandleFunc("POST /sim/faults", d.whole(d.handleSetFaults))
	anyRank.HandleFunc("POST "+KVPullPath, d.handlePull)
	anyRank.HandleFunc("POST /reset_prefix_cache", d.whole(func(rw http.ResponseWriter, _ *http.Request) {
		for _, w := range d.ranks {
			w.ClearCache()
		}
		rw.WriteHeader(http.StatusOK)
	}))
	// The rest (models, health, tokenize, metrics, unknown paths) does not depend on the
	// rank; /metrics is rank 0's registry unless a rank is named.
	anyRank.Handle("/", d.onRank(0))
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		rank, named, aerr := d.parseRank(r.Header)
		switch {
		case aerr != nil:
			rw.Header().Set("X-Worker-ID", d.ranks[0].cfg.ID)
			writeError(rw, aerr)
		case named:
			d.serveRank(rw, r, rank)
		default:
			anyRank.ServeHTTP(rw, r)
		}
	})
}

// parseRank reads the rank header: named is false when there is none; a value that is
// not a rank of this front is an error.
func (d *DataParallel) parseRank(h http.Header) (rank int, named bool, aerr *apiError) {
	vals := h.Values(DPRankHeader)
	switch len(vals) {
	case 0:
		return 0, false, nil
	case 1:
	default:
		return 0, false, badRequest("", "%s given %d times: give it at most once", DPRankHeader, len(vals))
	}
	v := strings.TrimSpace(vals[0])
	n, err := strconv.ParseUint(v, 10, 64)
	switch {
	case err != nil && !errors.Is(err, strconv.ErrRange):
		return 0, false, badRequest("", "%s %q: must be a non-negative integer", DPRankHeader, v)
	case err != nil || n >= uint64(len(d.ranks)):
		return 0, false, badRequest("", "%s %s: this worker has %d data-parallel ranks (0..%d)",
			DPRankHeader, v, len(d.ranks), len(d.ranks)-1)
	}
	return int(n), true, nil
}

// onRank returns a handler that serves every request on rank r.
func (d *DataParallel) onRank(r int) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, req *http.Request) { d.serveRank(rw, req, r) })
}

// serveRank hands a request to rank r's API, counting it in flight when it generates.
func (d *DataParallel) serveRank(rw http.ResponseWriter, r *http.Request, rank int) {
	if r.Method == http.MethodPost && (r.URL.Path == "/v1/completions" || r.URL.Path == "/v1/chat/completions") {
		d.mu.Lock()
		d.inFlight[rank]++
		d.mu.Unlock()
		defer d.done(rank)
	}
	d.dispatch(rw, r, rank)
}

// serveBalanced hands a generation request without a rank to the rank with the fewest
// requests in flight, the lowest on a tie; a refusing rank (an engine that is down) is
// passed over while another one serves.
func (d *DataParallel) serveBalanced(rw http.ResponseWriter, r *http.Request) {
	refusing := make([]bool, len(d.ranks))
	for i, w := range d.ranks {
		refusing[i] = w.refusing()
	}
	d.mu.Lock()
	best := 0
	for i := 1; i < len(d.ranks); i++ {
		// A serving rank beats a refusing one; among equals, fewer in flight wins.
		if refusing[i] == refusing[best] && d.inFlight[i] < d.inFlight[best] || refusing[best] && !refusing[i] {
			best = i
		}
	}
	d.inFlight[best]++
	d.mu.Unlock()
	defer d.done(best)
	d.dispatch(rw, r, best)
}

func (d *DataParallel) done(rank int) {
	d.mu.Lock()
	d.inFlight[rank]--
	d.mu.Unlock()
}

func (d *DataParallel) dispatch(rw http.ResponseWriter, r *http.Request, rank int) {
	rw.Header().Set(DPRankHeader, strconv.Itoa(rank))
	d.ranks[rank].handler.ServeHTTP(rw, r)
}

// whole wraps a handler that answers about every rank: it drops the connection only when
// the whole front refuses, as a single worker does.
func (d *DataParallel) whole(h http.HandlerFunc) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		if d.allRefusing() {
			d.ranks[0].dropConnection(rw)
			return
		}
		rw.Header().Set("X-Worker-ID", d.ranks[0].cfg.ID)
		h(rw, r)
	}
}

// handlePull hands a KV pull without a rank to the rank whose engine id it names (each
// rank is an engine of its own, as in vLLM); an engine id of no rank is answered 404.
func (d *DataParallel) handlePull(rw http.ResponseWriter, r *http.Request) {
	body, aerr := d.ranks[0].readBody(rw, r)
	var req *pullRequest
	if aerr == nil {
		req, aerr = decodePullRequest(body)
	}
	if aerr == nil {
		for i, w := range d.ranks {
			if w.engineID == req.EngineID {
				r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
				d.dispatch(rw, r, i)
				return
			}
		}
		aerr = &apiError{status: http.StatusNotFound, typ: "invalid_request_error", param: "engine_id", code: "unknown_engine",
			message: fmt.Sprintf("engine_id %q is none of this worker's %d data-parallel ranks' engines", req.EngineID, len(d.ranks))}
	}
	rw.Header().Set("X-Worker-ID", d.ranks[0].cfg.ID)
	writeError(rw, aerr)
}

// rankStats is one rank's part of /sim/stats.
type rankStats struct {
	Rank     int        `json:"dp_rank"`
	EngineID string     `json:"engine_id"`
	Stats    Stats      `json:"stats"`
	Cache    CacheStats `json:"cache"`
}

// handleStats answers the single worker's shape with every count summed over the ranks
// (capacity too: the fleet's cache is the ranks' together), and each rank's own in "ranks".
func (d *DataParallel) handleStats(rw http.ResponseWriter, _ *http.Request) {
	var sum Stats
	var cache CacheStats
	per := make([]rankStats, len(d.ranks))
	for i, w := range d.ranks {
		per[i] = rankStats{Rank: i, EngineID: w.engineID, Stats: w.Stats(), Cache: w.Cache()}
		sum = sum.plus(per[i].Stats)
		cache = cache.plus(per[i].Cache)
	}
	writeJSON(rw, http.StatusOK, struct {
		ID     string      `json:"id"`
		Role   string      `json:"role"`
		DPSize int         `json:"dp_size"`
		Stats  Stats       `json:"stats"`
		Cache  CacheStats  `json:"cache"`
		Ranks  []rankStats `json:"ranks"`
	}{d.ranks[0].cfg.ID, d.ranks[0].cfg.Role, len(d.ranks), sum, cache, per})
}

func (s Stats) plus(o Stats) Stats {
	s.Served += o.Served
	s.Aborted += o.Aborted
	s.Failed += o.Failed
	s.Running += o.Running
	s.Waiting += o.Waiting
	s.PromptTokens += o.PromptTokens
	s.CachedTokens += o.CachedTokens
	s.GeneratedTokens += o.GeneratedTokens
	s.InterTokens += o.InterTokens
	s.InterTokenSeconds += o.InterTokenSeconds
	s.KVTransfers += o.KVTransfers
	s.KVTransferBlocks += o.KVTransferBlocks
	s.KVTransferSeconds += o.KVTransferSeconds
	s.KVTransfersHeld += o.KVTransfersHeld
	return s
}

func (c CacheStats) plus(o CacheStats) CacheStats {
	c.BlockSize = o.BlockSize
	c.Capacity += o.Capacity
	c.Blocks += o.Blocks
	c.Pinned += o.Pinned
	c.Queries += o.Queries
	c.Hits += o.Hits
	c.StoredBlocks += o.StoredBlocks
	c.EvictedBlocks += o.EvictedBlocks
	return c
}

// allFaults is /sim/faults without a rank: rank 0's faults in the single worker's shape,
// and every rank's in "ranks".
type allFaults struct {
	faultsWire
	Ranks []faultsWire `json:"ranks"`
}

func faultsAnswer(fs []Faults) allFaults {
	out := allFaults{faultsWire: fs[0].wire(), Ranks: make([]faultsWire, len(fs))}
	for i, f := range fs {
		out.Ranks[i] = f.wire()
	}
	return out
}

func (d *DataParallel) handleGetFaults(rw http.ResponseWriter, _ *http.Request) {
	fs := make([]Faults, len(d.ranks))
	for i, w := range d.ranks {
		fs[i] = w.Faults()
	}
	writeJSON(rw, http.StatusOK, faultsAnswer(fs))
}

// handleSetFaults applies the body's fields to every rank's faults, all or none: every
// rank's lock is held (in rank order) while the new faults are worked out and set.
func (d *DataParallel) handleSetFaults(rw http.ResponseWriter, r *http.Request) {
	body, aerr := d.ranks[0].readBody(rw, r)
	if aerr != nil {
		writeError(rw, aerr)
		return
	}
	fs, err := d.setFaults(body)
	if err != nil {
		writeError(rw, badRequest("", "%v", err))
		return
	}
	d.log.Info("sim faults changed on every rank", "error_rate", fs[0].ErrorRate, "stall_rate", fs[0].StallRate,
		"stall", fs[0].Stall, "refuse", fs[0].Refuse, "refuse_for", fs[0].RefuseFor)
	writeJSON(rw, http.StatusOK, faultsAnswer(fs))
}

func (d *DataParallel) setFaults(body []byte) ([]Faults, error) {
	for _, w := range d.ranks {
		w.faultMu.Lock()
		defer w.faultMu.Unlock()
	}
	fs := make([]Faults, len(d.ranks))
	for i, w := range d.ranks {
		w.expireRefuseLocked()
		f, err := applyFaultsJSON(w.faults, body)
		if err != nil {
			return nil, err
		}
		fs[i] = f
	}
	for i, w := range d.ranks {
		w.setFaultsLocked(fs[i])
	}
	return fs, nil
}
