// Package routing chooses the worker for a request: filters, cost policies, load accounting
// and the session-affinity flow (acquire, commit, invalidate) of DESIGN.md sections 3, 5 and 7.
//
// It knows nothing of HTTP or Raft: the interfaces it needs (a prefix index, the set of
// workers, a load view, an affinity store) are defined here and implemented in memory here
// and over the network elsewhere.
package routing

import (
	"context"
	"errors"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// Role is a worker's part in disaggregated serving.
type Role string

// The roles. A worker with no role serves both phases.
const (
	RoleBoth    Role = ""
	RolePrefill Role = "prefill"
	RoleDecode  Role = "decode"
)

// WorkerSpec is a worker as an operator configures it.
type WorkerSpec struct {
	ID  string `json:"id"`
	URL string `json:"url"`
	// KVEvents is the worker's ZMQ KV-event endpoint (its PUB socket, rank 0), if it publishes
	// events; rank r publishes on the port plus r, as vLLM does.
	KVEvents string `json:"kv_events,omitempty"`
	// KVReplay is the worker's replay (ROUTER) endpoint for rank 0, if it has one.
	KVReplay string `json:"kv_replay,omitempty"`
	Role     Role   `json:"role,omitempty"`
	// DPSize is the number of data-parallel ranks; 0 means 1.
	DPSize int `json:"dp_size,omitempty"`
	// CapacityBlocks is the KV cache size in blocks, for the busy threshold; 0 is unknown.
	CapacityBlocks int `json:"capacity_blocks,omitempty"`
	// LoRAs lists the adapters the worker serves; "*" serves any.
	LoRAs []string `json:"loras,omitempty"`
	// Models lists the models the worker serves (vLLM's --served-model-name). Empty: as
	// learned from the worker's GET /v1/models, and until then any model (see Catalog).
	Models []string `json:"models,omitempty"`
}

// Model is a model a worker serves; Parent names the base model of a LoRA adapter, as
// vLLM's GET /v1/models lists adapters.
type Model struct {
	ID     string `json:"id"`
	Parent string `json:"parent,omitempty"`
}

// Target is one routable destination: a worker and one of its data-parallel ranks.
type Target struct {
	Worker indexer.Worker
	Spec   *WorkerSpec
	// Serves is what the worker serves, declared and learned together; nil when neither is
	// known (the worker then takes any model).
	Serves *Serving
}

// Serving is the set of names a worker answers to: models (declared in its spec or
// learned from it) and LoRA adapters (its spec's, "*" among them, and those learned).
type Serving struct {
	Models []string
	LoRAs  []string
}

// Load is a worker's in-flight work as the kv cost model reads it.
type Load struct {
	Requests      int64
	PrefillTokens int64
	DecodeBlocks  int64
}

// LoadView reports the in-flight load of a worker (this replica's, plus others' when merged).
type LoadView interface {
	Load(w indexer.Worker) Load
}

// PrefixIndex answers how many leading blocks of a prompt each worker holds.
type PrefixIndex interface {
	FindMatches(seq []uint64, dst []indexer.Match) []indexer.Match
}

// DecisionRecorder learns from routing decisions (the approximate index).
type DecisionRecorder interface {
	// Record records seq's blocks on w. It must not keep seq past its return (copy what it
	// keeps): a request's end records from memory of the request's own (Scratch).
	Record(w indexer.Worker, seq []uint64)
}

// Workers is the set of workers requests may go to.
type Workers interface {
	// Routable returns the healthy, undrained targets, one per worker and rank. The slice is
	// shared and must not be modified.
	Routable() []Target
	// Lookup finds a configured worker by id, routable or not.
	Lookup(id string) (WorkerSpec, bool)
	// NotReady reports whether worker id is configured but not ready for now: no new choice
	// goes to it, and its bindings are kept (a bound session's request is served elsewhere
	// meanwhile, without moving the binding).
	NotReady(id string) bool
}

// Binding is a session's worker and the revision that created it.
type Binding struct {
	Session  string
	Worker   indexer.Worker
	Revision uint64
	// Model is the alias target the session's requests are sent as ("" when the binding
	// was not made through an alias); it belongs to the binding, which keeps it.
	Model string
}

// Alias is a model name that stands for weighted target models (set through the admin
// API and replicated): a request for it is sent as one target.
type Alias struct {
	Name    string
	Targets []AliasTarget
}

// AliasTarget is one target model of an alias and its integer weight.
type AliasTarget struct {
	Model  string
	Weight uint32
}

// has reports whether model is one of the alias's targets (of any weight).
func (a *Alias) has(model string) bool {
	for _, t := range a.Targets {
		if t.Model == model {
			return true
		}
	}
	return false
}

// AffinityStore keeps session -> worker bindings. The in-memory MemoryAffinity has the
// semantics; the Raft-backed store in cluster replaces it behind this interface.
type AffinityStore interface {
	// Acquire returns a lease on the session. If the session has a live binding the lease is
	// bound to it; otherwise the caller becomes the session's initializer and concurrent
	// Acquires of the same session wait until it commits or gives up. With explicit set, a
	// live binding to another worker is ErrTargetConflict; no binding makes the caller the
	// initializer, expected to commit explicit.
	Acquire(ctx context.Context, session string, explicit *indexer.Worker) (Lease, error)
	// Peek reads a binding without taking a lease (query-only routing).
	Peek(ctx context.Context, session string) (Binding, bool, error)
	// Invalidate drops the binding if it still has this revision.
	Invalidate(ctx context.Context, session string, revision uint64) error
}

// Syncer is an AffinityStore that can catch up: Sync returns once the store reflects every
// binding acknowledged before the call, wherever it was made (the Raft store: a read-index
// round through the leader, whatever its consistency level).
type Syncer interface {
	Sync(ctx context.Context) error
}

// ResponseSession is the session key that binds state a worker keeps under id (a Responses
// API response's id) to that worker. Its space cannot occur in a session header's key
// (printable ASCII without spaces), so a client cannot name it as a session of its own.
func ResponseSession(id string) string { return responseSessionPrefix + id }

// responseSessionPrefix starts every ResponseSession key.
const responseSessionPrefix = "response "

// Lease is one request's hold on a session.
type Lease interface {
	// Binding returns the binding this lease found; false means this lease initializes it.
	Binding() (Binding, bool)
	// Commit binds the session to w (initializer only), recording model ("" for none) as
	// the binding's model, and returns the new binding.
	Commit(ctx context.Context, w indexer.Worker, model string) (Binding, error)
	// Reopen turns a bound lease into the initializer of the binding's replacement (its
	// worker failed): concurrent Acquires of the session wait for it as for a first request,
	// Commit replaces the binding in one compare-and-set on its revision (a binding another
	// replica made first wins, as with ErrBoundElsewhere), and giving up (Invalidate) drops
	// the old binding, revision-guarded. It reports false, changing nothing, when the lease
	// is not bound or another request of this replica is replacing the binding already.
	Reopen() bool
	// Invalidate drops the lease's binding (revision-guarded) or, for an initializer, gives
	// up so that waiters proceed. The lease is released.
	Invalidate(ctx context.Context)
	// Release ends the request: the binding's idle TTL counts from now. An initializer that
	// never committed gives up. Release after Invalidate is a no-op.
	Release()
}

// Errors a caller maps to HTTP answers.
var (
	// ErrNoWorker: no routable worker passes the filters (503).
	ErrNoWorker = errors.New("no healthy worker available")
	// ErrBusy: every candidate is over its busy threshold and the wait queue timed out or is full (503).
	ErrBusy = errors.New("all workers are busy")
	// ErrUnknownTarget: an explicit target names no configured worker (404).
	ErrUnknownTarget = errors.New("unknown target worker")
	// ErrTargetConflict: an explicit target disagrees with the session's live binding (409).
	ErrTargetConflict = errors.New("target worker conflicts with the session's binding")
	// ErrTooManySessions: the binding cap is reached (429).
	ErrTooManySessions = errors.New("too many sessions")
	// ErrUnavailable: the affinity store cannot vouch for bindings now (no leader, or out of
	// contact past the staleness bound) (503 with Retry-After).
	ErrUnavailable = errors.New("session bindings unavailable")
	// ErrBoundElsewhere: a concurrent first request on another replica bound the session to
	// another worker first; the request moves there before its first byte.
	ErrBoundElsewhere = errors.New("session was bound to another worker by a concurrent request")
	// ErrWorkerDraining: the state machine refused a new binding because its worker began
	// draining after it was chosen; the lease stays the session's initializer, so the
	// request can go to its next choice (no byte has reached the client yet).
	ErrWorkerDraining = errors.New("the chosen worker is draining")
	// ErrRetriesExhausted: the bounded retries before the first byte are used up (502).
	ErrRetriesExhausted = errors.New("retries exhausted")
)

// Refusal is an affinity store's answer to a request it cannot serve on this replica, given
// before any worker was asked (503, Retry-After, and a marker a load balancer can match): the
// replica is cut off from the cluster's leader, is stopping, or waited --bind-wait for a read
// lease in vain; or a new session's binding, committed before dispatch, failed. Nothing has run anywhere, so another replica may take the request.
type Refusal struct {
	// Reason is a short label: "cut_off", "stopping", "no_read_lease", or "bind_failed" (a
	// new session's binding, committed before dispatch, failed: Attempt.Propose).
	Reason string
	// Err is why (it wraps ErrUnavailable).
	Err error
}

// Error implements error.
func (r *Refusal) Error() string { return r.Err.Error() }

// Unwrap returns the cause.
func (r *Refusal) Unwrap() error { return r.Err }
