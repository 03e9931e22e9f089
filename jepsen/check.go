package jepsen

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// CheckConfig tells the checker what the cluster under test promised.
type CheckConfig struct {
	// Staleness is how far a read may lag an acknowledged revision: the replicas' --stale-bound
	// under the bounded level, 0 under linearizable, negative under local (no bound at all).
	Staleness time.Duration
	// SessionTTL is the replicas' --session-ttl: a binding idle this long may expire.
	SessionTTL time.Duration
	// Grace is how long after a worker fault ends a binding change may still be put down to it:
	// health probes notice a failure, and a return, some intervals late.
	Grace time.Duration
	// PorcupineTimeout bounds porcupine's search for one session (0: 10 s).
	PorcupineTimeout time.Duration
}

// Violation is one broken promise, with the operations and faults that show it.
type Violation struct {
	// Check names the checker: register, revision-backwards, revision-two-workers, churn,
	// durability, convergence.
	Check   string `json:"check"`
	Session string `json:"session,omitempty"`
	Message string `json:"message"`
	Ops     []int  `json:"ops,omitempty"`
	Faults  []int  `json:"faults,omitempty"`
}

// OpCounts counts operations by how they ended.
type OpCounts struct {
	Total    int `json:"total"`
	OK       int `json:"ok"`
	Fail     int `json:"fail"`
	Unknown  int `json:"unknown"`
	Observed int `json:"observed"`
	Streams  int `json:"streams"`
	First    int `json:"first_requests"`
	Sessions int `json:"sessions"`
}

// RegisterStats is the outcome of the per-session register check.
type RegisterStats struct {
	Sessions     int `json:"sessions"`
	Linearizable int `json:"linearizable"`
	Illegal      int `json:"illegal"`
	// TimedOut sessions are those porcupine could not decide in time; the direct checks below
	// still cover them (they are exact for this model, see DESIGN.md).
	TimedOut           int `json:"timed_out"`
	Backwards          int `json:"revision_backwards"`
	RevisionTwoWorkers int `json:"revision_two_workers"`
}

// ChurnStats counts changes of a session's binding and what explains them.
type ChurnStats struct {
	Changes       int `json:"changes"`
	WorkerChanges int `json:"worker_changes"`
	ByWorkerFault int `json:"by_worker_fault"`
	ByDrain       int `json:"by_drain"`
	ByExpiry      int `json:"by_expiry"`
	// ByRebind changes followed a deliberate invalidation of the old binding (the stale fault).
	ByRebind    int `json:"by_rebind"`
	Unexplained int `json:"unexplained"`
}

// DurabilityStats is the outcome of reading bindings back after full-cluster restarts and at
// the end of the run.
type DurabilityStats struct {
	Restarts int `json:"restarts"`
	// Checked bindings were acknowledged, unexpired, and read back.
	Checked int `json:"checked"`
	Lost    int `json:"lost"`
	// Regressed bindings came back with a lower revision, or the same revision on another worker.
	Regressed int `json:"regressed"`
	// Excused bindings were absent, but their worker failed or they may have expired since.
	Excused int `json:"excused"`
	// Unverified reads failed (no answer from the replica).
	Unverified int `json:"unverified"`
	// Late bindings were missing or older on the first read after a restart and there on a
	// later one: the leader answered before it had applied its log.
	Late int `json:"late"`
	// Divergent sessions read differently on different replicas at the end.
	Divergent int `json:"divergent"`
}

// ProbeStats counts the stale fault's probes: requests sent straight to a replica back from a
// pause or a partition, for sessions rebound while it was away.
type ProbeStats struct {
	Sent     int `json:"sent"`
	Sessions int `json:"sessions"`
	// Fresh probes saw the rebind's binding or a newer one; Old ones a lower revision (each
	// also a revision-backwards violation); Errors saw none (503 while the replica has no
	// read lease, a timeout).
	Fresh  int `json:"fresh"`
	Old    int `json:"old"`
	Errors int `json:"errors"`
}

