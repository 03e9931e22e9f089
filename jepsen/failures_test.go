package jepsen

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestClassifyFailure(t *testing.T) {
	faults := []Fault{
		{ID: 1, Kind: FaultKill, Targets: []string{"r0"}, Start: 100 * ms, End: 200 * ms, Recovered: 300 * ms},
		{ID: 2, Kind: FaultPartition, Targets: []string{"r1"}, Start: 1000 * ms, End: 1500 * ms},
		{ID: 3, Kind: FaultWorkerCrash, Targets: []string{"w0"}, Start: 2000 * ms, End: 2500 * ms},
	}
	end := 5 * time.Second
	cases := []struct {
		name      string
		op        Op
		cause     string
		phase     string
		faultKind FaultKind
		struck    bool // in flight on its replica when the fault began
	}{
		{name: "in flight on the killed replica, no answer",
			op:    Op{Target: "r0", Invoke: 90 * ms, Complete: 110 * ms, Result: ResultUnknown, Error: "EOF"},
			cause: CauseFaultedReplica, phase: PhaseNoAnswer, faultKind: FaultKill, struck: true},
		{name: "stream cut by the kill",
			op:    Op{Target: "r0", Invoke: 50 * ms, Headers: 60 * ms, Complete: 100 * ms, Status: 200, Result: ResultUnknown, Error: "body: unexpected EOF"},
			cause: CauseFaultedReplica, phase: PhaseTruncated, faultKind: FaultKill, struck: true},
		{name: "sent to the dead replica: connection refused",
			op:    Op{Target: "r0", Invoke: 150 * ms, Complete: 151 * ms, Result: ResultFail, Error: "connection refused"},
			cause: CauseFaultedReplica, phase: PhaseConnect, faultKind: FaultKill},
		{name: "through the balancer to the killed replica",
			op:    Op{Target: "lb", LBServer: "r0", Invoke: 90 * ms, Complete: 110 * ms, Result: ResultUnknown},
			cause: CauseFaultedReplica, phase: PhaseNoAnswer, faultKind: FaultKill, struck: true},
		{name: "through the balancer, answered by the faulted replica",
			op:    Op{Target: "lb", Replica: "r0", Invoke: 90 * ms, Headers: 95 * ms, Complete: 110 * ms, Status: 200, Result: ResultUnknown},
			cause: CauseFaultedReplica, phase: PhaseTruncated, faultKind: FaultKill, struck: true},
		{name: "refusal marked by the header, on the cut-off replica",
			op:    Op{Target: "r1", Invoke: 1100 * ms, Headers: 1101 * ms, Complete: 1101 * ms, Status: 503, Refused: true, Result: ResultFail, Error: "503: busy"},
			cause: CauseRefused, phase: PhaseError, faultKind: FaultPartition},
		{name: "refusal known by its message",
			op:    Op{Target: "r1", Invoke: 1100 * ms, Headers: 4100 * ms, Complete: 4100 * ms, Status: 503, Result: ResultFail, Error: "503: session bindings unavailable: no read lease"},
			cause: CauseRefused, phase: PhaseError, faultKind: FaultPartition},
		{name: "a refusal message on another status is no refusal",
			op:    Op{Target: "r2", Invoke: 1100 * ms, Headers: 1200 * ms, Complete: 1200 * ms, Status: 502, Result: ResultFail, Error: "502: session bindings unavailable"},
			cause: CauseOther, phase: PhaseError},
		{name: "a worker's 503 passed through is no refusal",
			op:    Op{Target: "r2", Invoke: 2100 * ms, Headers: 2200 * ms, Complete: 2200 * ms, Status: 503, Result: ResultFail, Error: "503: engine overloaded"},
			cause: CauseOther, phase: PhaseError},
		{name: "another replica than the faulted one",
			op:    Op{Target: "r2", Invoke: 90 * ms, Complete: 110 * ms, Result: ResultUnknown},
			cause: CauseOther, phase: PhaseNoAnswer},
		{name: "the faulted replica, after it recovered",
			op:    Op{Target: "r0", Invoke: 400 * ms, Complete: 410 * ms, Result: ResultUnknown},
			cause: CauseOther, phase: PhaseNoAnswer},
		{name: "the faulted replica, before the fault",
			op:    Op{Target: "r0", Invoke: 10 * ms, Complete: 50 * ms, Result: ResultFail, Error: "connection refused"},
			cause: CauseOther, phase: PhaseConnect},
		{name: "the balancer had no replica",
			op:    Op{Target: "lb", LBLogged: true, Invoke: 90 * ms, Headers: 91 * ms, Complete: 91 * ms, Status: 503, Result: ResultFail, Error: "503: No server is available"},
			cause: CauseNoReplica, phase: PhaseError},
		{name: "the balancer's 503 after retries on a named replica",
			op:    Op{Target: "lb", LBLogged: true, LBServer: "r0", LBRetries: 2, Invoke: 150 * ms, Headers: 151 * ms, Complete: 151 * ms, Status: 503, Result: ResultFail},
			cause: CauseFaultedReplica, phase: PhaseError, faultKind: FaultKill},
		{name: "through the balancer, replica unknown",
			op:    Op{Target: "lb", Invoke: 90 * ms, Complete: 110 * ms, Result: ResultUnknown},
			cause: CauseOther, phase: PhaseNoAnswer},
		{name: "the cut-off replica after the heal",
			op:    Op{Target: "r1", Invoke: 4000 * ms, Complete: 4100 * ms, Result: ResultUnknown},
			cause: CauseOther, phase: PhaseNoAnswer},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cause, phase, kind, struck := classifyFailure(&tc.op, faults, end)
			if cause != tc.cause || phase != tc.phase || kind != tc.faultKind || struck != tc.struck {
				t.Fatalf("got %s/%s/%q struck %v, want %s/%s/%q struck %v", cause, phase, kind, struck, tc.cause, tc.phase, tc.faultKind, tc.struck)
			}
		})
	}
}

