package hints

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// shareKind is what a share counter is about.
type shareKind int

const (
	shareDecisions shareKind = iota
	shareLoad
	shareSnapshot
	numShareKinds
)

var shareKindNames = [numShareKinds]string{"decisions", "load", "snapshot"}

// Reasons a shared message or entry is dropped (kvrouter_share_dropped_total{reason}).
const (
	// DropShareDecode: the payload does not parse.
	DropShareDecode = "decode"
	// DropShareSize: the payload claims a size it cannot have, or is over the bound.
	DropShareSize = "size"
	// DropShareVersion: a payload version this build does not read.
	DropShareVersion = "version"
	// DropShareNonMember: the sender is not an alive member (or is this replica).
	DropShareNonMember = "non_member"
	// DropShareSender: the payload names another replica than the one that sent it.
	DropShareSender = "sender_mismatch"
	// DropShareUnknownWorker: an entry about a worker this replica does not route to.
	DropShareUnknownWorker = "unknown_worker"
	// DropShareStale: a load report older than one already applied.
	DropShareStale = "stale"
	// DropShareQueue: an outbound decision dropped because the queue was full.
	DropShareQueue = "queue_full"
	// DropShareBudget: an outbound message over this replica's byte budget.
	DropShareBudget = "budget"
	// DropShareSend: an outbound message the gossip layer refused or failed to send.
	DropShareSend = "send"
)

var shareDropReasons = [...]string{
	DropShareDecode, DropShareSize, DropShareVersion, DropShareNonMember, DropShareSender,
	DropShareUnknownWorker, DropShareStale, DropShareQueue, DropShareBudget, DropShareSend,
}

// Results of one attempt to pull an index snapshot (kvrouter_share_snapshot_attempts_total).
const (
	SnapshotOK     = "ok"     // loaded
	SnapshotCold   = "cold"   // the peer is loading its own index, or serves none
	SnapshotBroken = "broken" // the stream broke or failed its checks
	SnapshotBad    = "bad"    // whole, but it does not decode
	SnapshotError  = "error"  // anything else (unreachable, refused)
)

var snapshotResults = [...]string{SnapshotOK, SnapshotCold, SnapshotBroken, SnapshotBad, SnapshotError}

// Metrics counts what the sharing of decisions, load and index snapshots sends,
// receives and drops. One value serves all three; its methods are safe for concurrent use.
type Metrics struct {
	now     func() time.Time
	bytes   [numShareKinds][2]atomic.Uint64 // [kind][0 in, 1 out]
	msgs    [numShareKinds][2]atomic.Uint64
	rates   [numShareKinds][2]rateMeter
	dropped [numShareKinds][len(shareDropReasons)]atomic.Uint64

	blocksIn, blocksOut atomic.Uint64
	gaps, late          atomic.Uint64
	anchors             [2]atomic.Uint64 // [0 missed, 1 expanded]
	lag                 lagHistogram
	snapshots           [len(snapshotResults)]atomic.Uint64
	snapshotBytes       atomic.Int64
	warm                atomic.Bool
	remoteReplicas      atomic.Int64
}

// Stats is a snapshot of Metrics (tests, benchmarks, the admin API).
type Stats struct {
	// BytesIn, BytesOut, MessagesIn and MessagesOut are by kind: "decisions", "load",
	// "snapshot". Payload bytes only (the gossip layer's framing is its own metric).
	BytesIn, BytesOut       map[string]uint64
	MessagesIn, MessagesOut map[string]uint64
	// BytesPerSecondIn and BytesPerSecondOut are over the last whole second, by kind.
	BytesPerSecondIn, BytesPerSecondOut map[string]uint64
	// Dropped is by kind, then reason.
	Dropped map[string]map[string]uint64
	// DecisionBlocksIn and DecisionBlocksOut count block hashes applied from and sent to
	// peers; DecisionGaps counts decision messages a peer sent that had not arrived when a
	// later one did, and DecisionLate those of them that arrived after all (and were
	// applied): small batches go as UDP packets and big ones over TCP, so they overtake one
	// another. DecisionGaps - DecisionLate were lost.
	DecisionBlocksIn, DecisionBlocksOut, DecisionGaps, DecisionLate uint64
	// DecisionAnchorsExpanded counts received suffixes stored as their whole chain, and
	// DecisionAnchorsMissed those stored alone because a block of the chain before them
	// was not known here (lost, forgotten, or a long decision's pieces arriving tail first).
	DecisionAnchorsExpanded, DecisionAnchorsMissed uint64
	// DecisionLag is the delay from a message's oldest decision, on the replica that made
	// it, to its arrival here (so it includes the two replicas' clock offset).
	DecisionLag LagHistogram
	// Snapshots counts snapshot pulls by result.
	Snapshots map[string]uint64
	// SnapshotBytes is the size of the last snapshot loaded.
	SnapshotBytes int64
	Warm          bool
	// RemoteLoadReplicas is how many other replicas' load shares are live.
	RemoteLoadReplicas int64
}