// Availability is the share of requests that succeeded while faults of one kind were active.
type Availability struct {
	Kind   string  `json:"kind"`
	Faults int     `json:"faults"`
	Ops    int     `json:"ops"`
	OK     int     `json:"ok"`
	Share  float64 `json:"share"`
	// Elsewhere counts the requests not sent to a faulted replica (those sent to healthy ones,
	// or through the load balancer): the ones the cluster promises to serve.
	ElsewhereOps   int     `json:"elsewhere_ops"`
	ElsewhereOK    int     `json:"elsewhere_ok"`
	ElsewhereShare float64 `json:"elsewhere_share"`
}

// Window is a stretch of the run, with the faults that overlap it.
type Window struct {
	From   time.Duration `json:"from_ns"`
	To     time.Duration `json:"to_ns"`
	Length time.Duration `json:"length_ns"`
	Faults []int         `json:"faults,omitempty"`
}

// Analysis is everything the checker found in a history.
type Analysis struct {
	Ops          OpCounts        `json:"ops"`
	Register     RegisterStats   `json:"register"`
	Churn        ChurnStats      `json:"churn"`
	Durability   DurabilityStats `json:"durability"`
	Probes       ProbeStats      `json:"stale_probes"`
	Availability []Availability  `json:"availability"`
	// Failures counts the failed and unknown requests by cause, phase and the fault on their
	// replica; Balancer what the load balancer retried.
	Failures []FailureCount `json:"failures"`
	Balancer BalancerStats  `json:"balancer"`
	// NoNewBinding is the longest stretch with no successful first binding of a session.
	NoNewBinding Window      `json:"longest_without_new_binding"`
	Violations   []Violation `json:"violations"`
	// Illegal lists the sessions porcupine found no linearization for, worst first.
	Illegal []string `json:"illegal_sessions,omitempty"`
}

// Valid reports whether the history broke no promise.
func (a *Analysis) Valid() bool { return len(a.Violations) == 0 }

// Check runs every checker over the history.
func Check(h *History, cfg CheckConfig) *Analysis {
	if cfg.PorcupineTimeout <= 0 {
		cfg.PorcupineTimeout = 10 * time.Second
	}
	a := &Analysis{Violations: []Violation{}}
	sessions := bySession(h.Ops)
	a.Ops = countOps(h.Ops, len(sessions))
	names := make([]string, 0, len(sessions))
	for s := range sessions {
		names = append(names, s)
	}
	sort.Strings(names)
	for _, s := range names {
		ops := sessions[s]
		a.checkRevisions(s, ops, cfg)
		a.checkRegister(s, ops, h.End, cfg)
		a.checkChurn(s, ops, h, cfg)
	}
	a.checkDurability(h, sessions, cfg)
	a.Probes = probeStats(sessions)
	for _, c := range h.Crashes {
		a.Violations = append(a.Violations, Violation{Check: "crash",
			Message: fmt.Sprintf("replica %s exited on its own at %s", c.Replica, fmtDur(c.At))})
	}
	a.Availability = availability(h)
	a.Failures, a.Balancer = failures(h)
	a.NoNewBinding = longestWithoutNewBinding(h, sessions)
	return a
}

func bySession(ops []Op) map[string][]*Op {
	out := map[string][]*Op{}
	for i := range ops {
		op := &ops[i]
		out[op.Session] = append(out[op.Session], op)
	}
	for _, l := range out {
		slices.SortStableFunc(l, func(x, y *Op) int { return cmp.Compare(x.Invoke, y.Invoke) })
	}
	return out
}

func countOps(ops []Op, sessions int) OpCounts {
	c := OpCounts{Total: len(ops), Sessions: sessions}
	for i := range ops {
		op := &ops[i]
		switch op.Result {
		case ResultOK:
			c.OK++
		case ResultFail:
			c.Fail++
		default:
			c.Unknown++
		}
		if op.Observed() {
			c.Observed++
		}
		if op.Stream {
			c.Streams++
		}
		if op.First {
			c.First++
		}
	}
	return c
}

