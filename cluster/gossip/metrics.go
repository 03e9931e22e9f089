package gossip

import (
	"bytes"
	"context"
	"log"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Stats is a snapshot of the gossip counters (tests, benchmarks, the admin API).
type Stats struct {
	// BytesIn and BytesOut count every byte on the gossip port, memberlist's own probes and
	// state exchange included (UDP payloads and TCP stream bytes).
	BytesIn, BytesOut uint64
	// PayloadBytesOut counts the frames charged to the budget (broadcast transmissions,
	// sends and push/pull state).
	PayloadBytesOut uint64
	// MessagesIn counts frames delivered to handlers; MessagesOut frames sent (a broadcast
	// counts once per transmission).
	MessagesIn, MessagesOut uint64
	// Dropped counts dropped messages by reason (the Drop* constants).
	Dropped map[string]uint64
	// QueuedBroadcasts is how many broadcasts wait for transmission.
	QueuedBroadcasts int
}

// counters are the live values behind Stats and the Prometheus metrics.
type counters struct {
	bytesIn, bytesOut, payloadOut atomic.Uint64
	msgsIn, msgsOut               atomic.Uint64
	dropped                       [len(dropReasons)]atomic.Uint64
	// lastKeyWarn is when a key mismatch was last logged (unix nanoseconds): a replica with
	// the wrong key sends a packet per probe, and one line per packet would flood the log.
	lastKeyWarn atomic.Int64
}

func (c *counters) drop(reason string) {
	for i, r := range dropReasons {
		if r == reason {
			c.dropped[i].Add(1)
			return
		}
	}
	c.dropped[0].Add(1)
}

// collector exposes the counters and member states to Prometheus.
type collector struct {
	g                                            *Gossip
	bytes, msgs, dropped, members, budget, queue *prometheus.Desc
}

func newCollector(g *Gossip) *collector {
	return &collector{
		g:       g,
		bytes:   prometheus.NewDesc("kvrouter_gossip_bytes_total", "Bytes on the gossip port (memberlist protocol and messages), by direction.", []string{"direction"}, nil),
		msgs:    prometheus.NewDesc("kvrouter_gossip_messages_total", "Gossip messages delivered (in) or transmitted (out).", []string{"direction"}, nil),
		dropped: prometheus.NewDesc("kvrouter_gossip_dropped_total", "Gossip messages dropped, by reason.", []string{"reason"}, nil),
		members: prometheus.NewDesc("kvrouter_gossip_members", "Known gossip members, by state.", []string{"state"}, nil),
		budget:  prometheus.NewDesc("kvrouter_gossip_budget_bytes_per_second", "Outbound byte budget for gossip messages.", nil, nil),
		queue:   prometheus.NewDesc("kvrouter_gossip_broadcast_queue", "Broadcasts waiting for transmission.", nil, nil),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.bytes, c.msgs, c.dropped, c.members, c.budget, c.queue} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	s := c.g.Stats()
	ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(s.BytesIn), "in")
	ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(s.BytesOut), "out")
	ch <- prometheus.MustNewConstMetric(c.msgs, prometheus.CounterValue, float64(s.MessagesIn), "in")
	ch <- prometheus.MustNewConstMetric(c.msgs, prometheus.CounterValue, float64(s.MessagesOut), "out")
	for _, r := range dropReasons {
		ch <- prometheus.MustNewConstMetric(c.dropped, prometheus.CounterValue, float64(s.Dropped[r]), r)
	}
	var byState [4]int
	for _, m := range c.g.Members() {
		byState[m.State]++
	}
	for st, n := range byState {
		ch <- prometheus.MustNewConstMetric(c.members, prometheus.GaugeValue, float64(n), State(st).String())
	}
	ch <- prometheus.MustNewConstMetric(c.budget, prometheus.GaugeValue, float64(c.g.cfg.MaxBytesPerSecond))
	ch <- prometheus.MustNewConstMetric(c.queue, prometheus.GaugeValue, float64(s.QueuedBroadcasts))
}

// logWriter turns memberlist's log lines into slog records and counts the lines that
// report inbound traffic memberlist dropped (it gives no other hook for them).
type logWriter struct {
	log   *slog.Logger
	stats *counters
}

// keyErrors are memberlist's words for traffic encrypted with another key, or not at all.
var keyErrors = [...]string{
	"no installed keys could decrypt",
	"decrypt packet failed",
	"encryption is configured but remote state is not encrypted",
	"remote state is encrypted and encryption is not configured",
}

// protocolErrors are memberlist's words for inbound traffic it could not decode.
var protocolErrors = [...]string{
	"failed to receive",
	"failed to decode",
	"not supported",
	"missing message type byte",
	"invalid checksum",
	"received invalid msgtype",
	"failed to read remote state",
	"failed to receive user message",
	"truncated messages",
	"failed to decompress",
	"unacceptable label",
	"label header",
	"udp packet too short",
}

func (w logWriter) Write(p []byte) (int, error) {
	line := string(bytes.TrimSpace(p))
	lower := strings.ToLower(line)
	level := slog.LevelDebug
	switch {
	case strings.Contains(line, "[ERR"):
		level = slog.LevelError
	case strings.Contains(line, "[WARN]"):
		level = slog.LevelWarn
	case strings.Contains(line, "[INFO]"):
		level = slog.LevelInfo
	}
	if level >= slog.LevelWarn {
		for _, k := range keyErrors {
			if strings.Contains(lower, k) {
				w.stats.drop(DropKey)
				now, last := time.Now().UnixNano(), w.stats.lastKeyWarn.Load()
				if now-last < int64(10*time.Second) || !w.stats.lastKeyWarn.CompareAndSwap(last, now) {
					return len(p), nil
				}
				w.log.Warn("gossip traffic from another replica could not be decrypted: its gossip key differs from ours (or one side has none); it cannot join",
					"detail", line)
				return len(p), nil
			}
		}
		for _, k := range protocolErrors {
			if strings.Contains(lower, k) {
				w.stats.drop(DropProtocol)
				// Garbage on the port is counted; a log line per packet would let anyone
				// flood the log.
				w.log.Debug("gossip: dropped undecodable traffic", "detail", line)
				return len(p), nil
			}
		}
	}
	w.log.Log(context.Background(), level, "memberlist", "line", line)
	return len(p), nil
}

func newStdLogger(l *slog.Logger, stats *counters) *log.Logger {
	return log.New(logWriter{log: l, stats: stats}, "", 0)
}