// NewMetrics returns the counters, registered with reg unless it is nil.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{now: time.Now}
	if reg != nil {
		if err := reg.Register(newShareCollector(m)); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// orNewMetrics is m, or an unregistered set when m is nil.
func orNewMetrics(m *Metrics) *Metrics {
	if m != nil {
		return m
	}
	return &Metrics{now: time.Now}
}

func (m *Metrics) in(k shareKind, n int) {
	m.bytes[k][0].Add(uint64(n))
	m.msgs[k][0].Add(1)
	m.rates[k][0].add(m.now(), n)
}

func (m *Metrics) out(k shareKind, n int) {
	m.bytes[k][1].Add(uint64(n))
	m.msgs[k][1].Add(1)
	m.rates[k][1].add(m.now(), n)
}

func (m *Metrics) drop(k shareKind, reason string) { m.dropN(k, reason, 1) }

func (m *Metrics) dropN(k shareKind, reason string, n int) {
	for i, r := range shareDropReasons {
		if r == reason {
			m.dropped[k][i].Add(uint64(n))
			return
		}
	}
	m.dropped[k][0].Add(uint64(n))
}

func (m *Metrics) snapshot(result string) {
	for i, r := range snapshotResults {
		if r == result {
			m.snapshots[i].Add(1)
			return
		}
	}
}

// Stats returns the current values.
func (m *Metrics) Stats() Stats {
	now := m.now()
	s := Stats{
		BytesIn: map[string]uint64{}, BytesOut: map[string]uint64{},
		MessagesIn: map[string]uint64{}, MessagesOut: map[string]uint64{},
		BytesPerSecondIn: map[string]uint64{}, BytesPerSecondOut: map[string]uint64{},
		Dropped:          map[string]map[string]uint64{},
		DecisionBlocksIn: m.blocksIn.Load(), DecisionBlocksOut: m.blocksOut.Load(), DecisionGaps: m.gaps.Load(), DecisionLate: m.late.Load(),
		DecisionAnchorsExpanded: m.anchors[1].Load(), DecisionAnchorsMissed: m.anchors[0].Load(),
		DecisionLag:   m.lag.snapshot(),
		Snapshots:     map[string]uint64{},
		SnapshotBytes: m.snapshotBytes.Load(), Warm: m.warm.Load(),
		RemoteLoadReplicas: m.remoteReplicas.Load(),
	}
	for k, name := range shareKindNames {
		s.BytesIn[name], s.BytesOut[name] = m.bytes[k][0].Load(), m.bytes[k][1].Load()
		s.MessagesIn[name], s.MessagesOut[name] = m.msgs[k][0].Load(), m.msgs[k][1].Load()
		s.BytesPerSecondIn[name], s.BytesPerSecondOut[name] = m.rates[k][0].perSecond(now), m.rates[k][1].perSecond(now)
		s.Dropped[name] = map[string]uint64{}
		for i, r := range shareDropReasons {
			if v := m.dropped[k][i].Load(); v > 0 {
				s.Dropped[name][r] = v
			}
		}
	}
	for i, r := range snapshotResults {
		s.Snapshots[r] = m.snapshots[i].Load()
	}
	return s
}

// rateMeter counts bytes per whole second: the current second's and the last one's.
type rateMeter struct {
	mu        sync.Mutex
	sec       int64
	cur, prev uint64
}

func (r *rateMeter) rollLocked(now time.Time) {
	s := now.Unix()
	switch {
	case s == r.sec:
	case s == r.sec+1:
		r.prev, r.cur, r.sec = r.cur, 0, s
	default:
		r.prev, r.cur, r.sec = 0, 0, s
	}
}

func (r *rateMeter) add(now time.Time, n int) {
	r.mu.Lock()
	r.rollLocked(now)
	r.cur += uint64(n)
	r.mu.Unlock()
}

// perSecond is the count of the last whole second.
func (r *rateMeter) perSecond(now time.Time) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rollLocked(now)
	return r.prev
}

