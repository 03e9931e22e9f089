package jepsen

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// headerRefused marks a replica's own refusal (no read lease, no leader, shutting down): an
// answer the router gave before sending anything to a worker, which a balancer may retry.
const headerRefused = "X-Kvrouter-Refused"

// refusalMessages are what a replica's refusal says where it carries no X-Kvrouter-Refused
// header (replicas before the header existed): the affinity store cannot vouch for bindings.
var refusalMessages = [...]string{"session bindings unavailable", "no read lease", "cannot vouch"}

// Causes of a failed request.
const (
	// CauseFaultedReplica: the request went to a replica while it was killed, paused, cut off
	// or restarting (the fault began while the request was in flight, or it was sent during
	// the fault), and the replica did not refuse it.
	CauseFaultedReplica = "faulted-replica"
	// CauseRefused: a replica refused it because it could not serve (a 503 marked
	// X-Kvrouter-Refused, or saying it cannot vouch for bindings).
	CauseRefused = "refused-unready"
	// CauseNoReplica: the load balancer had no replica to send it to (HAProxy's own 503,
	// with no server named in its log: every replica was down or out of rotation).
	CauseNoReplica = "no-replica-up"
	// CauseOther is everything else (a worker's error passed through, a timeout elsewhere).
	CauseOther = "other"
)

// Phases of a failed request: how far it got.
const (
	// PhaseConnect: it never left the client (connection refused or reset before it was written).
	PhaseConnect = "connect"
	// PhaseNoAnswer: it was sent and no response headers came (EOF, reset, timeout).
	PhaseNoAnswer = "no-answer"
	// PhaseError: an error status came back.
	PhaseError = "error-status"
	// PhaseTruncated: a 200 came, then the body or stream was cut.
	PhaseTruncated = "truncated"
)

// replicaFaults are the fault kinds that take a replica away.
var replicaFaults = [...]FaultKind{FaultKill, FaultStop, FaultRestart, FaultPartition, FaultStale}

// FailureCount counts failed requests (fail or unknown) of one cause, phase and fault kind.
type FailureCount struct {
	Cause string `json:"cause"`
	Phase string `json:"phase"`
	// Fault is the kind of the fault on the request's replica ("" when none was).
	Fault FaultKind `json:"fault,omitempty"`
	Ops   int       `json:"ops"`
	// Struck of them were already in flight on their replica when its fault began (sent
	// before it); the rest were sent while it lasted.
	Struck int `json:"struck,omitempty"`
	// ViaBalancer of them went through the load balancer; Retried were sent again by it
	// (to the same or another replica) before they failed.
	ViaBalancer int `json:"via_balancer,omitempty"`
	Retried     int `json:"retried,omitempty"`
}

// BalancerStats counts what the load balancer did with the requests sent through it, from
// its log.
type BalancerStats struct {
	// Ops were sent through it; Logged of them are in its log.
	Ops    int `json:"ops"`
	Logged int `json:"logged"`
	// Retried were sent again after a failed attempt (a refused connection, an empty answer,
	// a refusal); RetriedOK of them then succeeded; Redispatched went to another replica.
	Retried      int `json:"retried"`
	RetriedOK    int `json:"retried_ok"`
	Redispatched int `json:"redispatched"`
}

// phase says how far a failed operation got.
func (o *Op) phase() string {
	switch {
	case o.Status == 0 && o.Result == ResultFail:
		return PhaseConnect
	case o.Status == 0:
		return PhaseNoAnswer
	case o.Status != 200:
		return PhaseError
	}
	return PhaseTruncated
}

// refused reports whether a replica refused the operation itself.
func (o *Op) refused() bool {
	if o.Refused {
		return true
	}
	if o.Status != 503 {
		return false
	}
	return slices.ContainsFunc(refusalMessages[:], func(m string) bool { return strings.Contains(o.Error, m) })
}

// servedBy is the replica the operation went to: its target, or for the load balancer the
// server HAProxy logged, else the replica that answered ("" when unknown).
func (o *Op) servedBy() string {
	switch {
	case o.Target != "lb":
		return o.Target
	case o.LBServer != "":
		return o.LBServer
	}
	return o.Replica
}

