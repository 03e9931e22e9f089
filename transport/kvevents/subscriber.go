package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/ratelog"
)

// Mode says which side of the ZMQ connection the subscriber is.
type Mode int

// The two directions vLLM uses.
const (
	// Connect: the SUB socket connects to one worker's bound PUB (vLLM binds when its endpoint
	// has a wildcard host, tcp://*:5557).
	Connect Mode = iota
	// Bind: the SUB socket binds and many workers' PUB sockets connect to it (vLLM connects
	// when its endpoint names a host); workers are told apart by topic.
	Bind
)

// Defaults of Config's durations.
const (
	DefaultSilenceAfter  = 60 * time.Second
	DefaultMinBackoff    = 100 * time.Millisecond
	DefaultMaxBackoff    = 10 * time.Second
	DefaultDialTimeout   = 3 * time.Second
	DefaultReplayTimeout = 5 * time.Second
)

const (
	// maxStreams bounds the (worker, rank) streams one bind-mode subscriber tracks.
	maxStreams = 4096
	// maxReplayMessages bounds one replay answer; vLLM's buffer holds 10,000 steps by default.
	maxReplayMessages = 1 << 17
	// logEvery is how often one worker's (or topic's) repeated problems are logged.
	logEvery = time.Minute
	// replayMinWait and replayMaxWait bound the wait before a failed replay socket is asked
	// again; gaps in between are counted as missed without a replay.
	replayMinWait = time.Second
	replayMaxWait = time.Minute
)

// Config configures a Subscriber.
type Config struct {
	// Endpoint is the ZMQ endpoint: the worker's PUB (Connect) or the one to bind (Bind), such
	// as tcp://10.0.0.5:5557 or tcp://*:5557.
	Endpoint string
	Mode     Mode
	// Worker is the worker (and data-parallel rank) behind Endpoint, in Connect mode. vLLM
	// offsets the port by the rank, so a DP worker gets one Subscriber per rank (see OffsetPort).
	Worker indexer.Worker
	// Replay is the worker's replay (ROUTER) endpoint in Connect mode, already offset for the
	// rank; empty means gaps are counted, not recovered.
	Replay string

	// Topics maps a topic to its worker in Bind mode.
	Topics map[string]indexer.Worker
	// TopicPattern identifies a worker in Bind mode by the host:port in its topic, for topics
	// not in Topics: literal text with placeholders in braces, exactly one of them
	// {host:port}, such as "kv@{host:port}@{model}". The host:port is matched against URLs.
	TopicPattern string
	// URLs maps worker IDs to their URLs (http://host:port), for TopicPattern.
	URLs map[string]string
	// Replays maps a worker ID to its rank-0 replay endpoint in Bind mode; rank r uses the
	// port offset by r. The rank is the batch's data_parallel_rank, or the mapped worker's,
	// or else Rank.
	Replays map[string]string
	// Hosts maps a worker ID to the hosts (names or addresses) its publishers connect from, in
	// Bind mode: a connection from an address that is no worker's is refused at accept, and
	// one that sends a message under the topic of a worker at another address is failed, so
	// only a worker's own host can store, remove or purge its blocks. Names are resolved,
	// and looked up again every 30 s. Nil admits any address (tests); serve always sets it.
	Hosts map[string][]string
	// MaxPublishers bounds the publisher connections of the bound socket at once (0:
	// DefaultMaxPublishers).
	MaxPublishers int
	// MaxInFlight bounds the bytes of the socket's messages in flight, from the first byte of
	// a message to the end of its handling, across all its connections (0: DefaultMaxInFlight;
	// at least one message at its limit).
	MaxInFlight int64

	// Rank is, in Bind mode, the data-parallel rank of the publishers that connect to
	// Endpoint, for batches that do not say theirs and topics not mapped to a rank: vLLM
	// connects rank r of a worker to the router's port + r, so a router binds one Subscriber
	// per rank on the offset ports.
	Rank int

	// BlockSize is the router's block size; events of another size are dropped and counted.
	BlockSize int
	// MaxBlocks caps each worker's engine-hash map (0: DefaultMaxBlocks).
	MaxBlocks int
	// Sink receives the events; required.
	Sink Sink
	// Metrics receives the counters; nil makes a private, unregistered set.
	Metrics *Metrics
	// Logger logs; nil discards.
	Logger *slog.Logger

	// SilenceAfter reports a worker without a message for this long (gauge and log); it is not
	// purged, since an idle engine publishes nothing.
	SilenceAfter time.Duration
	// MinBackoff and MaxBackoff bound the jittered exponential wait between reconnects.
	MinBackoff, MaxBackoff time.Duration
	// DialTimeout bounds one TCP connect; ReplayTimeout one whole replay request.
	DialTimeout, ReplayTimeout time.Duration
}