// shareCollector exposes Metrics to Prometheus.
type shareCollector struct {
	m                                                   *Metrics
	bytes, msgs, rate, dropped, blocks, gaps, snapshots *prometheus.Desc
	late, snapshotBytes, warm, replicas                 *prometheus.Desc
	anchors, lag                                        *prometheus.Desc
}

func newShareCollector(m *Metrics) *shareCollector {
	kd := []string{"kind", "direction"}
	return &shareCollector{
		m:             m,
		bytes:         prometheus.NewDesc("kvrouter_share_bytes_total", "Payload bytes of shared decisions, load reports and index snapshots, by kind and direction.", kd, nil),
		msgs:          prometheus.NewDesc("kvrouter_share_messages_total", "Shared messages (snapshot: whole snapshots), by kind and direction.", kd, nil),
		rate:          prometheus.NewDesc("kvrouter_share_bytes_per_second", "Payload bytes shared over the last whole second, by kind and direction.", kd, nil),
		dropped:       prometheus.NewDesc("kvrouter_share_dropped_total", "Shared messages or entries dropped, by kind and reason.", []string{"kind", "reason"}, nil),
		blocks:        prometheus.NewDesc("kvrouter_share_decision_blocks_total", "Block hashes of routing decisions sent to peers (out) and applied from them (in).", []string{"direction"}, nil),
		gaps:          prometheus.NewDesc("kvrouter_share_decision_gaps_total", "Decision messages of peers that had not arrived when a later one did (sequence gaps).", nil, nil),
		late:          prometheus.NewDesc("kvrouter_share_decision_late_total", "Decision messages of peers that arrived after a later one (counted in the gaps first, then applied); gaps minus late were lost.", nil, nil),
		snapshots:     prometheus.NewDesc("kvrouter_share_snapshot_attempts_total", "Attempts to pull an index snapshot from a peer, by result.", []string{"result"}, nil),
		snapshotBytes: prometheus.NewDesc("kvrouter_share_snapshot_bytes", "Size of the last index snapshot loaded.", nil, nil),
		warm:          prometheus.NewDesc("kvrouter_share_index_warm", "1 once the index holds a peer's snapshot (or there was none to pull).", nil, nil),
		replicas:      prometheus.NewDesc("kvrouter_share_remote_load_replicas", "Other replicas whose load shares are live here.", nil, nil),
		anchors:       prometheus.NewDesc("kvrouter_share_decision_anchors_total", "Received decision suffixes, by whether they were stored as their whole chain (expanded) or alone (missed: the chain before them was not known here).", []string{"result"}, nil),
		lag:           prometheus.NewDesc("kvrouter_share_decision_lag_seconds", "Delay from the oldest decision of a peer's message, on the peer, to its arrival here (includes the clocks' offset).", nil, nil),
	}
}

func (c *shareCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.bytes, c.msgs, c.rate, c.dropped, c.blocks, c.gaps, c.late, c.snapshots, c.snapshotBytes, c.warm, c.replicas, c.anchors, c.lag} {
		ch <- d
	}
}

func (c *shareCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.m.Stats()
	for _, k := range shareKindNames {
		for _, d := range []struct {
			dir                string
			bytes, msgs, rates map[string]uint64
		}{{"in", s.BytesIn, s.MessagesIn, s.BytesPerSecondIn}, {"out", s.BytesOut, s.MessagesOut, s.BytesPerSecondOut}} {
			ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(d.bytes[k]), k, d.dir)
			ch <- prometheus.MustNewConstMetric(c.msgs, prometheus.CounterValue, float64(d.msgs[k]), k, d.dir)
			ch <- prometheus.MustNewConstMetric(c.rate, prometheus.GaugeValue, float64(d.rates[k]), k, d.dir)
		}
		for _, r := range shareDropReasons {
			ch <- prometheus.MustNewConstMetric(c.dropped, prometheus.CounterValue, float64(s.Dropped[k][r]), k, r)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.blocks, prometheus.CounterValue, float64(s.DecisionBlocksIn), "in")
	ch <- prometheus.MustNewConstMetric(c.blocks, prometheus.CounterValue, float64(s.DecisionBlocksOut), "out")
	ch <- prometheus.MustNewConstMetric(c.gaps, prometheus.CounterValue, float64(s.DecisionGaps))
	ch <- prometheus.MustNewConstMetric(c.late, prometheus.CounterValue, float64(s.DecisionLate))
	ch <- prometheus.MustNewConstMetric(c.anchors, prometheus.CounterValue, float64(s.DecisionAnchorsExpanded), "expanded")
	ch <- prometheus.MustNewConstMetric(c.anchors, prometheus.CounterValue, float64(s.DecisionAnchorsMissed), "missed")
	ch <- s.DecisionLag.metric(c.lag)
	for _, r := range snapshotResults {
		ch <- prometheus.MustNewConstMetric(c.snapshots, prometheus.CounterValue, float64(s.Snapshots[r]), r)
	}
	ch <- prometheus.MustNewConstMetric(c.snapshotBytes, prometheus.GaugeValue, float64(s.SnapshotBytes))
	warm := 0.0
	if s.Warm {
		warm = 1
	}
	ch <- prometheus.MustNewConstMetric(c.warm, prometheus.GaugeValue, warm)
	ch <- prometheus.MustNewConstMetric(c.replicas, prometheus.GaugeValue, float64(s.RemoteLoadReplicas))
}

