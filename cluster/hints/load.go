package hints

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Load sharing. A replica sends each alive peer its per-worker in-flight load in UDP packets
// (one, or a few for a large fleet), in two kinds of report:
//
//   - a change report as the load changes (a request starts, has its first token, ends: the
//     tracker's Changes signal), of the workers whose load differs from what was last sent.
//     The first change after a quiet spell goes at once; later ones are coalesced, at most
//     one report per Coalesce (5 ms), so a busy replica sends at most 200 change reports a
//     second to each peer, whatever its request rate. A request that ended a moment ago is
//     therefore gone from the peers' view before its client's next request reaches them;
//     with periodic reports alone the peers counted it for up to an interval more, which
//     cancelled a prompt's whole cached prefix in the kv cost;
//   - a full report every PublishInterval of the busy workers, plus, for idleReports
//     intervals, those that just went idle (so that peers see the drop even if a packet is
//     lost): an idle fleet sends nothing. It renews the peers' shares, which expire after a
//     few intervals, so a replica that dies stops counting within about half a second, long
//     before the gossip layer declares it dead (at which point its shares are dropped at
//     once).
//
// Both go through the gossip budget: a report over it is dropped and counted, and the next
// full report repairs what it missed. Each report carries the sender's (epoch, sequence); a
// report older than one already applied (UDP reorders) is dropped, and a worker it alone
// carried keeps its previous share until the next full report.

// DefaultLoadInterval is how often a replica publishes its load.
const DefaultLoadInterval = 150 * time.Millisecond

// DefaultLoadCoalesce is the least time between two change reports.
const DefaultLoadCoalesce = 5 * time.Millisecond

// idleReports is how many publishes still report a worker after it went idle.
const idleReports = 3

// LoadShareConfig configures load sharing.
type LoadShareConfig struct {
	// Messenger carries the reports (required).
	Messenger Messenger
	// Local is this replica's load accounting (required): a *routing.Tracker.
	Local interface {
		Snapshot() map[indexer.Worker]routing.Load
	}
	// Changes, when set, signals a change of Local's load (routing.Tracker.Changes): the
	// workers whose load changed are sent at once, then at most once per Coalesce.
	Changes <-chan struct{}
	// Coalesce is the least time between two change reports (default 5 ms).
	Coalesce time.Duration
	// Remote receives the peers' reports (required); give the router this view.
	Remote *routing.RemoteLoad
	// Interval between publishes (default 150 ms). Remote's TTL should be about three.
	Interval time.Duration
	// Known, when set, accepts only reports of workers this replica routes to.
	Known func(indexer.Worker) bool
	// Metrics receives the counters (nil: a private set).
	Metrics *Metrics
	// Logger logs (nil: discarded).
	Logger *slog.Logger

	now func() time.Time // tests; nil: time.Now
}

// LoadShare publishes this replica's load and applies its peers'.
type LoadShare struct {
	cfg   LoadShareConfig
	log   *slog.Logger
	m     *Metrics
	self  string
	epoch uint64
	now   func() time.Time

	pmu   sync.Mutex // one publish at a time; guards seq, idle and sent
	seq   uint64
	idle  map[indexer.Worker]int // reports of a worker since it went idle
	sent  map[indexer.Worker]routing.Load
	parts [][]byte

	rmu  sync.Mutex
	last map[string]recvState
}