// Subscriber feeds one worker's (Connect) or many workers' (Bind) KV events into a Sink.
type Subscriber struct {
	cfg     Config
	log     *slog.Logger
	m       *Metrics
	pattern *topicPattern
	from    *workerHosts // Bind mode: where each worker publishes from; nil: anywhere
	// roster is, in Bind mode, the workers a topic can name (SetWorkers replaces it).
	roster atomic.Pointer[roster]

	mu   sync.Mutex
	addr net.Addr

	// turn is a lock (a one-slot channel, so that a snapshot can wait for it under a context)
	// on the fields below. Run takes it for each message, reconnect resync and silence check,
	// and lets go in between, so SnapshotEngineMaps and RestoreEngineMaps can work on the
	// translators whether Run is running, not started or stopped. A message that needs a
	// replay holds it for up to ReplayTimeout (twice that when the replay shows a restart).
	turn chan struct{}

	// Held with turn.
	dec, replayDec *Decoder
	streams        map[indexer.Worker]*stream
	topicCache     map[string]topicResult
	limit          *ratelog.Limiter
	drops          *dropLog
	// replayMin and replayMax bound the wait after a failed replay (replayMinWait,
	// replayMaxWait; tests lengthen it).
	replayMin, replayMax time.Duration
}

type topicResult struct {
	w  indexer.Worker
	ok bool
}

// stream is one (worker, rank): one publisher socket and its sequence.
type stream struct {
	w       indexer.Worker
	label   string
	tr      *Translator
	replay  string
	started bool
	last    uint64
	lastMsg time.Time
	silent  bool
	// lastSum is the digest of the payload at last: a replay that holds another payload there
	// comes from a new engine incarnation.
	lastSum uint64
	// reconnected: Connect mode reconnected and nothing has shown yet that the engine is the
	// one it was (resync, begin).
	reconnected bool
	// replayed holds the payload digests of the messages the last replay applied: the same
	// messages may still arrive live, and must then be skipped as duplicates rather than taken
	// for an engine restart.
	replayed map[uint64]uint64
	// replayFails counts the replay requests failed in a row; none is made before
	// replayAfter (mayReplay).
	replayFails int
	replayAfter time.Time
	replayWait  backoff

	lastSeq, silence prometheus.Gauge
}

// NewSubscriber checks cfg and returns a Subscriber; Run starts it.
func NewSubscriber(cfg Config) (*Subscriber, error) {
	if cfg.Endpoint == "" {
		return nil, errors.New("kvevents: subscriber needs an endpoint")
	}
	if cfg.Sink == nil {
		return nil, errors.New("kvevents: subscriber needs a sink")
	}
	if cfg.BlockSize < 1 || cfg.BlockSize > MaxBlockSize {
		return nil, fmt.Errorf("kvevents: block size %d out of 1..%d", cfg.BlockSize, MaxBlockSize)
	}
	s := &Subscriber{
		cfg:        cfg,
		log:        cfg.Logger,
		m:          cfg.Metrics,
		turn:       make(chan struct{}, 1),
		dec:        NewDecoder(),
		replayDec:  NewDecoder(),
		streams:    make(map[indexer.Worker]*stream),
		topicCache: make(map[string]topicResult),
		limit:      ratelog.New(logEvery, maxStreams),
		drops:      newDropLog(logEvery),
		replayMin:  replayMinWait,
		replayMax:  replayMaxWait,
	}
	switch cfg.Mode {
	case Connect:
		if cfg.Worker.ID == "" {
			return nil, errors.New("kvevents: connect mode needs the worker")
		}
	case Bind:
		if len(cfg.Topics) == 0 && cfg.TopicPattern == "" {
			return nil, errors.New("kvevents: bind mode needs Topics or a TopicPattern")
		}
		if cfg.Rank < 0 || cfg.Rank > MaxDPRank {
			return nil, fmt.Errorf("kvevents: rank %d out of 0..%d", cfg.Rank, MaxDPRank)
		}
		if cfg.TopicPattern != "" {
			p, err := parseTopicPattern(cfg.TopicPattern)
			if err != nil {
				return nil, err
			}
			s.pattern = p
		}
		r, err := s.newRoster(cfg.URLs, cfg.Replays)
		if err != nil {
			return nil, err
		}
		s.roster.Store(r)
		if cfg.Hosts != nil {
			s.from = newWorkerHosts(cfg.Hosts)
		}
	default:
		return nil, fmt.Errorf("kvevents: unknown mode %d", cfg.Mode)
	}
	if s.cfg.MaxPublishers <= 0 {
		s.cfg.MaxPublishers = DefaultMaxPublishers
	}
	if s.cfg.MaxInFlight <= 0 {
		s.cfg.MaxInFlight = DefaultMaxInFlight
	}
	s.cfg.MaxInFlight = max(s.cfg.MaxInFlight, maxMessage)
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.m == nil {
		s.m, _ = NewMetrics(nil) // cannot fail without a registerer
	}
	s.cfg.SilenceAfter = orDefault(cfg.SilenceAfter, DefaultSilenceAfter)
	s.cfg.MinBackoff = orDefault(cfg.MinBackoff, DefaultMinBackoff)
	s.cfg.MaxBackoff = max(orDefault(cfg.MaxBackoff, DefaultMaxBackoff), s.cfg.MinBackoff)
	s.cfg.DialTimeout = orDefault(cfg.DialTimeout, DefaultDialTimeout)
	s.cfg.ReplayTimeout = orDefault(cfg.ReplayTimeout, DefaultReplayTimeout)
	return s, nil
}