// widen returns the earliest moment a read may reflect: Staleness before its invocation.
func widen(t time.Duration, cfg CheckConfig) time.Duration {
	if cfg.Staleness < 0 {
		return math.MinInt64 / 4
	}
	return t - cfg.Staleness
}

// checkRevisions is the direct form of the register check: one revision names one worker, and
// no operation observes a revision lower than one acknowledged more than the staleness bound
// before it was invoked.
func (a *Analysis) checkRevisions(session string, ops []*Op, cfg CheckConfig) {
	byRev := map[uint64]*Op{}
	var seen []*Op
	for _, op := range ops {
		if !op.Observed() {
			continue
		}
		seen = append(seen, op)
		if first, ok := byRev[op.Revision]; !ok {
			byRev[op.Revision] = op
		} else if first.Worker != op.Worker {
			a.Register.RevisionTwoWorkers++
			a.Violations = append(a.Violations, Violation{
				Check: "revision-two-workers", Session: session, Ops: []int{first.ID, op.ID},
				Message: fmt.Sprintf("revision %d named worker %s (op %d via %s) and worker %s (op %d via %s)",
					op.Revision, first.Worker, first.ID, first.Replica, op.Worker, op.ID, op.Replica),
			})
		}
	}
	if cfg.Staleness < 0 {
		return
	}
	// Sweep operations by widened invocation, folding in every acknowledgement that returned
	// before it; the highest so far must not exceed what the operation saw.
	acks := slices.Clone(seen)
	slices.SortFunc(acks, func(x, y *Op) int { return cmp.Compare(x.Headers, y.Headers) })
	calls := slices.Clone(seen)
	slices.SortFunc(calls, func(x, y *Op) int { return cmp.Compare(x.Invoke, y.Invoke) })
	var best *Op
	i := 0
	for _, op := range calls {
		for i < len(acks) && acks[i].Headers < widen(op.Invoke, cfg) {
			if best == nil || acks[i].Revision > best.Revision {
				best = acks[i]
			}
			i++
		}
		if best != nil && op.Revision < best.Revision {
			a.Register.Backwards++
			a.Violations = append(a.Violations, Violation{
				Check: "revision-backwards", Session: session, Ops: []int{best.ID, op.ID},
				Message: fmt.Sprintf("op %d (via %s, invoked %s) saw revision %d on %s, but op %d had been acknowledged revision %d on %s at %s",
					op.ID, op.Replica, fmtDur(op.Invoke), op.Revision, op.Worker, best.ID, best.Revision, best.Worker, fmtDur(best.Headers)),
			})
		}
	}
}

// regOutput is what one operation saw of its session's register.
type regOutput struct {
	Known    bool
	Worker   string
	Revision uint64
}

// regInput describes the operation for porcupine's visualisation.
type regInput struct {
	ID     int
	Target string
	Stream bool
}

// regState is the session's binding as clients may see it: the highest revision observed so far.
type regState struct {
	Worker   string
	Revision uint64
}

// RegisterModel is the porcupine model of one session's binding (see DESIGN.md): an operation
// that saw (worker, revision) is legal if the revision is above the register's, which it then
// becomes, or equal to it with the same worker. An operation that saw nothing (a failure, a
// timeout) is legal anywhere and changes nothing: whatever it may have written can only show
// up later as a higher revision, which any operation may observe.
func RegisterModel() porcupine.Model {
	return porcupine.Model{
		Init: func() any { return regState{} },
		Step: func(state, _, output any) (bool, any) {
			st := state.(regState)
			out := output.(regOutput)
			switch {
			case !out.Known:
				return true, st
			case out.Revision > st.Revision:
				return true, regState{Worker: out.Worker, Revision: out.Revision}
			case out.Revision == st.Revision:
				return out.Worker == st.Worker, st
			}
			return false, st
		},
		DescribeOperation: func(input, output any) string {
			in := input.(regInput)
			out := output.(regOutput)
			kind := "chat"
			if in.Stream {
				kind = "stream"
			}
			if !out.Known {
				return fmt.Sprintf("#%d %s via %s -> ?", in.ID, kind, in.Target)
			}
			return fmt.Sprintf("#%d %s via %s -> %s@%d", in.ID, kind, in.Target, out.Worker, out.Revision)
		},
		DescribeState: func(state any) string {
			st := state.(regState)
			if st.Revision == 0 {
				return "unbound"
			}
			return fmt.Sprintf("%s@%d", st.Worker, st.Revision)
		},
	}
}