// NewLoadShare checks cfg, registers the receive handler and a membership listener (a
// dead or departed peer's shares go at once) and returns the sharer; Run publishes.
func NewLoadShare(cfg LoadShareConfig) (*LoadShare, error) {
	if cfg.Messenger == nil || cfg.Local == nil || cfg.Remote == nil {
		return nil, errors.New("cluster: load sharing needs a messenger, the local tracker and a remote view")
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultLoadInterval
	}
	if cfg.Coalesce <= 0 {
		cfg.Coalesce = DefaultLoadCoalesce
	}
	if cfg.now == nil {
		cfg.now = time.Now
	}
	s := &LoadShare{
		cfg:   cfg,
		log:   cfg.Logger,
		m:     orNewMetrics(cfg.Metrics),
		self:  cfg.Messenger.Name(),
		epoch: uint64(cfg.now().UnixNano()),
		now:   cfg.now,
		idle:  map[indexer.Worker]int{},
		sent:  map[indexer.Worker]routing.Load{},
		last:  map[string]recvState{},
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if len(s.self) == 0 || len(s.self) > maxShareIDLen {
		return nil, fmt.Errorf("cluster: replica name of %d bytes cannot be shared", len(s.self))
	}
	cfg.Messenger.Handle(gossip.KindLoad, s.receive)
	cfg.Messenger.OnMemberChange(func(m gossip.Member) {
		if m.State == gossip.Dead || m.State == gossip.Left {
			s.forget(m.Name)
		}
	})
	return s, nil
}

// Run publishes every Interval and expires stale remote shares, and publishes changes as
// Changes signals them, until ctx ends.
func (s *LoadShare) Run(ctx context.Context) error {
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	// hold is the coalescing timer: while it runs, changes wait for it, in the Changes
	// channel (changes is nil meanwhile): a busy tracker signals on every request's start,
	// first token and end, and each signal taken would wake this goroutine for nothing.
	// Stopped, the timer's channel delivers nothing (Go 1.23 timers).
	hold := time.NewTimer(time.Hour)
	hold.Stop()
	changes := s.cfg.Changes
	var lastChange time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			s.Publish()
			s.cfg.Remote.Expire(s.now())
			s.m.remoteReplicas.Store(int64(len(s.cfg.Remote.Replicas())))
		case <-changes:
			if wait := s.cfg.Coalesce - time.Since(lastChange); wait > 0 {
				hold.Reset(wait)
				changes = nil
				continue
			}
			s.PublishChanges()
			lastChange = time.Now()
		case <-hold.C:
			// A change signalled meanwhile is still in the channel: the report sent now
			// takes it, and the next one goes a Coalesce later at the earliest.
			changes = s.cfg.Changes
			s.PublishChanges()
			lastChange = time.Now()
		}
	}
}

// Publish sends this replica's current load to every alive peer: every busy worker, and
// those that went idle within idleReports publishes.
func (s *LoadShare) Publish() {
	s.pmu.Lock()
	defer s.pmu.Unlock()
	loads := s.cfg.Local.Snapshot()
	var report []workerLoad
	for w, l := range loads {
		if len(w.ID) > maxShareIDLen {
			continue
		}
		if l != (routing.Load{}) {
			delete(s.idle, w)
			report = append(report, workerLoad{w, l})
			continue
		}
		if n, ok := s.idle[w]; !ok || n < idleReports {
			s.idle[w] = n + 1
			report = append(report, workerLoad{w, l})
		}
	}
	for w := range s.idle {
		if _, ok := loads[w]; !ok {
			delete(s.idle, w) // the tracker forgot it
		}
	}
	s.sendLocked(report, loads)
}

// PublishChanges sends every alive peer the load of the workers whose load differs from
// what this replica last sent them.
func (s *LoadShare) PublishChanges() {
	s.pmu.Lock()
	defer s.pmu.Unlock()
	loads := s.cfg.Local.Snapshot()
	var report []workerLoad
	for w, l := range loads {
		if len(w.ID) > maxShareIDLen || s.sent[w] == l {
			continue
		}
		report = append(report, workerLoad{w, l})
	}
	s.sendLocked(report, loads)
}

// sendLocked sends report to every alive peer and notes what was sent; loads is the
// snapshot report was taken from (to forget the workers the tracker forgot).
func (s *LoadShare) sendLocked(report []workerLoad, loads map[indexer.Worker]routing.Load) {
	for w := range s.sent {
		if _, ok := loads[w]; !ok {
			delete(s.sent, w)
		}
	}
	if len(report) == 0 {
		return
	}
	peers := alivePeers(s.cfg.Messenger)
	if len(peers) == 0 {
		return
	}
	for _, wl := range report {
		s.sent[wl.w] = wl.l
	}
	// Stable order, so that a report split across packets splits the same way each time.
	slices.SortFunc(report, func(a, b workerLoad) int {
		if a.w.ID != b.w.ID {
			if a.w.ID < b.w.ID {
				return -1
			}
			return 1
		}
		return int(a.w.DPRank) - int(b.w.DPRank)
	})
	s.seq++
	s.parts = encodeLoad(s.parts[:0], s.self, s.epoch, s.seq, report, s.cfg.Messenger.MaxBroadcastPayload())
	for _, p := range peers {
		for _, part := range s.parts {
			if err := s.cfg.Messenger.SendBestEffort(p.Name, gossip.KindLoad, part); err != nil {
				s.m.drop(shareLoad, DropShareSend)
				s.log.Debug("sending load", "to", p.Name, "err", err)
				continue
			}
			s.m.out(shareLoad, len(part))
		}
	}
}

