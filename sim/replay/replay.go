// Package replay plays a request trace against a router, or round-robin
// straight at workers as the no-router baseline, and summarises routing
// quality: prefix-cache hit rate, TTFT, load imbalance and how well the
// router's predicted overlap matched what the workers actually had cached.
//
// Each trace request becomes an OpenAI completions call whose prompt is the
// token ids trace.Tokens derives from the request's block ids, so the
// trace's prefix sharing reaches the router and the workers intact.
package replay

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
)

// Defaults applied by Run to zero Config fields, and by DefaultConfig.
const (
	// DefaultSpeedup replays in real time.
	DefaultSpeedup = 1.0
	// DefaultConcurrency is far above the trace's mean load (about 4 req/s),
	// so it only bites when the target falls behind.
	DefaultConcurrency = 256
	// DefaultTimeout allows a long prompt on a slow worker.
	DefaultTimeout = 5 * time.Minute
	// DefaultRouterBlockSize is vLLM's default KV block size.
	DefaultRouterBlockSize = 16
)

// Limits on Config values; beyond them a run is misconfigured, not large.
const (
	minSpeedup     = 1e-3
	maxSpeedup     = 1e9
	maxConcurrency = 1 << 16
	// maxEventBytes bounds one SSE event or non-streamed body, so a broken
	// server cannot make the client buffer without end.
	maxEventBytes = 8 << 20
	// maxErrorBody is how much of a non-2xx body is kept for the log.
	maxErrorBody = 512
)

// Response headers the replay reads.
const (
	headerWorker        = "X-Kvrouter-Worker"
	headerWorkerID      = "X-Worker-ID"
	headerOverlapBlocks = "X-Kvrouter-Overlap-Blocks"
	headerSession       = "X-Session-ID"
	headerReplica       = "X-Kvrouter-Replica"
)

// Error causes counted in Summary.Errors besides "http_<status>".
const (
	CauseTransport   = "transport"    // no response: connect refused, reset before headers
	CauseTimeout     = "timeout"      // the per-request Timeout elapsed
	CauseCanceled    = "canceled"     // the run's context ended while the request was in flight
	CauseBadBody     = "bad_body"     // a 2xx body that is not valid JSON or SSE
	CauseStreamError = "stream_error" // the body carried an OpenAI error object
	CauseTruncated   = "truncated"    // the stream ended before usage and [DONE]
	CauseNoUsage     = "no_usage"     // a complete response without usage
)

// unknownWorker labels responses from a router that named no worker.
const unknownWorker = "unknown"

// Config describes one replay run. Set exactly one of Target, Targets and Workers.
type Config struct {
	// Target is a router's base URL, e.g. http://127.0.0.1:8080.
	Target string
	// Targets are several routers' base URLs the client sends to round-robin, as a load
	// balancer in front of router replicas would.
	Targets []string
	// Workers are worker base URLs the client itself sends to round-robin:
	// the baseline with no router.
	Workers []string
	// Requests is the trace, in arrival order. Sessions are sent as
	// X-Session-ID when set (see trace.AssignSessions); Run does not modify it.
	Requests []trace.Request
	// Speedup divides every arrival time; 0 means 1.
	Speedup float64
	// Concurrency bounds requests in flight; later arrivals wait for a slot.
	// 0 means DefaultConcurrency.
	Concurrency int
	// Limit replays only the first Limit requests; 0 means all.
	Limit int
	// Timeout bounds each request from send to the end of its body; 0 means
	// DefaultTimeout.
	Timeout time.Duration
	// BlockTokens is the trace's tokens per hash id; 0 means trace.BlockTokens.
	BlockTokens int
	// RouterBlockSize converts X-Kvrouter-Overlap-Blocks to tokens; 0 means
	// DefaultRouterBlockSize.
	RouterBlockSize int
	// Model is sent as the request's model; empty leaves the field out.
	Model string
	// Stream asks for SSE with usage in the final chunk, which is what lets
	// TTFT be measured; DefaultConfig sets it.
	Stream bool
	// MaxOutputTokens caps each request's max_tokens; 0 means no cap.
	MaxOutputTokens int
	// Label names the run in summaries and the progress bar.
	Label string
	// Progress receives the run's progress: a bar on a terminal, a plain line every
	// ProgressEvery (5s) elsewhere; nil means none.
	Progress      io.Writer
	ProgressEvery time.Duration
	// RequestLog, when set, receives one JSON line per request once the run ends (RequestRecord):
	// the raw material behind the summary, for looking into a prediction error.
	RequestLog io.Writer
	// HTTPClient sends the requests; nil means a client sized for Concurrency.
	HTTPClient *http.Client
	// Logger receives per-failure debug lines and the run's start and end;
	// nil means no logging.
	Logger *slog.Logger
}