// registerOps turns a session's operations into porcupine operations: observed ones span
// [invoke - staleness, headers]; the rest return at the end of the history.
func registerOps(ops []*Op, end time.Duration, cfg CheckConfig) []porcupine.Operation {
	lanes := map[[2]int]int{}
	out := make([]porcupine.Operation, 0, len(ops))
	for _, op := range ops {
		key := [2]int{op.Client, op.Lane}
		cid, ok := lanes[key]
		if !ok {
			cid = len(lanes)
			lanes[key] = cid
		}
		p := porcupine.Operation{
			ClientId: cid,
			Input:    regInput{ID: op.ID, Target: op.Target, Stream: op.Stream},
			Call:     int64(widen(op.Invoke, cfg)),
			Return:   int64(end) + 1,
			Output:   regOutput{},
		}
		if op.Observed() {
			p.Output = regOutput{Known: true, Worker: op.Worker, Revision: op.Revision}
			p.Return = int64(op.Headers)
		}
		out = append(out, p)
	}
	return out
}

func (a *Analysis) checkRegister(session string, ops []*Op, end time.Duration, cfg CheckConfig) {
	a.Register.Sessions++
	res := porcupine.CheckOperationsTimeout(RegisterModel(), registerOps(ops, end, cfg), cfg.PorcupineTimeout)
	switch res {
	case porcupine.Ok:
		a.Register.Linearizable++
	case porcupine.Illegal:
		a.Register.Illegal++
		a.Illegal = append(a.Illegal, session)
		a.Violations = append(a.Violations, Violation{
			Check: "register", Session: session,
			Message: fmt.Sprintf("porcupine: no order of session %s's %d operations keeps its binding consistent", session, len(ops)),
		})
	default:
		a.Register.TimedOut++
	}
}

// revSpan is what the history shows of one revision of a session's binding.
type revSpan struct {
	rev      uint64
	worker   string
	firstRet time.Duration // earliest acknowledgement
	lastCall time.Duration // latest invocation that still saw it
	firstOp  int
	lastOp   int
}

func revisionSpans(ops []*Op) []revSpan {
	spans := map[uint64]*revSpan{}
	for _, op := range ops {
		if !op.Observed() {
			continue
		}
		s, ok := spans[op.Revision]
		if !ok {
			spans[op.Revision] = &revSpan{rev: op.Revision, worker: op.Worker, firstRet: op.Headers, lastCall: op.Invoke, firstOp: op.ID, lastOp: op.ID}
			continue
		}
		if op.Headers < s.firstRet {
			s.firstRet, s.firstOp = op.Headers, op.ID
		}
		if op.Invoke > s.lastCall {
			s.lastCall, s.lastOp = op.Invoke, op.ID
		}
	}
	out := make([]revSpan, 0, len(spans))
	for _, s := range spans {
		out = append(out, *s)
	}
	slices.SortFunc(out, func(x, y revSpan) int { return cmp.Compare(x.rev, y.rev) })
	return out
}

// idleGaps returns the stretches in which the session had no operation in flight.
func idleGaps(ops []*Op) [][2]time.Duration {
	var gaps [][2]time.Duration
	var busyUntil time.Duration
	seen := false
	for _, op := range ops { // sorted by invoke
		if !op.reachedRouter() {
			// It cannot have touched the binding, so the idle time runs on through it.
			continue
		}
		if seen && op.Invoke > busyUntil {
			gaps = append(gaps, [2]time.Duration{busyUntil, op.Invoke})
		}
		seen = true
		busyUntil = max(busyUntil, op.Complete, op.Invoke)
	}
	return gaps
}

func overlaps(a0, a1, b0, b1 time.Duration) bool { return a0 <= b1 && b0 <= a1 }

