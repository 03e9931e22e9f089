package jepsen

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

const ms = time.Millisecond

// hist builds hand-made histories.
type hist struct{ h History }

// saw adds an operation of session s, invoked at inv ms, whose headers came at ret ms and named
// worker@rev.
func (b *hist) saw(s string, inv, ret int, worker string, rev uint64) *hist {
	b.h.Ops = append(b.h.Ops, Op{
		ID: len(b.h.Ops) + 1, Session: s, Target: "r0", Replica: "r0",
		Invoke: time.Duration(inv) * ms, Headers: time.Duration(ret) * ms, Complete: time.Duration(ret+1) * ms,
		Result: ResultOK, Status: 200, Worker: worker, Revision: rev,
	})
	b.h.End = max(b.h.End, time.Duration(ret+1)*ms)
	return b
}

// lost adds an operation of session s that ended with res and no answer.
func (b *hist) lost(s string, inv, end int, res Result) *hist {
	b.h.Ops = append(b.h.Ops, Op{
		ID: len(b.h.Ops) + 1, Session: s, Target: "r1",
		Invoke: time.Duration(inv) * ms, Complete: time.Duration(end) * ms, Result: res, Error: "timeout",
	})
	b.h.End = max(b.h.End, time.Duration(end)*ms)
	return b
}

func (b *hist) fault(kind FaultKind, target string, start, end int) *hist {
	b.h.Faults = append(b.h.Faults, Fault{
		ID: len(b.h.Faults) + 1, Kind: kind, Targets: []string{target},
		Start: time.Duration(start) * ms, End: time.Duration(end) * ms,
	})
	return b
}

// rebind adds the nemesis's invalidation of s at rev, invoked at inv ms, ended with res.
func (b *hist) rebind(s string, inv int, rev uint64, res Result) *hist {
	b.h.Rebinds = append(b.h.Rebinds, Rebind{Fault: 1, Session: s, Replica: "r1",
		Invoke: time.Duration(inv) * ms, Complete: time.Duration(inv+2) * ms, Revision: rev, Result: res})
	return b
}

// nemesis marks the last operation as the stale fault's own (rebind or probe).
func (b *hist) nemesis(kind string) *hist {
	b.h.Ops[len(b.h.Ops)-1].Nemesis = kind
	return b
}

func (b *hist) read(fault int, s, replica string, at int, worker string, rev uint64) *hist {
	b.h.Reads = append(b.h.Reads, Read{Fault: fault, Session: s, Replica: replica, At: time.Duration(at) * ms,
		Found: worker != "", Worker: worker, Revision: rev})
	return b
}

var testCheck = CheckConfig{Staleness: 100 * ms, SessionTTL: 10 * time.Second, Grace: 500 * ms, PorcupineTimeout: 5 * time.Second}