// acquire takes turn (see Subscriber.turn); release gives it back.
func (s *Subscriber) acquire() { s.turn <- struct{}{} }

func (s *Subscriber) release() { <-s.turn }

func orDefault(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

// Addr is the address the subscriber is bound to in Bind mode, nil until it is.
func (s *Subscriber) Addr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

// Run connects (or binds), applies events until ctx ends, and reconnects with a capped,
// jittered exponential backoff whenever the connection is lost or cannot be made. It returns
// nil once ctx is done.
func (s *Subscriber) Run(ctx context.Context) error {
	tick := time.NewTicker(min(max(s.cfg.SilenceAfter/4, 10*time.Millisecond), time.Second))
	defer tick.Stop()
	bo := backoff{min: s.cfg.MinBackoff, max: s.cfg.MaxBackoff}
	for {
		sock, adm, err := s.open(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			s.m.connects.WithLabelValues(s.cfg.Endpoint, "error").Inc()
			s.logLimited("endpoint "+s.cfg.Endpoint, slog.LevelWarn, "kv events: cannot connect",
				"endpoint", s.cfg.Endpoint, "err", err)
		} else {
			s.m.connects.WithLabelValues(s.cfg.Endpoint, "ok").Inc()
			s.log.Info("kv events: connected", "endpoint", s.cfg.Endpoint, "mode", s.cfg.Mode)
			bo.reset()
			s.acquire()
			s.resync(ctx)
			s.release()
			err = s.serve(ctx, sock, adm.budget, tick.C)
			if ctx.Err() != nil {
				return nil
			}
			s.m.connects.WithLabelValues(s.cfg.Endpoint, "lost").Inc()
			s.log.Warn("kv events: connection lost, reconnecting", "endpoint", s.cfg.Endpoint, "err", err)
		}
		if !sleepCtx(ctx, bo.next()) {
			return nil
		}
	}
}

func (s *Subscriber) socketOptions() []zmq4.Option {
	return []zmq4.Option{
		zmq4.WithDialerMaxRetries(0), // we retry, with backoff and under ctx
		zmq4.WithDialerTimeout(s.cfg.DialTimeout),
		zmq4.WithTimeout(s.cfg.ReplayTimeout),
		zmq4.WithLogger(slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)),
	}
}

// open returns a subscribed SUB socket, connected or bound, and what its guard admits.
func (s *Subscriber) open(ctx context.Context) (zmq4.Socket, *admission, error) {
	adm := &admission{
		budget:   newBudget(s.cfg.MaxInFlight),
		maxConns: int64(s.cfg.MaxPublishers),
		ctx:      ctx,
		m:        s.m,
		log:      s.log,
		logged:   make(map[string]time.Time),
		pending:  make(map[string]int),
	}
	if s.cfg.Mode == Bind && s.from != nil {
		adm.hosts, adm.topics = s.from, s.workerOf
	}
	sock := zmq4.NewSub(withAdmission(ctx, adm), s.socketOptions()...)
	if err := sock.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		_ = sock.Close()
		return nil, nil, fmt.Errorf("subscribe: %w", err)
	}
	if s.cfg.Mode == Bind {
		if err := sock.Listen(guarded(s.cfg.Endpoint)); err != nil {
			_ = sock.Close()
			return nil, nil, err
		}
		s.mu.Lock()
		s.addr = sock.Addr()
		s.mu.Unlock()
		return sock, adm, nil
	}
	if err := dialCtx(ctx, sock, guarded(s.cfg.Endpoint)); err != nil {
		_ = sock.Close()
		return nil, nil, err
	}
	return sock, adm, nil
}

// dialCtx dials under ctx. zmq4's Dial does not watch a context and its ZMTP handshake has no
// deadline, so it runs aside; on ctx's end the caller closes the socket and moves on.
func dialCtx(ctx context.Context, sock zmq4.Socket, ep string) error {
	done := make(chan error, 1)
	go func() { done <- sock.Dial(ep) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// serve reads sock until ctx ends or, in Connect mode, the publisher goes away. Each message
// gives its bytes back to the socket's budget once handled.
func (s *Subscriber) serve(ctx context.Context, sock zmq4.Socket, inFlight *budget, tick <-chan time.Time) error {
	msgs := make(chan zmq4.Msg, 256)
	lost := make(chan error, 1)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			m, err := sock.Recv()
			if err != nil {
				select {
				case <-stop:
					return
				default:
				}
				if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
					return
				}
				if s.cfg.Mode == Bind {
					// One publisher's connection ended; the others carry on (zmq4 reports it
					// through Recv, once per connection).
					s.log.Debug("kv events: a publisher disconnected", "endpoint", s.cfg.Endpoint, "err", err)
					continue
				}
				lost <- err
				return
			}
			select {
			case msgs <- m:
			case <-stop:
				return
			}
		}
	}()
	defer func() {
		close(stop)
		_ = sock.Close() // unblocks Recv
		wg.Wait()
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-lost:
			return err
		case m := <-msgs:
			s.acquire()
			s.handle(ctx, m)
			s.release()
			inFlight.release(int64(msgSize(m)))
		case now := <-tick:
			s.acquire()
			s.checkSilence(now)
			s.drops.flush(s.log, now)
			s.release()
		}
	}
}

