package hints

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Decision sharing, and why it sends suffixes.
//
// The router records each decision (worker, the prompt's block sequence hashes) into this
// replica's approximate index; Decisions wraps that recorder so that the decision is also
// queued for the other replicas, which store it in theirs. A block's key is a chained
// sequence hash: it names its whole prefix. So when a peer already received blocks
// 0..i of a prompt for a worker, sending blocks i+1.. is enough: the receiver stores the
// suffix and holds the whole chain. A replica remembers, per worker, the hashes it sent
// recently, and sends each decision from the first block it did not send. Conversations
// re-send the same growing prompt turn after turn, so most decisions cost only their new
// blocks; one that brings none (a repeated prompt, or the refresh at a request's end, see
// routing.Attempt.Complete) costs its last block, anchored (below), so that the peers
// refresh the chain as this replica did.
//
// Loss. A lost message leaves a hole: the receiver lacks blocks that later suffixes build
// on, and those later suffixes do not fill it. The receiver's lookups then see the
// worker's run end at the hole (or, between two read blocks, miss it): a worse estimate,
// never a wrong binding. Holes are repaired three ways: a hash counts as sent only for
// FullAfter to 2*FullAfter (two generations of sent sets, rotated every FullAfter), after
// which the next decision over it resends the chain from there; every FullEvery-th decision
// of a worker is sent whole; and a send that fails forgets what it carried. A new member
// (a peer that joined or came back) also clears every sent set, so that it gets whole
// chains.
//
// A copy ages like the original. The origin stores each decision's whole chain, which
// makes the chain's opening its most recent entry again (and restarts its TTL); a receiver
// storing only the suffix would let the opening age, and under the per-worker cap evict it
// first, hiding the whole conversation from the prefix-closed lookup. So a suffix carries
// its anchor, the block before its first, and the length of the prefix it continues; the
// receiver remembers, for the chains decisions brought recently, each block's predecessor
// (chainLinks, shared by all peers: a chained hash names its prefix whoever sends it), walks
// back from the anchor, and stores the whole chain in one Store, as the origin did. When a
// link is missing (a lost message, a forgotten generation, the tail-first pieces of a
// decision longer than a message) the suffix is stored alone and counted; the rotation
// below then resends the chain within 2*FullAfter, refreshing the peers' entries.
// FullAfter defaults to an eighth of the TTL.
//
// Merges commute: storing a block for a worker is idempotent, and a receiver counts a TTL
// from when it stored the block, so of two decisions over a block the later one decides
// when it expires, whatever order they arrive in (every replica runs the same TTL). The
// (epoch, sequence) each message carries only detects gaps; it orders nothing.
//
// Repeats. A decision that changed nothing in the index (indexer.Index.RecordRepeat: the same
// decision, or one it begins, recorded within the same tick, by this replica or by a peer that
// sent it to all) is not queued: the peers had that refresh already. So a hot prompt's
// requests do not take mu.
//
// Volume. Decisions are batched every FlushInterval. A batch that fits in a few UDP
// packets goes as packets (one per peer each, SendBestEffort); a bigger one as messages
// of up to MaxMessageBytes over TCP (SendReliable). Memberlist's Broadcast is not used:
// it retransmits every message several times to random members, which costs more bytes
// than sending each peer one copy. MaxBytesPerSecond bounds what this replica sends;
// over it, batches are dropped (and counted), which only makes peers' estimates worse.

// Defaults of DecisionsConfig.
const (
	DefaultDecisionFlush     = 50 * time.Millisecond
	DefaultDecisionFullEvery = 32
	DefaultDecisionQueue     = 1 << 18
	DefaultDecisionMessage   = 64 << 10
	DefaultDecisionSendWait  = 2 * time.Second
	// smallBatchPackets: a batch that fits in this many UDP packets goes as packets.
	smallBatchPackets = 4
	// maxSentPerWorker bounds one worker's sent set generation; past it the generation
	// rotates early (which only makes a few more decisions go whole).
	maxSentPerWorker = 1 << 16
)

