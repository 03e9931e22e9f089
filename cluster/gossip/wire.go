package gossip

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Kind tells apart the messages that share the gossip channel. Kind 0 is invalid; the
// kinds below are allocated here so that two users of the package cannot collide.
type Kind byte

// Allocated kinds.
const (
	// KindHealth carries a replica's worker health observations (hints.HealthView).
	KindHealth Kind = 1
	// KindDecisions carries routing decisions for the shared approximate index.
	KindDecisions Kind = 2
	// KindLoad carries a replica's per-worker in-flight load.
	KindLoad Kind = 3
	// KindIndex is reserved for index summaries.
	KindIndex Kind = 4
)

// Wire format of one message (a frame):
//
//	[0]      version (1)
//	[1]      kind (non-zero)
//	[2]      n: length of the sender's name (1..MaxNameLen)
//	[3:3+n]  sender's name (the replica id)
//	[+4]     payload length, big-endian uint32
//	[...]    payload
//
// The sender's name lets a receiver drop a message from a replica that is not a member
// (memberlist does not say who sent a user message). Push/pull state is a sequence of
// frames, one per kind.
const (
	wireVersion = 1
	// MaxNameLen bounds a replica name (and so the frame header).
	MaxNameLen = 128
	// MaxReliablePayload bounds a payload sent over TCP (SendReliable, push/pull state):
	// a frame claiming more is impossible and dropped. Bulk transfers (index snapshots)
	// belong on the peer gRPC port.
	MaxReliablePayload = 4 << 20
	// maxPacketFrame bounds a frame sent in a UDP packet: memberlist's 1400-byte packet
	// minus its compound header, encryption and per-message overhead, with a margin.
	maxPacketFrame = 1350
	// maxStateBytes bounds the push/pull state of all kinds together.
	maxStateBytes = MaxReliablePayload + 64<<10
)

// Drop reasons, the values of kvrouter_gossip_dropped_total{reason}.
const (
	// DropDecode: a message that does not parse (bad version, kind, name or framing).
	DropDecode = "decode"
	// DropSize: a message that claims an impossible size.
	DropSize = "size"
	// DropNonMember: a message whose sender is not an alive member.
	DropNonMember = "non_member"
	// DropUnknownKind: a message of a kind nobody handles here.
	DropUnknownKind = "unknown_kind"
	// DropBudget: an outbound message over the byte budget.
	DropBudget = "budget"
	// DropKey: inbound traffic that could not be decrypted (a replica with another key).
	DropKey = "key"
	// DropProtocol: inbound memberlist traffic that memberlist itself could not decode.
	DropProtocol = "protocol"
)

var dropReasons = [...]string{DropDecode, DropSize, DropNonMember, DropUnknownKind, DropBudget, DropKey, DropProtocol}

// frameHeaderLen is the header size for a sender name of n bytes.
func frameHeaderLen(n int) int { return 3 + n + 4 }

// appendFrame appends one frame to dst.
func appendFrame(dst []byte, kind Kind, from string, payload []byte) []byte {
	dst = append(dst, wireVersion, byte(kind), byte(len(from)))
	dst = append(dst, from...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(payload)))
	return append(dst, payload...)
}

// frame is a decoded message.
type frame struct {
	kind    Kind
	from    string
	payload []byte // aliases the input
}

// errFrame is a frame that failed to parse, with the drop reason it counts under.
type errFrame struct {
	reason string
	msg    string
}

func (e *errFrame) Error() string { return "gossip message: " + e.msg }

func frameErr(reason, format string, args ...any) error {
	return &errFrame{reason: reason, msg: fmt.Sprintf(format, args...)}
}

// dropReason is the counter label for an error from parseFrame.
func dropReason(err error) string {
	var fe *errFrame
	if errors.As(err, &fe) {
		return fe.reason
	}
	return DropDecode
}