func checks(a *Analysis) []string {
	var out []string
	for _, v := range a.Violations {
		out = append(out, v.Check)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

func TestCheckerAcceptsLegalHistories(t *testing.T) {
	cases := []struct {
		name string
		h    *hist
	}{
		{"steady session", (&hist{}).saw("a", 0, 10, "w0", 5).saw("a", 20, 30, "w0", 5).saw("a", 40, 50, "w0", 5)},
		{"racing first requests agree", (&hist{}).saw("a", 0, 30, "w1", 7).saw("a", 1, 31, "w1", 7)},
		{"unknown and failed operations change nothing", (&hist{}).saw("a", 0, 10, "w0", 5).
			lost("a", 20, 5000, ResultUnknown).lost("a", 30, 40, ResultFail).saw("a", 50, 60, "w0", 5)},
		{"move explained by a worker crash", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w0", 15, 2000).
			saw("a", 20, 30, "w1", 9).saw("a", 2500, 2510, "w1", 9)},
		{"move shortly after a worker returned (grace)", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerStop, "w0", 15, 100).
			saw("a", 400, 420, "w2", 9)},
		{"move explained by a drain", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultDrain, "w0", 15, 0).saw("a", 20, 30, "w1", 9)},
		{"rebind to the same worker after an idle expiry", (&hist{}).saw("a", 0, 10, "w0", 5).saw("a", 10_500, 10_520, "w0", 40)},
		// A request that never reached a replica (refused connection) does not cut the idle
		// time in two: found by a five-replica run, where the session idled 31 s (TTL 30 s)
		// around a request to a killed replica.
		{"expiry across a request that never left", (&hist{}).saw("a", 0, 10, "w0", 5).
			lost("a", 4000, 4000, ResultFail).saw("a", 10_500, 10_520, "w0", 40)},
		{"a stale read within the bound", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w0", 5, 50).
			saw("a", 20, 30, "w1", 9).saw("a", 80, 90, "w0", 5)},
		{"concurrent reads straddling a change", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w0", 15, 300).
			saw("a", 200, 400, "w0", 5).saw("a", 250, 260, "w1", 9)},
		{"kept across a full restart", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultRestart, "all", 100, 200).
			read(1, "a", "r1", 300, "w0", 5).saw("a", 400, 410, "w0", 5)},
		{"absent after restart, but its worker failed", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w0", 20, 50).
			fault(FaultRestart, "all", 100, 200).read(2, "a", "r1", 300, "", 0)},
		{"replicas agree at the end", (&hist{}).saw("a", 0, 10, "w0", 5).read(0, "a", "r0", 100, "w0", 5).read(0, "a", "r1", 100, "w0", 5)},
		{"move explained by the nemesis's invalidation", (&hist{}).saw("a", 0, 10, "w0", 5).rebind("a", 20, 5, ResultOK).
			saw("a", 25, 30, "w1", 9).nemesis("rebind").saw("a", 300, 310, "w1", 9).nemesis("probe")},
		{"an invalidation whose answer was lost may explain a move", (&hist{}).saw("a", 0, 10, "w0", 5).rebind("a", 20, 5, ResultUnknown).
			saw("a", 25, 30, "w2", 9)},
		{"a probe within the bound may still see the old binding", (&hist{}).saw("a", 0, 10, "w0", 5).rebind("a", 20, 5, ResultOK).
			saw("a", 25, 30, "w1", 9).nemesis("rebind").saw("a", 80, 90, "w0", 5).nemesis("probe")},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := Check(&tc.h.h, testCheck)
			if !a.Valid() {
				t.Fatalf("violations in a legal history: %+v", a.Violations)
			}
			if a.Register.Linearizable != a.Register.Sessions {
				t.Fatalf("register: %+v", a.Register)
			}
		})
	}
}

func TestCheckerCatchesBrokenPromises(t *testing.T) {
	cases := []struct {
		name string
		h    *hist
		want []string
	}{
		{"revision goes backwards", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w0", 15, 60).
			saw("a", 20, 30, "w1", 9).saw("a", 500, 510, "w0", 5),
			[]string{"register", "revision-backwards"}},
		{"stale read past the bound", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w0", 15, 60).
			saw("a", 20, 30, "w1", 9).saw("a", 131, 140, "w0", 5),
			[]string{"register", "revision-backwards"}},
		{"one revision on two workers", (&hist{}).saw("a", 0, 10, "w0", 5).saw("a", 5, 12, "w1", 5),
			[]string{"register", "revision-two-workers"}},
		{"unexplained worker change", (&hist{}).saw("a", 0, 10, "w0", 5).saw("a", 20, 30, "w1", 9),
			[]string{"churn"}},
		{"unexplained rebind on the same worker (a lost compare-and-set)", (&hist{}).saw("a", 0, 30, "w0", 5).saw("a", 1, 31, "w0", 6),
			[]string{"churn"}},
		{"fault of another worker explains nothing", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w2", 12, 18).
			saw("a", 20, 30, "w1", 9),
			[]string{"churn"}},
		{"a replica fault explains nothing", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultKill, "r0", 12, 18).
			saw("a", 20, 30, "w1", 9),
			[]string{"churn"}},
		{"gap shorter than the TTL explains nothing", (&hist{}).saw("a", 0, 10, "w0", 5).saw("a", 5000, 5010, "w1", 9),
			[]string{"churn"}},
		{"a request that reached a replica keeps the binding alive", (&hist{}).saw("a", 0, 10, "w0", 5).
			lost("a", 4000, 4000, ResultUnknown).saw("a", 10_500, 10_520, "w0", 40),
			[]string{"churn"}},
		{"binding lost in a full restart", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultRestart, "all", 100, 200).
			read(1, "a", "r1", 300, "", 0),
			[]string{"durability"}},
		{"older binding after a full restart", (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w0", 15, 60).
			saw("a", 20, 30, "w1", 9).fault(FaultRestart, "all", 100, 200).read(2, "a", "r1", 300, "w0", 5),
			[]string{"durability"}},
		{"replicas disagree at the end", (&hist{}).saw("a", 0, 10, "w0", 5).read(0, "a", "r0", 100, "w0", 5).read(0, "a", "r2", 100, "", 0),
			[]string{"convergence", "durability"}},
		{"a probe past the bound sees the binding from before the rebind", (&hist{}).saw("a", 0, 10, "w0", 5).rebind("a", 20, 5, ResultOK).
			saw("a", 25, 30, "w1", 9).nemesis("rebind").saw("a", 200, 4000, "w0", 5).nemesis("probe"),
			[]string{"register", "revision-backwards"}},
		{"a refused invalidation explains nothing", (&hist{}).saw("a", 0, 10, "w0", 5).rebind("a", 20, 5, ResultFail).
			saw("a", 25, 30, "w1", 9),
			[]string{"churn"}},
		{"an invalidation of another revision explains nothing", (&hist{}).saw("a", 0, 10, "w0", 5).rebind("a", 20, 4, ResultOK).
			saw("a", 25, 30, "w1", 9),
			[]string{"churn"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := Check(&tc.h.h, testCheck)
			if got := checks(a); !slices.Equal(got, tc.want) {
				t.Fatalf("violations %v, want %v: %+v", got, tc.want, a.Violations)
			}
			for _, v := range a.Violations {
				if v.Message == "" || v.Session == "" {
					t.Fatalf("violation without a message or a session: %+v", v)
				}
			}
		})
	}
}

