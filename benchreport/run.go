package benchreport

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/demo"
)

// Results are everything a report shows; results.json in the report's folder holds them.
type Results struct {
	Command string   `json:"command"`
	Machine Machine  `json:"machine"`
	Config  Config   `json:"config"`
	Seconds float64  `json:"seconds"`
	Steps   []Step   `json:"steps"`
	Replays *Replays `json:"replays,omitempty"`
	// Capacity is the capacity sweep: each policy's highest load within the TTFT target.
	Capacity *demo.CapacityReport `json:"capacity,omitempty"`
	HA       *Failover            `json:"failover,omitempty"`
	// Workers, Index and Snapshots are the cost curves, Binds the bind throughput.
	Workers   []WorkerPoint   `json:"select_vs_workers,omitempty"`
	Index     []IndexPoint    `json:"index_size,omitempty"`
	Snapshots []SnapshotPoint `json:"snapshot_pull,omitempty"`
	Binds     []BindPoint     `json:"bind_throughput,omitempty"`
	GoBenches GoBenches       `json:"go_benches"`
}

// Step is one section's run: how long it took, the machine's load around it, and its error.
type Step struct {
	Name      string  `json:"name"`
	Seconds   float64 `json:"seconds"`
	LoadStart string  `json:"load_start"`
	LoadEnd   string  `json:"load_end"`
	// Neighbours is how much of the machine's processor time other processes (and the
	// hypervisor) took during the section.
	Neighbours Neighbours `json:"neighbours"`
	Error      string     `json:"error,omitempty"`
}

// Files the report writes (and replaces) in its folder.
const (
	ReportFile  = "report.md"
	ResultsFile = "results.json"
)