// replicaFault returns the kind of a replica fault on the operation's replica while it was in
// flight ("" when none was), and whether the operation was already in flight when that fault
// began.
func replicaFault(o *Op, faults []Fault, end time.Duration) (kind FaultKind, struck bool) {
	r := o.servedBy()
	if r == "" {
		return "", false
	}
	complete := max(o.Complete, o.Invoke)
	for i := range faults {
		f := &faults[i]
		if !slices.Contains(replicaFaults[:], f.Kind) || !slices.Contains(f.Targets, r) {
			continue
		}
		if f.Start <= complete && o.Invoke <= f.Until(end) {
			return f.Kind, o.Invoke < f.Start
		}
	}
	return "", false
}

// classifyFailure returns a failed operation's cause, phase and the replica fault it met, and
// whether it was in flight on its replica when that fault began.
func classifyFailure(o *Op, faults []Fault, end time.Duration) (cause, phase string, fault FaultKind, struck bool) {
	fault, struck = replicaFault(o, faults, end)
	switch {
	case o.refused():
		cause = CauseRefused
	case o.Target == "lb" && o.LBLogged && o.LBServer == "" && o.Status == 503:
		cause = CauseNoReplica
	case fault != "":
		cause = CauseFaultedReplica
	default:
		cause = CauseOther
	}
	return cause, o.phase(), fault, struck
}

// failures counts the failed operations by cause, phase and fault, and what the balancer did.
func failures(h *History) ([]FailureCount, BalancerStats) {
	var bal BalancerStats
	counts := map[FailureCount]*FailureCount{}
	for i := range h.Ops {
		op := &h.Ops[i]
		lb := op.Target == "lb"
		if lb {
			bal.Ops++
			if op.LBLogged {
				bal.Logged++
			}
			if op.LBRetries > 0 {
				bal.Retried++
				if op.Result == ResultOK {
					bal.RetriedOK++
				}
			}
			if op.LBRedispatched {
				bal.Redispatched++
			}
		}
		if op.Result == ResultOK {
			continue
		}
		cause, phase, fault, struck := classifyFailure(op, h.Faults, h.End)
		key := FailureCount{Cause: cause, Phase: phase, Fault: fault}
		c := counts[key]
		if c == nil {
			c = &key
			counts[key] = c
		}
		c.Ops++
		if struck {
			c.Struck++
		}
		if lb {
			c.ViaBalancer++
			if op.LBRetries > 0 {
				c.Retried++
			}
		}
	}
	out := make([]FailureCount, 0, len(counts))
	for _, c := range counts {
		out = append(out, *c)
	}
	slices.SortFunc(out, func(a, b FailureCount) int {
		return cmp.Or(cmp.Compare(a.Cause, b.Cause), cmp.Compare(a.Phase, b.Phase), cmp.Compare(a.Fault, b.Fault))
	})
	return out, bal
}

// readBalancerLog reads the load balancer's log and marks each operation it names with what
// the balancer did: the replica that served it last and how often it was retried. Lines that
// are not request lines are skipped; a request line that does not parse is an error.
func readBalancerLog(r io.Reader, ops []Op) error {
	byTag := make(map[string]*Op, len(ops))
	for i := range ops {
		if ops[i].Tag != "" {
			byTag[ops[i].Tag] = &ops[i]
		}
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var errs []error
	for sc.Scan() {
		req, ok, err := proc.ParseHAProxyLogLine(sc.Text())
		if err != nil && len(errs) < 5 {
			errs = append(errs, err)
		}
		if !ok || err != nil {
			continue
		}
		if op := byTag[req.Tag]; op != nil {
			op.LBLogged, op.LBServer, op.LBRetries, op.LBRedispatched = true, req.Server, req.Retries, req.Redispatched
		}
	}
	if err := sc.Err(); err != nil {
		errs = append(errs, fmt.Errorf("read balancer log: %w", err))
	}
	return errors.Join(errs...)
}

// readBalancerLogFile is readBalancerLog on a file.
func readBalancerLogFile(path string, ops []Op) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("balancer log: %w", err)
	}
	defer f.Close()
	return readBalancerLog(f, ops)
}
