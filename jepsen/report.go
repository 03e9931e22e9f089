package jepsen

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// Report is a run's outcome: what ran, what was injected, and what the checker found.
type Report struct {
	Seed         int64         `json:"seed"`
	Replicas     int           `json:"replicas"`
	Workers      int           `json:"workers"`
	Clients      int           `json:"clients"`
	Duration     time.Duration `json:"duration_ns"`
	Consistency  string        `json:"consistency"`
	StaleBound   time.Duration `json:"stale_bound_ns"`
	SessionTTL   time.Duration `json:"session_ttl_ns"`
	FaultsAsked  []FaultKind   `json:"faults_asked"`
	Network      string        `json:"network"`
	Partitions   string        `json:"partitions"`
	LoadBalancer string        `json:"load_balancer,omitempty"`
	ServeArgs    []string      `json:"serve_args,omitempty"`
	Plan         []Step        `json:"plan"`
	Injected     []Fault       `json:"injected"`
	Skipped      []string      `json:"skipped,omitempty"`
	Analysis     *Analysis     `json:"analysis"`
	Files        []string      `json:"files"`
	Elapsed      time.Duration `json:"elapsed_ns"`

	ops map[int]*Op
}

// Valid reports whether the run found no violation.
func (r *Report) Valid() bool { return r.Analysis != nil && r.Analysis.Valid() }

// Recheck checks a saved history again and returns a report of it alone.
func Recheck(h *History, cfg CheckConfig) *Report {
	r := &Report{Injected: h.Faults, Analysis: Check(h, cfg), Duration: h.End, Partitions: "(from a saved history)"}
	r.index(h)
	return r
}

func (r *Report) index(h *History) {
	r.ops = make(map[int]*Op, len(h.Ops))
	for i := range h.Ops {
		r.ops[h.Ops[i].ID] = &h.Ops[i]
	}
}

