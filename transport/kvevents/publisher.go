package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Publisher defaults.
const (
	// DefaultReplayBuffer is how many recent batches the replay socket keeps (vLLM's
	// buffer_steps default).
	DefaultReplayBuffer = 10000
	// DefaultQueue is how many batches may wait for the socket before Publish drops.
	DefaultQueue = 1024
	// peerPoll is how often a connecting publisher checks that its subscriber is still there.
	peerPoll = 100 * time.Millisecond
	// peerGonePolls is how many polls in a row without a subscription mean the peer is gone
	// (a fresh connection is not subscribed for the first few milliseconds).
	peerGonePolls = 3
)

// ErrClosed is returned by Publish after Close.
var ErrClosed = errors.New("kvevents: publisher closed")

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// Endpoint is where events go. As in vLLM, the PUB socket binds when the endpoint has a
	// wildcard ("tcp://*:5557"), is ipc:// or inproc://, or Bind is set; otherwise it connects
	// to a router's bound SUB, and reconnects whenever that goes away.
	Endpoint string
	Bind     bool
	// Topic is the first frame of every message (vLLM's default is empty).
	Topic string
	// MapEncoding writes batches as maps (newer vLLM) instead of arrays (older vLLM).
	MapEncoding bool
	// BytesHashes writes block hashes as bytes instead of integers.
	BytesHashes bool
	// ReplayEndpoint, if set, is bound by a ROUTER socket answering replay requests from the
	// last ReplayBuffer batches (0: DefaultReplayBuffer).
	ReplayEndpoint string
	ReplayBuffer   int
	// DPRank is the data-parallel rank: it moves both endpoints' ports up by DPRank (unless
	// the port is 0 or a wildcard) and is sent in every batch.
	DPRank int
	// StartSeq is the first sequence number; a new Publisher restarts from it, as a restarted
	// engine does.
	StartSeq uint64
	// Queue bounds the batches waiting to be sent (0: DefaultQueue); past it Publish drops.
	Queue int
	// Logger logs; nil discards.
	Logger *slog.Logger
	// MinBackoff and MaxBackoff bound the wait between reconnects when connecting.
	MinBackoff, MaxBackoff time.Duration
}

// Publisher publishes KV event batches in vLLM's wire format, as a simulated worker's engine.
type Publisher struct {
	cfg    PublisherConfig
	format Format
	log    *slog.Logger
	ep     string
	queue  chan replayed

	mu     sync.Mutex // guards seq, ring, closed
	seq    uint64
	ring   []replayed
	oldest int
	closed bool

	sockMu sync.Mutex
	sock   zmq4.Socket // nil while a connecting publisher has no peer
	addr   net.Addr

	replay     zmq4.Socket
	replayAddr net.Addr

	dropped atomic.Uint64
	ctx     context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// NewPublisher binds (or starts connecting) the PUB socket and the replay socket.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.Endpoint == "" {
		return nil, errors.New("kvevents: publisher needs an endpoint")
	}
	if cfg.DPRank < 0 || cfg.DPRank > MaxDPRank {
		return nil, fmt.Errorf("kvevents: dp rank %d out of 0..%d", cfg.DPRank, MaxDPRank)
	}
	if cfg.ReplayBuffer <= 0 {
		cfg.ReplayBuffer = DefaultReplayBuffer
	}
	if cfg.Queue <= 0 {
		cfg.Queue = DefaultQueue
	}
	cfg.MinBackoff = orDefault(cfg.MinBackoff, DefaultMinBackoff)
	cfg.MaxBackoff = max(orDefault(cfg.MaxBackoff, DefaultMaxBackoff), cfg.MinBackoff)
	ep, err := rankEndpoint(cfg.Endpoint, cfg.DPRank)
	if err != nil {
		return nil, err
	}
	p := &Publisher{
		cfg:    cfg,
		format: Format{Map: cfg.MapEncoding, BytesHashes: cfg.BytesHashes},
		log:    cfg.Logger,
		ep:     ep,
		queue:  make(chan replayed, cfg.Queue),
		seq:    cfg.StartSeq,
		ring:   make([]replayed, 0, min(cfg.ReplayBuffer, 1024)),
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())

	if cfg.ReplayEndpoint != "" {
		rep, err := rankEndpoint(cfg.ReplayEndpoint, cfg.DPRank)
		if err != nil {
			p.cancel()
			return nil, err
		}
		p.replay = zmq4.NewRouter(p.ctx, p.options()...)
		if err := p.replay.Listen(guarded(rep)); err != nil {
			p.cancel()
			_ = p.replay.Close()
			return nil, fmt.Errorf("kvevents: bind replay %s: %w", rep, err)
		}
		p.replayAddr = p.replay.Addr()
		p.wg.Add(1)
		go p.serveReplay()
	}

	if bindsLikeVLLM(ep, cfg.Bind) {
		sock := p.newPub()
		if err := sock.Listen(guarded(ep)); err != nil {
			p.cancel()
			_ = sock.Close()
			if p.replay != nil {
				_ = p.replay.Close()
			}
			p.wg.Wait()
			return nil, fmt.Errorf("kvevents: bind %s: %w", ep, err)
		}
		p.sock, p.addr = sock, sock.Addr()
	} else {
		p.wg.Add(1)
		go p.connectLoop()
	}
	p.wg.Add(1)
	go p.send()
	return p, nil
}