// DecisionsConfig configures decision sharing.
type DecisionsConfig struct {
	// Messenger carries the decisions (required).
	Messenger Messenger
	// Index is this replica's approximate index; local decisions and the peers' are
	// recorded there (required).
	Index routing.DecisionRecorder
	// TTL is the approximate index's entry TTL; it sets FullAfter's default and travels
	// in each message for the receivers' information.
	TTL time.Duration
	// Known, when set, accepts only received entries of workers this replica routes to;
	// the others are dropped and counted.
	Known func(indexer.Worker) bool
	// FlushInterval is how often queued decisions go out (default 50 ms).
	FlushInterval time.Duration
	// FullEvery sends every FullEvery-th decision of a worker whole (default 32).
	FullEvery int
	// FullAfter is how long a sent hash counts as sent, at least (default TTL/8, at least a
	// second; 15 s without a TTL).
	FullAfter time.Duration
	// MaxQueuedBlocks bounds the block hashes waiting for the next flush (default 2^18);
	// decisions past it are dropped and counted.
	MaxQueuedBlocks int
	// MaxMessageBytes bounds one TCP message (default 64 KiB).
	MaxMessageBytes int
	// MaxBytesPerSecond bounds the bytes this replica sends to all peers together
	// (0: no bound of its own; the gossip layer has one too).
	MaxBytesPerSecond int
	// SendTimeout bounds one TCP send (default 2 s).
	SendTimeout time.Duration
	// Metrics receives the counters (nil: a private set).
	Metrics *Metrics
	// Logger logs (nil: discarded).
	Logger *slog.Logger

	now func() time.Time // tests; nil: time.Now
}

// repeatRecorder is an index that tells a record that changed nothing (indexer.Index).
type repeatRecorder interface {
	RecordRepeat(w indexer.Worker, seq []uint64) bool
}

// Decisions shares this replica's routing decisions with its peers and applies theirs. It
// implements routing.DecisionRecorder: give it to the router in place of the index.
type Decisions struct {
	cfg   DecisionsConfig
	log   *slog.Logger
	m     *Metrics
	self  string
	epoch uint64
	now   func() time.Time
	// lonely: no peer at the last flush, so Record queues nothing.
	lonely atomic.Bool

	mu         sync.Mutex
	queue      []queuedDecision
	queued     int // hashes in queue
	sent       map[indexer.Worker]*sentSet
	lastRotate time.Time

	flushMu sync.Mutex // one flush at a time; guards the fields below
	seq     uint64
	peers   map[string]bool
	budget  shareBucket

	rmu  sync.Mutex
	recv map[string]recvState

	lmu   sync.Mutex
	links chainLinks
}

// queuedDecision is one decision's part that peers have not got: hashes of blocks from
// a chain's start, or continuing one (cont) whose earlier blocks were sent before.
type queuedDecision struct {
	w    indexer.Worker
	cont bool
	// prefix is how many blocks of the chain come before hashes (sent before), anchor the
	// last of them; 0 when the entry names no anchor (whole, or longer than
	// maxAnchoredPrefix).
	prefix int
	anchor uint64
	hashes []uint64
	at     int64 // when it was decided, Unix microseconds
}

// anchored is an entry the receiver can expand to the whole chain.
func (q queuedDecision) anchored() bool { return q.prefix > 0 }

// sentSet is what a worker's recent decisions sent: two generations of hashes.
type sentSet struct {
	cur, prev hashSet
	decisions int
}

func (s *sentSet) has(h uint64) bool { return s.cur.has(h) || s.prev.has(h) }

// recvState is the newest and the first message seen from a peer's incarnation, for gap
// counting.
type recvState struct{ epoch, seq, first uint64 }

