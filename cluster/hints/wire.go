package hints

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// Sharing between replicas (issue 5): every replica's routing decisions reach the others'
// approximate indexes (share_decisions.go), every replica publishes its per-worker in-flight
// load and adds the others' into the load its policy reads (share_load.go), and a joining or
// restarting replica pulls a whole index snapshot from a live peer before it reports ready
// (share_snapshot.go). All of it is hints: a lost message makes routing a little worse for a
// while, and no binding ever depends on it.

// Messenger is what sharing needs of the gossip layer; *gossip.Gossip is one, and tests
// use an in-memory fake. Messages are hints: any of them may be lost.
type Messenger interface {
	// Name is this replica's member name (its replica id).
	Name() string
	// Members lists every known member, this replica included, alive or not.
	Members() []gossip.Member
	// IsAlive reports whether name is an alive (or suspect) member.
	IsAlive(name string) bool
	// OnMemberChange registers fn for joins, leaves and state changes.
	OnMemberChange(fn func(gossip.Member))
	// Handle registers fn for messages of kind.
	Handle(kind gossip.Kind, fn func(from string, payload []byte))
	// SendReliable sends payload to one member over TCP.
	SendReliable(ctx context.Context, to string, kind gossip.Kind, payload []byte) error
	// SendBestEffort sends payload to one member in one UDP packet.
	SendBestEffort(to string, kind gossip.Kind, payload []byte) error
	// MaxBroadcastPayload is the largest payload SendBestEffort carries.
	MaxBroadcastPayload() int
}

var _ Messenger = (*gossip.Gossip)(nil)

// FromVoters is m seen through voter: the members it lists are this replica and those voter
// admits, and handlers receive only their messages. Whoever holds the gossip key can join
// gossip, but only a replica of the Raft configuration (voter) may feed decisions, load or
// index snapshots here, or be sent them.
func FromVoters(m Messenger, voter func(name string) bool) Messenger {
	return voterMessenger{Messenger: m, voter: voter}
}

// voterMessenger is FromVoters' Messenger.
type voterMessenger struct {
	Messenger
	voter func(string) bool
}

// Members lists this replica and the members voter admits.
func (v voterMessenger) Members() []gossip.Member {
	all := v.Messenger.Members()
	out := all[:0:0]
	self := v.Name()
	for _, m := range all {
		if m.Name == self || v.voter(m.Name) {
			out = append(out, m)
		}
	}
	return out
}

// Handle registers fn for the messages of kind that members voter admits send; the others
// are dropped unread.
func (v voterMessenger) Handle(kind gossip.Kind, fn func(from string, payload []byte)) {
	v.Messenger.Handle(kind, func(from string, payload []byte) {
		if v.voter(from) {
			fn(from, payload)
		}
	})
}

// alivePeers returns the alive members other than self.
func alivePeers(m Messenger) []gossip.Member {
	self := m.Name()
	var out []gossip.Member
	for _, mb := range m.Members() {
		if mb.Name != self && (mb.State == gossip.Alive || mb.State == gossip.Suspect) {
			out = append(out, mb)
		}
	}
	return out
}

// shareWireVersion is the first byte of every load and health payload, and of decision
// payloads of the first version (decisionWireVersion is the current one).
const shareWireVersion = 1

// maxSharePayload bounds a decision or load payload a replica accepts: the gossip layer's
// own bound for reliable sends.
const maxSharePayload = gossip.MaxReliablePayload

// maxShareIDLen bounds a replica or worker id on the wire.
const maxShareIDLen = 255

// Decoding errors, told apart for the drop counters.
var (
	errShareVersion = errors.New("unknown payload version")
	errShareSize    = errors.New("impossible size")
	errShareDecode  = errors.New("malformed payload")
)

// dropReason maps a decoding error to its drop counter.
func dropReason(err error) string {
	switch {
	case errors.Is(err, errShareVersion):
		return DropShareVersion
	case errors.Is(err, errShareSize):
		return DropShareSize
	}
	return DropShareDecode
}

// wireReader decodes a payload from a byte slice; the first error sticks and later reads
// return zero values, so a decoder checks once at the end.
type wireReader struct {
	b   []byte
	err error
}

