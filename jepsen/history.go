package jepsen

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Result is how an operation ended, as its client saw it.
type Result string

// The three ways an operation ends.
const (
	// ResultOK is a complete 200 answer (a stream read to its end).
	ResultOK Result = "ok"
	// ResultFail is a definite failure: an error answer, or a request that never left the client.
	ResultFail Result = "fail"
	// ResultUnknown is a request that was sent but never answered (timeout, reset): it may or
	// may not have taken effect.
	ResultUnknown Result = "unknown"
)

// Op is one client request and what came back. Times are monotonic offsets from the start of
// the run.
type Op struct {
	ID      int    `json:"id"`
	Client  int    `json:"client"`
	Session string `json:"session"`
	// Lane tells apart operations of one session that a client runs at once (raced first
	// requests); 0 otherwise.
	Lane   int  `json:"lane,omitempty"`
	Stream bool `json:"stream,omitempty"`
	// First marks a session's first request (each of them, when several race).
	First bool `json:"first,omitempty"`
	// Target is the replica asked ("r0", ...) or "lb" for the load balancer.
	Target   string        `json:"target"`
	Invoke   time.Duration `json:"invoke_ns"`
	Complete time.Duration `json:"complete_ns"`
	// Headers is when the response headers arrived (0: none did).
	Headers time.Duration `json:"headers_ns,omitempty"`
	Result  Result        `json:"result"`
	Status  int           `json:"status,omitempty"`
	// Worker, Revision and Replica are the X-Kvrouter-* headers of a 200 answer.
	Worker   string `json:"worker,omitempty"`
	Revision uint64 `json:"revision,omitempty"`
	Replica  string `json:"replica,omitempty"`
	Error    string `json:"error,omitempty"`
	// Refused reports that the answer carried X-Kvrouter-Refused: the replica refused the
	// request itself, before sending it to any worker.
	Refused bool `json:"refused,omitempty"`
	// Tag names the request in the load balancer's log (its X-Jepsen-Op header).
	Tag string `json:"tag,omitempty"`
	// LBLogged reports that the balancer logged the request; LBServer is the replica it
	// went to last, LBRetries how often the balancer sent it again after a failed attempt,
	// LBRedispatched whether a retry went to another replica.
	LBLogged       bool   `json:"lb_logged,omitempty"`
	LBServer       string `json:"lb_server,omitempty"`
	LBRetries      int    `json:"lb_retries,omitempty"`
	LBRedispatched bool   `json:"lb_redispatched,omitempty"`
	// Nemesis marks the stale fault's own requests: "rebind" (a new binding on a named worker,
	// through the leader) or "probe" (asking the replica back from the fault); "" for clients.
	Nemesis string `json:"nemesis,omitempty"`
}

// reachedRouter reports whether the operation may have reached a replica: everything but a
// failure with no answer, which the workload records only for a request that was never
// written (a refused connection to a killed replica, say).
func (o *Op) reachedRouter() bool { return o.Result != ResultFail || o.Status != 0 }

// Observed reports whether the operation saw its session's binding: a 200 answer naming a
// worker and a revision. A stream that broke after its headers still observed the binding.
func (o *Op) Observed() bool {
	return o.Status == 200 && o.Worker != "" && o.Revision != 0 && o.Headers > 0
}

// FaultKind names a kind of fault the nemesis injects.
type FaultKind string

// The fault kinds. Kill, Stop, Restart, Partition and Worker are the names --faults takes;
// a Worker fault is recorded as WorkerCrash or WorkerStop.
const (
	FaultKill        FaultKind = "kill"
	FaultStop        FaultKind = "stop"
	FaultRestart     FaultKind = "restart"
	FaultPartition   FaultKind = "partition"
	FaultWorker      FaultKind = "worker"
	FaultWorkerCrash FaultKind = "worker-crash"
	FaultWorkerStop  FaultKind = "worker-stop"
	FaultDrain       FaultKind = "drain"
	// FaultStale pauses (SIGSTOP) or cuts off one replica, rebinds sessions through the
	// others meanwhile, and probes it directly as it resumes or heals: it must not answer
	// with a binding older than the stale bound.
	FaultStale FaultKind = "stale"
	// FaultDiscovery starts a new worker process and lists it in the replicas' discovery
	// file, leaves it there for the step's hold (sessions bind to it), then takes it out of
	// the file and stops it once no replica has it. The listing is recorded as Discovery, the
	// taking out as a Drain of the worker (discovery drains it, then removes it), which
	// explains its sessions moving.
	FaultDiscovery FaultKind = "discovery"
)