// NewDecisions checks cfg, registers the receive handler and returns the sharer; Run
// sends.
func NewDecisions(cfg DecisionsConfig) (*Decisions, error) {
	if cfg.Messenger == nil || cfg.Index == nil {
		return nil, errors.New("cluster: decision sharing needs a messenger and an index")
	}
	if cfg.FlushInterval <= 0 {
		cfg.FlushInterval = DefaultDecisionFlush
	}
	if cfg.FullEvery <= 0 {
		cfg.FullEvery = DefaultDecisionFullEvery
	}
	if cfg.FullAfter <= 0 {
		cfg.FullAfter = 15 * time.Second
		if cfg.TTL > 0 {
			cfg.FullAfter = max(cfg.TTL/8, time.Second)
		}
	}
	if cfg.MaxQueuedBlocks <= 0 {
		cfg.MaxQueuedBlocks = DefaultDecisionQueue
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = DefaultDecisionMessage
	}
	cfg.MaxMessageBytes = min(cfg.MaxMessageBytes, maxSharePayload)
	if cfg.SendTimeout <= 0 {
		cfg.SendTimeout = DefaultDecisionSendWait
	}
	if cfg.now == nil {
		cfg.now = time.Now
	}
	d := &Decisions{
		cfg:   cfg,
		log:   cfg.Logger,
		m:     orNewMetrics(cfg.Metrics),
		self:  cfg.Messenger.Name(),
		epoch: uint64(cfg.now().UnixNano()),
		now:   cfg.now,
		sent:  map[indexer.Worker]*sentSet{},
		peers: map[string]bool{},
		recv:  map[string]recvState{},
		links: chainLinks{perGeneration: defaultChainLinks},
	}
	if d.log == nil {
		d.log = slog.New(slog.DiscardHandler)
	}
	if len(d.self) == 0 || len(d.self) > maxShareIDLen {
		return nil, fmt.Errorf("cluster: replica name of %d bytes cannot be shared", len(d.self))
	}
	d.lastRotate = d.now()
	for _, p := range alivePeers(cfg.Messenger) {
		d.peers[p.Name] = true
	}
	d.budget = shareBucket{perSecond: cfg.MaxBytesPerSecond}
	d.lonely.Store(len(alivePeers(cfg.Messenger)) == 0)
	cfg.Messenger.OnMemberChange(func(m gossip.Member) {
		// Do not wait for the next flush to notice a new peer: decisions made meanwhile
		// would go as suffixes it cannot use, or not at all.
		if m.Name != d.self && m.State == gossip.Alive {
			d.lonely.Store(false)
			d.mu.Lock()
			d.resetSentLocked()
			d.mu.Unlock()
		}
	})
	cfg.Messenger.Handle(gossip.KindDecisions, d.receive)
	return d, nil
}

// Record implements routing.DecisionRecorder: it records the decision locally and queues
// the part of it peers have not got.
func (d *Decisions) Record(w indexer.Worker, seq []uint64) {
	if r, ok := d.cfg.Index.(repeatRecorder); ok {
		if r.RecordRepeat(w, seq) {
			// The index was already as this decision leaves it: the same decision (or one
			// it begins) was recorded within the same tick, and queued for the peers then.
			// Sending it again would only refresh their copies a little later than the
			// origin's; not sending it spares every request of a hot prompt d.mu.
			return
		}
	} else {
		d.cfg.Index.Record(w, seq)
	}
	if len(seq) == 0 || d.lonely.Load() || len(w.ID) > maxShareIDLen {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.sent[w]
	if s == nil {
		s = &sentSet{}
		d.sent[w] = s
	}
	s.decisions++
	start := 0
	if s.decisions%d.cfg.FullEvery != 0 {
		// The sent hashes of a chain are a prefix of it (a key names its prefix), so a
		// binary search finds where they end. Where a rotation or a failed send broke
		// that, it may land on either side of the break: a few blocks more or fewer go
		// out, and the repairs above cover the rest.
		start = sort.Search(len(seq), func(i int) bool { return !s.has(seq[i]) })
	}
	if start == len(seq) {
		// The peers have the whole chain, but this decision refreshed it here (a repeated
		// prompt, or the refresh when a request ends), and their copies must age like this
		// one: the last block again, anchored, makes each of them store the whole chain.
		if len(seq)-1 > maxAnchoredPrefix {
			return
		}
		start = len(seq) - 1
	}
	suffix := seq[start:]
	if d.queued+len(suffix) > d.cfg.MaxQueuedBlocks {
		d.m.drop(shareDecisions, DropShareQueue)
		return
	}
	if s.cur.len() >= maxSentPerWorker {
		s.prev, s.cur = s.cur, hashSet{}
	}
	for _, h := range suffix {
		s.cur.add(h)
	}
	q := queuedDecision{w: w, cont: start > 0, hashes: append([]uint64(nil), suffix...), at: d.now().UnixMicro()}
	if start > 0 && start <= maxAnchoredPrefix {
		q.prefix, q.anchor = start, seq[start-1]
	}
	d.queue = append(d.queue, q)
	d.queued += len(suffix)
}

// Run flushes queued decisions every FlushInterval until ctx ends.
func (d *Decisions) Run(ctx context.Context) error {
	t := time.NewTicker(d.cfg.FlushInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			d.Flush(ctx)
		}
	}
}

