package hints

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// Index snapshots. A replica that starts (joins, or restarts after a crash) has an empty
// index, and until its own decisions and the peers' refill it, it routes blind: every
// prompt looks new. So before it reports ready it pulls a whole snapshot of a live peer's
// indexes over the peer port (IndexSnapshot, a server stream with a CRC trailer, see
// transport/peer) and loads it. Decisions gossiped meanwhile are applied as they arrive,
// so the snapshot and the stream together leave nothing out.
//
// A stream that breaks, fails its checks or does not decode is thrown away whole and the
// next peer is tried (peers in a random rotation, then again after a backoff); the replica
// stays unready until one whole snapshot is loaded. Two cases end the wait without one:
// no peer appears within DiscoveryWait (the first replica of a cluster), or every peer
// answers that it is itself not warm or serves no snapshots (all replicas restarted
// together: there is nothing to pull). A replica that is not warm refuses to serve a
// snapshot, so that a peer never loads a partial one from it.

// Defaults of IndexSyncConfig.
const (
	DefaultSnapshotDiscovery = 3 * time.Second
	DefaultSnapshotAttempt   = time.Minute
	DefaultSnapshotServing   = 2
)

// Snapshot container, version 1: "KVSS", version byte, then sections, each a kind byte, a
// uvarint length and the section's bytes, ended by kind 0. Unknown kinds are skipped, so a
// newer peer may add sections.
const (
	containerMagic   = "KVSS"
	containerVersion = 1

	sectionEnd        = 0
	sectionApprox     = 1 // indexer snapshot of the approximate index
	sectionPrecise    = 2 // indexer snapshot of the precise (KV events) index
	sectionEngineMaps = 3 // precise mode's engine hash -> router key maps
)

// EngineMaps is precise mode's per-worker maps from engine block hash to router key (kept
// by transport/kvevents), snapshotted with the index so that a restarted replica can still
// resolve BlockRemoved events of blocks stored before it started.
type EngineMaps interface {
	// SnapshotEngineMaps copies every worker's map.
	SnapshotEngineMaps(ctx context.Context) (map[indexer.Worker]map[uint64]uint64, error)
	// RestoreEngineMaps merges maps into the workers' maps.
	RestoreEngineMaps(maps map[indexer.Worker]map[uint64]uint64) error
}

// SnapshotPeer is a replica to pull a snapshot from.
type SnapshotPeer struct {
	ID   string
	Addr string // its peer port
}

// IndexSyncConfig configures index snapshots.
type IndexSyncConfig struct {
	// Self is this replica's id (it is never pulled from).
	Self string
	// Approx is the approximate index (required).
	Approx *indexer.Index
	// Precise is the index the KV events feed (nil without precise mode).
	Precise *indexer.Index
	// EngineMaps are precise mode's engine-hash maps (nil: not snapshotted).
	EngineMaps EngineMaps
	// Peers lists the replicas to pull from (required); GossipPeers gives the alive
	// gossip members.
	Peers func() []SnapshotPeer
	// Fetch pulls one whole, checked snapshot from a peer port (required); PoolFetcher
	// gives one over the peer gRPC pool.
	Fetch func(ctx context.Context, addr string) ([]byte, error)
	// DiscoveryWait is how long to wait for a peer to appear before starting empty
	// (default 3 s).
	DiscoveryWait time.Duration
	// AttemptTimeout bounds one pull (default 1 min).
	AttemptTimeout time.Duration
	// MinBackoff and MaxBackoff bound the wait between rounds of pulls (100 ms .. 2 s).
	MinBackoff, MaxBackoff time.Duration
	// MaxServing bounds the snapshots this replica serves at once (default 2); more are
	// refused as unavailable, and the asking replica tries another peer.
	MaxServing int
	// Metrics receives the counters (nil: a private set).
	Metrics *Metrics
	// Logger logs (nil: discarded).
	Logger *slog.Logger

	now func() time.Time // tests; nil: time.Now
}

// IndexSync pulls an index snapshot on start and serves this replica's to others. It
// implements peer.SnapshotSource.
type IndexSync struct {
	cfg     IndexSyncConfig
	log     *slog.Logger
	m       *Metrics
	warm    atomic.Bool
	warmed  chan struct{}
	serving chan struct{} // a semaphore of MaxServing
}