// forget drops a peer's shares (it died or left).
func (s *LoadShare) forget(replica string) {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	s.cfg.Remote.Forget(replica)
	delete(s.last, replica)
}

type workerLoad struct {
	w indexer.Worker
	l routing.Load
}

// Load payload, version 1:
//
//	version(1) replica id (uvarint length, bytes) epoch seq (uvarints)
//	workers (uvarint count), each: id (uvarint length, bytes), dp rank, requests, prefill
//	  tokens, decode blocks (uvarints)
//
// A report too big for one packet goes as several with the same sequence number, each a
// self-contained report of some workers.

// encodeLoad appends to parts the payloads of one report, each at most limit bytes (a
// worker alone over the limit still gets a payload of its own).
func encodeLoad(parts [][]byte, self string, epoch, seq uint64, report []workerLoad, limit int) [][]byte {
	head := appendHeader(nil, self)
	head = binary.AppendUvarint(head, epoch)
	head = binary.AppendUvarint(head, seq)
	room := limit - len(head) - binary.MaxVarintLen32
	var body, one []byte
	n := 0
	flush := func() {
		b := make([]byte, 0, len(head)+binary.MaxVarintLen32+len(body))
		b = binary.AppendUvarint(append(b, head...), uint64(n))
		parts = append(parts, append(b, body...))
		body, n = body[:0], 0
	}
	for _, wl := range report {
		one = appendWorker(one[:0], wl.w)
		one = binary.AppendUvarint(one, uint64(max(wl.l.Requests, 0)))
		one = binary.AppendUvarint(one, uint64(max(wl.l.PrefillTokens, 0)))
		one = binary.AppendUvarint(one, uint64(max(wl.l.DecodeBlocks, 0)))
		if n > 0 && len(body)+len(one) > room {
			flush()
		}
		body = append(body, one...)
		n++
	}
	if n > 0 {
		flush()
	}
	return parts
}

// loadMessage is a decoded load report.
type loadMessage struct {
	replica    string
	epoch, seq uint64
	loads      []workerLoad
}

// maxLoadFigure bounds a reported figure: no worker has 2^40 tokens in flight.
const maxLoadFigure = 1 << 40

// decodeLoad decodes a whole payload or nothing.
func decodeLoad(b []byte) (loadMessage, error) {
	r := wireReader{b: b}
	var m loadMessage
	m.replica = r.header()
	m.epoch, m.seq = r.uvarint(), r.uvarint()
	n := r.count(5) // id length, id, rank, three figures
	for range n {
		w := r.worker()
		req, pre, dec := r.uvarint(), r.uvarint(), r.uvarint()
		if r.err == nil && (req > maxLoadFigure || pre > maxLoadFigure || dec > maxLoadFigure) {
			r.fail(errShareSize, "load figures %d, %d, %d", req, pre, dec)
		}
		m.loads = append(m.loads, workerLoad{w, routing.Load{Requests: int64(req), PrefillTokens: int64(pre), DecodeBlocks: int64(dec)}})
	}
	if err := r.done(); err != nil {
		return loadMessage{}, err
	}
	return m, nil
}

// receive applies a peer's load report.
func (s *LoadShare) receive(from string, payload []byte) {
	msg, ok := admitShare(s.m, s.log, shareLoad, s.self, from, s.cfg.Messenger.IsAlive, payload,
		decodeLoad, func(m loadMessage) string { return m.replica })
	if !ok {
		return
	}
	loads := make(map[indexer.Worker]routing.Load, len(msg.loads))
	for _, wl := range msg.loads {
		if s.cfg.Known != nil && !s.cfg.Known(wl.w) {
			s.m.drop(shareLoad, DropShareUnknownWorker)
			continue
		}
		loads[wl.w] = wl.l
	}
	// Held across Set, so two reports of one peer cannot overtake each other in between.
	s.rmu.Lock()
	defer s.rmu.Unlock()
	// Another epoch is another incarnation of the peer (a restart): its sequence starts
	// over. Epochs are not compared, as a restarted host's clock may have gone back.
	if last, ok := s.last[from]; ok && msg.epoch == last.epoch && msg.seq < last.seq {
		s.m.drop(shareLoad, DropShareStale)
		return
	}
	s.last[from] = recvState{epoch: msg.epoch, seq: msg.seq}
	if len(loads) > 0 {
		s.cfg.Remote.Set(from, loads, s.now())
	}
}
