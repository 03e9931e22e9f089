package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
)

// Files the capacity sweep writes into Config.OutDir.
const (
	CapacityTableFile = "capacity.md"
	CapacityJSONFile  = "capacity.json"
)

// maxFailedShare is the share of a level's requests that may fail for the level still to
// count as served: the TTFT percentiles are over successful requests only, so a fleet that
// sheds load must not look fast.
const maxFailedShare = 0.01

// CapacityReport is the capacity sweep: each policy on the same trace slice at every load
// level (fewer workers for the same traffic), Runs times, and the highest load each policy
// serves with its TTFT p90 within the target.
type CapacityReport struct {
	// TargetMs is the TTFT p90 a level must stay within, in milliseconds as the replay
	// measures them (at the demo's speedup, like every demo table).
	TargetMs float64 `json:"target_ms"`
	Runs     int     `json:"runs"`
	// Requests is the slice's length, Start its first request, Speedup its pace.
	Requests int      `json:"requests"`
	Start    int      `json:"start"`
	Speedup  float64  `json:"speedup"`
	Policies []string `json:"policies"`
	// Cores and Date are the machine's processor count and when the sweep ended.
	Cores int       `json:"cores"`
	Date  time.Time `json:"date"`
	// Levels are the load levels, lightest first.
	Levels []CapacityLevel `json:"levels"`
	// Points are each policy at each level, the medians of its runs.
	Points []CapacityPoint `json:"points"`
	// Capacities are each policy's capacity, in Policies' order.
	Capacities []PolicyCapacity `json:"capacities"`
}

// CapacityLevel is one load level: the slice's traffic on Workers workers.
type CapacityLevel struct {
	Workers int `json:"workers"`
	// Load is the slice's arrival rate per worker, in requests per second of trace time.
	Load float64 `json:"load_rps_per_worker"`
}

// CapacityPoint is one policy at one level over its runs: the medians, and the spread of
// the TTFT p90.
type CapacityPoint struct {
	Policy  string `json:"policy"`
	Workers int    `json:"workers"`
	// TTFTP90Ms is the median over the runs of each run's p90; Min and Max its spread.
	TTFTP90Ms    float64 `json:"ttft_p90_ms"`
	TTFTP90MinMs float64 `json:"ttft_p90_min_ms"`
	TTFTP90MaxMs float64 `json:"ttft_p90_max_ms"`
	TTFTP50Ms    float64 `json:"ttft_p50_ms"`
	TTFTP99Ms    float64 `json:"ttft_p99_ms"`
	HitRate      float64 `json:"hit_rate"`
	// Failed sums the runs' failed requests, Requests the runs' requests.
	Failed   int `json:"failed"`
	Requests int `json:"requests"`
	// Within says the level is served: median p90 within the target, at most 1% failed.
	Within bool `json:"within"`
	// Summaries are the runs themselves.
	Summaries []*replay.Summary `json:"runs"`
}

// PolicyCapacity is the highest load level a policy serves within the target, it and every
// lighter level: Workers 0 when even the lightest is not. RunMin and RunMax are the spread
// of the same figure taken on each run alone (the lightest and heaviest load reached).
type PolicyCapacity struct {
	Policy  string  `json:"policy"`
	Workers int     `json:"workers"`
	Load    float64 `json:"load_rps_per_worker"`
	RunMin  float64 `json:"run_min_load_rps_per_worker"`
	RunMax  float64 `json:"run_max_load_rps_per_worker"`
}

// CapacityRun is one replay of the sweep: a policy, a fleet size, the run's number.
type CapacityRun struct {
	Policy  string
	Workers int
	Run     int
	Summary *replay.Summary
}