// Flush sends the queued decisions to every alive peer now.
func (d *Decisions) Flush(ctx context.Context) {
	d.flushMu.Lock()
	defer d.flushMu.Unlock()
	peers := alivePeers(d.cfg.Messenger)
	now := d.now()

	d.mu.Lock()
	q := d.queue
	d.queue, d.queued = nil, 0
	newcomer := false
	for _, p := range peers {
		if !d.peers[p.Name] {
			newcomer = true
		}
	}
	switch {
	case newcomer:
		// A peer that joined or came back has none of the prefixes: from now on, send
		// whole chains, except for what this very batch sends to every peer.
		d.resetSentLocked()
		d.lastRotate = now
		for _, e := range q {
			s := d.sent[e.w]
			if s == nil {
				s = &sentSet{}
				d.sent[e.w] = s
			}
			for _, h := range e.hashes {
				s.cur.add(h)
			}
		}
	case now.Sub(d.lastRotate) >= d.cfg.FullAfter:
		for w, s := range d.sent {
			if s.cur.len() == 0 && s.prev.len() == 0 && s.decisions%d.cfg.FullEvery == 0 {
				delete(d.sent, w)
				continue
			}
			s.prev, s.cur = s.cur, hashSet{}
		}
		d.lastRotate = now
	}
	d.mu.Unlock()
	d.lonely.Store(len(peers) == 0)
	clear(d.peers)
	for _, p := range peers {
		d.peers[p.Name] = true
	}
	if len(q) == 0 || len(peers) == 0 {
		return
	}

	packet := d.cfg.Messenger.MaxBroadcastPayload()
	// UDP packets only when the batch is small and every decision fits in one: a decision
	// split over packets would be stored in pieces (see pack).
	reliable := estimateDecisionBytes(d.self, q) > smallBatchPackets*packet || !fitsOnePacket(d.self, q, packet)
	limit := packet
	if reliable {
		limit = d.cfg.MaxMessageBytes
		if d.cfg.MaxBytesPerSecond > 0 {
			// A message the budget can never afford would never go.
			limit = max(min(limit, d.cfg.MaxBytesPerSecond/len(peers)), packet)
		}
	}
	for _, msg := range d.pack(q, limit) {
		if !d.budget.take(now, len(msg.payload)*len(peers)) {
			d.m.drop(shareDecisions, DropShareBudget)
			d.forget(msg.parts)
			continue
		}
		failed := false
		for _, p := range peers {
			var err error
			if reliable {
				sctx, cancel := context.WithTimeout(ctx, d.cfg.SendTimeout)
				err = d.cfg.Messenger.SendReliable(sctx, p.Name, gossip.KindDecisions, msg.payload)
				cancel()
			} else {
				err = d.cfg.Messenger.SendBestEffort(p.Name, gossip.KindDecisions, msg.payload)
			}
			if err != nil {
				failed = true
				d.m.drop(shareDecisions, DropShareSend)
				d.log.Debug("sending decisions", "to", p.Name, "bytes", len(msg.payload), "err", err)
				continue
			}
			d.m.out(shareDecisions, len(msg.payload))
			d.m.blocksOut.Add(uint64(msg.blocks))
		}
		if failed {
			d.forget(msg.parts)
		}
	}
}

// resetSentLocked forgets everything sent (keeping the per-worker decision counts), so
// that the next decisions go whole. Caller holds d.mu.
func (d *Decisions) resetSentLocked() {
	for _, s := range d.sent {
		s.cur, s.prev = hashSet{}, hashSet{}
	}
}

// forget unmarks the hashes of decisions that did not reach every peer, so that later
// decisions over them send them again.
func (d *Decisions) forget(parts []queuedDecision) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, p := range parts {
		if s := d.sent[p.w]; s != nil {
			for _, h := range p.hashes {
				s.cur.del(h)
				s.prev.del(h)
			}
		}
	}
}

// packedDecisions is one encoded message and the decision parts it carries.
type packedDecisions struct {
	payload []byte
	parts   []queuedDecision
	blocks  int
}

// Sizes used to pack messages; upper bounds of the encoded lengths.
const (
	decisionHeaderMax = 1 + 2 + 4*binary.MaxVarintLen64 + 2*binary.MaxVarintLen32
	decisionEntryMax  = 3*binary.MaxVarintLen32 + 1 + 8
)

