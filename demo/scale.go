package demo

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
)

// The scale demo: three replica processes (behind HAProxy when installed) find their workers
// in a fleet file (--discovery file:PATH) and nowhere else. The trace slice replays while the
// fleet grows at one third (new simulated workers start, then join the file) and shrinks at
// two thirds (the oldest leave the file, and are stopped once every replica has drained
// them). The same slice then replays over a fixed fleet of the same average size, and the
// report sets the two side by side with what moved, why, and each replica's worker set over
// time.

// ScaleStep is one change of the fleet file during the scale demo.
type ScaleStep struct {
	// Name is "start", "scale up" or "scale down".
	Name string `json:"name"`
	// At is when the file was written, from the replay's start (negative: before it).
	At time.Duration `json:"at"`
	// Want is the worker set every replica should route to after it.
	Want []string `json:"want"`
	// Converged says whether every replica's routable set became Want within the bound,
	// and Took how long after At the last one did.
	Converged bool          `json:"converged"`
	Took      time.Duration `json:"took"`
}

// SetChange is a replica's routable worker set (its workers not drained) from At on.
type SetChange struct {
	At      time.Duration `json:"at"`
	Workers []string      `json:"workers"`
}

// ScaleRun is one replay of the scale demo over a fleet file.
type ScaleRun struct {
	Summary *replay.Summary `json:"summary"`
	Steps   []ScaleStep     `json:"steps"`
	// Timeline is each replica's routable worker set as it changed, by replica id.
	Timeline map[string][]SetChange `json:"timeline"`
	// Stopped are the workers stopped after they drained, StoppedAt when (from the replay's
	// start).
	Stopped   []string      `json:"stopped"`
	StoppedAt time.Duration `json:"stopped_at"`
	// FailedOnStopped counts the failed requests that were sent to a stopped worker before it
	// stopped (in flight on it), and FailedAtBinding those the replicas failed because their
	// session's binding did not commit (kvrouter_errors_total{cause="commit"}: Raft did not
	// commit it within --bind-wait, as on a machine too loaded to keep its leader). The demo
	// expects no other failure.
	FailedOnStopped int `json:"failed_on_stopped"`
	FailedAtBinding int `json:"failed_at_binding"`
	// FailedDraining counts the failed requests whose error names a draining worker: a
	// request whose worker began draining after it was chosen goes to its next choice, so
	// the demo expects none.
	FailedDraining int `json:"failed_draining"`
	// FailureSamples are the first few failed requests' errors.
	FailureSamples []string `json:"failure_samples,omitempty"`
	// WorkerFaults counts the dispatches a worker failed (an error, a timeout, a refusal),
	// each retried on another worker: a bound session's retry moves it (its worker failed),
	// so moves no drain explains are bounded by them.
	WorkerFaults int `json:"worker_faults"`
	// Moves counts the times a session's request went to another worker than its previous
	// one, MovesByDrain those whose previous worker had left the file by then.
	Moves        int `json:"moves"`
	MovesByDrain int `json:"moves_by_drain"`
	// OtherMoves describes the first few moves no drain explains.
	OtherMoves []string `json:"other_moves,omitempty"`
}

// UnexplainedFailures is the failed requests neither in flight on a stopped worker nor
// refused their binding.
func (r *ScaleRun) UnexplainedFailures() int {
	return r.Summary.Failed - r.FailedOnStopped - r.FailedAtBinding
}

// ScaleReport is the scale demo's two runs: the fleet scaled, and fixed at its average size.
type ScaleReport struct {
	Scaled    *ScaleRun `json:"scaled"`
	Fixed     *ScaleRun `json:"fixed,omitempty"`
	FixedSize int       `json:"fixed_size"`
}

// scalePlan is a scale run's fleet: start workers at first, up more at one third, the
// first down of them gone at two thirds.
type scalePlan struct {
	start, up, down int
}

// average is the fleet's size averaged over the run's three thirds.
func (p scalePlan) average() int {
	return int(math.Round(float64(3*p.start+2*p.up-p.down) / 3))
}