// handle applies one message: [topic, 8-byte big-endian sequence, payload].
func (s *Subscriber) handle(ctx context.Context, m zmq4.Msg) {
	var topic string
	if len(m.Frames) > 0 {
		topic = string(m.Frames[0])
	}
	w, ok := s.identify(topic)
	if !ok {
		s.m.unknownPublisher.Inc()
		s.logLimited("topic "+topic, slog.LevelWarn, "kv events: message from an unknown publisher dropped",
			"endpoint", s.cfg.Endpoint, "topic", fmt.Sprintf("%.128q", topic))
		return
	}
	if len(m.Frames) != 3 || len(m.Frames[1]) != 8 || int64(binary.BigEndian.Uint64(m.Frames[1])) < 0 {
		sizes := make([]int, len(m.Frames))
		for i, f := range m.Frames {
			sizes[i] = len(f)
		}
		s.drop(w, "frame", fmt.Errorf("want [topic, 8-byte non-negative sequence, payload], got frames of %v bytes", sizes))
		return
	}
	seq := binary.BigEndian.Uint64(m.Frames[1])
	sum := xxhash.Sum64(m.Frames[2])
	var st *stream
	err := s.dec.DecodePieces(m.Frames[2], func(b Batch) error {
		if st == nil { // the first piece: the whole payload decoded, its rank known
			if st = s.begin(ctx, s.rankOf(w, b), seq, sum); st == nil {
				return errSkip
			}
		}
		s.apply(st, seq, sum, b)
		return nil
	})
	switch {
	case errors.Is(err, errSkip):
	case err != nil:
		s.dropped(s.rankOf(w, Batch{}), seq, sum, err)
	}
}

// errSkip stops the decode of a message that is not to be applied (a duplicate, no stream).
var errSkip = errors.New("skip")

// rankOf is the worker a batch from w's publisher belongs to: in Bind mode the batch's
// data_parallel_rank, else the topic's, else the socket's Rank.
func (s *Subscriber) rankOf(w indexer.Worker, b Batch) indexer.Worker {
	if s.cfg.Mode == Bind {
		switch {
		case b.HasDPRank:
			w.DPRank = uint32(b.DPRank)
		case w.DPRank == 0:
			w.DPRank = uint32(s.cfg.Rank)
		}
	}
	return w
}

// begin applies the sequence rules (DESIGN.md) to a message of w that decoded: it recovers a
// gap, purges an engine that restarted, and returns the stream to apply the message to, or nil
// when the message is not to be applied.
func (s *Subscriber) begin(ctx context.Context, w indexer.Worker, seq, sum uint64) *stream {
	st := s.stream(w)
	if st == nil {
		s.m.unknownPublisher.Inc()
		return nil
	}
	st.lastMsg = time.Now()
	if st.silent {
		st.silent = false
		s.log.Info("kv events: worker publishing again", "worker", st.label)
	}
	reconnected := st.reconnected
	st.reconnected = false
	switch {
	case !st.started:
		if st.replay != "" && seq > 0 {
			// Joined late (ZMQ's slow joiner): what the replay buffer still holds is better
			// than nothing.
			s.recover(ctx, st, 0, seq)
		}
	case seq == st.last+1:
	case seq > st.last+1:
		s.m.gaps.WithLabelValues(st.label).Inc()
		v := unverified
		if st.replay != "" {
			v = s.recover(ctx, st, st.last+1, seq)
		}
		if v == unverified && reconnected {
			// The first message on a new connection, past a gap nothing can fill: the engine
			// may have restarted while we were away (its new sequence already past ours), and
			// whatever it holds now is not what we know. Start over from this message.
			s.purge(st, "sequence gap after a reconnect that the replay cannot explain", seq)
			if st.replay != "" {
				s.recover(ctx, st, 0, seq)
			}
		}
		if st.started && seq > st.last+1 {
			missed := seq - 1 - st.last
			s.m.missed.WithLabelValues(st.label).Add(float64(missed))
			s.logLimited(st.label, slog.LevelWarn, "kv events: sequence gap", "worker", st.label,
				"missed", missed, "seq", seq)
		}
	case st.replayed[seq] == sum:
		return nil // already applied from the replay socket
	default:
		// A sequence that goes back is an engine that restarted: what we knew is stale.
		s.purge(st, "sequence went back", seq)
		if st.replay != "" && seq > 0 {
			s.recover(ctx, st, 0, seq)
		}
	}
	return st
}

