package jepsen

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// Shapes of the workload.
const (
	sessionsPerClient = 3    // sessions a client starts with
	maxSessions       = 6    // sessions a client keeps at once; a new one retires the oldest
	newSessionShare   = 0.06 // share of operations that start a new session
	raceShare         = 0.35 // share of new sessions whose first request goes to several replicas at once
	streamShare       = 0.3  // share of requests that stream
	longShare         = 0.05 // share of requests that decode long enough to span a fault
	parkShare         = 0.02 // share of operations after which a session idles past its TTL
)

// sharedPrefixes give sessions common prompt prefixes, as system prompts do, so KV-aware
// selection has something to weigh.
var sharedPrefixes = [...]string{
	"You are a careful assistant for a logistics company. Answer briefly and cite the shipment id. ",
	"You are a code reviewer. Point out bugs first, then style, and never rewrite whole files. ",
	"You are a travel planner. Prefer trains to planes and give times in the local time zone. ",
	"You are a tutor for high-school physics. Ask one question back before giving the answer. ",
}

// workload is the clients: each owns a few sessions and sends them chat requests, some
// streaming, to a random replica or through the load balancer, recording every one.
type workload struct {
	f   *fleet
	rec *recorder
	cfg *Config
}

type session struct {
	name   string
	turns  int
	prefix int
	parked time.Time
}

type client struct {
	id       int
	w        *workload
	rng      *rand.Rand
	sessions []*session
	made     int
}

// run drives the clients until the deadline for new requests; requests in flight then finish
// (each within its own timeout) unless ctx ends.
func (w *workload) run(ctx context.Context, until time.Time) {
	var wg sync.WaitGroup
	for i := range w.cfg.Clients {
		c := &client{id: i, w: w, rng: rand.New(rand.NewPCG(uint64(w.cfg.Seed), uint64(i)+1))}
		wg.Go(func() { c.loop(ctx, until) })
	}
	wg.Wait()
}

func (c *client) loop(ctx context.Context, until time.Time) {
	cfg := c.w.cfg
	parkFor := cfg.SessionTTL + cfg.SessionTTL/2
	park := cfg.SessionTTL > 0 && 2*parkFor < cfg.Duration
	// Every loop is bounded: no client can run more operations than one per millisecond.
	maxOps := int(cfg.Duration/time.Millisecond) + 1
	for n := 0; n < maxOps && ctx.Err() == nil && time.Now().Before(until); n++ {
		active := c.active()
		if len(active) == 0 || (len(c.sessions) < sessionsPerClient) || c.rng.Float64() < newSessionShare {
			s := c.newSession()
			c.first(ctx, s)
		} else {
			s := active[c.rng.IntN(len(active))]
			stream, body := c.request(s)
			c.w.rec.addOp(c.send(ctx, s, c.target(), "", 0, false, stream, body))
			s.turns++
			if park && len(active) > 1 && c.rng.Float64() < parkShare {
				// Half the parked sessions idle out; the other half come back within the TTL,
				// when their binding must still be there, whatever leader changes happened.
				d := parkFor
				if c.rng.IntN(2) == 0 {
					d = time.Duration(float64(cfg.SessionTTL) * (0.5 + 0.4*c.rng.Float64()))
				}
				s.parked = time.Now().Add(d)
			}
		}
		think := 10*time.Millisecond + time.Duration(c.rng.Int64N(int64(50*time.Millisecond)))
		if sleep(ctx, think) != nil {
			return
		}
	}
}

func (c *client) active() []*session {
	now := time.Now()
	var out []*session
	for _, s := range c.sessions {
		if s.parked.Before(now) {
			out = append(out, s)
		}
	}
	return out
}

func (c *client) newSession() *session {
	s := &session{name: fmt.Sprintf("c%d-s%d", c.id, c.made), prefix: c.rng.IntN(len(sharedPrefixes))}
	c.made++
	if len(c.sessions) >= maxSessions {
		c.sessions = c.sessions[1:]
	}
	c.sessions = append(c.sessions, s)
	return s
}

// first sends a session's first request; sometimes to several replicas at once, which must
// end on one binding.
func (c *client) first(ctx context.Context, s *session) {
	lanes := 1
	if c.rng.Float64() < raceShare && len(c.w.f.replicas) > 1 {
		lanes = 2 + c.rng.IntN(2)
	}
	targets := c.w.f.replicaIDs()
	c.rng.Shuffle(len(targets), func(i, j int) { targets[i], targets[j] = targets[j], targets[i] })
	if lanes == 1 {
		targets[0] = c.target()
	}
	lanes = min(lanes, len(targets))
	// The random draws happen here: the lanes run at once and the source is not shared.
	streams, bodies := make([]bool, lanes), make([][]byte, lanes)
	for lane := range lanes {
		streams[lane], bodies[lane] = c.request(s)
	}
	var wg sync.WaitGroup
	for lane := range lanes {
		wg.Go(func() { c.w.rec.addOp(c.send(ctx, s, targets[lane], "", lane, true, streams[lane], bodies[lane])) })
	}
	wg.Wait()
	s.turns++
}

