package kvevents

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the subscribers' instruments. One set serves every Subscriber of a process (they
// are labelled by worker), so create it once and pass it to each Config.
type Metrics struct {
	decodeErrors      *prometheus.CounterVec
	gaps              *prometheus.CounterVec
	missed            *prometheus.CounterVec
	replays           *prometheus.CounterVec
	replayed          *prometheus.CounterVec
	restarts          *prometheus.CounterVec
	unknownParent     *prometheus.CounterVec
	unknownRemoved    *prometheus.CounterVec
	blockSizeMismatch *prometheus.CounterVec
	overCapacity      *prometheus.CounterVec
	otherGroup        *prometheus.CounterVec
	unknownPublisher  prometheus.Counter
	refused           *prometheus.CounterVec
	events            *prometheus.CounterVec
	blocks            *prometheus.CounterVec
	connects          *prometheus.CounterVec
	lastSeq           *prometheus.GaugeVec
	silence           *prometheus.GaugeVec
}

// NewMetrics creates the instruments and registers them with reg unless reg is nil.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_kvevents_" + name, Help: help}, labels)
	}
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_kvevents_" + name, Help: help}, []string{"worker"})
	}
	m := &Metrics{
		decodeErrors: counter("dropped_messages_total",
			"Messages dropped as bad input, by cause (frame, malformed, unknown_event, wrong_type, too_large).", "worker", "cause"),
		gaps:     counter("gaps_total", "Jumps in a worker's sequence numbers.", "worker"),
		missed:   counter("missed_messages_total", "Messages lost in gaps and not recovered by replay.", "worker"),
		replays:  counter("replays_total", "Replay requests, by result (ok, partial, error; skipped: not asked, waiting after failures).", "worker", "result"),
		replayed: counter("replayed_messages_total", "Messages recovered through the replay socket.", "worker"),
		restarts: counter("restarts_total", "Purges of the worker from the index: engine restarts (the sequence went back, the replay holds another message at the last sequence, a gap on a new connection nothing explains) and messages too large to apply.", "worker"),
		unknownParent: counter("unknown_parent_total",
			"BlockStored events dropped because their parent block was never seen.", "worker"),
		unknownRemoved: counter("unknown_removed_blocks_total",
			"BlockRemoved hashes that were never stored or already forgotten.", "worker"),
		blockSizeMismatch: counter("block_size_mismatch_total",
			"BlockStored events dropped because their block size is not the router's.", "worker"),
		overCapacity: counter("over_capacity_blocks_total",
			"Stored (or restored from a peer's snapshot) blocks dropped because the worker's engine-hash map was full.", "worker"),
		otherGroup: counter("other_group_events_total",
			"Events of KV cache groups that do not feed the index (a hybrid model's sliding-window or Mamba groups).", "worker"),
		unknownPublisher: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvrouter_kvevents_unknown_publisher_total",
			Help: "Messages on a shared socket whose topic names no configured worker.",
		}),
		refused: counter("refused_connections_total",
			"Publisher connections refused at accept or failed later, by reason (not_a_worker, too_many_connections, wrong_worker, too_large, slow_message, handshake).", "reason"),
		events:   counter("events_applied_total", "KV events applied to the index.", "worker"),
		blocks:   counter("blocks_applied_total", "Blocks stored or removed in the index by KV events.", "worker"),
		connects: counter("connects_total", "Connections (or binds) to an event endpoint, by result (ok, error, lost).", "endpoint", "result"),
		lastSeq:  gauge("last_sequence", "Last sequence number applied per worker."),
		silence:  gauge("seconds_since_last_message", "Seconds since the worker's last event message."),
	}
	if reg == nil {
		return m, nil
	}
	var errs []error
	for _, c := range []prometheus.Collector{m.decodeErrors, m.gaps, m.missed, m.replays, m.replayed, m.restarts,
		m.unknownParent, m.unknownRemoved, m.blockSizeMismatch, m.overCapacity, m.otherGroup, m.unknownPublisher, m.refused, m.events,
		m.blocks, m.connects, m.lastSeq, m.silence} {
		errs = append(errs, reg.Register(c))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("kvevents: register metrics: %w", err)
	}
	return m, nil
}

// counts adds what a translator did to the worker's counters.
func (m *Metrics) counts(worker string, c Counts) {
	add := func(v *prometheus.CounterVec, n int) {
		if n > 0 {
			v.WithLabelValues(worker).Add(float64(n))
		}
	}
	add(m.events, c.Events)
	add(m.blocks, c.Blocks)
	add(m.unknownParent, c.UnknownParent)
	add(m.unknownRemoved, c.UnknownRemoved)
	add(m.blockSizeMismatch, c.BlockSizeMismatch)
	add(m.overCapacity, c.OverCapacity)
	add(m.otherGroup, c.OtherGroup)
}