// Run runs cfg's measurements and writes the report into cfg.Out. Progress lines go to
// progress (nil: none). A section that fails is reported as such in the report, the others
// still run, and Run returns an error naming the failed sections.
func Run(ctx context.Context, cfg Config, progress io.Writer) (*Results, error) {
	if cfg.Out == "" {
		return nil, errors.New("benchreport: no output folder")
	}
	if progress == nil {
		progress = io.Discard
	}
	began := time.Now()
	say := func(format string, args ...any) {
		fmt.Fprintf(progress, "[%6.1fs] %s\n", time.Since(began).Seconds(), fmt.Sprintf(format, args...))
	}
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return nil, err
	}
	work, err := os.MkdirTemp("", "kvrouter-benchreport-")
	if err != nil {
		return nil, err
	}
	logs, err := os.Create(filepath.Join(work, "routers.log"))
	if err != nil {
		return nil, err
	}
	defer logs.Close()
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelError}))

	res := &Results{Command: cfg.Command, Machine: thisMachine(), Config: cfg}
	say("bench report for %q into %s on %s (load %s); logs in %s", cfg.Command, cfg.Out, res.Machine.Footer(), res.Machine.LoadStart, work)
	var failed []string
	step := func(name string, fn func() error) {
		if ctx.Err() != nil {
			return
		}
		s := Step{Name: name, LoadStart: loadAverage()}
		t0, cpu := time.Now(), readCPU()
		say("== %s", name)
		err := fn()
		s.Seconds, s.LoadEnd, s.Neighbours = time.Since(t0).Seconds(), loadAverage(), cpu.since()
		if err != nil {
			s.Error = err.Error()
			failed = append(failed, name)
			say("%s failed: %v", name, err)
		}
		say("%s took %.0f s (%s)", name, s.Seconds, s.Neighbours)
		res.Steps = append(res.Steps, s)
	}

	step("replays", func() error {
		var err error
		res.Replays, err = runReplays(ctx, cfg, work, log, say)
		return err
	})
	if len(cfg.CapacityWorkers) > 0 {
		step("capacity sweep", func() error {
			var err error
			res.Capacity, err = runCapacity(ctx, cfg, log, progress)
			return err
		})
	}
	if cfg.Failover {
		step("failover", func() error {
			n := cfg.FailoverRequests
			if n <= 0 {
				n = cfg.Requests
			}
			reqs, err := cfg.slice(n)
			if err != nil {
				return err
			}
			if len(reqs) < 2 {
				return errors.New("the failover needs at least two requests")
			}
			say("three replica processes, %d requests at %gx, the leader killed half-way", len(reqs), cfg.Speedup)
			res.HA, err = failover(ctx, cfg, reqs, work)
			if err == nil {
				say("  %s killed at %.1f s, ready again at %.1f s; %d of %d requests failed; %.2f s without a leader",
					res.HA.Killed, res.HA.KillAt, res.HA.BackAt, res.HA.Summary.Failed, res.HA.Summary.Requests, res.HA.NoLeaderSeconds)
			}
			return err
		})
	}
	if len(cfg.BindReplicas) > 0 {
		step("bind throughput", func() error {
			var err error
			res.Binds, err = bindCurve(ctx, cfg, logs, say)
			return err
		})
	}
	if len(cfg.WorkerCounts) > 0 {
		step("selection against workers", func() error {
			var err error
			res.Workers, err = workerCurve(ctx, cfg, say)
			return err
		})
	}
	if len(cfg.IndexSizes) > 0 {
		step("index size", func() error {
			var err error
			res.Index, res.Snapshots, err = indexCurve(ctx, cfg, say)
			return err
		})
	}
	if len(cfg.GoBenches) > 0 {
		step("go test benchmarks", func() error {
			res.GoBenches = runGoBenches(ctx, cfg, filepath.Join(work, "go-bench.txt"), say)
			var errs []string
			for _, r := range res.GoBenches.Runs {
				if r.Error != "" {
					errs = append(errs, r.Command+": "+r.Error)
				}
			}
			if len(errs) > 0 {
				return errors.New(strings.Join(errs, "; "))
			}
			return nil
		})
	} else {
		res.GoBenches.Skipped = "not configured"
	}
	res.Seconds = time.Since(began).Seconds()
	res.Machine.LoadEnd = loadAverage()
	if err := ctx.Err(); err != nil {
		return res, err
	}

	say("writing %s", cfg.Out)
	if err := write(cfg.Out, res); err != nil {
		return res, err
	}
	if len(failed) > 0 {
		return res, fmt.Errorf("benchreport: %s failed (logs kept in %s)", strings.Join(failed, ", "), work)
	}
	logs.Close()
	os.RemoveAll(work)
	say("done in %.0f s: %s", res.Seconds, filepath.Join(cfg.Out, ReportFile))
	return res, nil
}

// Render rewrites the report and its plots in dir from the results.json there, measuring
// nothing: for a change to how the report reads.
func Render(dir string) (*Results, error) {
	b, err := os.ReadFile(filepath.Join(dir, ResultsFile))
	if err != nil {
		return nil, err
	}
	var res Results
	if err := json.Unmarshal(b, &res); err != nil {
		return nil, fmt.Errorf("%s: %w", ResultsFile, err)
	}
	return &res, write(dir, &res)
}

// write replaces the report, its plots and results.json in dir.
func write(dir string, res *Results) error {
	old, _ := filepath.Glob(filepath.Join(dir, "*.png"))
	for _, f := range old {
		_ = os.Remove(f)
	}
	figs, notes, err := figures(res)
	if err != nil {
		return err
	}
	footer := func(f figure) []string {
		lines := wrap(fmt.Sprintf("made by `%s` on %s", res.Command, res.Machine.Footer()), 150)
		lines = append(lines, notes[f.file]...)
		return lines
	}
	for _, f := range figs {
		if err := render(dir, f, footer(f), res.Config.FastPNG); err != nil {
			return err
		}
	}
	b, err := json.MarshalIndent(res, "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, ResultsFile), append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, ReportFile), []byte(markdown(res, figs)), 0o644)
}