// dropped handles a message of w that failed to decode. Its sequence number is the engine's
// all the same: when it is the next one, the stream moves past it, so the message after it is
// not taken for a gap (and fetched again by a replay, to fail again). A message refused as too
// large may be a real engine's batch that the limits cannot hold: what the worker holds is
// then unknown (the batch may have removed any block), so the worker is purged.
func (s *Subscriber) dropped(w indexer.Worker, seq, sum uint64, err error) {
	cause := Cause(err)
	s.drop(w, cause, err)
	st := s.streams[w]
	if st == nil && cause == "too_large" {
		st = s.stream(w)
	}
	if st == nil {
		return
	}
	st.reconnected = false
	if cause == "too_large" {
		s.purge(st, "a message over the limits was dropped", seq)
		st.started, st.last, st.lastSum = true, seq, sum
		st.lastSeq.Set(float64(seq))
		return
	}
	if st.started && seq == st.last+1 {
		st.last, st.lastSum = seq, sum
		st.lastSeq.Set(float64(seq))
	}
}

// purge forgets everything known of a stream's worker (translator and index) and starts its
// sequence over.
func (s *Subscriber) purge(st *stream, why string, seq uint64) {
	s.m.restarts.WithLabelValues(st.label).Inc()
	s.log.Warn("kv events: purging the worker", "worker", st.label, "why", why, "last", st.last, "seq", seq)
	st.tr.Purge()
	s.cfg.Sink.RemoveWorker(st.w)
	st.started = false
	clear(st.replayed)
}

// msgSize is the bytes of a message's frames: what the guard reserved for it.
func msgSize(m zmq4.Msg) int {
	n := 0
	for _, f := range m.Frames {
		n += len(f)
	}
	return n
}

// workerOf names the worker a topic belongs to, in Bind mode; safe for concurrent use (the
// guard asks, from each connection's reader).
func (s *Subscriber) workerOf(topic string) (string, bool) {
	if w, ok := s.cfg.Topics[topic]; ok {
		return w.ID, true
	}
	if s.pattern != nil {
		if hp, ok := s.pattern.match(topic); ok {
			id, ok := s.roster.Load().hosts[hp]
			return id, ok
		}
	}
	return "", false
}

// resync runs after a (re)connect in Connect mode when the worker has a replay socket: what
// the worker published while no SUB was connected is lost to ZMQ, and an idle engine may not
// publish again for a long time, so waiting for the next message to reveal the gap is not
// enough. It fetches the whole replay buffer: if the engine restarted (the buffer's newest
// sequence is behind ours, or its message at our last sequence is not the one we applied),
// the worker is purged and the buffer applied; otherwise what follows our last is applied.
// When the buffer cannot tell (no answer, or our last message has left it), the stream stays
// marked as reconnected, and a gap on its next message purges it (begin).
func (s *Subscriber) resync(ctx context.Context) {
	if s.cfg.Mode != Connect {
		return
	}
	st := s.stream(s.cfg.Worker)
	if st == nil {
		return
	}
	st.reconnected = st.started
	if st.replay == "" || !st.mayReplay() {
		return
	}
	got, err := s.fetchReplay(ctx, st.replay, 0, math.MaxInt64)
	s.replayDone(st, err)
	if err != nil {
		s.m.replays.WithLabelValues(st.label, "error").Inc()
		s.logLimited(st.label, slog.LevelWarn, "kv events: replay after connect failed", "worker", st.label,
			"replay", st.replay, "err", err)
		return
	}
	s.m.replays.WithLabelValues(st.label, "ok").Inc()
	switch s.verify(st, got) {
	case restarted:
		s.purge(st, "the engine restarted while disconnected (replay)", got[len(got)-1].seq)
	case continuous:
		st.reconnected = false
	}
	s.applyReplayed(st, got)
}

// verdict is what a replay answer says about a started stream's engine.
type verdict int

const (
	// unverified: the answer does not hold our last message (or there was none).
	unverified verdict = iota
	// continuous: the answer holds our last message, the same bytes: the same engine.
	continuous
	// restarted: the answer ends before our last sequence, or holds another message there: a
	// new engine incarnation, whose sequence may already be past ours.
	restarted
)

// verify compares a replay answer with what the stream last applied.
func (s *Subscriber) verify(st *stream, got []replayed) verdict {
	if !st.started || len(got) == 0 {
		return unverified
	}
	if got[len(got)-1].seq < st.last {
		return restarted
	}
	for _, r := range got {
		if r.seq == st.last {
			if xxhash.Sum64(r.payload) != st.lastSum {
				return restarted
			}
			return continuous
		}
	}
	return unverified
}

