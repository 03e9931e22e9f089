package gossip

import (
	"math"
	"slices"
	"sync"
)

// queue holds broadcasts until each has been transmitted retransmitLimit times, fresher
// ones first. It stands in for memberlist's TransmitLimitedQueue, which can lose a message
// when its id counter restarts while older items are still queued (two items that compare
// equal replace each other in its tree).
type queue struct {
	mu    sync.Mutex
	items []*queued
	keyed map[string]*queued
	bytes int
	seq   uint64
	// mult and numNodes give the retransmit limit: mult * ceil(log10(nodes + 1)).
	mult     int
	numNodes func() int
}

type queued struct {
	msg       []byte
	key       string
	transmits int
	seq       uint64
}

func newQueue(mult int, numNodes func() int) *queue {
	return &queue{keyed: map[string]*queued{}, mult: mult, numNodes: numNodes}
}

// push queues msg if the queue stays within maxBytes; a keyed message replaces the queued
// one with the same key.
func (q *queue) push(key string, msg []byte, maxBytes int) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	var old *queued
	if key != "" {
		old = q.keyed[key]
	}
	size := q.bytes + len(msg)
	if old != nil {
		size -= len(old.msg)
	}
	if size > maxBytes {
		return false
	}
	if old != nil {
		q.removeLocked(old)
	}
	q.seq++
	it := &queued{msg: msg, key: key, seq: q.seq}
	q.items = append(q.items, it)
	q.bytes += len(msg)
	if key != "" {
		q.keyed[key] = it
	}
	return true
}

func (q *queue) removeLocked(it *queued) {
	if i := slices.Index(q.items, it); i >= 0 {
		q.items = slices.Delete(q.items, i, i+1)
	}
	q.bytes -= len(it.msg)
	if it.key != "" && q.keyed[it.key] == it {
		delete(q.keyed, it.key)
	}
}

// take returns messages that fit in limit bytes (each costing overhead more), least
// transmitted and then newest first, and counts a transmission for each.
func (q *queue) take(overhead, limit int) [][]byte {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.items) == 0 {
		return nil
	}
	maxTransmits := q.mult * int(math.Ceil(math.Log10(float64(max(q.numNodes(), 1)+1))))
	order := slices.Clone(q.items)
	slices.SortFunc(order, func(a, b *queued) int {
		if a.transmits != b.transmits {
			return a.transmits - b.transmits
		}
		return int(b.seq) - int(a.seq)
	})
	var (
		out  [][]byte
		used int
	)
	for _, it := range order {
		if used+overhead+len(it.msg) > limit {
			continue
		}
		used += overhead + len(it.msg)
		out = append(out, it.msg)
		it.transmits++
		if it.transmits >= maxTransmits {
			q.removeLocked(it)
		}
	}
	return out
}

func (q *queue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items)
}

func (q *queue) queuedBytes() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.bytes
}

func (q *queue) reset() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.items, q.keyed, q.bytes = nil, map[string]*queued{}, 0
}