var _ peer.SnapshotSource = (*IndexSync)(nil)

// NewIndexSync checks cfg and returns a cold IndexSync; Run warms it.
func NewIndexSync(cfg IndexSyncConfig) (*IndexSync, error) {
	if cfg.Approx == nil || cfg.Peers == nil || cfg.Fetch == nil {
		return nil, errors.New("cluster: index sync needs the approximate index, peers and a fetcher")
	}
	if cfg.DiscoveryWait <= 0 {
		cfg.DiscoveryWait = DefaultSnapshotDiscovery
	}
	if cfg.AttemptTimeout <= 0 {
		cfg.AttemptTimeout = DefaultSnapshotAttempt
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = 100 * time.Millisecond
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(2*time.Second, cfg.MinBackoff)
	}
	if cfg.MaxServing <= 0 {
		cfg.MaxServing = DefaultSnapshotServing
	}
	if cfg.now == nil {
		cfg.now = time.Now
	}
	s := &IndexSync{
		cfg:     cfg,
		log:     cfg.Logger,
		m:       orNewMetrics(cfg.Metrics),
		warmed:  make(chan struct{}),
		serving: make(chan struct{}, cfg.MaxServing),
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	return s, nil
}

// Warm reports whether the index holds a peer's whole snapshot, or there was none to
// pull. Readiness should wait for it.
func (s *IndexSync) Warm() bool { return s.warm.Load() }

// Warmed is closed once Warm turns true.
func (s *IndexSync) Warmed() <-chan struct{} { return s.warmed }

func (s *IndexSync) setWarm() {
	if s.warm.CompareAndSwap(false, true) {
		s.m.warm.Store(true)
		close(s.warmed)
	}
}

// Run pulls a snapshot until one is loaded (or there is none to pull) and returns nil;
// it also returns nil, still cold, when ctx ends.
func (s *IndexSync) Run(ctx context.Context) error {
	start := s.cfg.now()
	backoff := s.cfg.MinBackoff
	for !s.Warm() {
		peers := s.peers()
		waited := s.cfg.now().Sub(start) >= s.cfg.DiscoveryWait
		if len(peers) == 0 {
			if waited {
				s.log.Info("no peer to pull the index from: starting with an empty index")
				s.setWarm()
				return nil
			}
			if !shareSleep(ctx, s.cfg.MinBackoff) {
				return nil
			}
			continue
		}
		cold := 0
		off := rand.IntN(len(peers))
		for i := range peers {
			p := peers[(off+i)%len(peers)]
			began := s.cfg.now()
			result, n, err := s.pull(ctx, p)
			s.m.snapshot(result)
			if result == SnapshotOK {
				s.log.Info("index snapshot loaded", "from", p.ID, "bytes", n,
					"approx_entries", s.cfg.Approx.Len(), "took", s.cfg.now().Sub(began).Round(time.Millisecond))
				s.setWarm()
				return nil
			}
			if ctx.Err() != nil {
				return nil
			}
			if result == SnapshotCold {
				cold++
				s.log.Debug("peer cannot serve an index snapshot yet", "peer", p.ID, "err", err)
				continue
			}
			s.log.Warn("pulling the index snapshot failed; trying another peer", "peer", p.ID, "result", result, "err", err)
		}
		if cold == len(peers) && waited {
			s.log.Info("every peer is loading its own index too: starting with an empty index", "peers", len(peers))
			s.setWarm()
			return nil
		}
		if !shareSleep(ctx, backoff) {
			return nil
		}
		backoff = min(2*backoff, s.cfg.MaxBackoff)
	}
	return nil
}

// peers returns the configured peers other than this replica, with an address.
func (s *IndexSync) peers() []SnapshotPeer {
	var out []SnapshotPeer
	for _, p := range s.cfg.Peers() {
		if p.ID != s.cfg.Self && p.Addr != "" {
			out = append(out, p)
		}
	}
	return out
}

// pull fetches and loads one peer's snapshot; it returns the result for the counters and
// the snapshot's size.
func (s *IndexSync) pull(ctx context.Context, p SnapshotPeer) (string, int, error) {
	actx, cancel := context.WithTimeout(ctx, s.cfg.AttemptTimeout)
	data, err := s.cfg.Fetch(actx, p.Addr)
	cancel()
	if err != nil {
		switch {
		case errors.Is(err, peer.ErrNotWarm), status.Code(err) == codes.Unimplemented:
			return SnapshotCold, 0, err
		case errors.Is(err, peer.ErrSnapshotBroken):
			return SnapshotBroken, 0, err
		}
		return SnapshotError, 0, err
	}
	if err := s.load(data); err != nil {
		return SnapshotBad, len(data), err
	}
	s.m.in(shareSnapshot, len(data))
	s.m.snapshotBytes.Store(int64(len(data)))
	return SnapshotOK, len(data), nil
}

// load decodes every section first and loads only if all of them decode.
func (s *IndexSync) load(data []byte) error {
	var (
		approx, precise *indexer.Snapshot
		maps            map[indexer.Worker]map[uint64]uint64
	)
	err := readContainer(data, func(kind byte, body []byte) error {
		var err error
		switch kind {
		case sectionApprox:
			approx, err = indexer.DecodeSnapshot(body)
		case sectionPrecise:
			if s.cfg.Precise != nil {
				precise, err = indexer.DecodeSnapshot(body)
			}
		case sectionEngineMaps:
			if s.cfg.EngineMaps != nil {
				maps, err = decodeEngineMaps(body)
			}
		}
		return err
	})
	if err != nil {
		return err
	}
	if approx != nil {
		s.cfg.Approx.Restore(approx)
	}
	if precise != nil {
		s.cfg.Precise.Restore(precise)
	}
	if maps != nil {
		if err := s.cfg.EngineMaps.RestoreEngineMaps(maps); err != nil {
			// The indexes are loaded; without the maps, removals of those blocks go
			// unresolved (counted by kvevents) until the engines clear or restart.
			s.log.Warn("restoring the engine-hash maps", "err", err)
		}
	}
	return nil
}

// WriteIndexSnapshot implements peer.SnapshotSource: the container with this replica's
// indexes. A replica that is not warm refuses (peer.ErrNotWarm).
func (s *IndexSync) WriteIndexSnapshot(ctx context.Context, w io.Writer) error {
	if !s.Warm() {
		return fmt.Errorf("cluster: %w", peer.ErrNotWarm)
	}
	select {
	case s.serving <- struct{}{}:
		defer func() { <-s.serving }()
	default:
		return fmt.Errorf("cluster: already serving %d index snapshots: %w", s.cfg.MaxServing, peer.ErrUnavailable)
	}
	cw := &shareCountingWriter{w: w}
	if _, err := cw.Write(append([]byte(containerMagic), containerVersion)); err != nil {
		return err
	}
	var buf bytes.Buffer
	section := func(kind byte, fill func(*bytes.Buffer) error) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		buf.Reset()
		if err := fill(&buf); err != nil {
			return err
		}
		head := binary.AppendUvarint([]byte{kind}, uint64(buf.Len()))
		if _, err := cw.Write(head); err != nil {
			return err
		}
		_, err := cw.Write(buf.Bytes())
		return err
	}
	if err := section(sectionApprox, func(b *bytes.Buffer) error { return s.cfg.Approx.WriteSnapshot(b) }); err != nil {
		return fmt.Errorf("cluster: approximate index snapshot: %w", err)
	}
	if s.cfg.Precise != nil {
		if err := section(sectionPrecise, func(b *bytes.Buffer) error { return s.cfg.Precise.WriteSnapshot(b) }); err != nil {
			return fmt.Errorf("cluster: precise index snapshot: %w", err)
		}
	}
	if s.cfg.EngineMaps != nil {
		err := section(sectionEngineMaps, func(b *bytes.Buffer) error {
			maps, err := s.cfg.EngineMaps.SnapshotEngineMaps(ctx)
			if err != nil {
				return err
			}
			b.Write(encodeEngineMaps(maps))
			return nil
		})
		if err != nil {
			return fmt.Errorf("cluster: engine-hash maps snapshot: %w", err)
		}
	}
	if _, err := cw.Write([]byte{sectionEnd}); err != nil {
		return err
	}
	s.m.out(shareSnapshot, int(cw.n))
	return nil
}