func workerWireMax(w indexer.Worker) int { return 2 + len(w.ID) + binary.MaxVarintLen32 }

// estimateDecisionBytes is about what a batch costs on the wire.
func estimateDecisionBytes(self string, q []queuedDecision) int {
	n := decisionHeaderMax + len(self)
	for _, e := range q {
		n += 8*len(e.hashes) + 4 + len(e.w.ID)
		if e.anchored() {
			n += 11
		}
	}
	return n
}

// fitsOnePacket reports whether every decision of q fits in one packet of its own.
func fitsOnePacket(self string, q []queuedDecision, packet int) bool {
	for _, e := range q {
		if decisionHeaderMax+len(self)+decisionEntryMax+workerWireMax(e.w)+8*len(e.hashes) > packet {
			return false
		}
	}
	return true
}

// pack encodes q into messages of at most limit bytes. A decision goes whole into one
// message when it fits in one, so that the receiver stores it with one Store, and a store
// queues a chain's blocks from its tail to its head: a cap then evicts the tail first and
// the holdings stay prefix-closed, exactly as on the replica that made the decision. (Cut
// head first into messages applied one after another, the head became the receiver's
// oldest and was evicted first, hiding the whole chain from the prefix-closed lookup.) A
// decision longer than a whole message goes in pieces, tail first, so that its head is
// stored last there too.
func (d *Decisions) pack(q []queuedDecision, limit int) []packedDecisions {
	var (
		out     []packedDecisions
		cur     []queuedDecision
		workers = map[indexer.Worker]bool{}
		size    int
	)
	reset := func() {
		cur, size = nil, decisionHeaderMax+len(d.self)
		clear(workers)
	}
	emit := func() {
		if len(cur) == 0 {
			return
		}
		d.seq++
		payload, blocks := encodeDecisions(d.self, d.epoch, d.seq, d.cfg.TTL, cur)
		out = append(out, packedDecisions{payload: payload, parts: cur, blocks: blocks})
		reset()
	}
	reset()
	extra := func(w indexer.Worker) int {
		if workers[w] {
			return decisionEntryMax
		}
		return decisionEntryMax + workerWireMax(w)
	}
	for _, e := range q {
		if len(cur) > 0 && size+extra(e.w)+8*len(e.hashes) > limit {
			emit() // it fits in a message of its own, perhaps: do not cut it
		}
		if size+extra(e.w)+8*len(e.hashes) <= limit {
			cur = append(cur, e)
			size += extra(e.w) + 8*len(e.hashes)
			workers[e.w] = true
			continue
		}
		room := (limit - size - extra(e.w)) / 8
		if room < 1 {
			// Even alone it does not fit (a limit below any real packet size).
			d.m.drop(shareDecisions, DropShareSize)
			continue
		}
		for end := len(e.hashes); end > 0; {
			start := max(0, end-room)
			piece := queuedDecision{w: e.w, cont: e.cont || start > 0, hashes: e.hashes[start:end], at: e.at,
				prefix: e.prefix, anchor: e.anchor}
			if start > 0 {
				piece.prefix, piece.anchor = 0, 0
				if p := e.prefix + start; (!e.cont || e.anchored()) && p <= maxAnchoredPrefix {
					piece.prefix, piece.anchor = p, e.hashes[start-1]
				}
			}
			cur = append(cur, piece)
			emit()
			end = start
		}
	}
	emit()
	return out
}

// Decision payload, version 2 (decisionWireVersion; version 1 is still read):
//
//	version(2) replica id (uvarint length, bytes) epoch seq ttl_ms (uvarints)
//	decided_us (uvarint: when the message's oldest decision was made, Unix microseconds)
//	workers (uvarint count), each: id (uvarint length, bytes), dp rank (uvarint)
//	entries (uvarint count), each: worker index (uvarint), flags (1 byte: bit 0 = the
//	  entry continues a chain sent before, bit 1 = anchored, which needs bit 0),
//	  when anchored: anchor (8 bytes LE, the chain's block before the entry's first) and
//	  prefix (uvarint, 1..maxAnchoredPrefix: the blocks before the entry's first),
//	  n (uvarint, >= 1), n hashes of 8 bytes (LE)
//
// Version 1 is version 2 without decided_us and without anchors.
const decisionWireVersion = 2