// lagBounds are the upper bounds of the decision lag histogram's buckets.
var lagBounds = [...]time.Duration{
	500 * time.Microsecond, time.Millisecond, 2 * time.Millisecond, 3 * time.Millisecond,
	5 * time.Millisecond, 7500 * time.Microsecond, 10 * time.Millisecond, 15 * time.Millisecond,
	20 * time.Millisecond, 30 * time.Millisecond, 40 * time.Millisecond, 50 * time.Millisecond,
	60 * time.Millisecond, 75 * time.Millisecond, 100 * time.Millisecond, 150 * time.Millisecond,
	200 * time.Millisecond, 300 * time.Millisecond, 500 * time.Millisecond, time.Second,
	2 * time.Second, 5 * time.Second,
}

// lagHistogram counts delays into lagBounds' buckets, the last one unbounded.
type lagHistogram struct {
	counts [len(lagBounds) + 1]atomic.Uint64
	sumUS  atomic.Uint64
}

func (h *lagHistogram) observe(d time.Duration) {
	d = max(d, 0)
	i := 0
	for i < len(lagBounds) && d > lagBounds[i] {
		i++
	}
	h.counts[i].Add(1)
	h.sumUS.Add(uint64(d.Microseconds()))
}

func (h *lagHistogram) snapshot() LagHistogram {
	var s LagHistogram
	for i := range h.counts {
		s.Counts[i] = h.counts[i].Load()
	}
	s.Sum = time.Duration(h.sumUS.Load()) * time.Microsecond
	return s
}

// LagHistogram is a snapshot of a delay histogram: Counts[i] delays of at most
// LagBounds()[i] and more than the bound before (the last, more than every bound).
type LagHistogram struct {
	Counts [len(lagBounds) + 1]uint64
	Sum    time.Duration
}

// LagBounds returns the histogram's bucket bounds.
func LagBounds() []time.Duration { return append([]time.Duration(nil), lagBounds[:]...) }

// Total is how many delays the histogram holds.
func (h LagHistogram) Total() uint64 {
	var n uint64
	for _, c := range h.Counts {
		n += c
	}
	return n
}

// Since returns the delays observed after earlier, a snapshot of the same histogram.
func (h LagHistogram) Since(earlier LagHistogram) LagHistogram {
	for i := range h.Counts {
		h.Counts[i] -= min(earlier.Counts[i], h.Counts[i])
	}
	h.Sum -= min(earlier.Sum, h.Sum)
	return h
}

// Add returns the sum of two histograms (several replicas' together).
func (h LagHistogram) Add(o LagHistogram) LagHistogram {
	for i := range h.Counts {
		h.Counts[i] += o.Counts[i]
	}
	h.Sum += o.Sum
	return h
}

// Quantile is the upper bound of the bucket that holds the q-quantile (0 < q <= 1); -1 when
// the histogram is empty or the quantile lies past the last bound.
func (h LagHistogram) Quantile(q float64) time.Duration {
	total := h.Total()
	if total == 0 {
		return -1
	}
	rank := uint64(math.Ceil(q * float64(total)))
	var seen uint64
	for i, c := range h.Counts {
		seen += c
		if seen >= max(rank, 1) {
			if i == len(lagBounds) {
				return -1
			}
			return lagBounds[i]
		}
	}
	return -1
}

func (h LagHistogram) metric(d *prometheus.Desc) prometheus.Metric {
	buckets := make(map[float64]uint64, len(lagBounds))
	var cum uint64
	for i, b := range lagBounds {
		cum += h.Counts[i]
		buckets[b.Seconds()] = cum
	}
	return prometheus.MustNewConstHistogram(d, h.Total(), h.Sum.Seconds(), buckets)
}