// applyReplayed applies, in order, the replayed messages the stream does not have yet, and
// remembers them so that their live copies are skipped; it returns how many it applied.
func (s *Subscriber) applyReplayed(st *stream, got []replayed) int {
	applied := 0
	clear(st.replayed)
	for _, r := range got {
		if st.started && r.seq <= st.last {
			continue // a duplicate
		}
		sum := xxhash.Sum64(r.payload)
		err := s.replayDec.DecodePieces(r.payload, func(b Batch) error {
			s.apply(st, r.seq, sum, b)
			return nil
		})
		if err != nil {
			s.drop(st.w, Cause(err), err)
			// It is bad however often it is fetched; one too large leaves the worker unknown.
			if Cause(err) == "too_large" {
				s.purge(st, "a replayed message over the limits was dropped", r.seq)
			}
			st.started, st.last, st.lastSum = true, r.seq, sum
			continue
		}
		st.noteReplayed(r)
		applied++
	}
	s.m.replayed.WithLabelValues(st.label).Add(float64(applied))
	return applied
}

// apply applies one decoded batch (or piece of one) and moves the stream to seq, whose
// payload's digest is sum.
func (s *Subscriber) apply(st *stream, seq, sum uint64, b Batch) {
	c, err := st.tr.Apply(b, s.cfg.Sink)
	s.m.counts(st.label, c)
	if err != nil {
		s.drop(st.w, Cause(err), err)
	}
	st.started, st.last, st.lastSum = true, seq, sum
	st.lastSeq.Set(float64(seq))
}

// recover fetches [from, to) from the worker's replay socket and applies what it gets in
// order, skipping what the stream already has. For a started stream it asks from its last
// sequence on, to check that the engine is the one it was (verify): one that restarted is
// purged and replayed from 0. After failures the replay is skipped for a while (mayReplay),
// so a replay socket that never answers does not hold every gap up for ReplayTimeout.
func (s *Subscriber) recover(ctx context.Context, st *stream, from, to uint64) verdict {
	if !st.mayReplay() {
		s.m.replays.WithLabelValues(st.label, "skipped").Inc()
		return unverified
	}
	ask := from
	if st.started && st.last < from {
		ask = st.last
	}
	got, err := s.fetchReplay(ctx, st.replay, ask, to)
	s.replayDone(st, err)
	v := s.verify(st, got)
	if v == restarted {
		s.purge(st, "the replay holds another message at our last sequence: the engine restarted", to)
		from = 0
		got, err = s.fetchReplay(ctx, st.replay, from, to)
		s.replayDone(st, err)
	}
	applied := s.applyReplayed(st, got)
	result := "ok"
	switch {
	case err != nil:
		result = "error"
		s.logLimited(st.label, slog.LevelWarn, "kv events: replay failed", "worker", st.label,
			"replay", st.replay, "from", from, "to", to, "err", err)
	case !st.started || st.last+1 < to:
		result = "partial"
	}
	s.m.replays.WithLabelValues(st.label, result).Inc()
	s.log.Debug("kv events: replayed", "worker", st.label, "from", from, "to", to, "applied", applied, "result", result)
	return v
}

// mayReplay says whether the stream's replay socket may be asked now: after a failed request
// it is left alone for a jittered, doubling while (replayMinWait up to replayMaxWait).
func (st *stream) mayReplay() bool {
	return st.replayFails == 0 || !time.Now().Before(st.replayAfter)
}

// replayDone records how a replay request went, for mayReplay.
func (s *Subscriber) replayDone(st *stream, err error) {
	if err == nil {
		st.replayFails, st.replayWait = 0, backoff{}
		return
	}
	if st.replayFails == 0 {
		st.replayWait = backoff{min: s.replayMin, max: s.replayMax}
	}
	st.replayFails++
	st.replayAfter = time.Now().Add(st.replayWait.next())
}

type replayed struct {
	seq     uint64
	payload []byte
}

// noteReplayed remembers a message applied from the replay socket (see stream.replayed).
func (st *stream) noteReplayed(r replayed) {
	if st.replayed == nil {
		st.replayed = make(map[uint64]uint64)
	}
	st.replayed[r.seq] = xxhash.Sum64(r.payload)
}