// Capacity runs the capacity sweep: for each of cfg.Runs runs, each level of
// cfg.LoadWorkers and each policy (interleaved, so that a disturbance of the machine falls on
// every policy alike), one replay of the slice through a fresh fleet and a fresh router,
// cfg.Parallel of them at once (0: one); then
// it prints the tables and, with cfg.OutDir, writes them and the JSON there.
func Capacity(ctx context.Context, cfg Config, stdout, progress io.Writer) (*CapacityReport, error) {
	if len(cfg.Policies) == 0 {
		return nil, errors.New("no policies to compare")
	}
	if len(cfg.LoadWorkers) == 0 {
		return nil, errors.New("no load levels (worker counts)")
	}
	if cfg.Runs < 1 || cfg.TTFTTarget <= 0 {
		return nil, fmt.Errorf("capacity: want at least one run and a TTFT target, got %d runs and %s", cfg.Runs, cfg.TTFTTarget)
	}
	for _, w := range cfg.LoadWorkers {
		if w < 1 {
			return nil, fmt.Errorf("capacity: %d workers", w)
		}
	}
	reqs, err := cfg.traceSlice()
	if err != nil {
		return nil, err
	}
	if len(reqs) < 2 {
		return nil, errors.New("capacity: the slice needs at least two requests")
	}
	span := (reqs[len(reqs)-1].Timestamp - reqs[0].Timestamp).Seconds()
	if span <= 0 {
		return nil, errors.New("capacity: the slice's requests all arrive at once")
	}
	levels := make([]CapacityLevel, 0, len(cfg.LoadWorkers))
	for _, w := range cfg.LoadWorkers {
		levels = append(levels, CapacityLevel{Workers: w, Load: float64(len(reqs)) / span / float64(w)})
	}
	slices.SortFunc(levels, func(a, b CapacityLevel) int { return b.Workers - a.Workers })
	levels = slices.CompactFunc(levels, func(a, b CapacityLevel) bool { return a.Workers == b.Workers })

	say := func(format string, args ...any) {
		if progress != nil {
			fmt.Fprintf(progress, format+"\n", args...)
		}
	}
	say("capacity sweep: %s at %d levels, %d runs, %d requests at %gx, TTFT p90 target %s",
		strings.Join(cfg.Policies, ", "), len(levels), cfg.Runs, len(reqs), cfg.Speedup, cfg.TTFTTarget)
	var todo []CapacityRun
	for i := range cfg.Runs {
		for _, l := range levels {
			for _, pol := range cfg.Policies {
				todo = append(todo, CapacityRun{Policy: pol, Workers: l.Workers, Run: i})
			}
		}
	}
	// Up to cfg.Parallel replays at once, in the order above; the first error stops the
	// rest from starting.
	var (
		mu    sync.Mutex
		first error
		wg    sync.WaitGroup
	)
	slots := make(chan struct{}, max(cfg.Parallel, 1))
	for k := range todo {
		slots <- struct{}{}
		mu.Lock()
		failed := first != nil
		mu.Unlock()
		if err := ctx.Err(); err != nil || failed {
			<-slots
			break
		}
		wg.Add(1)
		go func(r *CapacityRun) {
			defer wg.Done()
			defer func() { <-slots }()
			c := cfg
			c.Workers = r.Workers
			s, err := runOne(ctx, c, run{fleet: Fleet{Aggregated: r.Workers}, tp: Topology{Replicas: 1}, policy: r.Policy, recordAt: "dispatch"}, reqs, nil)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if first == nil {
					first = fmt.Errorf("run %d, %d workers, policy %s: %w", r.Run+1, r.Workers, r.Policy, err)
				}
				return
			}
			s.Label = fmt.Sprintf("%s w%d #%d", r.Policy, r.Workers, r.Run+1)
			r.Summary = s
			say("  run %d, %d workers (%.2f req/s each), %-13s TTFT p90 %7.1f ms, hit rate %5.1f%%, %d failed",
				r.Run+1, r.Workers, float64(len(reqs))/span/float64(r.Workers), r.Policy, s.TTFTP90Ms, 100*s.HitRate, s.Failed)
		}(&todo[k])
	}
	wg.Wait()
	if first != nil {
		return nil, first
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	runs := todo
	rep := NewCapacityReport(cfg.TTFTTarget, cfg.Policies, levels, cfg.Runs, runs)
	rep.Requests, rep.Start, rep.Speedup = len(reqs), cfg.Start, cfg.Speedup
	rep.Cores, rep.Date = runtime.NumCPU(), time.Now().UTC()
	fmt.Fprintln(stdout, rep.Markdown())
	if cfg.OutDir != "" {
		if err := rep.Write(cfg.OutDir); err != nil {
			return rep, err
		}
		fmt.Fprintf(stdout, "wrote %s and %s in %s\n", CapacityTableFile, CapacityJSONFile, cfg.OutDir)
	}
	return rep, nil
}