// Fault is one injected fault: Start when it began, End when it was healed (the process
// restarted or continued, the partition lifted), Recovered when every replica reported ready
// again. An End of 0 means it was never healed before the run ended.
type Fault struct {
	ID      int       `json:"id"`
	Kind    FaultKind `json:"kind"`
	Targets []string  `json:"targets"`
	// Detail says how the targets were chosen (leader, random, minority, bridge, ...).
	Detail    string        `json:"detail,omitempty"`
	Start     time.Duration `json:"start_ns"`
	End       time.Duration `json:"end_ns,omitempty"`
	Recovered time.Duration `json:"recovered_ns,omitempty"`
	Error     string        `json:"error,omitempty"`
}

// Until returns the end of the fault's effect: Recovered, else End, else the given run end.
func (f *Fault) Until(runEnd time.Duration) time.Duration {
	switch {
	case f.Recovered > 0:
		return f.Recovered
	case f.End > 0:
		return f.End
	}
	return runEnd
}

// Read is one admin read of a session's binding, made to check durability after a
// full-cluster restart or convergence at the end.
type Read struct {
	// Fault is the restart fault the read follows (0: the final convergence read).
	Fault    int           `json:"fault"`
	Session  string        `json:"session"`
	Replica  string        `json:"replica"`
	At       time.Duration `json:"at_ns"`
	Found    bool          `json:"found"`
	Worker   string        `json:"worker,omitempty"`
	Revision uint64        `json:"revision,omitempty"`
	Error    string        `json:"error,omitempty"`
	// Attempts is how many reads it took to get this answer: a binding missing or older than
	// acknowledged is read again for a while, since a just-elected leader may not have applied
	// its log yet.
	Attempts int `json:"attempts,omitempty"`
}

// Rebind is one binding the nemesis dropped on purpose (the admin API's DELETE
// /admin/sessions/{id}, through the leader), so that the session's next request binds anew.
// It explains the change from Revision to whatever comes next.
type Rebind struct {
	Fault    int           `json:"fault"`
	Session  string        `json:"session"`
	Replica  string        `json:"replica"`
	Invoke   time.Duration `json:"invoke_ns"`
	Complete time.Duration `json:"complete_ns"`
	// Revision is the binding invalidated (the admin API's invalidated_revision, or the one
	// asked for when the answer was lost).
	Revision uint64 `json:"revision"`
	// Result is ok (invalidated), fail (refused: nothing changed) or unknown (no answer).
	Result Result `json:"result"`
	Error  string `json:"error,omitempty"`
}

// Note is something the harness saw without causing it: a leader change, a replica marking a
// worker unhealthy. Notes explain nothing to the checker; they help a reader of a violation.
type Note struct {
	At      time.Duration `json:"at_ns"`
	Replica string        `json:"replica,omitempty"`
	Text    string        `json:"text"`
}

// Crash is a replica process that exited without the nemesis killing it.
type Crash struct {
	Replica string        `json:"replica"`
	At      time.Duration `json:"at_ns"`
}

// History is everything a run recorded. It is plain data: the checker reads it, and it
// round-trips through JSON so a run can be checked again later.
type History struct {
	Ops    []Op    `json:"ops"`
	Faults []Fault `json:"faults"`
	Reads  []Read  `json:"reads,omitempty"`
	// Rebinds are the nemesis's deliberate invalidations (the stale fault).
	Rebinds []Rebind `json:"rebinds,omitempty"`
	Notes   []Note   `json:"notes,omitempty"`
	// Crashes are replicas that died on their own: a broken promise in itself.
	Crashes []Crash `json:"crashes,omitempty"`
	// End is when recording stopped.
	End time.Duration `json:"end_ns"`
}

// WriteJSON writes the history as indented JSON.
func (h *History) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", " ")
	if err := enc.Encode(h); err != nil {
		return fmt.Errorf("encode history: %w", err)
	}
	return nil
}