func TestFailuresCountWhatTheBalancerRetried(t *testing.T) {
	h := History{
		Faults: []Fault{{ID: 1, Kind: FaultKill, Targets: []string{"r0"}, Start: 100 * ms, End: 200 * ms, Recovered: 300 * ms}},
		Ops: []Op{
			{Tag: "1", Target: "lb", Invoke: 90 * ms, Complete: 110 * ms, Result: ResultUnknown},
			{Tag: "2", Target: "lb", Invoke: 120 * ms, Complete: 130 * ms, Result: ResultOK, Status: 200},
			{Tag: "3", Target: "lb", Invoke: 120 * ms, Complete: 130 * ms, Result: ResultOK, Status: 200},
			{Tag: "4", Target: "r0", Invoke: 95 * ms, Complete: 110 * ms, Result: ResultUnknown},
			{Tag: "5", Target: "lb", Invoke: 10 * ms, Complete: 20 * ms, Result: ResultOK, Status: 200},
		},
		End: time.Second,
	}
	log := strings.Join([]string{
		"[NOTICE]   (1) : haproxy version is 2.6.12",
		"kvrouter-lb 1 r0 0 -1 SH",
		"kvrouter-lb 2 r1 +1 200 --",
		"kvrouter-lb 3 r0 2 200 --",
		"kvrouter-lb 5 r2 0 200 --",
		"kvrouter-lb 99 r2 0 200 --",
	}, "\n")
	if err := readBalancerLog(strings.NewReader(log), h.Ops); err != nil {
		t.Fatal(err)
	}
	fs, bal := failures(&h)
	wantBal := BalancerStats{Ops: 4, Logged: 4, Retried: 2, RetriedOK: 2, Redispatched: 1}
	if bal != wantBal {
		t.Errorf("balancer %+v, want %+v", bal, wantBal)
	}
	want := []FailureCount{{Cause: CauseFaultedReplica, Phase: PhaseNoAnswer, Fault: FaultKill, Ops: 2, Struck: 2, ViaBalancer: 1}}
	if len(fs) != 1 || fs[0] != want[0] {
		t.Fatalf("failures %+v, want %+v", fs, want)
	}
	rep := Recheck(&h, testCheck)
	var text bytes.Buffer
	if err := rep.WriteText(&text); err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{"failures:    2 requests", "faulted-replica  no-answer     kill           2  (2 in flight on it when the fault began)", "4 requests sent through the balancer, 4 in its log: 2 retried by it (2 then succeeded), 1 of them on another replica"} {
		if !strings.Contains(text.String(), line) {
			t.Errorf("summary lacks %q:\n%s", line, text.String())
		}
	}
}

func TestReadBalancerLogReportsABrokenLine(t *testing.T) {
	ops := []Op{{Tag: "1", Target: "lb"}}
	err := readBalancerLog(strings.NewReader("kvrouter-lb 1 r0 zero 200 --\n"), ops)
	if err == nil || ops[0].LBLogged {
		t.Fatalf("err %v, op %+v: want an error and the op untouched", err, ops[0])
	}
}