type shareCountingWriter struct {
	w io.Writer
	n int64
}

func (c *shareCountingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// errBadContainer marks a snapshot container that does not decode.
var errBadContainer = errors.New("cluster: bad index snapshot container")

// readContainer calls fn for each section of a whole container.
func readContainer(b []byte, fn func(kind byte, body []byte) error) error {
	if len(b) < len(containerMagic)+1 || string(b[:len(containerMagic)]) != containerMagic {
		return fmt.Errorf("%w: no header", errBadContainer)
	}
	if v := b[len(containerMagic)]; v != containerVersion {
		return fmt.Errorf("%w: version %d, this build reads %d", errBadContainer, v, containerVersion)
	}
	r := wireReader{b: b[len(containerMagic)+1:]}
	for {
		kind := r.byte()
		if r.err != nil {
			return fmt.Errorf("%w: %w", errBadContainer, r.err)
		}
		if kind == sectionEnd {
			break
		}
		n := r.uvarint()
		if r.err == nil && n > uint64(len(r.b)) {
			r.fail(errShareSize, "section of %d bytes with %d left", n, len(r.b))
		}
		body := r.take(int(n))
		if r.err != nil {
			return fmt.Errorf("%w: %w", errBadContainer, r.err)
		}
		if err := fn(kind, body); err != nil {
			return fmt.Errorf("%w: section %d: %w", errBadContainer, kind, err)
		}
	}
	if err := r.done(); err != nil {
		return fmt.Errorf("%w: %w", errBadContainer, err)
	}
	return nil
}

// Engine maps section: workers (uvarint count), each: worker (id, dp rank), n (uvarint),
// n pairs of engine hash and router key (8 bytes each, LE).

func encodeEngineMaps(maps map[indexer.Worker]map[uint64]uint64) []byte {
	var b []byte
	n := 0
	for w := range maps {
		if len(w.ID) > 0 && len(w.ID) <= maxShareIDLen {
			n++
		}
	}
	b = binary.AppendUvarint(b, uint64(n))
	for w, m := range maps {
		if len(w.ID) == 0 || len(w.ID) > maxShareIDLen {
			continue
		}
		b = appendWorker(b, w)
		b = binary.AppendUvarint(b, uint64(len(m)))
		for k, v := range m {
			b = binary.LittleEndian.AppendUint64(b, k)
			b = binary.LittleEndian.AppendUint64(b, v)
		}
	}
	return b
}

func decodeEngineMaps(b []byte) (map[indexer.Worker]map[uint64]uint64, error) {
	r := wireReader{b: b}
	nw := r.count(3)
	out := make(map[indexer.Worker]map[uint64]uint64, nw)
	for range nw {
		w := r.worker()
		n := r.count(16)
		raw := r.take(16 * n)
		if r.err != nil {
			break
		}
		m := make(map[uint64]uint64, n)
		for i := 0; i < len(raw); i += 16 {
			m[binary.LittleEndian.Uint64(raw[i:])] = binary.LittleEndian.Uint64(raw[i+8:])
		}
		out[w] = m
	}
	if err := r.done(); err != nil {
		return nil, err
	}
	return out, nil
}

// GossipPeers lists the alive gossip members other than this replica, at the peer
// addresses they advertise.
func GossipPeers(m Messenger) func() []SnapshotPeer {
	return func() []SnapshotPeer {
		var out []SnapshotPeer
		for _, mb := range alivePeers(m) {
			out = append(out, SnapshotPeer{ID: mb.Name, Addr: mb.Meta.PeerAddr})
		}
		return out
	}
}

// PoolFetcher pulls snapshots over the peer gRPC pool, refusing any over maxBytes
// (0: peer.DefaultMaxSnapshotBytes).
func PoolFetcher(pool *peer.Pool, self string, maxBytes int64) func(ctx context.Context, addr string) ([]byte, error) {
	return func(ctx context.Context, addr string) ([]byte, error) {
		c, err := pool.Get(addr)
		if err != nil {
			return nil, err
		}
		return c.IndexSnapshot(ctx, self, maxBytes)
	}
}

// shareSleep waits d or until ctx ends; false means ctx ended.
func shareSleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