// Scale is the scale demo (see the comment above ScaleStep). It prints the report and
// returns it.
func Scale(ctx context.Context, cfg Config, stdout, progress io.Writer) (*ScaleReport, error) {
	if cfg.Workers < 1 || cfg.ScaleUp < 0 || cfg.ScaleDown < 0 || cfg.ScaleDown >= cfg.Workers+cfg.ScaleUp {
		return nil, fmt.Errorf("scale: want at least one worker (--workers %d) and fewer to remove (--scale-down %d) than there are after --scale-up %d",
			cfg.Workers, cfg.ScaleDown, cfg.ScaleUp)
	}
	reqs, err := cfg.traceSlice()
	if err != nil {
		return nil, err
	}
	if len(reqs) < 3 {
		return nil, errors.New("the trace slice needs at least three requests")
	}
	plan := scalePlan{start: cfg.Workers, up: cfg.ScaleUp, down: cfg.ScaleDown}
	fmt.Fprintf(stdout, "three replicas finding their workers in a fleet file: %d simulated workers, +%d at one third, -%d at two thirds; then a fixed fleet of %d\n",
		plan.start, plan.up, plan.down, plan.average())
	rep := &ScaleReport{FixedSize: plan.average()}
	if rep.Scaled, err = scaleRun(ctx, cfg, reqs, plan, "kv x3, fleet scaled", stdout, progress); err != nil {
		return nil, err
	}
	if !cfg.ScaleNoFixed {
		if rep.Fixed, err = scaleRun(ctx, cfg, reqs, scalePlan{start: rep.FixedSize}, fmt.Sprintf("kv x3, fixed %d", rep.FixedSize), stdout, progress); err != nil {
			return nil, err
		}
	}
	rep.print(stdout)
	if cfg.JSONPath != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(cfg.JSONPath, b, 0o644); err != nil {
			return nil, fmt.Errorf("write %s: %w", cfg.JSONPath, err)
		}
	}
	return rep, nil
}