// bindsLikeVLLM is vLLM's rule: bind a wildcard or local endpoint, connect to a named host.
func bindsLikeVLLM(ep string, force bool) bool {
	return force || strings.Contains(ep, "*") || strings.HasPrefix(ep, "ipc://") || strings.HasPrefix(ep, "inproc://")
}

// rankEndpoint offsets ep for a DP rank, except an ephemeral or wildcard port.
func rankEndpoint(ep string, rank int) (string, error) {
	if i := strings.LastIndexByte(ep, ':'); i >= 0 {
		if port := ep[i+1:]; port == "0" || port == "*" {
			return ep, nil
		}
	}
	return OffsetPort(ep, rank)
}

func (p *Publisher) options() []zmq4.Option {
	return []zmq4.Option{
		zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(DefaultDialTimeout),
		zmq4.WithTimeout(DefaultReplayTimeout),
		zmq4.WithLogger(slog.NewLogLogger(p.log.Handler(), slog.LevelDebug)),
	}
}

func (p *Publisher) newPub() zmq4.Socket {
	sock := zmq4.NewPub(p.ctx, p.options()...)
	// zmq4 queues without bound unless told; past the mark it drops, as libzmq does.
	_ = sock.SetOption(zmq4.OptionHWM, p.cfg.Queue)
	return sock
}

// Addr is the bound PUB address, nil when the publisher connects.
func (p *Publisher) Addr() net.Addr { return p.addr }

// ReplayAddr is the bound replay address, nil without a replay socket.
func (p *Publisher) ReplayAddr() net.Addr { return p.replayAddr }

// Dropped counts batches dropped because the queue was full or no subscriber was connected.
func (p *Publisher) Dropped() uint64 { return p.dropped.Load() }

// NextSeq is the sequence number the next batch will get.
func (p *Publisher) NextSeq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seq
}

// Publish sends events as one batch under the next sequence number. It encodes in the caller
// (so a bad event is the caller's error) and queues the send; a full queue drops the batch,
// which stays in the replay buffer, so a subscriber sees a gap it can recover.
func (p *Publisher) Publish(events []Event) error {
	b := Batch{
		TS:        float64(time.Now().UnixNano()) / 1e9,
		Events:    events,
		DPRank:    p.cfg.DPRank,
		HasDPRank: true,
	}
	payload, err := p.format.Append(nil, b)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrClosed
	}
	m := replayed{seq: p.seq, payload: payload}
	p.seq++
	p.remember(m)
	select {
	case p.queue <- m:
	default:
		p.dropped.Add(1)
	}
	return nil
}

// remember keeps m in the replay ring, overwriting the oldest when full.
func (p *Publisher) remember(m replayed) {
	if p.replay == nil {
		return
	}
	if len(p.ring) < p.cfg.ReplayBuffer {
		p.ring = append(p.ring, m)
		return
	}
	p.ring[p.oldest] = m
	p.oldest = (p.oldest + 1) % len(p.ring)
}

// since copies the buffered batches from sequence start on, oldest first.
func (p *Publisher) since(start uint64) []replayed {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []replayed
	for i := range p.ring {
		m := p.ring[(p.oldest+i)%len(p.ring)]
		if m.seq >= start {
			out = append(out, m)
		}
	}
	return out
}

