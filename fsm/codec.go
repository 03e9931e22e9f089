package fsm

import (
	"errors"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvrouter-ha/kvrouter-ha/fsm/fsmpb"
)

// An encoded command is one type byte followed by the protobuf body of fsmpb. The type
// byte's high bit (flagIgnorable) lets a newer leader propose a command that a replica
// running older code may skip; without it, such a replica panics in Apply rather than
// diverge from the others.

var (
	marshalOpts   = proto.MarshalOptions{Deterministic: true}
	unmarshalOpts = proto.UnmarshalOptions{DiscardUnknown: true}
)

// Encode validates cmd and returns its log entry bytes.
func Encode(cmd Command) ([]byte, error) {
	if cmd == nil {
		return nil, fmt.Errorf("encode: %w: nil command", ErrInvalid)
	}
	if err := cmd.validate(); err != nil {
		return nil, fmt.Errorf("encode %T: %w", cmd, err)
	}
	t := cmd.kind()
	if ignorable(t) {
		t |= flagIgnorable
	}
	b, err := marshalOpts.MarshalAppend([]byte{t}, toProto(cmd))
	if err != nil {
		return nil, fmt.Errorf("encode %T: %w", cmd, err)
	}
	if len(b) > MaxCommandLen {
		return nil, fmt.Errorf("encode %T: %w: %d bytes, over %d", cmd, ErrInvalid, len(b), MaxCommandLen)
	}
	return b, nil
}

// Decode parses and validates a log entry. It never panics; its errors wrap ErrMalformed,
// ErrInvalid or ErrUnknownType. The leader runs it before proposing, so a bad command is
// refused with a clear error instead of reaching the log.
func Decode(b []byte) (Command, error) {
	if len(b) == 0 {
		return nil, fmt.Errorf("decode: %w: empty entry", ErrMalformed)
	}
	t := b[0] &^ flagIgnorable
	if !knownType(t) {
		ign := ""
		if b[0]&flagIgnorable != 0 {
			ign = " (flagged ignore-if-unknown)"
		}
		return nil, fmt.Errorf("decode: %w 0x%02x%s", ErrUnknownType, b[0], ign)
	}
	return decodeBody(t, b[1:])
}

func knownType(t byte) bool { return t >= typeBind && t <= typeDeleteAlias }