// scaleRun replays reqs through three replicas that read their fleet from a file, changed
// as plan says.
func scaleRun(ctx context.Context, cfg Config, reqs []trace.Request, plan scalePlan, label string, stdout, progress io.Writer) (*ScaleRun, error) {
	dir, err := os.MkdirTemp("", "kvrouter-ha-scale-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	sc := cfg.simConfig(cfg.Logger)
	fleet := newSimFleet(ctx)
	defer fleet.Close()
	ff := fleetFile{path: filepath.Join(dir, "fleet.json"), specs: map[string]routing.WorkerSpec{}}
	addWorkers := func(from, n int) ([]string, error) {
		var ids []string
		for i := from; i < from+n; i++ {
			spec, err := fleet.add(fmt.Sprintf("w%d", i), routing.RoleBoth, sc, false)
			if err != nil {
				return nil, err
			}
			ff.specs[spec.ID] = spec
			ids = append(ids, spec.ID)
		}
		return ids, ff.write()
	}
	if _, err := addWorkers(0, plan.start); err != nil {
		return nil, err
	}
	// Discovery looks often here; a gone worker drains for a while before it is removed, and
	// a scale-down of more than half the fleet is held as suspect for a while first (both
	// the serve defaults, in time that runs cfg.Speedup times faster).
	h := &haCluster{cfg: cfg, dir: dir, hc: &http.Client{Timeout: 2 * time.Second}}
	defer h.stop(ctx)
	if err := h.start(ctx, nil, "--discovery", "file:"+ff.path, "--discovery-interval", "100ms",
		"--discovery-drain-for", scaled(30*time.Second, cfg.Speedup).String(),
		"--discovery-suspect-for", scaled(time.Minute, cfg.Speedup).String()); err != nil {
		return nil, err
	}
	targets, front, stopLB, err := startBalancer(ctx, cfg, dir, h.members, h.hc)
	if err != nil {
		return nil, err
	}
	defer stopLB()
	fmt.Fprintf(stdout, "%s: %s\n", label, front)

	run := &ScaleRun{}
	sets := newSetWatch(h)
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	var watching sync.WaitGroup
	start := time.Now()
	watching.Go(func() { sets.run(watchCtx, start) })
	defer watching.Wait()
	// The replay starts once every replica routes to the starting fleet.
	run.Steps = append(run.Steps, sets.converge(ctx, "start", ff.ids(), 0, start))
	start = time.Now()
	sets.restart(start)

	// The steps happen at their times even when the replay is over sooner (a short slice);
	// a failed replay ends them.
	stepCtx, stopSteps := context.WithCancel(ctx)
	defer stopSteps()
	var stepping sync.WaitGroup
	span := scaled(reqs[len(reqs)-1].Timestamp-reqs[0].Timestamp, cfg.Speedup)
	stepping.Go(func() {
		if plan.up == 0 && plan.down == 0 {
			return
		}
		if !sleepCtx(stepCtx, time.Until(start.Add(span/3))) {
			return
		}
		at := time.Since(start)
		if _, err := addWorkers(plan.start, plan.up); err != nil {
			cfg.Logger.Error("scale up", "err", err)
			return
		}
		run.Steps = append(run.Steps, sets.converge(stepCtx, "scale up", ff.ids(), at, start))
		if !sleepCtx(stepCtx, time.Until(start.Add(2*span/3))) {
			return
		}
		at = time.Since(start)
		gone := ff.remove(plan.down)
		if err := ff.write(); err != nil {
			cfg.Logger.Error("scale down", "err", err)
			return
		}
		// A drain can move a session only after this (discovery has yet to read the file).
		ff.removedAt = time.Since(start)
		run.Steps = append(run.Steps, sets.converge(stepCtx, "scale down", ff.ids(), at, start))
		// Drained on every replica (or the bound passed): no new request goes there, and
		// those in flight get the worker's shutdown grace.
		for _, id := range gone {
			fleet.stop(id)
		}
		run.Stopped, run.StoppedAt = gone, time.Since(start)
	})

	commits0, faults0 := h.errorCounts(ctx)
	var log bytes.Buffer
	rc := cfg.replayConfig(targets, reqs, label, progress)
	rc.RequestLog = &log
	sum, err := replay.Run(ctx, rc)
	if err != nil {
		stopSteps()
	}
	stepping.Wait()
	stopWatch()
	watching.Wait()
	if err != nil {
		return nil, err
	}
	run.Summary = sum
	commits, faults := h.errorCounts(ctx)
	run.FailedAtBinding, run.WorkerFaults = commits-commits0, faults-faults0
	run.Timeline = sets.timeline()
	if err := run.explain(&log, ff.removedAt); err != nil {
		return nil, err
	}
	return run, nil
}

// explain counts, from the replay's request log, the failures in flight on a stopped worker
// and the sessions' moves, with those a drain explains: the previous worker had left the
// file (at removedAt, from the replay's start) before the request was sent.
func (r *ScaleRun) explain(log io.Reader, removedAt time.Duration) error {
	var recs []replay.RequestRecord
	dec := json.NewDecoder(log)
	for {
		var rec replay.RequestRecord
		if err := dec.Decode(&rec); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return fmt.Errorf("request log: %w", err)
		}
		recs = append(recs, rec)
	}
	slices.SortStableFunc(recs, func(a, b replay.RequestRecord) int { return cmp.Compare(a.SentMs, b.SentMs) })
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	type seen struct {
		worker string
		sentMs float64
		index  int
	}
	last := map[string]seen{}
	for _, rec := range recs {
		if !rec.OK {
			if slices.Contains(r.Stopped, rec.Worker) && rec.SentMs < ms(r.StoppedAt) {
				r.FailedOnStopped++
			}
			if strings.Contains(rec.Error, routing.ErrWorkerDraining.Error()) {
				r.FailedDraining++
			}
			if len(r.FailureSamples) < 5 {
				r.FailureSamples = append(r.FailureSamples, fmt.Sprintf("request %d (session %s, sent at %.0f ms, worker %q): %s: %s",
					rec.Index, rec.Session, rec.SentMs, rec.Worker, rec.Cause, rec.Error))
			}
			continue
		}
		if rec.Session == "" || rec.Worker == "" {
			continue
		}
		if prev, ok := last[rec.Session]; ok && prev.worker != rec.Worker {
			r.Moves++
			switch {
			case slices.Contains(r.Stopped, prev.worker) && rec.SentMs >= ms(removedAt):
				r.MovesByDrain++
			case len(r.OtherMoves) < 5:
				r.OtherMoves = append(r.OtherMoves, fmt.Sprintf("session %s: request %d on %s (sent at %.0f ms), request %d on %s (sent at %.0f ms)",
					rec.Session, prev.index, prev.worker, prev.sentMs, rec.Index, rec.Worker, rec.SentMs))
			}
		}
		last[rec.Session] = seen{worker: rec.Worker, sentMs: rec.SentMs, index: rec.Index}
	}
	return nil
}

// errorCounts sums the replicas' kvrouter_errors_total: commits, the requests whose
// session's binding did not commit (cause "commit"), and faults, the
// dispatches a worker failed (every other cause but "draining", a worker that began draining
// after it was chosen). A replica that does not answer counts 0.
func (h *haCluster) errorCounts(ctx context.Context) (commits, faults int) {
	for _, m := range h.members {
		for cause, v := range scrapeCounters(ctx, h.hc, "http://"+m.Admin+"/metrics", "kvrouter_errors_total", "cause") {
			switch cause {
			case "commit":
				commits += int(v)
			case "draining":
			default:
				faults += int(v)
			}
		}
	}
	return commits, faults
}