// ReadHistory decodes a history written by WriteJSON.
func ReadHistory(r io.Reader) (*History, error) {
	var h History
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil {
		return nil, fmt.Errorf("decode history: %w", err)
	}
	return &h, nil
}

// ReadHistoryFile reads a history.json.
func ReadHistoryFile(path string) (*History, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open history: %w", err)
	}
	defer f.Close()
	return ReadHistory(f)
}

// recorder appends to a History from many goroutines against one monotonic clock.
type recorder struct {
	start time.Time
	tags  atomic.Uint64
	mu    sync.Mutex
	h     History
}

func newRecorder() *recorder {
	return &recorder{start: time.Now()}
}

// now is the monotonic offset from the start of the run.
func (r *recorder) now() time.Duration { return time.Since(r.start) }

// tag returns a new request tag, unique in the run.
func (r *recorder) tag() string { return strconv.FormatUint(r.tags.Add(1), 10) }

func (r *recorder) addOp(op Op) {
	r.mu.Lock()
	op.ID = len(r.h.Ops) + 1
	r.h.Ops = append(r.h.Ops, op)
	r.mu.Unlock()
}

// beginFault records a fault's start and returns its id.
func (r *recorder) beginFault(kind FaultKind, targets []string, detail string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	id := len(r.h.Faults) + 1
	r.h.Faults = append(r.h.Faults, Fault{ID: id, Kind: kind, Targets: targets, Detail: detail, Start: time.Since(r.start)})
	return id
}

// updateFault changes a recorded fault under the lock.
func (r *recorder) updateFault(id int, f func(*Fault)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if id >= 1 && id <= len(r.h.Faults) {
		f(&r.h.Faults[id-1])
	}
}

func (r *recorder) endFault(id int) {
	at := r.now()
	r.updateFault(id, func(f *Fault) { f.End = at })
}

func (r *recorder) recoverFault(id int) {
	at := r.now()
	r.updateFault(id, func(f *Fault) { f.Recovered = at })
}

func (r *recorder) faultError(id int, err error) {
	r.updateFault(id, func(f *Fault) {
		if f.Error == "" {
			f.Error = err.Error()
		}
	})
}

func (r *recorder) addRead(rd Read) {
	r.mu.Lock()
	r.h.Reads = append(r.h.Reads, rd)
	r.mu.Unlock()
}

func (r *recorder) addRebind(rb Rebind) {
	r.mu.Lock()
	r.h.Rebinds = append(r.h.Rebinds, rb)
	r.mu.Unlock()
}

func (r *recorder) note(replica, format string, args ...any) {
	n := Note{At: r.now(), Replica: replica, Text: fmt.Sprintf(format, args...)}
	r.mu.Lock()
	r.h.Notes = append(r.h.Notes, n)
	r.mu.Unlock()
}

// sessionsBefore returns, for every session with an operation invoked before t, the time of
// its latest activity before t (an invoke or a completion).
func (r *recorder) sessionsBefore(t time.Duration) map[string]time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]time.Duration{}
	for i := range r.h.Ops {
		op := &r.h.Ops[i]
		if op.Invoke >= t {
			continue
		}
		last := op.Invoke
		if op.Complete > last && op.Complete < t {
			last = op.Complete
		}
		if last > out[op.Session] {
			out[op.Session] = last
		}
	}
	return out
}

// latest returns, per session, the observed operation with the highest revision that was
// acknowledged before t.
func (r *recorder) latest(t time.Duration) map[string]Op {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]Op{}
	for i := range r.h.Ops {
		op := r.h.Ops[i]
		if op.Observed() && op.Headers < t && op.Revision > out[op.Session].Revision {
			out[op.Session] = op
		}
	}
	return out
}

// snapshot copies the history, sorted by invoke time, with End set to now.
func (r *recorder) snapshot() *History {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := History{
		Ops:     append([]Op(nil), r.h.Ops...),
		Faults:  append([]Fault(nil), r.h.Faults...),
		Reads:   append([]Read(nil), r.h.Reads...),
		Rebinds: append([]Rebind(nil), r.h.Rebinds...),
		Notes:   append([]Note(nil), r.h.Notes...),
		End:     time.Since(r.start),
	}
	sort.SliceStable(h.Ops, func(i, j int) bool { return h.Ops[i].Invoke < h.Ops[j].Invoke })
	return &h
}