// NewCapacityReport gathers runs (each policy at each of levels, lightest first, runs
// times) into the report: medians per level and each policy's capacity within target.
func NewCapacityReport(target time.Duration, policies []string, levels []CapacityLevel, runs int, all []CapacityRun) *CapacityReport {
	rep := &CapacityReport{TargetMs: float64(target) / float64(time.Millisecond), Runs: runs,
		Policies: slices.Clone(policies), Levels: slices.Clone(levels)}
	for _, pol := range policies {
		// within[r][l]: run r alone at level l is within the target.
		within := make([][]bool, runs)
		for r := range within {
			within[r] = make([]bool, len(levels))
		}
		var served []bool
		for li, l := range levels {
			p := CapacityPoint{Policy: pol, Workers: l.Workers}
			var p50, p90, p99, hit []float64
			for _, r := range all {
				if r.Policy != pol || r.Workers != l.Workers || r.Summary == nil {
					continue
				}
				s := r.Summary
				p.Summaries = append(p.Summaries, s)
				p50, p90, p99, hit = append(p50, s.TTFTP50Ms), append(p90, s.TTFTP90Ms), append(p99, s.TTFTP99Ms), append(hit, s.HitRate)
				p.Failed += s.Failed
				p.Requests += s.Requests
				if r.Run >= 0 && r.Run < runs {
					within[r.Run][li] = withinTarget(s.TTFTP90Ms, s.Failed, s.Requests, rep.TargetMs)
				}
			}
			if len(p90) > 0 {
				p.TTFTP90Ms, p.TTFTP90MinMs, p.TTFTP90MaxMs = median(p90), slices.Min(p90), slices.Max(p90)
				p.TTFTP50Ms, p.TTFTP99Ms, p.HitRate = median(p50), median(p99), median(hit)
				p.Within = withinTarget(p.TTFTP90Ms, p.Failed, p.Requests, rep.TargetMs)
			}
			served = append(served, p.Within)
			rep.Points = append(rep.Points, p)
		}
		c := PolicyCapacity{Policy: pol}
		if i := highestServed(served); i >= 0 {
			c.Workers, c.Load = levels[i].Workers, levels[i].Load
		}
		c.RunMin = math.Inf(1)
		for r := range runs {
			load := 0.0
			if i := highestServed(within[r]); i >= 0 {
				load = levels[i].Load
			}
			c.RunMin, c.RunMax = min(c.RunMin, load), max(c.RunMax, load)
		}
		if runs == 0 {
			c.RunMin = 0
		}
		rep.Capacities = append(rep.Capacities, c)
	}
	return rep
}

// withinTarget says a level is served: a TTFT p90 within target (ms) and at most
// maxFailedShare of its requests failed; a level without requests is not.
func withinTarget(p90Ms float64, failed, requests int, targetMs float64) bool {
	return requests > 0 && p90Ms <= targetMs && float64(failed) <= maxFailedShare*float64(requests)
}

// highestServed is the index of the heaviest level such that it and every lighter one
// (levels run lightest first) are served; -1 when the lightest is not.
func highestServed(served []bool) int {
	i := slices.Index(served, false)
	if i < 0 {
		return len(served) - 1
	}
	return i - 1
}