func decodeBody(t byte, body []byte) (Command, error) {
	if len(body)+1 > MaxCommandLen {
		return nil, fmt.Errorf("decode: %w: %d bytes, over %d", ErrInvalid, len(body)+1, MaxCommandLen)
	}
	var (
		cmd Command
		msg proto.Message
	)
	switch t {
	case typeBind:
		msg = &fsmpb.Bind{}
	case typeInvalidate, typeExpire:
		msg = &fsmpb.Unbind{}
	case typeInvalidateWorker:
		msg = &fsmpb.InvalidateWorker{}
	case typeCheckpoint:
		msg = &fsmpb.Checkpoint{}
	case typeAddWorker:
		msg = &fsmpb.AddWorker{}
	case typeDrainWorker, typeRemoveWorker:
		msg = &fsmpb.WorkerID{}
	case typeSetMember:
		msg = &fsmpb.SetMember{}
	case typeRemoveMember:
		msg = &fsmpb.RemoveMember{}
	case typeSetAlias:
		msg = &fsmpb.SetAlias{}
	case typeDeleteAlias:
		msg = &fsmpb.DeleteAlias{}
	default:
		return nil, fmt.Errorf("decode: %w 0x%02x", ErrUnknownType, t)
	}
	if err := unmarshalOpts.Unmarshal(body, msg); err != nil {
		return nil, fmt.Errorf("decode type %d: %w: body of %d bytes: %w", t, ErrMalformed, len(body), err)
	}
	switch m := msg.(type) {
	case *fsmpb.Bind:
		ttl, err := duration("ttl", m.GetTtlNanos())
		if err != nil {
			return nil, err
		}
		cmd = &Bind{Session: m.GetSession(), Worker: m.GetWorker(), DPRank: m.GetDpRank(),
			ExpectRevision: m.GetExpectRevision(), TTL: ttl, MaxBindings: m.GetMaxBindings(), Model: m.GetModel()}
	case *fsmpb.Unbind:
		if t == typeInvalidate {
			cmd = &Invalidate{Session: m.GetSession(), Revision: m.GetRevision()}
		} else {
			cmd = &Expire{Session: m.GetSession(), Revision: m.GetRevision()}
		}
	case *fsmpb.InvalidateWorker:
		cmd = &InvalidateWorker{Worker: m.GetWorker()}
	case *fsmpb.Checkpoint:
		if n := len(m.GetEntries()); n > MaxCheckpointEntries {
			return nil, fmt.Errorf("decode: %w: checkpoint of %d entries, over %d", ErrInvalid, n, MaxCheckpointEntries)
		}
		c := &Checkpoint{Aged: time.Duration(m.GetAgedNanos())}
		if n := len(m.GetEntries()); n > 0 {
			c.Entries = make([]Remaining, n)
		}
		for i, e := range m.GetEntries() {
			c.Entries[i] = Remaining{Session: e.GetSession(), Revision: e.GetRevision(), Remaining: time.Duration(e.GetRemainingNanos())}
		}
		cmd = c
	case *fsmpb.AddWorker:
		c := &AddWorker{ID: m.GetId()}
		if len(m.GetSpec()) > 0 {
			c.Spec = m.GetSpec()
		}
		cmd = c
	case *fsmpb.WorkerID:
		if t == typeDrainWorker {
			cmd = &DrainWorker{ID: m.GetId()}
		} else {
			cmd = &RemoveWorker{ID: m.GetId()}
		}
	case *fsmpb.SetMember:
		pm := m.GetMember()
		cmd = &SetMember{Member: Member{ID: pm.GetId(), RaftAddr: pm.GetRaftAddr(), PeerAddr: pm.GetPeerAddr()}}
	case *fsmpb.RemoveMember:
		cmd = &RemoveMember{ID: m.GetId()}
	case *fsmpb.SetAlias:
		if n := len(m.GetTargets()); n > MaxAliasTargets {
			return nil, fmt.Errorf("decode: %w: alias of %d targets, over %d", ErrInvalid, n, MaxAliasTargets)
		}
		a := Alias{Name: m.GetName()}
		for _, t := range m.GetTargets() {
			a.Targets = append(a.Targets, AliasTarget{Model: t.GetModel(), Weight: t.GetWeight()})
		}
		cmd = &SetAlias{Alias: a}
	case *fsmpb.DeleteAlias:
		cmd = &DeleteAlias{Name: m.GetName()}
	}
	if err := cmd.validate(); err != nil {
		return nil, fmt.Errorf("decode %T: %w", cmd, err)
	}
	return cmd, nil
}

func duration(what string, n int64) (time.Duration, error) {
	if n < 0 {
		return 0, fmt.Errorf("decode: %w: negative %s %v", ErrInvalid, what, time.Duration(n))
	}
	return time.Duration(n), nil
}