func TestProbeStatsCountOldAnswers(t *testing.T) {
	h := (&hist{}).saw("a", 0, 10, "w0", 5).rebind("a", 20, 5, ResultOK).saw("a", 25, 30, "w1", 9).nemesis("rebind").
		saw("a", 200, 210, "w0", 5).nemesis("probe").saw("a", 220, 230, "w1", 9).nemesis("probe").
		lost("a", 240, 250, ResultFail).nemesis("probe")
	p := Check(&h.h, testCheck).Probes
	if want := (ProbeStats{Sent: 3, Sessions: 1, Fresh: 1, Old: 1, Errors: 1}); p != want {
		t.Fatalf("probe stats %+v, want %+v", p, want)
	}
}

func TestUnboundedStalenessOnlyChecksRevisionToWorker(t *testing.T) {
	h := (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w0", 15, 60).
		saw("a", 20, 30, "w1", 9).saw("a", 5000, 5010, "w0", 5)
	cfg := testCheck
	cfg.Staleness = -1
	if a := Check(&h.h, cfg); !a.Valid() {
		t.Fatalf("local reads may be stale without bound: %+v", a.Violations)
	}
	h.saw("a", 6000, 6010, "w2", 9)
	if got := checks(Check(&h.h, cfg)); !slices.Equal(got, []string{"register", "revision-two-workers"}) {
		t.Fatalf("got %v", got)
	}
}

// randomHistory makes a small history of one session: sequential and overlapping operations
// whose revisions mostly grow, with occasional regressions and worker swaps.
func randomHistory(r *rand.Rand) []Op {
	n := 2 + r.IntN(7)
	ops := make([]Op, 0, n)
	rev := uint64(1)
	for i := range n {
		inv := r.IntN(400)
		ret := inv + 1 + r.IntN(100)
		switch r.IntN(6) {
		case 0:
			rev++
		case 1:
			if rev > 1 {
				rev--
			}
		}
		worker := fmt.Sprintf("w%d", rev%3)
		if r.IntN(10) == 0 {
			worker = "w9"
		}
		op := Op{ID: i + 1, Client: i, Session: "s", Invoke: time.Duration(inv) * ms, Headers: time.Duration(ret) * ms,
			Complete: time.Duration(ret) * ms, Result: ResultOK, Status: 200, Worker: worker, Revision: rev}
		if r.IntN(5) == 0 {
			op.Result, op.Status, op.Worker, op.Revision, op.Headers = ResultUnknown, 0, "", 0, 0
		}
		ops = append(ops, op)
	}
	return ops
}

func TestPorcupineAndDirectChecksAgree(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	illegal := 0
	for i := range 3000 {
		ops := randomHistory(r)
		ptrs := make([]*Op, len(ops))
		for j := range ops {
			ptrs[j] = &ops[j]
		}
		for _, stale := range []time.Duration{0, 30 * ms} {
			cfg := CheckConfig{Staleness: stale}
			var a Analysis
			a.checkRevisions("s", ptrs, cfg)
			direct := len(a.Violations) == 0
			res := porcupine.CheckOperationsTimeout(RegisterModel(), registerOps(ptrs, time.Second, cfg), 10*time.Second)
			if res == porcupine.Unknown {
				t.Fatalf("history %d: porcupine timed out", i)
			}
			if direct != (res == porcupine.Ok) {
				t.Fatalf("history %d (staleness %s): direct check says legal=%v, porcupine %s: %+v", i, stale, direct, res, ops)
			}
			if !direct {
				illegal++
			}
		}
	}
	if illegal == 0 {
		t.Fatal("no random history was illegal: the comparison proved nothing")
	}
}

func TestAvailabilityAndLongestWindowWithoutANewBinding(t *testing.T) {
	b := &hist{}
	b.saw("a", 0, 10, "w0", 1)
	b.h.Ops[0].First = true
	b.fault(FaultKill, "r0", 100, 1000)
	b.lost("b", 200, 300, ResultFail)
	b.saw("b", 400, 410, "w1", 2)
	b.h.Ops[2].First = true
	b.saw("a", 2000, 2010, "w0", 1)
	a := Check(&b.h, testCheck)
	b.h.Ops[2].Target = "r0" // sent to the killed replica, and it still answered (it was restarted)
	want := []Availability{
		{Kind: "kill", Faults: 1, Ops: 2, OK: 1, Share: 0.5, ElsewhereOps: 1, ElsewhereOK: 0, ElsewhereShare: 0},
		{Kind: "none", Ops: 2, OK: 2, Share: 1, ElsewhereOps: 2, ElsewhereOK: 2, ElsewhereShare: 1},
	}
	if !slices.Equal(a.Availability, want) {
		t.Fatalf("availability %+v, want %+v", a.Availability, want)
	}
	w := a.NoNewBinding
	if w.From != 410*ms || w.To != 2000*ms || w.Length != 1590*ms || !slices.Equal(w.Faults, []int{1}) {
		t.Fatalf("window %+v", w)
	}
}

func TestHistoryRoundTripsThroughJSON(t *testing.T) {
	b := (&hist{}).saw("a", 0, 10, "w0", 5).lost("a", 20, 30, ResultUnknown).fault(FaultPartition, "r1", 5, 25).read(1, "a", "r0", 40, "w0", 5)
	b.h.Notes = []Note{{At: ms, Replica: "r0", Text: "leader r0"}}
	var buf bytes.Buffer
	if err := b.h.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	got, err := ReadHistory(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.Ops, b.h.Ops) || len(got.Faults) != 1 || got.Faults[0].Kind != FaultPartition ||
		!slices.Equal(got.Reads, b.h.Reads) || !slices.Equal(got.Notes, b.h.Notes) || got.End != b.h.End {
		t.Fatalf("round trip changed the history:\n%+v\n%+v", got, b.h)
	}
	if _, err := ReadHistory(bytes.NewBufferString(`{"ops":[{"bogus":1}]}`)); err == nil {
		t.Fatal("a history with unknown fields decoded")
	}
}

func TestLateReadsAfterARestartAreCountedNotFailed(t *testing.T) {
	b := (&hist{}).saw("a", 0, 10, "w0", 5).saw("b", 0, 10, "w1", 6).fault(FaultRestart, "all", 100, 200).
		read(1, "a", "r1", 300, "w0", 5).read(1, "b", "r1", 900, "w1", 6)
	b.h.Reads[1].Attempts = 3
	a := Check(&b.h, testCheck)
	if !a.Valid() || a.Durability.Checked != 2 || a.Durability.Late != 1 {
		t.Fatalf("durability %+v, violations %+v", a.Durability, a.Violations)
	}
}