// median is xs' median (the mean of the middle two for an even count); xs is not changed.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(xs))
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// Point is policy's point at workers (nil when the sweep has none).
func (r *CapacityReport) Point(policy string, workers int) *CapacityPoint {
	for i := range r.Points {
		if r.Points[i].Policy == policy && r.Points[i].Workers == workers {
			return &r.Points[i]
		}
	}
	return nil
}

// Markdown is the sweep as Markdown: each policy's capacity, then TTFT p90 and hit rate at
// every level.
func (r *CapacityReport) Markdown() string {
	var b strings.Builder
	fmt.Fprintf(&b, "Capacity within a TTFT p90 of %g ms (median of %d runs; a level counts when its median p90 is within the target and at most %.0f%% of its requests failed, and every lighter level does too). Load: the slice's requests per second of trace time per worker.\n\n",
		r.TargetMs, r.Runs, 100*maxFailedShare)
	b.WriteString("| policy | capacity (req/s per worker) | at workers | spread over runs |\n| --- | ---: | ---: | --- |\n")
	for _, c := range r.Capacities {
		capa, at := "none", "-"
		if c.Workers > 0 {
			capa, at = fmt.Sprintf("%.3f", c.Load), fmt.Sprint(c.Workers)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %.3f-%.3f |\n", c.Policy, capa, at, c.RunMin, c.RunMax)
	}
	// table writes one row per policy, one cell per level.
	table := func(title string, cell func(p *CapacityPoint) string) {
		fmt.Fprintf(&b, "\n%s\n\n| policy |", title)
		for _, l := range r.Levels {
			fmt.Fprintf(&b, " %d workers (%.3f) |", l.Workers, l.Load)
		}
		b.WriteString("\n| --- |" + strings.Repeat(" ---: |", len(r.Levels)) + "\n")
		for _, pol := range r.Policies {
			fmt.Fprintf(&b, "| %s |", pol)
			for _, l := range r.Levels {
				if p := r.Point(pol, l.Workers); p != nil {
					fmt.Fprintf(&b, " %s |", cell(p))
				} else {
					b.WriteString(" - |")
				}
			}
			b.WriteString("\n")
		}
	}
	table("TTFT p90 ms, median (min-max over runs); * over the target or more than 1% failed:", func(p *CapacityPoint) string {
		mark := ""
		if !p.Within {
			mark = " *"
		}
		return fmt.Sprintf("%.0f (%.0f-%.0f)%s", p.TTFTP90Ms, p.TTFTP90MinMs, p.TTFTP90MaxMs, mark)
	})
	table("Hit rate (share of prompt tokens served from cache), median; failed requests over all runs after a slash when any:", func(p *CapacityPoint) string {
		if p.Failed > 0 {
			return fmt.Sprintf("%.1f%% / %d failed", 100*p.HitRate, p.Failed)
		}
		return fmt.Sprintf("%.1f%%", 100*p.HitRate)
	})
	return b.String()
}

// Write writes the Markdown tables and the JSON report into dir (created).
func (r *CapacityReport) Write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(r, "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, CapacityJSONFile), append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, CapacityTableFile), []byte(r.Markdown()), 0o644)
}

// ReadCapacityReport reads the JSON report Write wrote into dir.
func ReadCapacityReport(dir string) (*CapacityReport, error) {
	b, err := os.ReadFile(filepath.Join(dir, CapacityJSONFile))
	if err != nil {
		return nil, err
	}
	var r CapacityReport
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%s: %w", CapacityJSONFile, err)
	}
	return &r, nil
}

// ParseLoadWorkers reads --load-workers: a comma-separated list of worker counts, each from
// 1 to 64.
func ParseLoadWorkers(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > 64 {
			return nil, fmt.Errorf("--load-workers item %q: want a worker count from 1 to 64", f)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, errors.New("--load-workers: no worker counts")
	}
	return out, nil
}
