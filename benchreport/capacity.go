package benchreport

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/kvrouter-ha/kvrouter-ha/demo"
)

// figCapacity is the capacity sweep's figure: TTFT p90 and hit rate against the load.
const figCapacity = "capacity.png"

// runCapacity runs the capacity sweep (demo.Capacity) on cfg's slice: each of cfg.Policies
// at every fleet size of cfg.CapacityWorkers, cfg.CapacityRuns times.
func runCapacity(ctx context.Context, cfg Config, log *slog.Logger, progress io.Writer) (*demo.CapacityReport, error) {
	dc := cfg.demoConfig(log)
	dc.Policies = cfg.Policies
	dc.LoadWorkers, dc.Runs, dc.TTFTTarget = cfg.CapacityWorkers, cfg.CapacityRuns, cfg.CapacityTarget
	if cfg.CapacityRequests > 0 {
		dc.Limit = cfg.CapacityRequests
	}
	return demo.Capacity(ctx, dc, io.Discard, progress)
}

// PlotCapacity draws the capacity figure into dir from the capacity.json that
// `kvrouter-ha demo --scenario capacity --out DIR` wrote there, for a sweep run apart from
// the report (the router's binary carries no plotting library).
func PlotCapacity(dir string) (string, error) {
	rep, err := demo.ReadCapacityReport(dir)
	if err != nil {
		return "", err
	}
	f, err := capacityFigure(rep)
	if err != nil {
		return "", err
	}
	made := "made by `kvrouter-ha demo --scenario capacity`"
	if rep.Cores > 0 {
		made += fmt.Sprintf(" on a %d-core machine, %s", rep.Cores, rep.Date.Format("2006-01-02 15:04 MST"))
	}
	footer := wrap(made+"; "+capacityNote(rep), 150)
	return filepath.Join(dir, f.file), render(dir, f, footer, false)
}

// capacityNote says what the capacity figure shows, for its footer.
func capacityNote(rep *demo.CapacityReport) string {
	return fmt.Sprintf("%d requests of the trace from request %d at %gx, the same slice on each fleet size; medians of %d runs, bars from the fastest to the slowest run; one router replica.",
		rep.Requests, rep.Start, rep.Speedup, rep.Runs)
}

// capacityFigure is TTFT p90 (log scale, the target dashed) above hit rate, both against the
// load per worker, one line per policy.
func capacityFigure(rep *demo.CapacityReport) (figure, error) {
	f := figure{file: figCapacity, height: 8.5 * vg.Inch}
	if len(rep.Levels) == 0 || !slices.ContainsFunc(rep.Points, func(p demo.CapacityPoint) bool { return len(p.Summaries) > 0 }) {
		return f, fmt.Errorf("capacity: no load level with a run to plot")
	}
	for _, l := range rep.Levels {
		if !(l.Load > 0) || math.IsInf(l.Load, 0) || l.Workers < 1 {
			return f, fmt.Errorf("capacity: level %+v: want a positive load and at least one worker", l)
		}
	}
	ttft := newPlot(fmt.Sprintf("TTFT p90 against load: the highest load within %g ms is each policy's capacity", rep.TargetMs),
		"load (requests per second of trace time, per worker)", "TTFT p90 ms (log scale)")
	hits := newPlot("Hit rate against load", "load (requests per second of trace time, per worker)", "prefix-cache hit rate (% of prompt tokens)")
	var xs []float64
	for _, l := range rep.Levels {
		xs = append(xs, l.Load)
	}
	slices.Sort(xs)
	lo, hi := xs[0]*0.9, xs[len(xs)-1]*1.1
	if lo == hi {
		lo, hi = lo*0.5, hi*1.5
	}
	floor := 1.0
	top, ymin, ymax := 0.0, math.Inf(1), rep.TargetMs
	for i, pol := range rep.Policies {
		c := palette[i%len(palette)]
		var p90s, rates plotter.XYs
		for _, l := range rep.Levels {
			p := rep.Point(pol, l.Workers)
			if p == nil || len(p.Summaries) == 0 {
				continue
			}
			p90s = append(p90s, plotter.XY{X: l.Load, Y: max(p.TTFTP90Ms, floor)})
			rates = append(rates, plotter.XY{X: l.Load, Y: 100 * p.HitRate})
			// Each policy's bar a little to the side, so that they do not hide one another.
			bx := l.Load + (float64(i)-float64(len(rep.Policies)-1)/2)*(hi-lo)/200
			if err := vline(ttft, "", bx, max(p.TTFTP90MinMs, floor), max(p.TTFTP90MaxMs, floor), style{color: c, width: vg.Points(1)}); err != nil {
				return f, err
			}
			ymin, ymax, top = min(ymin, max(p.TTFTP90MinMs, floor)), max(ymax, p.TTFTP90MaxMs), max(top, 100*p.HitRate)
		}
		name := pol
		if i < len(rep.Capacities) {
			if cp := rep.Capacities[i]; cp.Workers > 0 {
				name = fmt.Sprintf("%s: capacity %.2f (%d workers)", pol, cp.Load, cp.Workers)
			} else {
				name = pol + ": no level within the target"
			}
		}
		if err := addLine(ttft, name, p90s, style{color: c, points: true}); err != nil {
			return f, err
		}
		if err := addLine(hits, pol, rates, style{color: c, points: true}); err != nil {
			return f, err
		}
	}
	if math.IsInf(ymin, 1) {
		ymin = rep.TargetMs
	}
	target := plotter.XYs{{X: lo, Y: rep.TargetMs}, {X: hi, Y: rep.TargetMs}}
	if err := addLine(ttft, fmt.Sprintf("target: TTFT p90 %g ms", rep.TargetMs), target, style{color: red, dashes: dashed, width: vg.Points(1.6)}); err != nil {
		return f, err
	}
	ticks := logTicks(xs, func(v float64) string {
		for _, l := range rep.Levels {
			if l.Load == v {
				return fmt.Sprintf("%.2f\n(%d workers)", v, l.Workers)
			}
		}
		return fmt.Sprintf("%.2f", v)
	})
	for _, p := range []*plot.Plot{ttft, hits} {
		p.X.Min, p.X.Max = lo, hi
		p.X.Tick.Marker = ticks
		p.Legend.Top, p.Legend.Left = true, true
	}
	ttft.Y.Scale = plot.LogScale{}
	ttft.Y.Min, ttft.Y.Max = ymin/1.5, ymax*1.5
	ttft.Y.Tick.Marker = decadeTicks(ttft.Y.Min, ttft.Y.Max, ms)
	hits.Y.Min, hits.Y.Max = 0, math.Ceil((top+8)/10)*10
	hits.Y.Tick.Marker = percentTicks(hits.Y.Max)
	hits.Legend.Top, hits.Legend.Left = false, false
	f.plots = [][]*plot.Plot{{ttft}, {hits}}
	return f, nil
}