// fetchReplay asks a vLLM replay (ROUTER) socket for everything from `from` on, and keeps the
// messages before `to`, in increasing order. The request is an empty delimiter and the 8-byte
// big-endian start (vLLM's ROUTER expects [identity, "", start]); each answer carries a
// sequence and a payload, until seq -1, in any of the layouts replayFrames accepts.
func (s *Subscriber) fetchReplay(ctx context.Context, ep string, from, to uint64) ([]replayed, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ReplayTimeout)
	defer cancel()
	sock := zmq4.NewDealer(ctx, s.socketOptions()...)
	defer func() { _ = sock.Close() }()
	if err := dialCtx(ctx, sock, guarded(ep)); err != nil {
		return nil, fmt.Errorf("dial replay %s: %w", ep, err)
	}
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], from)
	if err := sock.Send(zmq4.NewMsgFrom([]byte{}, start[:])); err != nil {
		return nil, fmt.Errorf("replay request: %w", err)
	}
	var out []replayed
	for range maxReplayMessages {
		m, err := sock.Recv()
		if err != nil {
			return out, fmt.Errorf("replay answer: %w", err)
		}
		seqFrame, payload, ok := replayFrames(m.Frames)
		if !ok {
			sizes := make([]int, len(m.Frames))
			for i, f := range m.Frames {
				sizes[i] = len(f)
			}
			return out, fmt.Errorf("replay answer of %d frames (%v bytes): %w", len(m.Frames), sizes, ErrMalformed)
		}
		seq := binary.BigEndian.Uint64(seqFrame)
		if int64(seq) == -1 {
			return out, nil
		}
		if seq < from || (len(out) > 0 && seq <= out[len(out)-1].seq) {
			continue
		}
		if seq >= to {
			return out, nil // the rest arrives, or arrived, on the SUB socket
		}
		out = append(out, replayed{seq: seq, payload: payload})
		if seq == to-1 {
			return out, nil
		}
	}
	return out, fmt.Errorf("replay answer longer than %d messages: %w", maxReplayMessages, ErrTooLarge)
}

// replayFrames finds the sequence and the payload in one replay answer as our DEALER receives
// it: the publisher's ROUTER takes the first frame it sends (the client's identity) to route
// the message and sends the rest as they are, so what arrives is whatever the publisher put
// after the identity. The layouts publishers use, as received:
//
//	[seq, payload]                   no delimiter
//	["", seq, payload]               vLLM and SGLang ([identity, "", seq, payload] sent)
//	[topic, seq, payload]            the topic instead of the delimiter
//	["", topic, seq, payload]        the delimiter and the topic (llm-d-inference-sim)
//	[identity, "", topic, seq, payload]  the same with the identity echoed, as a client that is
//	                                 not a DEALER, or a publisher that adds it twice, sees it
//
// The sequence is always the 8-byte frame before the payload, the end marker an 8-byte -1 and
// an empty payload. Anything else is malformed.
func replayFrames(f [][]byte) (seq, payload []byte, ok bool) {
	n := len(f)
	if n < 2 || n > 5 || len(f[n-2]) != 8 {
		return nil, nil, false
	}
	switch n {
	case 4: // ["", topic, ...]
		if len(f[0]) != 0 {
			return nil, nil, false
		}
	case 5: // [identity, "", topic, ...]
		if len(f[1]) != 0 {
			return nil, nil, false
		}
	}
	return f[n-2], f[n-1], true
}

// identify names the worker behind a topic.
func (s *Subscriber) identify(topic string) (indexer.Worker, bool) {
	if s.cfg.Mode == Connect {
		return s.cfg.Worker, true
	}
	if w, ok := s.cfg.Topics[topic]; ok {
		return w, true
	}
	if r, ok := s.topicCache[topic]; ok {
		return r.w, r.ok
	}
	var r topicResult
	if id, ok := s.workerOf(topic); ok {
		r = topicResult{w: indexer.Worker{ID: id}, ok: true}
	}
	if len(s.topicCache) >= maxStreams {
		clear(s.topicCache) // a flood of made-up topics must not grow it for ever
	}
	s.topicCache[topic] = r
	return r.w, r.ok
}

// stream returns the stream of w, creating it; nil past maxStreams.
func (s *Subscriber) stream(w indexer.Worker) *stream {
	if st, ok := s.streams[w]; ok {
		return st
	}
	if len(s.streams) >= maxStreams {
		return nil
	}
	tr, err := NewTranslator(w, s.cfg.BlockSize, s.cfg.MaxBlocks)
	if err != nil {
		return nil // NewSubscriber checked the block size
	}
	label := w.String()
	st := &stream{
		w:       w,
		label:   label,
		tr:      tr,
		lastMsg: time.Now(), // silence counts from when we began to expect messages
		lastSeq: s.m.lastSeq.WithLabelValues(label),
		silence: s.m.silence.WithLabelValues(label),
	}
	switch {
	case s.cfg.Mode == Connect:
		st.replay = s.cfg.Replay
	case s.roster.Load().replays[w.ID] != "":
		ep, err := OffsetPort(s.roster.Load().replays[w.ID], int(w.DPRank))
		if err != nil {
			s.log.Warn("kv events: bad replay endpoint", "worker", label, "err", err)
		}
		st.replay = ep
	}
	s.streams[w] = st
	return st
}

// checkSilence updates the silence gauges and reports workers that went quiet.
func (s *Subscriber) checkSilence(now time.Time) {
	for _, st := range s.streams {
		since := now.Sub(st.lastMsg)
		st.silence.Set(since.Seconds())
		if since > s.cfg.SilenceAfter && !st.silent {
			st.silent = true
			s.log.Warn("kv events: worker silent", "worker", st.label, "since", since.Round(time.Second))
		}
	}
}