// checkChurn explains every change of the session's binding (each new revision after the
// first) by a fault of the old worker, a drain of it, an idle expiry, or the nemesis's own
// invalidation of that binding.
func (a *Analysis) checkChurn(session string, ops []*Op, h *History, cfg CheckConfig) {
	spans := revisionSpans(ops)
	gaps := idleGaps(ops)
	slack := min(time.Second, cfg.SessionTTL/10)
	for i := 1; i < len(spans); i++ {
		prev, next := spans[i-1], spans[i]
		a.Churn.Changes++
		if prev.worker != next.worker {
			a.Churn.WorkerChanges++
		}
		// The change happened after some client could still see prev and before one saw next.
		lo := time.Duration(0)
		if cfg.Staleness >= 0 {
			lo = prev.lastCall - cfg.Staleness
		}
		hi := next.firstRet
		lo = min(lo, hi)
		var why string
		var faults []int
		for _, f := range h.Faults {
			if !slices.Contains(f.Targets, prev.worker) {
				continue
			}
			switch f.Kind {
			case FaultWorkerCrash, FaultWorkerStop:
				if overlaps(f.Start, f.Until(h.End)+cfg.Grace, lo, hi) {
					why = "worker fault"
					faults = append(faults, f.ID)
				}
			case FaultDrain:
				if f.Start <= hi {
					why = "drain"
					faults = append(faults, f.ID)
				}
			}
		}
		if why == "" {
			for _, rb := range h.Rebinds {
				// The nemesis dropped exactly this binding before the next one was seen (a
				// request whose answer was lost may have done it too).
				if rb.Session == session && rb.Revision == prev.rev && rb.Result != ResultFail && rb.Invoke <= hi {
					why = "rebind"
					break
				}
			}
		}
		if why == "" && cfg.SessionTTL > 0 {
			for _, g := range gaps {
				if g[1]-g[0] >= cfg.SessionTTL-slack && overlaps(g[0]+cfg.SessionTTL-slack, g[1]+cfg.Grace, lo, hi) {
					why = "expiry"
					break
				}
			}
		}
		switch why {
		case "worker fault":
			a.Churn.ByWorkerFault++
		case "drain":
			a.Churn.ByDrain++
		case "expiry":
			a.Churn.ByExpiry++
		case "rebind":
			a.Churn.ByRebind++
		default:
			a.Churn.Unexplained++
			a.Violations = append(a.Violations, Violation{
				Check: "churn", Session: session, Ops: []int{prev.lastOp, next.firstOp},
				Faults: faultsDuring(h, lo, hi),
				Message: fmt.Sprintf("binding moved %s@%d -> %s@%d between %s and %s with no fault of %s, no drain, no idle expiry and no invalidation",
					prev.worker, prev.rev, next.worker, next.rev, fmtDur(lo), fmtDur(hi), prev.worker),
			})
		}
	}
}

// probeStats compares each probe with the newest rebind of its session acknowledged before
// the probe was sent.
func probeStats(sessions map[string][]*Op) ProbeStats {
	var p ProbeStats
	for _, ops := range sessions {
		probed := false
		for _, op := range ops {
			if op.Nemesis != "probe" {
				continue
			}
			p.Sent++
			probed = true
			var want uint64
			for _, rb := range ops {
				if rb.Nemesis == "rebind" && rb.Observed() && rb.Headers < op.Invoke {
					want = max(want, rb.Revision)
				}
			}
			switch {
			case !op.Observed():
				p.Errors++
			case op.Revision < want:
				p.Old++
			default:
				p.Fresh++
			}
		}
		if probed {
			p.Sessions++
		}
	}
	return p
}

func faultsDuring(h *History, from, to time.Duration) []int {
	var out []int
	for _, f := range h.Faults {
		if overlaps(f.Start, f.Until(h.End), from, to) {
			out = append(out, f.ID)
		}
	}
	return out
}

// ack is the highest revision of a session acknowledged before some moment.
type ack struct {
	op   *Op
	last time.Duration // latest activity of the session before the moment
}