// send drains the queue into the current socket.
func (p *Publisher) send() {
	defer p.wg.Done()
	topic := []byte(p.cfg.Topic)
	for {
		select {
		case <-p.ctx.Done():
			return
		case m := <-p.queue:
			p.sockMu.Lock()
			sock := p.sock
			p.sockMu.Unlock()
			if sock == nil {
				p.dropped.Add(1)
				continue
			}
			var seq [8]byte
			binary.BigEndian.PutUint64(seq[:], m.seq)
			if err := sock.Send(zmq4.NewMsgFrom(topic, seq[:], m.payload)); err != nil && p.ctx.Err() == nil {
				p.dropped.Add(1)
				p.log.Debug("kv events: send failed", "endpoint", p.ep, "err", err)
			}
		}
	}
}

// connectLoop keeps a PUB socket connected to the endpoint. zmq4 does not reconnect a PUB
// safely (its automatic reconnect can deadlock the writer), so a socket whose subscriber has
// been gone for a few polls is closed and a fresh one dialled, never two at once: a duplicate
// connection would deliver every batch twice.
func (p *Publisher) connectLoop() {
	defer p.wg.Done()
	bo := backoff{min: p.cfg.MinBackoff, max: p.cfg.MaxBackoff}
	for p.ctx.Err() == nil {
		sock := p.newPub()
		if err := dialCtx(p.ctx, sock, guarded(p.ep)); err != nil {
			_ = sock.Close()
			p.log.Debug("kv events: cannot connect", "endpoint", p.ep, "err", err)
			sleepCtx(p.ctx, bo.next())
			continue
		}
		p.log.Info("kv events: publisher connected", "endpoint", p.ep)
		p.setSock(sock)
		p.watch(sock)
		p.setSock(nil)
		_ = sock.Close()
		if p.ctx.Err() == nil {
			p.log.Info("kv events: subscriber gone, reconnecting", "endpoint", p.ep)
			bo.reset()
			sleepCtx(p.ctx, bo.next())
		}
	}
}

// watch returns once sock has had no subscribed peer for peerGonePolls polls, or on Close.
func (p *Publisher) watch(sock zmq4.Socket) {
	t := time.NewTicker(peerPoll)
	defer t.Stop()
	topics, _ := sock.(zmq4.Topics)
	for empty := 0; empty < peerGonePolls; {
		select {
		case <-p.ctx.Done():
			return
		case <-t.C:
		}
		if topics != nil && len(topics.Topics()) == 0 {
			empty++
		} else {
			empty = 0
		}
	}
}

func (p *Publisher) setSock(s zmq4.Socket) {
	p.sockMu.Lock()
	p.sock = s
	p.sockMu.Unlock()
}

// serveReplay answers replay requests: [identity, "", start] (the delimiter may be absent) gets
// [identity, "", seq, payload] for each buffered batch from start on, then [identity, "", -1, ""].
func (p *Publisher) serveReplay() {
	defer p.wg.Done()
	end := make([]byte, 8)
	binary.BigEndian.PutUint64(end, ^uint64(0)) // -1, big-endian two's complement
	for {
		m, err := p.replay.Recv()
		if err != nil {
			if p.ctx.Err() != nil {
				return
			}
			continue
		}
		f := m.Frames
		if len(f) == 3 && len(f[1]) == 0 {
			f = [][]byte{f[0], f[2]}
		}
		if len(f) != 2 || len(f[1]) != 8 {
			p.log.Debug("kv events: bad replay request", "frames", len(m.Frames))
			continue
		}
		id := f[0]
		for _, r := range p.since(binary.BigEndian.Uint64(f[1])) {
			var seq [8]byte
			binary.BigEndian.PutUint64(seq[:], r.seq)
			if err := p.replay.Send(zmq4.NewMsgFrom(id, []byte{}, seq[:], r.payload)); err != nil {
				break
			}
		}
		_ = p.replay.Send(zmq4.NewMsgFrom(id, []byte{}, end, []byte{}))
	}
}

// Close stops sending, closes the sockets and waits for the goroutines. Batches still queued
// are dropped, as a stopping engine's would be. zmq4 reports errors closing connections a peer
// already closed, which say nothing useful, so Close always returns nil.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	p.sockMu.Lock()
	if p.sock != nil {
		_ = p.sock.Close()
		p.sock = nil
	}
	p.sockMu.Unlock()
	if p.replay != nil {
		_ = p.replay.Close()
	}
	p.wg.Wait()
	return nil
}