// DefaultConfig returns a Config with every default filled in, streaming on.
func DefaultConfig() Config {
	return Config{
		Speedup:         DefaultSpeedup,
		Concurrency:     DefaultConcurrency,
		Timeout:         DefaultTimeout,
		BlockTokens:     trace.BlockTokens,
		RouterBlockSize: DefaultRouterBlockSize,
		Stream:          true,
	}
}

// normalize validates cfg, fills defaults and returns the endpoint URLs to
// send to (one for a router, one per worker).
func normalize(cfg Config) (Config, []string, error) {
	var bases []string
	switch {
	case (cfg.Target != "") && len(cfg.Workers) > 0, (cfg.Target != "") && len(cfg.Targets) > 0, len(cfg.Targets) > 0 && len(cfg.Workers) > 0:
		return cfg, nil, errors.New("replay: set one of a target, targets or workers, not both")
	case cfg.Target != "":
		bases = []string{cfg.Target}
	case len(cfg.Targets) > 0:
		bases = cfg.Targets
	case len(cfg.Workers) > 0:
		bases = cfg.Workers
	default:
		return cfg, nil, errors.New("replay: no target or workers to send to")
	}
	urls := make([]string, len(bases))
	for i, b := range bases {
		u, err := url.Parse(b)
		if err != nil {
			return cfg, nil, fmt.Errorf("replay: base URL %q: %w", b, err)
		}
		if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return cfg, nil, fmt.Errorf("replay: base URL %q: want http(s)://host[:port]", b)
		}
		urls[i] = strings.TrimRight(b, "/") + "/v1/completions"
	}
	if len(cfg.Requests) == 0 {
		return cfg, nil, errors.New("replay: no requests to replay")
	}
	if cfg.Speedup == 0 {
		cfg.Speedup = DefaultSpeedup
	}
	if math.IsNaN(cfg.Speedup) || cfg.Speedup < minSpeedup || cfg.Speedup > maxSpeedup {
		return cfg, nil, fmt.Errorf("replay: speedup %v outside [%g, %g]", cfg.Speedup, minSpeedup, maxSpeedup)
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.Concurrency < 0 || cfg.Concurrency > maxConcurrency {
		return cfg, nil, fmt.Errorf("replay: concurrency %d outside [1, %d]", cfg.Concurrency, maxConcurrency)
	}
	if cfg.Limit < 0 {
		return cfg, nil, fmt.Errorf("replay: negative limit %d", cfg.Limit)
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Timeout < 0 {
		return cfg, nil, fmt.Errorf("replay: negative timeout %v", cfg.Timeout)
	}
	if cfg.BlockTokens == 0 {
		cfg.BlockTokens = trace.BlockTokens
	}
	if cfg.BlockTokens < 0 {
		return cfg, nil, fmt.Errorf("replay: negative block tokens %d", cfg.BlockTokens)
	}
	if cfg.RouterBlockSize == 0 {
		cfg.RouterBlockSize = DefaultRouterBlockSize
	}
	if cfg.RouterBlockSize < 0 {
		return cfg, nil, fmt.Errorf("replay: negative router block size %d", cfg.RouterBlockSize)
	}
	if cfg.MaxOutputTokens < 0 {
		return cfg, nil, fmt.Errorf("replay: negative max output tokens %d", cfg.MaxOutputTokens)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return cfg, urls, nil
}

// result is what one request produced; Run fills one per dispatched request.
type result struct {
	ok           bool
	cause        string
	worker       string
	replica      string
	sent         time.Duration // since the run's start
	ttft         time.Duration
	hasTTFT      bool
	latency      time.Duration
	promptTokens int64
	cachedTokens int64
	// outputTokens is the usage's completion_tokens; streamed says the first token was seen
	// apart from the last, so (latency - ttft) / (outputTokens - 1) is its inter-token latency.
	outputTokens int64
	streamed     bool
	overlap      int64
	hasOverlap   bool
	session      string
	// errText is a failure's error, with the start of the response body for a non-2xx.
	errText string
}

// runner holds what every request of one run shares.
type runner struct {
	cfg      Config
	client   *http.Client
	model    []byte // the model as a JSON string, encoded once
	fallback []string
	tokens   sync.Pool // *[]uint32 prompts, reused once encoded
}

// Run replays cfg.Requests, each at its arrival time divided by Speedup,
// with at most Concurrency in flight, and summarises the outcome. Failed
// requests are counted by cause and never stop the run. When ctx ends, no
// more requests are sent, those in flight are cancelled, and Run returns the
// partial summary (Interrupted set) together with ctx's error.
func Run(ctx context.Context, cfg Config) (*Summary, error) {
	cfg, urls, err := normalize(cfg)
	if err != nil {
		return nil, err
	}
	reqs := cfg.Requests
	if cfg.Limit > 0 && cfg.Limit < len(reqs) {
		reqs = reqs[:cfg.Limit]
	}
	r := &runner{cfg: cfg, client: cfg.HTTPClient}
	if r.client == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		// The default of 2 idle connections per host would make every burst
		// above 2 open and close connections, which the latencies would show.
		t.MaxIdleConnsPerHost = cfg.Concurrency
		r.client = &http.Client{Transport: t}
		defer t.CloseIdleConnections()
	}
	if cfg.Model != "" {
		if r.model, err = json.Marshal(cfg.Model); err != nil {
			return nil, fmt.Errorf("replay: encode model: %w", err)
		}
	}
	// Without a worker header, a baseline run still knows where it sent.
	r.fallback = make([]string, len(urls))
	for i := range urls {
		r.fallback[i] = unknownWorker
		if len(cfg.Workers) > 0 {
			r.fallback[i] = cfg.Workers[i]
		}
	}

	bar := newProgress(cfg, len(reqs))
	cfg.Logger.Info("replay starting", "label", cfg.Label, "requests", len(reqs),
		"endpoints", len(urls), "speedup", cfg.Speedup, "concurrency", cfg.Concurrency)

	results := make([]result, len(reqs))
	sem := make(chan struct{}, cfg.Concurrency)
	var wg sync.WaitGroup
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	start := time.Now()
	dispatched := 0
	// A slice from the middle of a trace starts at its first request, not at the trace's zero.
	var origin time.Duration
	if len(reqs) > 0 {
		origin = reqs[0].Timestamp
	}
dispatch:
	for i, req := range reqs {
		if wait := scaled(req.Timestamp-origin, cfg.Speedup) - time.Since(start); wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				timer.Stop()
				break dispatch
			case <-timer.C:
			}
		}
		select {
		case <-ctx.Done():
			break dispatch
		case sem <- struct{}{}:
		}
		if ctx.Err() != nil {
			// Both cases were ready and select chose the slot at random.
			<-sem
			break
		}
		dispatched++
		ep := i % len(urls)
		wg.Go(func() {
			defer func() { <-sem }()
			sent := time.Since(start)
			results[i] = r.do(ctx, req, urls[ep], r.fallback[ep])
			results[i].sent = sent
			if bar != nil {
				bar.add()
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)

	if cfg.RequestLog != nil {
		if err := writeRequestLog(cfg.RequestLog, reqs[:dispatched], results[:dispatched], cfg.RouterBlockSize); err != nil {
			cfg.Logger.Warn("replay request log", "err", err)
		}
	}
	sum := summarize(results[:dispatched], cfg.RouterBlockSize)
	sum.Label = cfg.Label
	sum.Planned = len(reqs)
	sum.DurationSeconds = elapsed.Seconds()
	sum.OutputTokensPerSecond = ratio(float64(sum.OutputTokens), sum.DurationSeconds)
	sum.Interrupted = ctx.Err() != nil
	if bar != nil {
		bar.finish(!sum.Interrupted)
	}
	cfg.Logger.Info("replay done", "label", cfg.Label, "requests", sum.Requests, "ok", sum.OK,
		"failed", sum.Failed, "hit_rate", sum.HitRate, "interrupted", sum.Interrupted)
	if sum.Interrupted {
		return sum, fmt.Errorf("replay interrupted after %d of %d requests: %w", dispatched, len(reqs), ctx.Err())
	}
	return sum, nil
}

// scaled is ts divided by speedup, clamped so an extreme ratio cannot
// overflow a Duration.
func scaled(ts time.Duration, speedup float64) time.Duration {
	f := float64(ts) / speedup
	if f >= math.MaxInt64/2 {
		return math.MaxInt64 / 2
	}
	return time.Duration(f)
}

// do sends one request and reads its whole response.
func (r *runner) do(parent context.Context, req trace.Request, endpoint, fallback string) result {
	ctx, cancel := context.WithTimeout(parent, r.cfg.Timeout)
	defer cancel()

	// The body is not pooled: the transport may still read it after Do
	// returns (an early error response), so reuse would race.
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, endpoint, bytes.NewReader(r.encode(req)))
	if err != nil {
		// normalize checked the URL, so this is not expected; count it anyway.
		return r.fail(req, CauseTransport, err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	if r.cfg.Stream {
		hreq.Header.Set("Accept", "text/event-stream")
	}
	if req.Session != "" {
		hreq.Header.Set(headerSession, req.Session)
	}

	begin := time.Now()
	resp, err := r.client.Do(hreq)
	if err != nil {
		return r.fail(req, causeOf(parent, ctx, err, CauseTransport), err)
	}
	defer resp.Body.Close()

	res := result{worker: workerOf(resp.Header, fallback), session: req.Session, replica: resp.Header.Get(headerReplica)}
	if v := resp.Header.Get(headerOverlapBlocks); v != "" {
		if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil && n >= 0 {
			res.overlap, res.hasOverlap = n, true
		}
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		res.cause = "http_" + strconv.Itoa(resp.StatusCode)
		err := fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(msg))
		res.errText = err.Error()
		r.logFail(req, res.cause, err)
		return res
	}

	var u *usage
	var cause string
	if r.cfg.Stream {
		u, cause, err = readStream(resp.Body, begin, &res)
		res.streamed = true
	} else {
		u, cause, err = readJSON(resp.Body)
		// Without a stream the first token is only seen with the last.
		res.ttft, res.hasTTFT = time.Since(begin), true
	}
	res.latency = time.Since(begin)
	if err != nil {
		if cause == CauseTruncated {
			cause = causeOf(parent, ctx, err, cause)
		}
		res.cause, res.errText = cause, err.Error()
		r.logFail(req, cause, err)
		return res
	}
	res.ok = true
	res.promptTokens, res.outputTokens = u.PromptTokens, u.CompletionTokens
	if u.PromptTokensDetails != nil {
		res.cachedTokens = u.PromptTokensDetails.CachedTokens
	}
	return res
}

func (r *runner) fail(req trace.Request, cause string, err error) result {
	r.logFail(req, cause, err)
	return result{cause: cause, errText: err.Error()}
}

func (r *runner) logFail(req trace.Request, cause string, err error) {
	r.cfg.Logger.Debug("replay request failed", "index", req.Index, "session", req.Session,
		"cause", cause, "err", err)
}

// causeOf tells apart the run ending, this request's own deadline and any
// other failure, which is reported as fallback.
func causeOf(parent, ctx context.Context, err error, fallback string) string {
	if parent.Err() != nil {
		return CauseCanceled
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return CauseTimeout
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return CauseTimeout
	}
	return fallback
}

// workerOf names the worker that served a response: the router's header,
// else the worker's own, else the endpoint the request went to.
func workerOf(h http.Header, fallback string) string {
	if w := h.Get(headerWorker); w != "" {
		return w
	}
	if w := h.Get(headerWorkerID); w != "" {
		return w
	}
	return fallback
}

// encode returns the completions request body for req. It is written by
// hand because the prompt can hold ~200k ids and reflection-based encoding
// would dominate the client's CPU.
func (r *runner) encode(req trace.Request) []byte {
	tp, _ := r.tokens.Get().(*[]uint32)
	if tp == nil {
		tp = new([]uint32)
	}
	*tp = trace.Tokens(req, r.cfg.BlockTokens, *tp)
	defer r.tokens.Put(tp)

	// Token ids have at most 6 digits plus a comma.
	b := make([]byte, 0, 7*len(*tp)+len(r.model)+128)
	b = append(b, '{')
	if r.model != nil {
		b = append(b, `"model":`...)
		b = append(b, r.model...)
		b = append(b, ',')
	}
	b = append(b, `"prompt":[`...)
	for i, t := range *tp {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(t), 10)
	}
	b = append(b, `],"max_tokens":`...)
	b = strconv.AppendInt(b, int64(maxTokens(req.OutputLength, r.cfg.MaxOutputTokens)), 10)
	if r.cfg.Stream {
		b = append(b, `,"stream":true,"stream_options":{"include_usage":true}}`...)
	} else {
		b = append(b, `,"stream":false}`...)
	}
	return b
}

// maxTokens is the output length to ask for: capped when a cap is set, and
// at least 1 because servers reject max_tokens 0.
func maxTokens(outputLength, limit int) int {
	n := outputLength
	if limit > 0 {
		n = min(n, limit)
	}
	return max(n, 1)
}

// usage is the OpenAI usage object; details are absent on servers that do
// not report cached tokens (vLLM without --enable-prompt-tokens-details).
type usage struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// chunk is one streamed event, or a whole non-streamed response.
type chunk struct {
	Choices []json.RawMessage `json:"choices"`
	Usage   *usage            `json:"usage"`
	Error   json.RawMessage   `json:"error"`
}

func (c *chunk) check() (string, error) {
	if len(c.Error) > 0 && string(c.Error) != "null" {
		return CauseStreamError, fmt.Errorf("server error: %s", truncate(c.Error, maxErrorBody))
	}
	if u := c.Usage; u != nil {
		if u.PromptTokens < 0 || (u.PromptTokensDetails != nil &&
			(u.PromptTokensDetails.CachedTokens < 0 || u.PromptTokensDetails.CachedTokens > u.PromptTokens)) {
			return CauseBadBody, fmt.Errorf("implausible usage: prompt %d", u.PromptTokens)
		}
	}
	return "", nil
}

func truncate(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}

// readStream reads an SSE completions stream to its end. It sets res's TTFT
// at the first event carrying choices and returns the final usage, or the
// failure's cause and error.
func readStream(body io.Reader, begin time.Time, res *result) (*usage, string, error) {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 4096), maxEventBytes)
	var (
		u      *usage
		data   []byte
		events int
		done   bool
	)
	// dispatch handles one complete event; an error ends the read.
	dispatch := func() (string, error) {
		if len(data) == 0 {
			return "", nil
		}
		events++
		defer func() { data = data[:0] }()
		if string(data) == "[DONE]" {
			done = true
			return "", nil
		}
		var c chunk
		if err := json.Unmarshal(data, &c); err != nil {
			return CauseBadBody, fmt.Errorf("stream event %d: %w", events, err)
		}
		if cause, err := c.check(); err != nil {
			return cause, err
		}
		if len(c.Choices) > 0 && !res.hasTTFT {
			res.ttft, res.hasTTFT = time.Since(begin), true
		}
		if c.Usage != nil {
			u = c.Usage
		}
		return "", nil
	}
	for !done && sc.Scan() {
		line := sc.Bytes()
		switch {
		case len(line) == 0:
			if cause, err := dispatch(); err != nil {
				return nil, cause, err
			}
		case bytes.HasPrefix(line, []byte("data:")):
			v := bytes.TrimPrefix(line[len("data:"):], []byte(" "))
			if len(data) > 0 {
				data = append(data, '\n')
			}
			if len(data)+len(v) > maxEventBytes {
				return nil, CauseBadBody, fmt.Errorf("stream event over %d bytes", maxEventBytes)
			}
			data = append(data, v...)
		}
		// Comments, event:, id: and retry: lines carry nothing we need.
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, CauseBadBody, fmt.Errorf("stream line over %d bytes: %w", maxEventBytes, err)
		}
		return nil, CauseTruncated, fmt.Errorf("read stream: %w", err)
	}
	// A final event without its blank line still counts.
	if cause, err := dispatch(); err != nil {
		return nil, cause, err
	}
	switch {
	case u != nil:
		return u, "", nil
	case events == 0:
		return nil, CauseBadBody, errors.New("no SSE data events in the body")
	case done:
		return nil, CauseNoUsage, errors.New("stream finished without usage")
	default:
		return nil, CauseTruncated, errors.New("stream ended before usage and [DONE]")
	}
}

