package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// ErrOutcomeUnknown: a command's leader stepped down before it could say whether the
// command committed, and this replica could not learn it in time (the next leader has not
// decided the entry yet, or the entry left this replica's log). The command may have taken
// effect: read the state before trying again.
var ErrOutcomeUnknown = fmt.Errorf("the command's outcome is unknown (its leader stepped down before the entry committed; whether the next leader committed it was not learned in time): %w", routing.ErrUnavailable)

// resultRing is how many applied commands' results a node keeps (resultLog).
const resultRing = 4096

// resultLog keeps the results of the last resultRing commands applied, by log index. A
// command whose leader stepped down before the entry committed (ErrLeadershipLost) may
// still commit in the next term, and then this node's FSM applies it without anyone to
// tell: settle reads its result here. (Sending the command again instead would apply it a
// second time: an invalidation that had removed the binding then answers "not found".)
type resultLog struct {
	mu    sync.Mutex
	slots [resultRing]appliedResult
}

// appliedResult is one applied command's result and its index.
type appliedResult struct {
	index uint64
	res   *fsm.Result
}

// putLocked records the result of the entry at index (nothing for an entry that is no
// command); r.mu is held.
func (r *resultLog) putLocked(index uint64, res any) {
	if v, ok := res.(*fsm.Result); ok && v != nil {
		r.slots[index%resultRing] = appliedResult{index: index, res: v}
	}
}

// past reports whether the slot of index holds a later command's result: index's, if it
// was a command, is no longer kept.
func (r *resultLog) past(index uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.slots[index%resultRing].index > index
}

// get returns the result of the command applied at index, if it is still kept.
func (r *resultLog) get(index uint64) (*fsm.Result, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.slots[index%resultRing]
	return s.res, s.res != nil && s.index == index
}

// recordingFSM is the FSM Raft drives: the node's state machine, whose results are also
// kept in results.
type recordingFSM struct {
	*fsm.FSM
	results *resultLog
}

// Apply applies one entry and keeps its result.
func (f recordingFSM) Apply(l *raft.Log) any {
	res := f.FSM.Apply(l)
	f.results.mu.Lock()
	f.results.putLocked(l.Index, res)
	f.results.mu.Unlock()
	return res
}

// ApplyBatch applies entries in order and keeps their results.
func (f recordingFSM) ApplyBatch(logs []*raft.Log) []any {
	out := f.FSM.ApplyBatch(logs)
	f.results.mu.Lock()
	for i, l := range logs {
		f.results.putLocked(l.Index, out[i])
	}
	f.results.mu.Unlock()
	return out
}

// errNotCommitted: the entry a stepped-down leader appended did not commit (another entry
// holds its index), so sending the command again applies it once.
var errNotCommitted = errors.New("the entry did not commit")

// applyLeader applies an encoded command on this node as leader (applyLocal). When the
// node steps down before the entry committed (ErrLeadershipLost), it settles what became of
// the entry instead of leaving the caller to send the command again: the entry's result
// when the next term committed it, ErrLeadershipLost (safe to send again) when another
// entry took its index, ErrOutcomeUnknown when neither is known before ctx ends.
func (n *Node) applyLeader(ctx context.Context, b []byte) (*fsm.Result, uint64, error) {
	res, idx, err := n.applyLocal(ctx, b)
	if !errors.Is(err, raft.ErrLeadershipLost) || idx == 0 {
		return res, idx, err
	}
	res, serr := n.settle(ctx, idx, b)
	switch {
	case serr == nil:
		n.log.Info("a command whose leader stepped down committed in the next term", "index", idx, "status", res.Status)
		return res, idx, res.Err
	case errors.Is(serr, errNotCommitted):
		return nil, 0, err
	}
	return nil, 0, serr
}

// settle waits until this node knows index idx committed, then reports the result of the
// command b there: the FSM's result when the entry at idx is b, errNotCommitted when it is
// another, ErrOutcomeUnknown when ctx ends first or the entry or its result is no longer
// kept.
func (n *Node) settle(ctx context.Context, idx uint64, b []byte) (*fsm.Result, error) {
	// Raft counts an entry applied once it is handed to the FSM, before the FSM applied it:
	// the entry is committed then, its result comes a moment later.
	if err := n.awaitSettled(ctx, idx, func() bool { return n.raft.AppliedIndex() >= idx }); err != nil {
		return nil, err
	}
	var e raft.Log
	if err := n.logs.GetLog(idx, &e); err != nil {
		return nil, fmt.Errorf("%w: entry %d: %w", ErrOutcomeUnknown, idx, err)
	}
	if e.Type != raft.LogCommand || !bytes.Equal(e.Data, b) {
		return nil, errNotCommitted
	}
	var res *fsm.Result
	var kept bool
	if err := n.awaitSettled(ctx, idx, func() bool {
		res, kept = n.results.get(idx)
		return kept || n.results.past(idx)
	}); err != nil {
		return nil, err
	}
	if !kept {
		return nil, fmt.Errorf("%w: entry %d committed, its result is no longer kept", ErrOutcomeUnknown, idx)
	}
	return res, nil
}

// awaitSettled waits until done holds, ctx ends (ErrOutcomeUnknown) or the node closes.
func (n *Node) awaitSettled(ctx context.Context, idx uint64, done func() bool) error {
	for {
		ch := n.changeCh()
		if done() {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("%w: entry %d not applied here yet: %w", ErrOutcomeUnknown, idx, ctx.Err())
		case <-n.ctx.Done():
			return ErrClosed
		case <-time.After(10 * time.Millisecond): // entries that are no commands notify nobody
		}
	}
}