// scrapeCounters reads one counter's series by the value of label, from a Prometheus text
// endpoint (none when it is not there or the endpoint cannot be read).
func scrapeCounters(ctx context.Context, hc *http.Client, url, name, label string) map[string]float64 {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(io.LimitReader(resp.Body, 16<<20))
	if err != nil || fams[name] == nil {
		return nil
	}
	out := map[string]float64{}
	for _, m := range fams[name].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == label {
				out[l.GetValue()] += m.GetCounter().GetValue()
			}
		}
	}
	return out
}

// sleepCtx waits d or until ctx ends; it reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(max(d, 0))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// fleetFile is the demo's fleet file, written whole and renamed over the old one (as
// discovery's file source asks).
type fleetFile struct {
	path  string
	specs map[string]routing.WorkerSpec
	// removedAt is when workers last left it, from the replay's start.
	removedAt time.Duration
	order     []string
}

// ids are the workers in the file, in the order they joined.
func (f *fleetFile) ids() []string {
	for id := range f.specs {
		if !slices.Contains(f.order, id) {
			f.order = append(f.order, id)
		}
	}
	f.order = slices.DeleteFunc(f.order, func(id string) bool { _, ok := f.specs[id]; return !ok })
	slices.SortStableFunc(f.order, func(a, b string) int { return cmp.Compare(workerNumber(a), workerNumber(b)) })
	return slices.Clone(f.order)
}

// workerNumber is the number in a demo worker id w<n>.
func workerNumber(id string) int {
	var n int
	_, _ = fmt.Sscanf(id, "w%d", &n)
	return n
}

// remove takes the n oldest workers out of the file (not yet written) and returns them.
func (f *fleetFile) remove(n int) []string {
	gone := f.ids()[:n]
	for _, id := range gone {
		delete(f.specs, id)
	}
	return gone
}

// write writes the file: a temporary file renamed over it.
func (f *fleetFile) write() error {
	var specs []routing.WorkerSpec
	for _, id := range f.ids() {
		specs = append(specs, f.specs[id])
	}
	b, err := json.MarshalIndent(specs, "", "  ")
	if err != nil {
		return err
	}
	tmp := f.path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("fleet file: %w", err)
	}
	if err := os.Rename(tmp, f.path); err != nil {
		return fmt.Errorf("fleet file: %w", err)
	}
	return nil
}

// setWatch follows each replica's routable worker set through its admin API.
type setWatch struct {
	h     *haCluster
	mu    sync.Mutex
	start time.Time
	now   map[string][]string // replica id → its set now (nil: not read yet)
	seen  map[string][]SetChange
}

func newSetWatch(h *haCluster) *setWatch {
	return &setWatch{h: h, now: map[string][]string{}, seen: map[string][]SetChange{}}
}

// restart measures the timeline from start on (what came before is the set at 0).
func (s *setWatch) restart(start time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.start = start
	for id, set := range s.now {
		s.seen[id] = []SetChange{{At: 0, Workers: set}}
	}
}

// run reads every replica's set every 50 ms until ctx ends.
func (s *setWatch) run(ctx context.Context, start time.Time) {
	s.mu.Lock()
	s.start = start
	s.mu.Unlock()
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		for _, m := range s.h.members {
			set, err := routableSet(ctx, s.h.hc, m.Admin)
			if err != nil {
				continue
			}
			s.mu.Lock()
			if !slices.Equal(set, s.now[m.ID]) || s.now[m.ID] == nil {
				s.now[m.ID] = set
				s.seen[m.ID] = append(s.seen[m.ID], SetChange{At: time.Since(s.start), Workers: set})
			}
			s.mu.Unlock()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// routableSet asks a replica's admin API for its workers not drained, sorted as the demo
// numbers them.
func routableSet(ctx context.Context, hc *http.Client, admin string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	var ws []routing.WorkerStatus
	if err := proc.Get(ctx, hc, "http://"+admin+"/admin/workers", &ws); err != nil {
		return nil, err
	}
	set := []string{}
	for _, w := range ws {
		if !w.Drained {
			set = append(set, w.Spec.ID)
		}
	}
	slices.SortFunc(set, func(a, b string) int { return cmp.Compare(workerNumber(a), workerNumber(b)) })
	return set, nil
}

// converge waits (at most a minute) until every replica's set is want, and reports the step.
func (s *setWatch) converge(ctx context.Context, name string, want []string, at time.Duration, start time.Time) ScaleStep {
	step := ScaleStep{Name: name, At: at, Want: want}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		s.mu.Lock()
		all := len(s.now) == len(s.h.members)
		for _, set := range s.now {
			all = all && slices.Equal(set, want)
		}
		s.mu.Unlock()
		if all {
			step.Converged, step.Took = true, time.Since(start)-at
			return step
		}
		select {
		case <-ctx.Done():
			step.Took = time.Since(start) - at
			return step
		case <-t.C:
		}
	}
}

// timeline is a copy of each replica's changes.
func (s *setWatch) timeline() map[string][]SetChange {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string][]SetChange{}
	for id, cs := range s.seen {
		out[id] = slices.Clone(cs)
	}
	return out
}