func toProto(cmd Command) proto.Message {
	switch c := cmd.(type) {
	case *Bind:
		return &fsmpb.Bind{Session: c.Session, Worker: c.Worker, DpRank: c.DPRank,
			ExpectRevision: c.ExpectRevision, TtlNanos: int64(c.TTL), MaxBindings: c.MaxBindings, Model: c.Model}
	case *Invalidate:
		return &fsmpb.Unbind{Session: c.Session, Revision: c.Revision}
	case *Expire:
		return &fsmpb.Unbind{Session: c.Session, Revision: c.Revision}
	case *InvalidateWorker:
		return &fsmpb.InvalidateWorker{Worker: c.Worker}
	case *Checkpoint:
		m := &fsmpb.Checkpoint{Entries: make([]*fsmpb.Remaining, len(c.Entries)), AgedNanos: int64(c.Aged)}
		for i, e := range c.Entries {
			m.Entries[i] = &fsmpb.Remaining{Session: e.Session, Revision: e.Revision, RemainingNanos: int64(e.Remaining)}
		}
		return m
	case *AddWorker:
		return &fsmpb.AddWorker{Id: c.ID, Spec: c.Spec}
	case *DrainWorker:
		return &fsmpb.WorkerID{Id: c.ID}
	case *RemoveWorker:
		return &fsmpb.WorkerID{Id: c.ID}
	case *SetMember:
		return &fsmpb.SetMember{Member: &fsmpb.Member{Id: c.Member.ID, RaftAddr: c.Member.RaftAddr, PeerAddr: c.Member.PeerAddr}}
	case *RemoveMember:
		return &fsmpb.RemoveMember{Id: c.ID}
	case *SetAlias:
		m := &fsmpb.SetAlias{Name: c.Alias.Name, Targets: make([]*fsmpb.AliasTarget, len(c.Alias.Targets))}
		for i, t := range c.Alias.Targets {
			m.Targets[i] = &fsmpb.AliasTarget{Model: t.Model, Weight: t.Weight}
		}
		return m
	case *DeleteAlias:
		return &fsmpb.DeleteAlias{Name: c.Name}
	}
	// Unreachable: Command is sealed and every implementation is listed above.
	panic(fmt.Sprintf("fsm: no protobuf form for %T", cmd))
}

// Error kinds carried by an encoded Result, so a follower's errors.Is still works.
const (
	errKindOther     = 0
	errKindInvalid   = 1
	errKindMalformed = 2
	errKindUnknown   = 3
)

// EncodeResult serializes a Result for a follower that forwarded the command.
func EncodeResult(r *Result) ([]byte, error) {
	if r == nil {
		return nil, errors.New("encode result: nil result")
	}
	m := &fsmpb.Result{Status: uint32(r.Status), Found: r.Found, Count: int64(r.Count)}
	if r.Found || r.Binding != (Binding{}) {
		b := r.Binding
		m.Binding = &fsmpb.Binding{Session: b.Session, Worker: b.Worker, DpRank: b.DPRank, Revision: b.Revision,
			TtlNanos: int64(b.TTL), RemainingNanos: int64(b.Remaining), Model: b.Model}
	}
	if r.Err != nil {
		m.Err = r.Err.Error()
		switch {
		case errors.Is(r.Err, ErrMalformed):
			m.ErrKind = errKindMalformed
		case errors.Is(r.Err, ErrUnknownType):
			m.ErrKind = errKindUnknown
		case errors.Is(r.Err, ErrInvalid):
			m.ErrKind = errKindInvalid
		}
	}
	b, err := marshalOpts.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode result: %w", err)
	}
	return b, nil
}

// DecodeResult parses what EncodeResult made. An error the leader reported comes back
// with the same message, and errors.Is matches the same sentinel (ErrInvalid...).
func DecodeResult(b []byte) (*Result, error) {
	var m fsmpb.Result
	if err := unmarshalOpts.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("decode result: %w: %w", ErrMalformed, err)
	}
	if m.Status == 0 || m.Status > uint32(Ignored) {
		return nil, fmt.Errorf("decode result: %w: status %d", ErrMalformed, m.Status)
	}
	r := &Result{Status: Status(m.Status), Found: m.Found, Count: int(m.Count)}
	if pb := m.GetBinding(); pb != nil {
		r.Binding = Binding{Session: pb.GetSession(), Worker: pb.GetWorker(), DPRank: pb.GetDpRank(),
			Revision: pb.GetRevision(), TTL: time.Duration(pb.GetTtlNanos()), Remaining: time.Duration(pb.GetRemainingNanos()),
			Model: pb.GetModel()}
	}
	if m.Err != "" {
		re := &remoteError{msg: m.Err}
		switch m.ErrKind {
		case errKindInvalid:
			re.kind = ErrInvalid
		case errKindMalformed:
			re.kind = ErrMalformed
		case errKindUnknown:
			re.kind = ErrUnknownType
		}
		r.Err = re
	}
	return r, nil
}

// remoteError is an error reported by the leader's FSM, rebuilt on a follower.
type remoteError struct {
	msg  string
	kind error
}

func (e *remoteError) Error() string { return e.msg }
func (e *remoteError) Unwrap() error { return e.kind }