// WriteText writes the readable summary.
func (r *Report) WriteText(w io.Writer) error {
	a := r.Analysis
	var b strings.Builder
	verdict := "PASS: 0 violations"
	if !r.Valid() {
		verdict = fmt.Sprintf("FAIL: %d violations", len(a.Violations))
	}
	fmt.Fprintf(&b, "kvrouter-ha jepsen: %s\n", verdict)
	fmt.Fprintf(&b, "run:         seed %d, %d replicas, %d workers, %d clients, %s (took %s)\n",
		r.Seed, r.Replicas, r.Workers, r.Clients, r.Duration, r.Elapsed.Round(time.Second))
	fmt.Fprintf(&b, "replicas:    consistency %s, stale bound %s, session ttl %s", r.Consistency, r.StaleBound, r.SessionTTL)
	if len(r.ServeArgs) > 0 {
		fmt.Fprintf(&b, ", extra flags %q", r.ServeArgs)
	}
	b.WriteString("\n")
	fmt.Fprintf(&b, "network:     %s\n", r.Network)
	fmt.Fprintf(&b, "partitions:  %s\n", r.Partitions)
	if r.LoadBalancer != "" {
		fmt.Fprintf(&b, "balancer:    %s\n", r.LoadBalancer)
	}
	o := a.Ops
	fmt.Fprintf(&b, "operations:  %d (ok %d, fail %d, unknown %d); %d saw a binding; %d streams; %d sessions, %d first requests\n",
		o.Total, o.OK, o.Fail, o.Unknown, o.Observed, o.Streams, o.Sessions, o.First)
	fmt.Fprintf(&b, "faults:      %d injected (%s)", len(r.Injected), faultCounts(r.Injected))
	if len(r.Skipped) > 0 {
		fmt.Fprintf(&b, ", %d planned steps not run", len(r.Skipped))
	}
	b.WriteString("\n")
	for _, f := range r.Injected {
		fmt.Fprintf(&b, "  #%-3d %-13s %-14s %8s - %-8s", f.ID, f.Kind, strings.Join(f.Targets, ","), fmtDur(f.Start), fmtDur(f.End))
		if f.Recovered > 0 {
			fmt.Fprintf(&b, " ready %s", fmtDur(f.Recovered))
		}
		if f.Detail != "" {
			fmt.Fprintf(&b, "  (%s)", f.Detail)
		}
		if f.Error != "" {
			fmt.Fprintf(&b, "  ERROR: %s", f.Error)
		}
		b.WriteString("\n")
	}
	for _, s := range r.Skipped {
		fmt.Fprintf(&b, "  not run: %s\n", s)
	}
	g := a.Register
	fmt.Fprintf(&b, "register:    porcupine over %d sessions: %d linearizable, %d illegal, %d undecided in time\n",
		g.Sessions, g.Linearizable, g.Illegal, g.TimedOut)
	fmt.Fprintf(&b, "revisions:   %d went backwards, %d named two workers\n", g.Backwards, g.RevisionTwoWorkers)
	c := a.Churn
	fmt.Fprintf(&b, "churn:       %d binding changes (%d to another worker): %d by a worker fault, %d by a drain, %d by expiry, %d by the nemesis's rebinds, %d unexplained\n",
		c.Changes, c.WorkerChanges, c.ByWorkerFault, c.ByDrain, c.ByExpiry, c.ByRebind, c.Unexplained)
	if p := a.Probes; p.Sent > 0 {
		fmt.Fprintf(&b, "stale:       %d probes of a replica back from a pause or a partition, %d rebound sessions: %d answered with the new binding (or newer), %d with an older one, %d errors\n",
			p.Sent, p.Sessions, p.Fresh, p.Old, p.Errors)
	}
	d := a.Durability
	fmt.Fprintf(&b, "durability:  %d full restarts; %d acknowledged bindings read back: %d lost, %d regressed; %d excused (worker failed since); %d reads failed; %d sessions diverged at the end\n",
		d.Restarts, d.Checked, d.Lost, d.Regressed, d.Excused, d.Unverified, d.Divergent)
	if d.Late > 0 {
		fmt.Fprintf(&b, "             %d bindings read back after a full restart showed up only on a second read (the new leader answered before applying its log)\n", d.Late)
	}
	b.WriteString("availability: requests that succeeded, by what was going on when they were sent\n")
	for _, av := range a.Availability {
		fmt.Fprintf(&b, "  %-13s %6.1f%%  (%d of %d, %d faults)", av.Kind, 100*av.Share, av.OK, av.Ops, av.Faults)
		if av.Kind != "none" && av.ElsewhereOps > 0 && av.ElsewhereOps != av.Ops {
			fmt.Fprintf(&b, "; not sent to a faulted replica: %.1f%% (%d of %d)", 100*av.ElsewhereShare, av.ElsewhereOK, av.ElsewhereOps)
		}
		b.WriteString("\n")
	}
	writeFailures(&b, a.Failures, a.Balancer)
	nb := a.NoNewBinding
	fmt.Fprintf(&b, "new sessions: longest stretch without a new binding %s (%s - %s)", nb.Length.Round(time.Millisecond), fmtDur(nb.From), fmtDur(nb.To))
	if len(nb.Faults) > 0 {
		fmt.Fprintf(&b, ", during faults %v", nb.Faults)
	}
	b.WriteString("\n")
	if !r.Valid() {
		b.WriteString("violations:\n")
		for i, v := range a.Violations {
			if i == 20 {
				fmt.Fprintf(&b, "  ... and %d more (report.json has them all)\n", len(a.Violations)-20)
				break
			}
			fmt.Fprintf(&b, "  [%s] %s\n", v.Check, v.Message)
			for _, id := range v.Ops {
				if op := r.ops[id]; op != nil {
					fmt.Fprintf(&b, "      %s\n", describeOp(op))
				}
			}
			if len(v.Faults) > 0 {
				fmt.Fprintf(&b, "      faults nearby: %v\n", v.Faults)
			}
		}
	}
	if len(r.Files) > 0 {
		fmt.Fprintf(&b, "files:       %s\n", strings.Join(r.Files, ", "))
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func faultCounts(fs []Fault) string {
	counts := map[FaultKind]int{}
	var kinds []FaultKind
	for _, f := range fs {
		if counts[f.Kind] == 0 {
			kinds = append(kinds, f.Kind)
		}
		counts[f.Kind]++
	}
	slices.Sort(kinds)
	parts := make([]string, len(kinds))
	for i, k := range kinds {
		parts[i] = fmt.Sprintf("%s %d", k, counts[k])
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

func describeOp(op *Op) string {
	seen := "saw nothing"
	if op.Observed() {
		seen = fmt.Sprintf("saw %s@%d from %s", op.Worker, op.Revision, op.Replica)
	}
	s := fmt.Sprintf("op %d: client %d session %s via %s, %s - %s, %s, %s", op.ID, op.Client, op.Session, op.Target,
		fmtDur(op.Invoke), fmtDur(op.Complete), op.Result, seen)
	if op.Error != "" {
		s += ": " + op.Error
	}
	return s
}

var unsafeName = regexp.MustCompile(`[^A-Za-z0-9_.-]+`)

// write puts history.json, report.json, summary.txt and porcupine's pages into dir.
func (r *Report) write(dir string, h *History, cc CheckConfig) error {
	r.index(h)
	r.Files = []string{"summary.txt", "report.json", "history.json", "logs/"}
	pages := r.visualize(dir, h, cc)
	r.Files = append(r.Files, pages...)

	hf, err := os.Create(filepath.Join(dir, "history.json"))
	if err != nil {
		return fmt.Errorf("history file: %w", err)
	}
	if err := h.WriteJSON(hf); err != nil {
		hf.Close()
		return err
	}
	if err := hf.Close(); err != nil {
		return fmt.Errorf("history file: %w", err)
	}
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encode report: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), append(js, '\n'), 0o644); err != nil {
		return fmt.Errorf("report file: %w", err)
	}
	sf, err := os.Create(filepath.Join(dir, "summary.txt"))
	if err != nil {
		return fmt.Errorf("summary file: %w", err)
	}
	if err := r.WriteText(sf); err != nil {
		sf.Close()
		return err
	}
	return sf.Close()
}

// visualize writes porcupine's HTML for up to three failing sessions (those porcupine found
// illegal first, then those of other violations), with the faults drawn on the timeline.
func (r *Report) visualize(dir string, h *History, cc CheckConfig) []string {
	var sessions []string
	for _, s := range r.Analysis.Illegal {
		if !slices.Contains(sessions, s) {
			sessions = append(sessions, s)
		}
	}
	for _, v := range r.Analysis.Violations {
		if v.Session != "" && !slices.Contains(sessions, v.Session) {
			sessions = append(sessions, v.Session)
		}
	}
	if len(sessions) > 3 {
		sessions = sessions[:3]
	}
	all := bySession(h.Ops)
	var files []string
	for _, s := range sessions {
		name := "porcupine-" + unsafeName.ReplaceAllString(s, "_") + ".html"
		if err := visualizeSession(filepath.Join(dir, name), all[s], h, cc); err == nil {
			files = append(files, name)
		}
	}
	return files
}

func visualizeSession(path string, ops []*Op, h *History, cc CheckConfig) error {
	model := RegisterModel()
	timeout := 20 * time.Second
	_, info := porcupine.CheckOperationsVerbose(model, registerOps(ops, h.End, cc), timeout)
	var annotations []porcupine.Annotation
	for _, f := range h.Faults {
		annotations = append(annotations, porcupine.Annotation{
			Tag: "nemesis", Start: int64(f.Start), End: int64(f.Until(h.End)),
			Description: fmt.Sprintf("#%d %s %s", f.ID, f.Kind, strings.Join(f.Targets, ",")),
			Details:     f.Detail, BackgroundColor: "#f6d7d7",
		})
	}
	info.AddAnnotations(annotations)
	if err := porcupine.VisualizePath(model, info, path); err != nil {
		return fmt.Errorf("visualize: %w", err)
	}
	return nil
}

// writeFailures writes the failed requests by cause and phase, and what the balancer retried.
func writeFailures(b *strings.Builder, fs []FailureCount, bal BalancerStats) {
	total := 0
	for _, f := range fs {
		total += f.Ops
	}
	fmt.Fprintf(b, "failures:    %d requests failed or went unanswered, by cause and phase (the fault on their replica)\n", total)
	for _, f := range fs {
		fmt.Fprintf(b, "  %-16s %-13s %-10s %5d", f.Cause, f.Phase, cmp.Or(string(f.Fault), "-"), f.Ops)
		if f.Fault != "" {
			fmt.Fprintf(b, "  (%d in flight on it when the fault began)", f.Struck)
		}
		if f.ViaBalancer > 0 {
			fmt.Fprintf(b, "  (%d through the balancer, %d of them retried by it)", f.ViaBalancer, f.Retried)
		}
		b.WriteString("\n")
	}
	if bal.Ops > 0 {
		fmt.Fprintf(b, "lb retries:  %d requests sent through the balancer, %d in its log: %d retried by it (%d then succeeded), %d of them on another replica\n",
			bal.Ops, bal.Logged, bal.Retried, bal.RetriedOK, bal.Redispatched)
	}
}