func (r *wireReader) fail(kind error, format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: "+format, append([]any{kind}, args...)...)
	}
}

func (r *wireReader) byte() byte {
	if r.err != nil {
		return 0
	}
	if len(r.b) == 0 {
		r.fail(errShareDecode, "truncated")
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *wireReader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail(errShareDecode, "bad or truncated varint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

// count reads a count of items of at least minBytes each, refusing one the bytes left
// cannot hold, so a forged count never sizes an allocation.
func (r *wireReader) count(minBytes int) int {
	v := r.uvarint()
	if r.err == nil && v > uint64(len(r.b)/minBytes) {
		r.fail(errShareSize, "count %d with %d bytes left", v, len(r.b))
		return 0
	}
	return int(v)
}

func (r *wireReader) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || n > len(r.b) {
		r.fail(errShareSize, "%d bytes claimed, %d left", n, len(r.b))
		return nil
	}
	b := r.b[:n]
	r.b = r.b[n:]
	return b
}

// id reads a length-prefixed id of 1..maxShareIDLen bytes.
func (r *wireReader) id() string {
	n := r.uvarint()
	if r.err == nil && (n == 0 || n > maxShareIDLen) {
		r.fail(errShareSize, "id of %d bytes", n)
		return ""
	}
	return string(r.take(int(n)))
}

// worker reads a worker: its id and dp rank.
func (r *wireReader) worker() indexer.Worker {
	id := r.id()
	rank := r.uvarint()
	if r.err == nil && rank > 1<<32-1 {
		r.fail(errShareSize, "dp rank %d", rank)
	}
	return indexer.Worker{ID: id, DPRank: uint32(rank)}
}

// header reads and checks the version byte and the sender's replica id.
func (r *wireReader) header() string {
	_, id := r.versionedHeader(shareWireVersion, shareWireVersion)
	return id
}

// versionedHeader reads a payload's version, which must lie in [lo, hi], and the sender's
// id.
func (r *wireReader) versionedHeader(lo, hi byte) (byte, string) {
	if len(r.b) > maxSharePayload {
		r.fail(errShareSize, "%d bytes, over the bound of %d", len(r.b), maxSharePayload)
		return 0, ""
	}
	v := r.byte()
	if r.err == nil && (v < lo || v > hi) {
		r.fail(errShareVersion, "version %d, this build reads %d to %d", v, lo, hi)
		return 0, ""
	}
	return v, r.id()
}

// done fails a payload with bytes left over.
func (r *wireReader) done() error {
	if r.err == nil && len(r.b) != 0 {
		r.fail(errShareDecode, "%d bytes after the end", len(r.b))
	}
	return r.err
}

func appendID(b []byte, id string) []byte {
	b = binary.AppendUvarint(b, uint64(len(id)))
	return append(b, id...)
}

func appendWorker(b []byte, w indexer.Worker) []byte {
	return binary.AppendUvarint(appendID(b, w.ID), uint64(w.DPRank))
}

// appendHeader starts a payload: version byte and the sender's id.
func appendHeader(b []byte, self string) []byte {
	return appendVersionedHeader(b, shareWireVersion, self)
}

// appendVersionedHeader starts a payload of a kind whose version moved on.
func appendVersionedHeader(b []byte, version byte, self string) []byte {
	return appendID(append(b, version), self)
}

// admitShare counts a received message of kind k and lets it through only when it comes from
// another live member, decodes, and names the replica that sent it; each refusal is counted
// under its reason, so no receive path applies what it should not.
func admitShare[M any](m *Metrics, log *slog.Logger, k shareKind, self, from string, alive func(string) bool,
	payload []byte, decode func([]byte) (M, error), sender func(M) string) (M, bool) {
	var zero M
	m.in(k, len(payload))
	if from == self || !alive(from) {
		m.drop(k, DropShareNonMember)
		return zero, false
	}
	msg, err := decode(payload)
	if err != nil {
		m.drop(k, dropReason(err))
		log.Debug("dropping a shared message", "kind", shareKindNames[k], "from", from, "err", err)
		return zero, false
	}
	if sender(msg) != from {
		m.drop(k, DropShareSender)
		return zero, false
	}
	return msg, true
}