func acknowledgedBefore(ops []*Op, t time.Duration) (ack, bool) {
	var out ack
	for _, op := range ops {
		if op.Invoke >= t {
			continue
		}
		out.last = max(out.last, op.Invoke)
		if op.Complete < t {
			out.last = max(out.last, op.Complete)
		}
		if op.Observed() && op.Headers < t && (out.op == nil || op.Revision > out.op.Revision) {
			out.op = op
		}
	}
	return out, out.op != nil
}

// checkDurability compares the admin reads after each full-cluster restart (and the final
// reads at the end) with what clients had been acknowledged before.
func (a *Analysis) checkDurability(h *History, sessions map[string][]*Op, cfg CheckConfig) {
	faults := map[int]*Fault{}
	for i := range h.Faults {
		f := &h.Faults[i]
		faults[f.ID] = f
		if f.Kind == FaultRestart {
			a.Durability.Restarts++
		}
	}
	// The final reads: every replica read each session; they must agree.
	final := map[string][]Read{}
	for _, rd := range h.Reads {
		if rd.Fault == 0 && rd.Error == "" {
			final[rd.Session] = append(final[rd.Session], rd)
		}
	}
	finalNames := make([]string, 0, len(final))
	for s := range final {
		finalNames = append(finalNames, s)
	}
	sort.Strings(finalNames)
	for _, s := range finalNames {
		rds := final[s]
		for _, rd := range rds[1:] {
			if rd.Found != rds[0].Found || rd.Revision != rds[0].Revision || rd.Worker != rds[0].Worker {
				a.Durability.Divergent++
				a.Violations = append(a.Violations, Violation{
					Check: "convergence", Session: s,
					Message: fmt.Sprintf("after the faults healed, %s reads %s and %s reads %s", rds[0].Replica, describeRead(rds[0]), rd.Replica, describeRead(rd)),
				})
				break
			}
		}
	}
	for _, rd := range h.Reads {
		if rd.Error != "" {
			a.Durability.Unverified++
			continue
		}
		if rd.Fault != 0 && rd.Attempts > 1 {
			a.Durability.Late++
		}
		// A restart's reads are compared with what was acknowledged before the kill; the final
		// reads with everything acknowledged.
		cut := rd.At
		var f *Fault
		if rd.Fault != 0 {
			f = faults[rd.Fault]
			if f == nil {
				continue
			}
			cut = f.Start
		}
		got, ok := acknowledgedBefore(sessions[rd.Session], cut)
		if !ok {
			continue
		}
		// An idle binding may have expired, wherever the time went: only those active within
		// half a TTL of the kill are owed.
		if cfg.SessionTTL > 0 && cut-got.last > cfg.SessionTTL/2 {
			continue
		}
		want := got.op
		what := "at the end of the run"
		if f != nil {
			what = fmt.Sprintf("after full restart #%d", f.ID)
		}
		switch {
		case !rd.Found:
			if excused := workerFaultSince(h, want.Worker, want.Headers, rd.At, cfg); excused {
				a.Durability.Excused++
				continue
			}
			a.Durability.Checked++
			a.Durability.Lost++
			v := Violation{Check: "durability", Session: rd.Session, Ops: []int{want.ID},
				Message: fmt.Sprintf("%s: %s has no binding for %s, acknowledged %s@%d to op %d at %s",
					what, rd.Replica, rd.Session, want.Worker, want.Revision, want.ID, fmtDur(want.Headers))}
			if f != nil {
				v.Faults = []int{f.ID}
			}
			a.Violations = append(a.Violations, v)
		case rd.Revision < want.Revision || (rd.Revision == want.Revision && rd.Worker != want.Worker):
			a.Durability.Checked++
			a.Durability.Regressed++
			v := Violation{Check: "durability", Session: rd.Session, Ops: []int{want.ID},
				Message: fmt.Sprintf("%s: %s reads %s@%d for %s, but %s@%d was acknowledged to op %d at %s",
					what, rd.Replica, rd.Worker, rd.Revision, rd.Session, want.Worker, want.Revision, want.ID, fmtDur(want.Headers))}
			if f != nil {
				v.Faults = []int{f.ID}
			}
			a.Violations = append(a.Violations, v)
		default:
			a.Durability.Checked++
		}
	}
}

