// Package peer is the gRPC wire between kvrouter-ha replicas (the peer port): a follower
// forwards state machine commands, read-index requests and idle-timer touches to the
// leader, and replicas ask each other for status and membership changes.
//
// The package knows nothing of Raft or the state machine: commands and results are
// opaque bytes encoded by package fsm, and a Handler (implemented by package cluster)
// decides what a call does. Server puts a Handler on a listener; Client, Pool, Forwarder
// and ReadIndexBatcher are the calling side. See DESIGN.md beside this file.
package peer

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// DefaultMaxMessageBytes bounds a peer message in either direction when the options
// leave MaxMessageBytes at zero.
const DefaultMaxMessageBytes = 4 << 20

// ErrInvalid marks a request the handler refuses as malformed; wrap it (fmt.Errorf("%w: ...",
// ErrInvalid)) and the caller gets gRPC InvalidArgument, seen again as ErrInvalid on the
// client side. A retry cannot help such a request.
var ErrInvalid = errors.New("invalid peer request")

// ErrUnavailable marks a transient refusal (shutting down, no quorum yet); wrap it and the
// caller gets gRPC Unavailable, which Forwarder retries with backoff.
var ErrUnavailable = errors.New("peer unavailable")

// ErrPermission marks a call the caller may not make (its certificate names no replica
// allowed to); wrap it and the caller gets gRPC PermissionDenied, seen again as
// ErrPermission on the client side. A retry cannot help.
var ErrPermission = errors.New("peer call not permitted")

// ErrClosed is returned by a Pool or Client used after Close.
var ErrClosed = errors.New("peer client closed")

// Handler is what a replica does with peer calls; package cluster implements it. A
// replica that does not lead answers every leader-only call (Apply, ReadIndex, Touch,
// Join, Leave) with *NotLeaderError and must not act on it.
type Handler interface {
	// Apply applies one encoded command through Raft and returns its encoded result and
	// the log index it was applied at.
	Apply(ctx context.Context, command []byte) (result []byte, index uint64, err error)
	// ReadIndex returns the commit index after the leader confirmed its leadership.
	ReadIndex(ctx context.Context) (uint64, error)
	// Touch refreshes the leader's idle timers of sessions.
	Touch(ctx context.Context, touches []Touch) error
	// Status describes this replica; every replica answers it.
	Status(ctx context.Context) (Status, error)
	// Join adds a replica to the Raft configuration.
	Join(ctx context.Context, req JoinRequest) error
	// Leave removes a replica from the Raft configuration.
	Leave(ctx context.Context, id string) error
}

// NotLeaderError says the answering replica does not lead. LeaderID and LeaderAddr (a
// peer address) name the leader it knows of; both are empty while no leader is known.
// It crosses the wire as FailedPrecondition with a peerpb.NotLeader detail, so errors.As
// finds it on the calling side as well.
type NotLeaderError struct {
	LeaderID   string
	LeaderAddr string
}

// Error describes the redirect.
func (e *NotLeaderError) Error() string {
	if e.LeaderAddr == "" && e.LeaderID == "" {
		return "not the leader, and no leader is known"
	}
	return fmt.Sprintf("not the leader; the leader is %s at %s", e.LeaderID, e.LeaderAddr)
}

// Touch is one idle-timer touch of a session's binding.
type Touch struct {
	Session string
	// Revision is the binding revision the touch refers to; a stale one touches nothing.
	Revision uint64
	// End is true when a request of the session ended, false when one started or is
	// still streaming.
	End bool
	// Age is how long ago the touch was made (0: now): a touch sent again to a new leader
	// carries its age, so the TTL counts from the touch, not from its delivery.
	Age time.Duration
}

// Status describes one replica, as the Status call reports it.
type Status struct {
	ID             string `json:"id"`
	RaftAddr       string `json:"raft_addr"`
	PeerAddr       string `json:"peer_addr"`
	State          string `json:"state"` // Raft state: Follower, Candidate, Leader, Shutdown
	LeaderID       string `json:"leader_id"`
	LeaderPeerAddr string `json:"leader_peer_addr"`
	Term           uint64 `json:"term"`
	CommitIndex    uint64 `json:"commit_index"`
	AppliedIndex   uint64 `json:"applied_index"`   // the state machine's: commands and membership changes only (Raft's, with its no-ops and barriers, is in the admin API's raft.applied_index)
	LastContactMs  int64  `json:"last_contact_ms"` // 0 on the leader
	ClusterID      string `json:"cluster_id"`
	Version        string `json:"version"`
	// Discovery is each discovery source's looks while this replica runs the discovery duty
	// (it leads and has sources); empty otherwise.
	Discovery []DiscoverySource `json:"discovery,omitempty"`
}

// DiscoverySource is how one discovery source's looks go on the replica that runs them.
type DiscoverySource struct {
	Source string `json:"source"`
	// LastGood is when the last good look was (zero: none in this term).
	LastGood time.Time `json:"last_good,omitzero"`
	// FailingSince is when the failing looks in a row began (zero: they do not fail).
	FailingSince  time.Time `json:"failing_since,omitzero"`
	Failures      int       `json:"failures,omitempty"`
	LastError     string    `json:"last_error,omitempty"`
	SuspectDrains int       `json:"suspect_drains,omitempty"`
}

// JoinRequest asks the leader to add a replica.
type JoinRequest struct {
	ID        string
	RaftAddr  string
	PeerAddr  string
	ClusterID string // empty: any cluster; else the leader refuses a different cluster
	Voter     bool
}

// maxBytes is the effective message bound of an options value.
func maxBytes(n int) int {
	if n <= 0 {
		return DefaultMaxMessageBytes
	}
	return n
}