// readJSON reads a non-streamed completions response.
func readJSON(body io.Reader) (*usage, string, error) {
	b, err := io.ReadAll(io.LimitReader(body, maxEventBytes+1))
	if err != nil {
		return nil, CauseTruncated, fmt.Errorf("read body: %w", err)
	}
	if len(b) > maxEventBytes {
		return nil, CauseBadBody, fmt.Errorf("body over %d bytes", maxEventBytes)
	}
	var c chunk
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, CauseBadBody, fmt.Errorf("decode body: %w", err)
	}
	if cause, err := c.check(); err != nil {
		return nil, cause, err
	}
	if c.Usage == nil {
		return nil, CauseNoUsage, errors.New("response without usage")
	}
	return c.Usage, "", nil
}

// RequestRecord is one replayed request as RequestLog writes it.
type RequestRecord struct {
	Index   int    `json:"index"`
	Session string `json:"session,omitempty"`
	// SentMs is when it was sent, from the run's start.
	SentMs  float64 `json:"sent_ms"`
	OK      bool    `json:"ok"`
	Cause   string  `json:"cause,omitempty"`
	Replica string  `json:"replica,omitempty"`
	Worker  string  `json:"worker,omitempty"`
	Prompt  int64   `json:"prompt_tokens"`
	Cached  int64   `json:"cached_tokens"`
	// Predicted is the router's predicted overlap in tokens (-1: it said nothing).
	Predicted int64   `json:"predicted_tokens"`
	TTFTMs    float64 `json:"ttft_ms"`
	// Error is a failed request's error: for a non-2xx answer, its status and the start of
	// its body.
	Error string `json:"error,omitempty"`
}

func writeRequestLog(w io.Writer, reqs []trace.Request, results []result, blockSize int) error {
	enc := json.NewEncoder(w)
	for i, res := range results {
		rec := RequestRecord{Index: reqs[i].Index, Session: res.session, SentMs: float64(res.sent.Microseconds()) / 1000,
			OK: res.ok, Cause: res.cause, Replica: res.replica, Worker: res.worker, Prompt: res.promptTokens,
			Cached: res.cachedTokens, Predicted: -1, TTFTMs: float64(res.ttft.Microseconds()) / 1000, Error: res.errText}
		if res.hasOverlap {
			rec.Predicted = predictedTokens(res.overlap, res.promptTokens, blockSize)
		}
		if err := enc.Encode(rec); err != nil {
			return err
		}
	}
	return nil
}