func describeRead(rd Read) string {
	if !rd.Found {
		return "no binding"
	}
	return fmt.Sprintf("%s@%d", rd.Worker, rd.Revision)
}

// workerFaultSince reports whether the worker failed or was drained between from and to, which
// lets its bindings go.
func workerFaultSince(h *History, worker string, from, to time.Duration, cfg CheckConfig) bool {
	for _, f := range h.Faults {
		if !slices.Contains(f.Targets, worker) {
			continue
		}
		switch f.Kind {
		case FaultWorkerCrash, FaultWorkerStop, FaultDrain:
			if overlaps(f.Start, f.Until(h.End)+cfg.Grace, from, to) {
				return true
			}
		}
	}
	return false
}

// availability is the share of operations invoked during each kind of fault that succeeded,
// and the same for operations invoked while no fault was active.
func availability(h *History) []Availability {
	kinds := map[string]*Availability{}
	var order []string
	get := func(k string) *Availability {
		if kinds[k] == nil {
			kinds[k] = &Availability{Kind: k}
			order = append(order, k)
		}
		return kinds[k]
	}
	for _, f := range h.Faults {
		get(string(f.Kind)).Faults++
	}
	for i := range h.Ops {
		op := &h.Ops[i]
		ok := op.Result == ResultOK
		// Per kind: was the request sent during such a fault, and was it sent to a target of one?
		during := map[FaultKind]bool{}
		atTarget := map[FaultKind]bool{}
		for _, f := range h.Faults {
			if op.Invoke >= f.Start && op.Invoke <= f.Until(h.End) {
				during[f.Kind] = true
				if slices.Contains(f.Targets, op.Target) {
					atTarget[f.Kind] = true
				}
			}
		}
		if len(during) == 0 {
			a := get("none")
			a.Ops++
			a.ElsewhereOps++
			if ok {
				a.OK++
				a.ElsewhereOK++
			}
			continue
		}
		for k := range during {
			a := get(string(k))
			a.Ops++
			if ok {
				a.OK++
			}
			if !atTarget[k] {
				a.ElsewhereOps++
				if ok {
					a.ElsewhereOK++
				}
			}
		}
	}
	out := make([]Availability, 0, len(order))
	for _, k := range order {
		a := *kinds[k]
		if a.Ops > 0 {
			a.Share = float64(a.OK) / float64(a.Ops)
		}
		if a.ElsewhereOps > 0 {
			a.ElsewhereShare = float64(a.ElsewhereOK) / float64(a.ElsewhereOps)
		}
		out = append(out, a)
	}
	slices.SortStableFunc(out, func(x, y Availability) int {
		if (x.Kind == "none") != (y.Kind == "none") {
			if x.Kind == "none" {
				return 1
			}
			return -1
		}
		return strings.Compare(x.Kind, y.Kind)
	})
	return out
}

// longestWithoutNewBinding is the longest stretch, from the first new binding to the last
// invocation, in which no session got its first binding.
func longestWithoutNewBinding(h *History, sessions map[string][]*Op) Window {
	var times []time.Duration
	var lastInvoke time.Duration
	for _, ops := range sessions {
		var first time.Duration = -1
		for _, op := range ops {
			lastInvoke = max(lastInvoke, op.Invoke)
			if op.Observed() && op.First && (first < 0 || op.Headers < first) {
				first = op.Headers
			}
		}
		if first >= 0 {
			times = append(times, first)
		}
	}
	if len(times) == 0 {
		return Window{}
	}
	slices.Sort(times)
	times = append(times, max(lastInvoke, times[len(times)-1]))
	var w Window
	for i := 1; i < len(times); i++ {
		if d := times[i] - times[i-1]; d > w.Length {
			w = Window{From: times[i-1], To: times[i], Length: d}
		}
	}
	w.Faults = faultsDuring(h, w.From, w.To)
	return w
}

func fmtDur(d time.Duration) string {
	return fmt.Sprintf("%.3fs", d.Seconds())
}