const (
	flagCont     = 1
	flagAnchored = 2
)

// encodeDecisions encodes one message and returns it with the number of hashes in it.
func encodeDecisions(self string, epoch, seq uint64, ttl time.Duration, parts []queuedDecision) ([]byte, int) {
	idx := map[indexer.Worker]int{}
	var ws []indexer.Worker
	oldest := int64(0)
	for i, p := range parts {
		if _, ok := idx[p.w]; !ok {
			idx[p.w] = len(ws)
			ws = append(ws, p.w)
		}
		if i == 0 || p.at < oldest {
			oldest = p.at
		}
	}
	b := appendVersionedHeader(make([]byte, 0, estimateDecisionBytes(self, parts)), decisionWireVersion, self)
	b = binary.AppendUvarint(b, epoch)
	b = binary.AppendUvarint(b, seq)
	b = binary.AppendUvarint(b, uint64(max(ttl, 0).Milliseconds()))
	b = binary.AppendUvarint(b, uint64(max(oldest, 0)))
	b = binary.AppendUvarint(b, uint64(len(ws)))
	for _, w := range ws {
		b = appendWorker(b, w)
	}
	b = binary.AppendUvarint(b, uint64(len(parts)))
	blocks := 0
	for _, p := range parts {
		b = binary.AppendUvarint(b, uint64(idx[p.w]))
		flags := byte(0)
		if p.cont {
			flags |= flagCont
		}
		if p.cont && p.anchored() {
			flags |= flagAnchored
		}
		b = append(b, flags)
		if flags&flagAnchored != 0 {
			b = binary.LittleEndian.AppendUint64(b, p.anchor)
			b = binary.AppendUvarint(b, uint64(p.prefix))
		}
		b = binary.AppendUvarint(b, uint64(len(p.hashes)))
		for _, h := range p.hashes {
			b = binary.LittleEndian.AppendUint64(b, h)
		}
		blocks += len(p.hashes)
	}
	return b, blocks
}

// decisionMessage is a decoded decision payload; hash bytes stay in the payload.
type decisionMessage struct {
	replica    string
	epoch, seq uint64
	ttl        time.Duration
	decidedUS  int64 // 0: not said (version 1)
	workers    []indexer.Worker
	entries    []decisionEntry
}

type decisionEntry struct {
	worker int
	cont   bool
	prefix int // 0: no anchor
	anchor uint64
	raw    []byte // 8 bytes per hash
}

// hashes decodes the entry's hashes into dst.
func (e decisionEntry) hashes(dst []uint64) []uint64 {
	dst = dst[:0]
	for i := 0; i+8 <= len(e.raw); i += 8 {
		dst = append(dst, binary.LittleEndian.Uint64(e.raw[i:]))
	}
	return dst
}

// decodeDecisions decodes a whole payload or nothing.
func decodeDecisions(b []byte) (decisionMessage, error) {
	r := wireReader{b: b}
	var m decisionMessage
	var version byte
	version, m.replica = r.versionedHeader(shareWireVersion, decisionWireVersion)
	m.epoch, m.seq = r.uvarint(), r.uvarint()
	ttl := r.uvarint()
	if r.err == nil && ttl > uint64(365*24*time.Hour/time.Millisecond) {
		r.fail(errShareSize, "ttl of %d ms", ttl)
	}
	m.ttl = time.Duration(ttl) * time.Millisecond
	if version >= 2 {
		us := r.uvarint()
		if r.err == nil && us > math.MaxInt64 {
			r.fail(errShareSize, "decision time %d", us)
		}
		m.decidedUS = int64(us)
	}
	nw := r.count(2)
	for range nw {
		m.workers = append(m.workers, r.worker())
	}
	ne := r.count(11) // index, flags, n and one hash
	for range ne {
		wi := r.uvarint()
		flags := r.byte()
		e := decisionEntry{worker: int(wi), cont: flags&flagCont != 0}
		known := byte(flagCont)
		if version >= 2 {
			known |= flagAnchored
		}
		if r.err == nil && flags&^known != 0 {
			r.fail(errShareDecode, "unknown flags %#x", flags)
		}
		if flags&flagAnchored != 0 {
			if flags&flagCont == 0 {
				r.fail(errShareDecode, "an anchored entry that continues nothing")
			}
			if a := r.take(8); a != nil {
				e.anchor = binary.LittleEndian.Uint64(a)
			}
			p := r.uvarint()
			if r.err == nil && (p == 0 || p > maxAnchoredPrefix) {
				r.fail(errShareSize, "anchored prefix of %d blocks", p)
			}
			e.prefix = int(p)
		}
		n := r.count(8)
		e.raw = r.take(8 * n)
		if r.err != nil {
			break
		}
		switch {
		case wi >= uint64(len(m.workers)):
			r.fail(errShareDecode, "worker index %d of %d", wi, len(m.workers))
		case n == 0:
			r.fail(errShareDecode, "empty entry")
		}
		m.entries = append(m.entries, e)
	}
	if err := r.done(); err != nil {
		return decisionMessage{}, err
	}
	return m, nil
}