// drop counts a dropped message by cause and logs it in the subscriber's summary of drops
// (dropLog: one line per logEvery, counts by cause).
func (s *Subscriber) drop(w indexer.Worker, cause string, err error) {
	label := w.String()
	s.m.decodeErrors.WithLabelValues(label, cause).Inc()
	s.drops.add(label, cause, err)
	s.drops.flush(s.log, time.Now())
}

// logLimited logs at most once per logEvery for key, with the count of lines left out.
func (s *Subscriber) logLimited(key string, level slog.Level, msg string, args ...any) {
	s.limit.Log(s.log, key, level, msg, args...)
}

// backoff is a capped exponential backoff with jitter (each wait is drawn from the upper half
// of the current step, so a fleet of subscribers does not reconnect in lockstep).
type backoff struct {
	min, max, cur time.Duration
}

func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.min
	} else {
		b.cur = min(2*b.cur, b.max)
	}
	half := b.cur / 2
	return half + rand.N(half+1)
}

func (b *backoff) reset() { b.cur = 0 }

// sleepCtx waits d or until ctx ends, and reports whether ctx is still live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// OffsetPort returns a tcp endpoint with its port moved up by offset, as vLLM does for each
// data-parallel rank; other transports and offset 0 are returned unchanged.
func OffsetPort(endpoint string, offset int) (string, error) {
	if offset == 0 || !strings.HasPrefix(endpoint, "tcp://") {
		return endpoint, nil
	}
	host, port, err := net.SplitHostPort(strings.TrimPrefix(endpoint, "tcp://"))
	if err != nil {
		return endpoint, fmt.Errorf("kvevents: endpoint %q: %w", endpoint, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p+offset > 65535 || p+offset < 1 {
		return endpoint, fmt.Errorf("kvevents: endpoint %q: port cannot be offset by %d", endpoint, offset)
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+offset)), nil
}

// hostPort is the host:port of a worker URL, with the scheme's default port if it has none.
func hostPort(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("url %q: %w", raw, err)
	}
	if u.Host == "" {
		return "", fmt.Errorf("url %q has no host", raw)
	}
	if u.Port() != "" {
		return u.Host, nil
	}
	port := "80"
	if u.Scheme == "https" {
		port = "443"
	}
	return net.JoinHostPort(u.Hostname(), port), nil
}

// topicPattern matches topics such as kv@10.0.0.5:8000@llama against "kv@{host:port}@{model}".
type topicPattern struct {
	// parts alternate literal text and placeholders: parts[0] literal, parts[1] placeholder...
	parts []string
	hp    int // index in parts of {host:port}
}

func parseTopicPattern(p string) (*topicPattern, error) {
	tp := &topicPattern{hp: -1}
	rest := p
	for {
		open := strings.IndexByte(rest, '{')
		if open < 0 {
			if strings.IndexByte(rest, '}') >= 0 {
				return nil, fmt.Errorf("kvevents: topic pattern %q: unbalanced '}'", p)
			}
			tp.parts = append(tp.parts, rest)
			break
		}
		end := strings.IndexByte(rest[open:], '}')
		if end < 0 {
			return nil, fmt.Errorf("kvevents: topic pattern %q: unbalanced '{'", p)
		}
		lit, name := rest[:open], rest[open+1:open+end]
		if strings.IndexByte(lit, '}') >= 0 || strings.IndexByte(name, '{') >= 0 {
			return nil, fmt.Errorf("kvevents: topic pattern %q: unbalanced braces", p)
		}
		if len(tp.parts) > 0 && lit == "" {
			return nil, fmt.Errorf("kvevents: topic pattern %q: two placeholders need text between them", p)
		}
		tp.parts = append(tp.parts, lit, name)
		if name == "host:port" {
			if tp.hp >= 0 {
				return nil, fmt.Errorf("kvevents: topic pattern %q: {host:port} twice", p)
			}
			tp.hp = len(tp.parts) - 1
		}
		rest = rest[open+end+1:]
	}
	if tp.hp < 0 {
		return nil, fmt.Errorf("kvevents: topic pattern %q has no {host:port}", p)
	}
	return tp, nil
}

// match returns the host:port a topic carries. A placeholder takes the shortest text up to the
// next literal (a host:port has no '@'); the last placeholder takes the rest.
func (tp *topicPattern) match(topic string) (string, bool) {
	rest := topic
	var hp string
	for i := 0; i < len(tp.parts); i += 2 {
		lit := tp.parts[i]
		if !strings.HasPrefix(rest, lit) {
			return "", false
		}
		rest = rest[len(lit):]
		if i+1 >= len(tp.parts) {
			break
		}
		var val string
		if next := tp.parts[i+2]; next != "" {
			j := strings.Index(rest, next)
			if j < 0 {
				return "", false
			}
			val, rest = rest[:j], rest[j:]
		} else {
			val, rest = rest, ""
		}
		if val == "" {
			return "", false
		}
		if i+1 == tp.hp {
			hp = val
		}
	}
	if rest != "" {
		return "", false
	}
	return hp, true
}