// target picks where a request goes: a random replica, or the load balancer (a share
// --lb-share of the requests).
func (c *client) target() string {
	f := c.w.f
	if f.lbAddr != "" && c.rng.Float64() < c.w.cfg.LBShare {
		return "lb"
	}
	return f.replicas[c.rng.IntN(len(f.replicas))].ID
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatRequest struct {
	Model     string        `json:"model"`
	Messages  []chatMessage `json:"messages"`
	MaxTokens int           `json:"max_tokens"`
	Stream    bool          `json:"stream,omitempty"`
}

// request draws whether the next request streams, and its body.
func (c *client) request(s *session) (bool, []byte) {
	stream := c.rng.Float64() < streamShare
	maxTokens := 4 + c.rng.IntN(12)
	if c.rng.Float64() < longShare {
		maxTokens = 100 + c.rng.IntN(100)
	}
	msgs := []chatMessage{{Role: "system", Content: sharedPrefixes[s.prefix]}}
	// The conversation grows with every turn, as chats do, within a bounded window.
	for t := max(0, s.turns-3); t <= s.turns; t++ {
		msgs = append(msgs, chatMessage{Role: "user", Content: fmt.Sprintf("Session %s, turn %d: what changed since the last message?", s.name, t)})
	}
	b, _ := json.Marshal(chatRequest{Model: "sim-model", Messages: msgs, MaxTokens: maxTokens, Stream: stream})
	return stream, b
}

func (f *fleet) replicaIDs() []string {
	out := make([]string, len(f.replicas))
	for i, r := range f.replicas {
		out[i] = r.ID
	}
	return out
}

func (f *fleet) clientAddr(target string) string {
	if target == "lb" {
		return f.lbAddr
	}
	i := slices.IndexFunc(f.replicas, func(r *replica) bool { return r.ID == target })
	if i < 0 {
		return ""
	}
	return f.replicas[i].Client
}

// send makes one request and returns it as an operation; pin, when set, names the worker a
// new binding must take (X-Target-Worker). It draws nothing from the client's random
// source, so raced lanes may run it at once.
func (c *client) send(ctx context.Context, s *session, target, pin string, lane int, first, stream bool, body []byte) Op {
	rec := c.w.rec
	op := Op{Client: c.id, Session: s.name, Lane: lane, Stream: stream, First: first, Target: target, Tag: rec.tag()}
	ctx, cancel := context.WithTimeout(ctx, c.w.cfg.RequestTimeout)
	defer cancel()
	var wrote atomic.Bool
	trace := &httptrace.ClientTrace{WroteRequest: func(httptrace.WroteRequestInfo) { wrote.Store(true) }}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost,
		"http://"+c.w.f.clientAddr(target)+"/v1/chat/completions", bytes.NewReader(body))
	op.Invoke = rec.now()
	if err != nil {
		op.Complete, op.Result, op.Error = rec.now(), ResultFail, err.Error()
		return op
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(headerSession, s.name)
	req.Header.Set(proc.HeaderOpTag, op.Tag)
	if pin != "" {
		req.Header.Set(headerTargetWorker, pin)
	}
	resp, err := c.w.f.client.Do(req)
	if err != nil {
		op.Complete, op.Error = rec.now(), err.Error()
		// A request that never left cannot have changed anything; one that did may have.
		op.Result = ResultFail
		if wrote.Load() {
			op.Result = ResultUnknown
		}
		return op
	}
	defer resp.Body.Close()
	op.Headers = rec.now()
	op.Status = resp.StatusCode
	op.Replica = resp.Header.Get(headerReplica)
	op.Refused = resp.Header.Get(headerRefused) != ""
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		op.Complete, op.Result, op.Error = rec.now(), ResultFail, errorMessage(resp.StatusCode, b)
		return op
	}
	op.Worker = resp.Header.Get(headerWorker)
	if v := resp.Header.Get(headerRevision); v != "" {
		rev, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			op.Error = fmt.Sprintf("bad %s %q", headerRevision, v)
		}
		op.Revision = rev
	}
	var readErr error
	if stream {
		readErr = readStream(resp.Body)
	} else {
		_, readErr = io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<20))
	}
	op.Complete = rec.now()
	switch {
	case readErr != nil:
		// The binding was seen; how the request ended is not known.
		op.Result, op.Error = ResultUnknown, "body: "+readErr.Error()
	case op.Worker == "" || op.Revision == 0:
		op.Result = ResultFail
		if op.Error == "" {
			op.Error = "200 without a worker or a binding revision"
		}
	default:
		op.Result = ResultOK
	}
	return op
}

// readStream reads server-sent events until [DONE]; a stream that ends without it broke.
func readStream(r io.Reader) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for lines := 0; sc.Scan() && lines < 100_000; lines++ {
		if strings.TrimSpace(sc.Text()) == "data: [DONE]" {
			_, _ = io.Copy(io.Discard, io.LimitReader(r, 1<<20))
			return nil
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return io.ErrUnexpectedEOF
}

// errorMessage pulls the message out of an OpenAI-shaped error.
func errorMessage(status int, body []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && e.Error.Message != "" {
		return fmt.Sprintf("%d: %s", status, e.Error.Message)
	}
	return fmt.Sprintf("%d: %.200s", status, strings.TrimSpace(string(body)))
}