// parseFrame reads the frame at the start of b; rest is what follows it. A payload longer
// than maxPayload is impossible (DropSize), as is one longer than what b holds.
func parseFrame(b []byte, maxPayload int) (f frame, rest []byte, err error) {
	if len(b) < 3 {
		return f, nil, frameErr(DropDecode, "%d bytes is shorter than a header", len(b))
	}
	if b[0] != wireVersion {
		return f, nil, frameErr(DropDecode, "unknown version %d", b[0])
	}
	if b[1] == 0 {
		return f, nil, frameErr(DropDecode, "kind 0 is invalid")
	}
	n := int(b[2])
	if n == 0 || n > MaxNameLen {
		return f, nil, frameErr(DropDecode, "sender name length %d out of range 1..%d", n, MaxNameLen)
	}
	if len(b) < frameHeaderLen(n) {
		return f, nil, frameErr(DropDecode, "truncated header")
	}
	name := b[3 : 3+n]
	if err := checkName(name); err != nil {
		return f, nil, frameErr(DropDecode, "%v", err)
	}
	size := binary.BigEndian.Uint32(b[3+n:])
	body := b[frameHeaderLen(n):]
	if uint64(size) > uint64(maxPayload) {
		return f, nil, frameErr(DropSize, "claims a %d-byte payload, limit %d", size, maxPayload)
	}
	if uint64(size) > uint64(len(body)) {
		return f, nil, frameErr(DropSize, "claims a %d-byte payload, only %d bytes follow", size, len(body))
	}
	return frame{kind: Kind(b[1]), from: string(name), payload: body[:size]}, body[size:], nil
}

// checkName accepts printable ASCII without spaces, as replica ids are.
func checkName[T string | []byte](name T) error {
	if len(name) == 0 || len(name) > MaxNameLen {
		return fmt.Errorf("name length %d out of range 1..%d", len(name), MaxNameLen)
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= 0x20 || c >= 0x7f {
			return fmt.Errorf("name %q: only printable ASCII without spaces", string(name))
		}
	}
	return nil
}

// Meta is what a replica tells the others about itself (memberlist node metadata).
type Meta struct {
	// ID is the replica id (its Raft server id).
	ID string
	// Version is the software version.
	Version string
	// PeerAddr and RaftAddr are the replica's advertised peer gRPC and Raft addresses.
	PeerAddr, RaftAddr string
	// ClusterID is the Raft cluster the replica's data directory belongs to ("" for a fresh
	// one), so that a leader never adds a replica of another cluster as a voter.
	ClusterID string

	// leaving is set by Leave before memberlist's goodbye: memberlist reports a departure
	// and a death alike, so the flag is how the others tell Left from Dead.
	leaving bool
}

// metaVersion is the first byte of encoded metadata.
const metaVersion = 1

// maxMetaLen is memberlist's limit on node metadata.
const maxMetaLen = 512

func (m Meta) fields() [5]string {
	return [5]string{m.ID, m.Version, m.PeerAddr, m.RaftAddr, m.ClusterID}
}

// metaLeaving is the flag bit for Meta.leaving.
const metaLeaving = 1

// encode writes the version byte, each field as a uvarint length and its bytes, then a
// flags byte.
func (m Meta) encode() []byte {
	out := []byte{metaVersion}
	for _, f := range m.fields() {
		out = binary.AppendUvarint(out, uint64(len(f)))
		out = append(out, f...)
	}
	var flags byte
	if m.leaving {
		flags |= metaLeaving
	}
	return append(out, flags)
}

// decodeMeta parses encode's output; the flags byte is optional, and what follows it (a
// newer version's fields) is ignored.
func decodeMeta(b []byte) (Meta, error) {
	if len(b) == 0 {
		return Meta{}, errors.New("empty metadata")
	}
	if b[0] != metaVersion {
		return Meta{}, fmt.Errorf("metadata version %d", b[0])
	}
	b = b[1:]
	var f [5]string
	for i := range f {
		n, k := binary.Uvarint(b)
		if k <= 0 || n > uint64(len(b)-k) {
			return Meta{}, errors.New("truncated metadata")
		}
		f[i] = string(b[k : k+int(n)])
		b = b[k+int(n):]
	}
	m := Meta{ID: f[0], Version: f[1], PeerAddr: f[2], RaftAddr: f[3], ClusterID: f[4]}
	if len(b) > 0 {
		m.leaving = b[0]&metaLeaving != 0
	}
	return m, nil
}