// print writes the report: the two runs side by side, the steps, what moved and why, and
// each replica's worker set over time.
func (r *ScaleReport) print(w io.Writer) {
	sums := []*replay.Summary{r.Scaled.Summary}
	if r.Fixed != nil {
		sums = append(sums, r.Fixed.Summary)
	}
	fmt.Fprintln(w)
	replay.Table(w, sums)
	fmt.Fprintln(w)
	s := r.Scaled
	if r.Fixed != nil {
		fmt.Fprintf(w, "hit rate (cached / prompt tokens, as the workers report): %.1f%% scaled, %.1f%% on a fixed fleet of %d\n",
			100*s.Summary.HitRate, 100*r.Fixed.Summary.HitRate, r.FixedSize)
	}
	for _, st := range s.Steps {
		state := fmt.Sprintf("every replica routes to it %.2f s later", st.Took.Seconds())
		if !st.Converged {
			state = fmt.Sprintf("NOT every replica routed to it within %.0f s", st.Took.Seconds())
		}
		fmt.Fprintf(w, "%-10s at %6.1f s: %d workers in the file; %s\n", st.Name, st.At.Seconds(), len(st.Want), state)
	}
	if len(s.Stopped) > 0 {
		fmt.Fprintf(w, "stopped once drained: %s at %.1f s\n", strings.Join(s.Stopped, " "), s.StoppedAt.Seconds())
	}
	fmt.Fprintf(w, "requests failed: %d of %d (%d in flight on a stopped worker, %d whose binding did not commit in time, %d otherwise; %d naming a draining worker): %s\n",
		s.Summary.Failed, s.Summary.Requests, s.FailedOnStopped, s.FailedAtBinding, s.UnexplainedFailures(), s.FailedDraining, s.Summary.ErrorList())
	for _, f := range s.FailureSamples {
		fmt.Fprintf(w, "  failed: %s\n", f)
	}
	fmt.Fprintf(w, "sessions that changed worker: %d of %d; moves: %d, %d because their worker left the file (drained), %d otherwise (%d dispatches a worker failed, each retried elsewhere)\n",
		s.Summary.SessionsMoved, s.Summary.Sessions, s.Moves, s.MovesByDrain, s.Moves-s.MovesByDrain, s.WorkerFaults)
	for _, m := range s.OtherMoves {
		fmt.Fprintf(w, "  a move no drain explains: %s\n", m)
	}
	fmt.Fprintln(w, "each replica's routable workers (not drained) over time, from the replay's start:")
	ids := make([]string, 0, len(s.Timeline))
	for id := range s.Timeline {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		var parts []string
		var prev []string
		for _, c := range s.Timeline[id] {
			parts = append(parts, fmt.Sprintf("%.1f s %s", c.At.Seconds(), setDiff(prev, c.Workers)))
			prev = c.Workers
		}
		fmt.Fprintf(w, "  %s: %s\n", id, strings.Join(parts, "; "))
	}
}

// setDiff is how set b differs from a: the whole set when a is empty, else +added -removed,
// with b's size.
func setDiff(a, b []string) string {
	if len(a) == 0 {
		return fmt.Sprintf("[%s] (%d)", strings.Join(b, " "), len(b))
	}
	var d []string
	for _, id := range b {
		if !slices.Contains(a, id) {
			d = append(d, "+"+id)
		}
	}
	for _, id := range a {
		if !slices.Contains(b, id) {
			d = append(d, "-"+id)
		}
	}
	return fmt.Sprintf("%s (%d)", strings.Join(d, " "), len(b))
}