// receive applies a peer's decisions to the local index. It runs on the gossip layer's
// receive path; storing a message's blocks takes microseconds per hundred.
func (d *Decisions) receive(from string, payload []byte) {
	msg, ok := admitShare(d.m, d.log, shareDecisions, d.self, from, d.cfg.Messenger.IsAlive, payload,
		decodeDecisions, func(m decisionMessage) string { return m.replica })
	if !ok {
		return
	}
	d.noteSeq(from, msg.epoch, msg.seq)
	if msg.decidedUS > 0 {
		d.m.lag.observe(d.now().Sub(time.UnixMicro(msg.decidedUS)))
	}
	var buf, chain []uint64
	for _, e := range msg.entries {
		w := msg.workers[e.worker]
		if d.cfg.Known != nil && !d.cfg.Known(w) {
			d.m.drop(shareDecisions, DropShareUnknownWorker)
			continue
		}
		buf = e.hashes(buf)
		store := buf
		d.lmu.Lock()
		expanded := false
		if e.prefix > 0 {
			// Store the whole chain, as the origin did: a suffix alone would refresh only
			// its own blocks here, and the prefix would age (and be evicted) sooner than on
			// the origin, which stored it again with this decision.
			chain, expanded = d.links.expand(chain[:0], e.anchor, e.prefix)
			if expanded {
				chain = append(chain, buf...)
				store = chain
			}
			d.m.anchors[boolIndex(expanded)].Add(1)
		}
		if expanded {
			d.links.remember(store, 0, false) // every link, into the current generation
		} else {
			d.links.remember(buf, e.anchor, e.prefix > 0)
		}
		d.lmu.Unlock()
		d.cfg.Index.Record(w, store)
		d.m.blocksIn.Add(uint64(len(buf)))
	}
}

// boolIndex is 1 for true, 0 for false.
func boolIndex(b bool) int {
	if b {
		return 1
	}
	return 0
}

// noteSeq counts the messages of a peer's incarnation that were skipped over, and those
// of them that turn up late. A message older than the newest seen is still applied: merges
// commute, so order does not matter, only loss.
func (d *Decisions) noteSeq(from string, epoch, seq uint64) {
	d.rmu.Lock()
	defer d.rmu.Unlock()
	st, ok := d.recv[from]
	switch {
	case !ok || epoch != st.epoch: // another incarnation: its sequence starts over
		d.recv[from] = recvState{epoch: epoch, seq: seq, first: seq}
	case seq > st.seq:
		d.m.gaps.Add(seq - st.seq - 1)
		st.seq = seq
		d.recv[from] = st
	case seq < st.seq && seq > st.first:
		// Older than the first message seen is no gap of ours: it was overtaken before we
		// started counting.
		d.m.late.Add(1)
	}
}

// shareBucket bounds bytes per second, allowing a second's worth in one burst; a
// perSecond of 0 allows everything. Not safe for concurrent use.
type shareBucket struct {
	perSecond int
	tokens    float64
	last      time.Time
}

func (b *shareBucket) take(now time.Time, n int) bool {
	if b.perSecond <= 0 {
		return true
	}
	if b.last.IsZero() {
		b.tokens = float64(b.perSecond)
	} else {
		b.tokens = min(float64(b.perSecond), b.tokens+now.Sub(b.last).Seconds()*float64(b.perSecond))
	}
	b.last = now
	if float64(n) > b.tokens {
		return false
	}
	b.tokens -= float64(n)
	return true
}
