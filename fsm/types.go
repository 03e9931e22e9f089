package fsm

import (
	"fmt"
	"time"
)

// Binding is a session's affinity to one worker (and data-parallel rank).
type Binding struct {
	Session string
	Worker  string
	DPRank  uint32
	// Revision is the Raft log index of the Bind that made the binding; every change of a
	// session's binding therefore gets a higher revision.
	Revision uint64
	// TTL is the idle TTL the binder asked for (0: the cluster's default).
	TTL time.Duration
	// Remaining is the idle TTL left at the last Checkpoint that covered this binding;
	// 0 means never checkpointed.
	Remaining time.Duration
	// Model is the model the session's requests are sent as: the target an alias chose
	// when the binding was made ("" when none was recorded). It belongs to the binding.
	Model string
}

// Alias is a model name that stands for weighted target models: a request for it goes
// to one target, drawn by weight (a session keeps the target its binding records).
type Alias struct {
	Name    string
	Targets []AliasTarget
}

// AliasTarget is one target model of an alias and its integer weight.
type AliasTarget struct {
	Model  string
	Weight uint32
}

// Worker is an entry of the cluster's worker registry.
type Worker struct {
	ID string
	// Spec is opaque to the state machine (JSON the binary owns).
	Spec []byte
	// Draining workers take no new bindings.
	Draining bool
}

// Member is one replica of the cluster, so any replica can find another's peer port.
type Member struct {
	ID       string
	RaftAddr string
	PeerAddr string
}

// Status is the outcome of an applied command.
type Status uint8

// Statuses. The zero value is not a valid outcome, so a forgotten assignment shows.
const (
	// OK: a command without a more specific outcome took effect (registry changes,
	// InvalidateWorker, Checkpoint).
	OK Status = iota + 1
	// Created: Bind created or replaced the binding; Result.Binding is the new one.
	Created
	// Exists: an absent-only Bind found the session bound; Result.Binding is the binding.
	Exists
	// Conflict: the revision guard did not match; Result.Binding is the current binding
	// when Result.Found.
	Conflict
	// NotFound: the session, worker or member does not exist.
	NotFound
	// Removed: Invalidate or Expire removed the binding in Result.Binding.
	Removed
	// Full: a new session would exceed Bind.MaxBindings.
	Full
	// Rejected: the Bind's worker is draining.
	Rejected
	// Invalid: the command is malformed or breaks a limit; Result.Err says why. No state
	// changed.
	Invalid
	// Ignored: an unknown command flagged ignore-if-unknown was skipped.
	Ignored
)

var statusNames = [...]string{
	OK: "ok", Created: "created", Exists: "exists", Conflict: "conflict", NotFound: "not found",
	Removed: "removed", Full: "full", Rejected: "rejected", Invalid: "invalid", Ignored: "ignored",
}

// String names the status.
func (s Status) String() string {
	if int(s) < len(statusNames) && statusNames[s] != "" {
		return statusNames[s]
	}
	return fmt.Sprintf("status(%d)", uint8(s))
}

// Result is what Apply returns (as *Result) for a command entry; it is the raft
// ApplyFuture's Response.
type Result struct {
	Status  Status
	Binding Binding
	// Found reports whether Binding holds a binding (the current, new or removed one).
	Found bool
	// Count is the number of bindings removed (InvalidateWorker, DrainWorker,
	// RemoveWorker) or checkpointed (Checkpoint).
	Count int
	// Err is set with Status Invalid: the entry did not decode or broke a limit. It is the
	// same on every replica, so it cannot make them diverge.
	Err error
}

// ChangeKind says what happened to a binding.
type ChangeKind uint8

// Change kinds.
const (
	// Bound: Binding was created or replaced a previous one.
	Bound ChangeKind = iota + 1
	// Unbound: Binding was removed.
	Unbound
	// Reset: the whole state was replaced by Restore; re-read it.
	Reset
	// WorkersChanged: the worker registry changed (AddWorker, DrainWorker or RemoveWorker of
	// Binding.Worker); re-read Workers. Bindings the command removed come as Unbound.
	WorkersChanged
)

// String names the kind.
func (k ChangeKind) String() string {
	switch k {
	case Bound:
		return "bound"
	case Unbound:
		return "unbound"
	case Reset:
		return "reset"
	case WorkersChanged:
		return "workers changed"
	}
	return fmt.Sprintf("change(%d)", uint8(k))
}

// Reason says why a binding changed.
type Reason uint8

// Reasons.
const (
	// NewBinding: an absent-only Bind made a new binding.
	NewBinding Reason = iota + 1
	// Replaced: a compare-and-set Bind replaced Change.Previous.
	Replaced
	// Invalidated: an Invalidate removed the binding.
	Invalidated
	// Expired: an Expire removed the binding.
	Expired
	// WorkerInvalidated: an InvalidateWorker removed the binding.
	WorkerInvalidated
	// Drained: DrainWorker removed the binding.
	Drained
	// WorkerRemoved: RemoveWorker removed the binding. (Not "Removed": that name is the
	// Status of a successful Invalidate or Expire.)
	WorkerRemoved
	// Restored: Restore replaced the whole state (with Kind Reset).
	Restored
)

var reasonNames = [...]string{
	NewBinding: "new", Replaced: "replaced", Invalidated: "invalidated", Expired: "expired",
	WorkerInvalidated: "worker invalidated", Drained: "drained", WorkerRemoved: "worker removed",
	Restored: "restored",
}

// String names the reason.
func (r Reason) String() string {
	if int(r) < len(reasonNames) && reasonNames[r] != "" {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason(%d)", uint8(r))
}

// Change is one change of the state, reported to Options.OnChange.
type Change struct {
	Kind   ChangeKind
	Reason Reason
	// Binding is the new binding (Bound) or the removed one (Unbound); zero for Reset.
	Binding Binding
	// Previous is the binding a compare-and-set Bind replaced (Reason Replaced).
	Previous Binding
	// Index is the log index of the entry that made the change, or the snapshot's applied
	// index for Reset.
	Index uint64
}
