package benchreport

import (
	"fmt"
	"image/color"
	"math"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// The report's figures, by file.
const (
	figTTFT      = "ttft_cdf.png"
	figHitRate   = "hit_rate_vs_cache.png"
	figReplicas  = "replicas_quality.png"
	figCluster   = "replicas_cost.png"
	figFailover  = "failover_timeline.png"
	figWorkers   = "select_vs_workers.png"
	figIndexSize = "index_size.png"
	figSnapshot  = "snapshot_pull.png"
)

// kneeTolerance is how far off the straight line through a curve's first points a point may
// be before the curve counts as no longer linear.
const kneeTolerance = 0.25

// fitPoints is how many of a curve's n first points its straight line goes through: up to
// four, so that one noisy point does not tilt it, and never more than half of them.
func fitPoints(n int) int { return min(4, max(2, n/2)) }

// figures builds every figure the results have data for, and each one's footer notes.
func figures(res *Results) ([]figure, map[string][]string, error) {
	var figs []figure
	notes := map[string][]string{}
	cfg := res.Config
	all := overall(res)
	shared := fmt.Sprintf("A machine shared with other engineers' tests: during the report others took %.0f%% of the CPU, steal %.0f%% (1-minute load %s at the start, %s at the end).",
		100*all.OthersCPU, 100*all.Steal, first(res.Machine.LoadStart), first(res.Machine.LoadEnd))
	slice := fmt.Sprintf("%d requests of %s from request %d, %gx speed, %d simulated workers.", cfg.Requests, traceName(cfg), cfg.Start, cfg.Speedup, cfg.Workers)
	add := func(f figure, err error, lines ...string) error {
		if err != nil {
			return fmt.Errorf("%s: %w", f.file, err)
		}
		figs = append(figs, f)
		for _, l := range lines {
			notes[f.file] = append(notes[f.file], wrap(l, 150)...)
		}
		return nil
	}
	if r := res.Replays; r != nil && len(r.Policies) > 0 {
		f, err := ttftFigure(r)
		if err := add(f, err, slice+fmt.Sprintf(" Each worker's cache %d blocks; one router replica.", cfg.CapacityBlocks), shared); err != nil {
			return nil, nil, err
		}
	}
	if r := res.Replays; r != nil && len(r.Sweep) > 0 {
		f, err := hitRateFigure(r)
		if err := add(f, err, slice+" The router's index is capped at the workers' cache size, as --approx-max-blocks should be.", shared); err != nil {
			return nil, nil, err
		}
	}
	if r := res.Replays; r != nil && len(r.Topologies) > 0 {
		f, err := replicasFigure(r)
		if err := add(f, err, slice+" kv policy; the client sends to the replicas in turn; gossip on.", shared); err != nil {
			return nil, nil, err
		}
	}
	if r := res.Capacity; r != nil && len(r.Points) > 0 {
		f, err := capacityFigure(r)
		if err := add(f, err, capacityNote(r)+fmt.Sprintf(" Each worker's cache %d blocks.", cfg.CapacityBlocks), shared); err != nil {
			return nil, nil, err
		}
	}
	if len(res.Binds) > 0 || (res.Replays != nil && len(res.Replays.Topologies) > 1) {
		f, err := clusterFigure(res)
		if err := add(f, err, fmt.Sprintf("Binds: %d clients, each request a new session (one Raft write through the leader), for %s per size; in-process replicas on loopback over 4 simulated workers that answer at once.",
			cfg.BindConcurrency, cfg.BindDuration), shared); err != nil {
			return nil, nil, err
		}
	}
	if res.HA != nil && len(res.HA.Bins) > 0 {
		f, err := failoverFigure(res.HA)
		n := cfg.FailoverRequests
		if n <= 0 {
			n = cfg.Requests
		}
		if err := add(f, err, fmt.Sprintf("Three `kvrouter-ha serve` processes, %s; %d requests of %s from request %d at %gx; requests counted by when they were sent.",
			res.HA.Balancer, n, traceName(cfg), cfg.Start, cfg.Speedup), shared); err != nil {
			return nil, nil, err
		}
	}
	if len(res.Workers) > 0 {
		f, err := workersFigure(res.Workers)
		if err := add(f, err, fmt.Sprintf("One selection: hash an 8,192-token prompt, look it up in an index of about %s entries, read every worker's load, score (kv), take and release the load. %d rounds; p99 \"best\" is the best round's.",
			millions(cfg.WorkerCurveEntries), cfg.Rounds), shared); err != nil {
			return nil, nil, err
		}
	}
	if len(res.Index) > 0 {
		f, err := indexFigure(res.Index)
		if err := add(f, err, fmt.Sprintf("64 workers; 512-block prompts held by 1-16 workers at random depths, approximate index (120 s TTL); lookups cycle through every prompt. %d rounds per point.", cfg.Rounds), shared); err != nil {
			return nil, nil, err
		}
	}
	if len(res.Snapshots) > 0 {
		f, err := snapshotFigure(res.Snapshots)
		if err := add(f, err, "A joining replica's IndexSync pulls the index snapshot over a loopback peer (gRPC) port from another's, checks and loads it into an empty index: the wait before its /readyz turns ready.", shared); err != nil {
			return nil, nil, err
		}
	}
	return figs, notes, nil
}

func traceName(c Config) string {
	if c.Trace == "" {
		return "the bundled Mooncake trace"
	}
	return c.Trace
}

// first is the first field of a load average ("?" for none).
func first(load string) string {
	for i := range load {
		if load[i] == ' ' {
			return load[:i]
		}
	}
	if load == "" {
		return "?"
	}
	return load
}

func ms(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.0f", v)
	case v >= 1:
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.1f", v)
}

func ttftFigure(r *Replays) (figure, error) {
	f := figure{file: figTTFT}
	p := newPlot("Time to first token by routing policy (CDF)", "time to first token (ms, log scale)", "requests with a TTFT at most x")
	lo, hi := math.Inf(1), 0.0
	for _, pr := range r.Policies {
		if len(pr.TTFTMs) > 0 {
			lo = min(lo, max(pr.TTFTMs[0], 0.1))
			hi = max(hi, pr.TTFTMs[len(pr.TTFTMs)-1])
		}
	}
	if math.IsInf(lo, 1) {
		return f, fmt.Errorf("no TTFT was measured")
	}
	for i, pr := range r.Policies {
		n := len(pr.TTFTMs)
		xys := make(plotter.XYs, 0, n+1)
		if n > 0 {
			xys = append(xys, plotter.XY{X: max(pr.TTFTMs[0], lo), Y: 0})
		}
		for j, v := range pr.TTFTMs {
			xys = append(xys, plotter.XY{X: max(v, lo), Y: float64(j+1) / float64(n)})
		}
		s := pr.Summary
		name := fmt.Sprintf("%s: p50 %s, p90 %s, p99 %s ms; hit rate %.1f%%; %s", pr.Policy, ms(s.TTFTP50Ms), ms(s.TTFTP90Ms), ms(s.TTFTP99Ms), 100*s.HitRate, pr.Neighbours)
		if s.Failed > 0 {
			name += fmt.Sprintf("; %d failed", s.Failed)
		}
		if err := addLine(p, name, xys, style{color: palette[i%len(palette)], step: true, width: vg.Points(2.2)}); err != nil {
			return f, err
		}
	}
	p.X.Scale = plot.LogScale{}
	p.X.Min, p.X.Max = lo, hi*1.05
	p.X.Tick.Marker = decadeTicks(lo, hi*1.05, func(v float64) string { return fmt.Sprintf("%g", v) })
	p.Y.Min, p.Y.Max = 0, 1.0
	var yt plot.ConstantTicks
	for i := 0; i <= 10; i++ {
		yt = append(yt, plot.Tick{Value: float64(i) / 10, Label: fmt.Sprintf("%d%%", 10*i)})
	}
	p.Y.Tick.Marker = yt
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.XOffs = vg.Points(6)
	f.plots = [][]*plot.Plot{{p}}
	return f, nil
}

func hitRateFigure(r *Replays) (figure, error) {
	f := figure{file: figHitRate}
	p := newPlot("Hit rate against each worker's KV cache size, by policy", "KV cache per worker (16-token blocks, log scale)", "prefix-cache hit rate (% of prompt tokens)")
	var order []string
	caps := map[int]bool{}
	for _, s := range r.Sweep {
		if !slices.Contains(order, s.Policy) {
			order = append(order, s.Policy)
		}
		caps[s.CapacityBlocks] = true
	}
	var xs []float64
	for c := range caps {
		xs = append(xs, float64(c))
	}
	slices.Sort(xs)
	top := 100 * r.CeilingTokens
	for i, pol := range order {
		var xys plotter.XYs
		for _, s := range r.Sweep {
			if s.Policy == pol {
				xys = append(xys, plotter.XY{X: float64(s.CapacityBlocks), Y: 100 * s.HitRate})
				top = max(top, 100*s.HitRate)
			}
		}
		if err := addLine(p, pol, xys, style{color: palette[i%len(palette)], points: true}); err != nil {
			return f, err
		}
	}
	lo, hi := xs[0]/1.3, xs[len(xs)-1]*1.3
	ceiling := plotter.XYs{{X: lo, Y: 100 * r.CeilingTokens}, {X: hi, Y: 100 * r.CeilingTokens}}
	if err := addLine(p, fmt.Sprintf("ceiling: one unlimited cache holds %.1f%% of the slice's prompt tokens", 100*r.CeilingTokens),
		ceiling, style{color: grey, dashes: dashed, width: vg.Points(1.6)}); err != nil {
		return f, err
	}
	p.X.Scale = plot.LogScale{}
	p.X.Min, p.X.Max = lo, hi
	p.X.Tick.Marker = logTicks(xs, func(v float64) string {
		return fmt.Sprintf("%s\n(%s tokens)", comma(int(v)), millions(int(v)*blockSize))
	})
	p.Y.Min, p.Y.Max = 0, math.Ceil((top+8)/10)*10
	p.Y.Tick.Marker = percentTicks(p.Y.Max)
	p.Legend.Top, p.Legend.Left = false, false
	p.Legend.YOffs = vg.Points(8)
	f.plots = [][]*plot.Plot{{p}}
	return f, nil
}

// percentTicks label a percentage axis every 10 points up to hi.
func percentTicks(hi float64) plot.ConstantTicks {
	var t plot.ConstantTicks
	for v := 0.0; v <= hi+1e-9; v += 10 {
		t = append(t, plot.Tick{Value: v, Label: fmt.Sprintf("%.0f%%", v)})
	}
	return t
}

// comma renders n with thousands separators.
func comma(n int) string {
	s := fmt.Sprint(n)
	if n < 0 {
		return "-" + comma(-n)
	}
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// replicaTicks labels a replica-count axis at the counts.
func replicaTicks(counts []int) plot.ConstantTicks {
	var t plot.ConstantTicks
	for _, c := range counts {
		t = append(t, plot.Tick{Value: float64(c), Label: fmt.Sprint(c)})
	}
	return t
}

func replicasFigure(r *Replays) (figure, error) {
	f := figure{file: figReplicas}
	hit := newPlot("Hit rate against router replicas (kv)", "router replicas", "hit rate (% of prompt tokens)")
	mae := newPlot("Prediction error against router replicas (kv)", "router replicas", "mean |predicted - cached| (tokens)")
	var counts []int
	var hx, mx plotter.XYs
	var hl, ml []string
	for _, t := range r.Topologies {
		counts = append(counts, t.Replicas)
		hx = append(hx, plotter.XY{X: float64(t.Replicas), Y: 100 * t.Summary.HitRate})
		hl = append(hl, fmt.Sprintf("%.1f%%", 100*t.Summary.HitRate))
		mx = append(mx, plotter.XY{X: float64(t.Replicas), Y: t.Summary.OverlapMAETokens})
		label := fmt.Sprintf("%.0f", t.Summary.OverlapMAETokens)
		if t.Summary.Failed > 0 {
			label += fmt.Sprintf(" (%d failed)", t.Summary.Failed)
		}
		ml = append(ml, label)
	}
	if err := addLine(hit, "hit rate", hx, style{color: palette[0], points: true}); err != nil {
		return f, err
	}
	if err := addLabels(hit, hx, hl, belowRight); err != nil {
		return f, err
	}
	lo, hi := float64(counts[0])-0.5, float64(counts[len(counts)-1])+0.8
	if err := addLine(hit, fmt.Sprintf("unlimited-cache ceiling %.1f%%", 100*r.CeilingTokens),
		plotter.XYs{{X: lo, Y: 100 * r.CeilingTokens}, {X: hi, Y: 100 * r.CeilingTokens}}, style{color: grey, dashes: dashed, width: vg.Points(1.6)}); err != nil {
		return f, err
	}
	if err := addLine(mae, "prediction MAE", mx, style{color: palette[4], points: true}); err != nil {
		return f, err
	}
	if err := addLabels(mae, mx, ml, belowRight); err != nil {
		return f, err
	}
	for _, p := range []*plot.Plot{hit, mae} {
		p.X.Min, p.X.Max = lo, hi
		p.X.Tick.Marker = replicaTicks(counts)
		p.Y.Min = 0
	}
	hit.Y.Max = math.Ceil((100*r.CeilingTokens+10)/10) * 10
	hit.Y.Tick.Marker = percentTicks(hit.Y.Max)
	mae.Y.Max = max(10, mae.Y.Max*1.2)
	hit.Legend.Top = false
	f.plots = [][]*plot.Plot{{hit, mae}}
	return f, nil
}

func clusterFigure(res *Results) (figure, error) {
	f := figure{file: figCluster}
	binds := newPlot("Session binds per second against replicas", "router replicas", "new sessions bound per second")
	gossip := newPlot("Gossip sent per replica against replicas", "router replicas", "KB/s sent per replica")
	var counts []int
	var bx plotter.XYs
	var bl []string
	var gb plotter.XYs
	for _, b := range res.Binds {
		counts = append(counts, b.Replicas)
		bx = append(bx, plotter.XY{X: float64(b.Replicas), Y: b.PerSecond})
		bl = append(bl, fmt.Sprintf("%.0f/s, p99 %.0f ms", b.PerSecond, b.LatencyP99Ms))
		gb = append(gb, plotter.XY{X: float64(b.Replicas), Y: b.GossipBytesPerSecond / 1000})
	}
	var gt plotter.XYs
	var gl []string
	if res.Replays != nil {
		for _, t := range res.Replays.Topologies {
			if t.Replicas > 1 {
				if !slices.Contains(counts, t.Replicas) {
					counts = append(counts, t.Replicas)
				}
				gt = append(gt, plotter.XY{X: float64(t.Replicas), Y: t.Summary.GossipBytesPerSecond / 1000})
				l := fmt.Sprintf("%.0f KB/s", t.Summary.GossipBytesPerSecond/1000)
				if t.Summary.GossipDropped > 0 {
					l += fmt.Sprintf(", %d dropped", t.Summary.GossipDropped)
				}
				gl = append(gl, l)
			}
		}
	}
	slices.Sort(counts)
	if len(counts) == 0 {
		return f, fmt.Errorf("no cluster sizes")
	}
	if err := addLine(binds, "binds/s (each a Raft write before the worker is asked)", bx, style{color: palette[0], points: true}); err != nil {
		return f, err
	}
	if err := addLabels(binds, bx, bl, belowRight); err != nil {
		return f, err
	}
	if err := addLine(gossip, "during the trace replay (decisions, load, membership)", gt, style{color: palette[2], points: true}); err != nil {
		return f, err
	}
	if err := addLabels(gossip, gt, gl, belowRight); err != nil {
		return f, err
	}
	if err := addLine(gossip, "during the bind run", gb, style{color: palette[1], points: true, dashes: dashed}); err != nil {
		return f, err
	}
	lo, hi := float64(counts[0])-0.7, float64(counts[len(counts)-1])+1.2
	for _, p := range []*plot.Plot{binds, gossip} {
		p.X.Min, p.X.Max = lo, hi
		p.X.Tick.Marker = replicaTicks(counts)
		p.Y.Min = 0
		p.Y.Max *= 1.5
		p.Legend.Top = true
	}
	f.plots = [][]*plot.Plot{{binds, gossip}}
	return f, nil
}

func failoverFigure(h *Failover) (figure, error) {
	f := figure{file: figFailover, height: 8.5 * vg.Inch}
	end := h.Bins[len(h.Bins)-1].At + binWidth.Seconds()
	// The axis runs to the last thing seen: requests, a leader change, the restart.
	xEnd := end
	last := h.KillAt
	for _, c := range h.Leaders {
		xEnd = max(xEnd, c.At+binWidth.Seconds())
		if c.At >= h.KillAt {
			last = max(last, c.At)
		}
	}
	xEnd = max(xEnd, h.BackAt+binWidth.Seconds())
	last = max(last, h.BackAt)
	whole, err := failoverPanel(h, fmt.Sprintf("Failover: leader %s killed (SIGKILL) under load: %d of %d requests failed", h.Killed, h.Summary.Failed, h.Summary.Requests),
		0, xEnd, end, false)
	if err != nil {
		return f, err
	}
	lo, hi := max(0, h.KillAt-2), min(xEnd, last+3)
	zoom, err := failoverPanel(h, fmt.Sprintf("The same, from %.1f to %.1f s", lo, hi), lo, hi, end, true)
	if err != nil {
		return f, err
	}
	f.plots = [][]*plot.Plot{{whole}, {zoom}}
	return f, nil
}

// failoverPanel draws the timeline between lo and hi seconds; labels names the markers.
func failoverPanel(h *Failover, title string, lo, hi, end float64, labels bool) (*plot.Plot, error) {
	p := newPlot(title, "time since the replay started (s)", "requests sent per 100 ms")
	var all, bad plotter.XYs
	top := 0
	for _, b := range h.Bins {
		all = append(all, plotter.XY{X: b.At, Y: float64(b.OK + b.Failed)})
		bad = append(bad, plotter.XY{X: b.At, Y: float64(b.Failed)})
		if b.At >= lo && b.At < hi {
			top = max(top, b.OK+b.Failed)
		}
	}
	all = append(all, plotter.XY{X: end, Y: 0})
	bad = append(bad, plotter.XY{X: end, Y: 0})
	// Room above the bars for the legend and the markers' labels.
	ymax := float64(top)*1.8 + 2
	// Spells without a leader, shaded.
	var spells []plotter.XYer
	spellStart := -1.0
	box := func(a, b float64) plotter.XYs {
		return plotter.XYs{{X: a, Y: 0}, {X: b, Y: 0}, {X: b, Y: ymax}, {X: a, Y: ymax}}
	}
	for _, c := range h.Leaders {
		switch {
		case c.Leader == "" && spellStart < 0:
			spellStart = c.At
		case c.Leader != "" && spellStart >= 0:
			spells = append(spells, box(max(spellStart, lo), min(c.At, hi)))
			spellStart = -1
		}
	}
	if spellStart >= 0 {
		spells = append(spells, box(max(spellStart, lo), hi))
	}
	if len(spells) > 0 {
		poly, err := plotter.NewPolygon(spells...)
		if err != nil {
			return nil, err
		}
		poly.Color = lightRed
		poly.LineStyle.Width = 0
		p.Add(poly)
		p.Legend.Add(fmt.Sprintf("no leader (%.2f s in all, longest %.2f s)", h.NoLeaderSeconds, h.LongestNoLeader), poly)
	}
	for _, series := range []struct {
		xys  plotter.XYs
		c    color.Color
		name string
	}{{all, okGreen, "completed"}, {bad, red, fmt.Sprintf("failed (%s)", causes(h.Failures))}} {
		l, err := plotter.NewLine(series.xys)
		if err != nil {
			return nil, err
		}
		l.StepStyle = plotter.PostStep
		l.FillColor, l.Color, l.Width = series.c, series.c, vg.Points(0.5)
		p.Add(l)
		p.Legend.Add(series.name, l)
	}
	var mx plotter.XYs
	var ml []string
	mark := func(name, label string, x, at float64, s style) error {
		if err := vline(p, name, x, 0, ymax, s); err != nil {
			return err
		}
		if labels && x >= lo && x <= hi {
			mx = append(mx, plotter.XY{X: x, Y: ymax * at})
			ml = append(ml, label)
		}
		return nil
	}
	if h.Killed != "" {
		if err := mark("leader killed", "killed "+h.Killed, h.KillAt, 0.93, style{color: red, dashes: dashed, width: vg.Points(1.8)}); err != nil {
			return nil, err
		}
	}
	named := false
	for i, c := range h.Leaders {
		if c.Leader == "" || i == 0 {
			continue
		}
		name := ""
		if !named {
			name, named = "a leader elected", true
		}
		if err := mark(name, c.Leader+" leads", c.At, 0.85, style{color: palette[0], dashes: dotted, width: vg.Points(1.8)}); err != nil {
			return nil, err
		}
	}
	if h.BackAt > 0 {
		if err := mark("killed replica ready again", h.Killed+" ready", h.BackAt, 0.77, style{color: grey, dashes: dashed, width: vg.Points(1.5)}); err != nil {
			return nil, err
		}
	}
	if err := addLabels(p, mx, ml, aboveRight); err != nil {
		return nil, err
	}
	p.X.Min, p.X.Max = lo, hi
	p.Y.Min, p.Y.Max = 0, ymax
	p.Legend.Top, p.Legend.Left = true, false
	if labels {
		// The zoomed panel's markers are labelled; the legend above says the rest.
		p.Legend = plot.NewLegend()
	}
	return p, nil
}

// causes renders failure counts by cause.
func causes(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	s := ""
	for i, k := range keys {
		if i > 0 {
			s += ", "
		}
		s += fmt.Sprintf("%d %s", m[k], k)
	}
	return s
}

// timingSeries adds a Timing curve's p50, p99 (median of rounds), best p99 and the floor's p99.
func timingSeries(p *plot.Plot, what string, xs []float64, ts []Timing, c int, withFloor bool) error {
	var p50, p99, best, floor plotter.XYs
	for i, t := range ts {
		p50 = append(p50, plotter.XY{X: xs[i], Y: t.P50 / 1000})
		p99 = append(p99, plotter.XY{X: xs[i], Y: t.P99 / 1000})
		best = append(best, plotter.XY{X: xs[i], Y: t.P99Best / 1000})
		floor = append(floor, plotter.XY{X: xs[i], Y: t.FloorP99 / 1000})
	}
	if err := addLine(p, what+" p50", p50, style{color: palette[c], points: true}); err != nil {
		return err
	}
	if err := addLine(p, what+" p99 (median round)", p99, style{color: palette[c+1], points: true}); err != nil {
		return err
	}
	if err := addLine(p, what+" p99, best round", best, style{color: palette[c+1], dashes: dashed, width: vg.Points(1.4)}); err != nil {
		return err
	}
	if withFloor {
		name := "noise floor p99 (arithmetic as long as the " + what + ", same rounds)"
		fc := color.Color(grey)
		if c > 0 {
			fc = brown
		}
		return addLine(p, name, floor, style{color: fc, dashes: dotted, width: vg.Points(1.8)})
	}
	return nil
}

// kneeSeries draws the straight line through a curve's first points and marks where the curve
// leaves it. It returns a description of the knee.
func kneeSeries(p *plot.Plot, what string, xs, ys []float64, lo, hi float64, scale float64) (string, error) {
	k := fitPoints(len(xs))
	a, b, knee := linearFit(xs, ys, k, kneeTolerance)
	var fit plotter.XYs
	for i := range 60 {
		x := lo * math.Pow(hi/lo, float64(i)/59)
		if y := (a + b*x) * scale; y > 0 {
			fit = append(fit, plotter.XY{X: x, Y: y})
		}
	}
	if err := addLine(p, fmt.Sprintf("%s: straight line through the first %d points", what, k), fit,
		style{color: fitGrey, dashes: []vg.Length{vg.Points(8), vg.Points(3), vg.Points(2), vg.Points(3)}, width: vg.Points(1.2)}); err != nil {
		return "", err
	}
	if knee < 0 {
		return fmt.Sprintf("%s stays within %.0f%% of the straight line through its first %d points", what, 100*kneeTolerance, k), nil
	}
	fitAt := a + b*xs[knee]
	sc, err := plotter.NewScatter(plotter.XYs{{X: xs[knee], Y: ys[knee] * scale}})
	if err != nil {
		return "", err
	}
	sc.GlyphStyle = draw.GlyphStyle{Color: red, Radius: vg.Points(8), Shape: draw.RingGlyph{}}
	p.Add(sc)
	desc := fmt.Sprintf("%s leaves the straight line through its first %d points at x = %s (%+.0f%%: %s)", what, k, compact(xs[knee]), 100*(ys[knee]/fitAt-1), direction(ys[knee], fitAt))
	p.Legend.Add(desc, sc)
	return desc, nil
}

// direction says which way a curve left its straight line.
func direction(y, fit float64) string {
	if y > fit {
		return "grows faster than linearly"
	}
	return "grows slower than linearly"
}

// compact renders an axis value: 1M, 256.
func compact(v float64) string {
	if v >= 1000 {
		return millions(int(v))
	}
	return fmt.Sprintf("%g", v)
}

func workersFigure(ws []WorkerPoint) (figure, error) {
	f := figure{file: figWorkers}
	p := newPlot("One selection against the number of workers", "workers (log scale)", "latency of one selection (us, log scale)")
	var xs, p50 []float64
	var ts []Timing
	for _, w := range ws {
		xs = append(xs, float64(w.Workers))
		p50 = append(p50, w.Select.P50)
		ts = append(ts, w.Select)
	}
	if err := timingSeries(p, "selection", xs, ts, 0, true); err != nil {
		return f, err
	}
	lo, hi := xs[0]/1.25, xs[len(xs)-1]*1.25
	if _, err := kneeSeries(p, "p50", xs, p50, lo, hi, 1.0/1000); err != nil {
		return f, err
	}
	p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
	p.X.Min, p.X.Max = lo, hi
	p.X.Tick.Marker = logTicks(xs, func(v float64) string { return fmt.Sprint(int(v)) })
	yticks(p, ts)
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.XOffs = vg.Points(6)
	f.plots = [][]*plot.Plot{{p}}
	return f, nil
}

// yticks sets a log latency axis to cover ts, floors included.
func yticks(p *plot.Plot, ts []Timing) {
	lo, hi := math.Inf(1), 0.0
	for _, t := range ts {
		lo = min(lo, t.P50, t.FloorP50)
		hi = max(hi, t.P99Worst, t.FloorP99, t.P99)
	}
	// Headroom above the curves for the legend.
	lo, hi = max(lo/1000/1.5, 0.01), hi/1000*5
	p.Y.Min, p.Y.Max = lo, hi
	p.Y.Tick.Marker = decadeTicks(lo, hi, func(v float64) string { return fmt.Sprintf("%g", v) })
}

func indexFigure(ps []IndexPoint) (figure, error) {
	f := figure{file: figIndexSize}
	lat := newPlot("Lookup and selection against index size", "index entries ((block, worker) pairs, log scale)", "latency (us, log scale)")
	mem := newPlot("Index memory against index size", "index entries (log scale)", "heap (GiB, log scale)")
	var xs, lp50, mems []float64
	var lts, sts []Timing
	var mx plotter.XYs
	var ml []string
	for _, p := range ps {
		x := float64(p.Entries)
		xs = append(xs, x)
		lp50 = append(lp50, p.Lookup.P50)
		lts = append(lts, p.Lookup)
		sts = append(sts, p.Select)
		gib := float64(p.HeapBytes) / (1 << 30)
		mems = append(mems, gib)
		mx = append(mx, plotter.XY{X: x, Y: max(gib, 1e-6)})
		ml = append(ml, fmt.Sprintf("%.1f B/entry", float64(p.HeapBytes)/float64(max(1, p.Entries))))
	}
	if err := timingSeries(lat, "lookup", xs, lts, 0, true); err != nil {
		return f, err
	}
	if err := timingSeries(lat, "selection", xs, sts, 2, true); err != nil {
		return f, err
	}
	lo, hi := xs[0]/1.3, xs[len(xs)-1]*1.3
	if _, err := kneeSeries(lat, "lookup p50", xs, lp50, lo, hi, 1.0/1000); err != nil {
		return f, err
	}
	if err := addLine(mem, "heap of the index", mx, style{color: palette[0], points: true}); err != nil {
		return f, err
	}
	if err := addLabels(mem, mx, ml, belowRight); err != nil {
		return f, err
	}
	if _, err := kneeSeries(mem, "memory", xs, mems, lo, hi, 1); err != nil {
		return f, err
	}
	for _, p := range []*plot.Plot{lat, mem} {
		p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
		p.X.Min, p.X.Max = lo, hi
		p.X.Tick.Marker = logTicks(xs, func(v float64) string { return millions(int(v)) })
		p.Legend.Top, p.Legend.Left = true, true
		p.Legend.XOffs = vg.Points(4)
	}
	yticks(lat, append(slices.Clone(lts), sts...))
	mlo, mhi := slices.Min(mems), slices.Max(mems)
	mem.Y.Min, mem.Y.Max = max(mlo/2, 1e-4), mhi*10
	mem.Y.Tick.Marker = decadeTicks(mem.Y.Min, mem.Y.Max, func(v float64) string { return fmt.Sprintf("%g", v) })
	f.plots = [][]*plot.Plot{{lat}, {mem}}
	f.height = 10 * vg.Inch
	return f, nil
}

func snapshotFigure(ss []SnapshotPoint) (figure, error) {
	f := figure{file: figSnapshot}
	p := newPlot("Snapshot pull of a joining replica against index size", "index entries (log scale)", "pull, check and load (s, log scale)")
	var xs, ys []float64
	var xys plotter.XYs
	var labels []string
	for _, s := range ss {
		if s.Error != "" {
			continue
		}
		x := float64(s.Entries)
		xs = append(xs, x)
		ys = append(ys, s.Seconds)
		xys = append(xys, plotter.XY{X: x, Y: s.Seconds})
		labels = append(labels, fmt.Sprintf("%.0f MiB, %.2f s (%.1fM entries/s)", float64(s.Bytes)/(1<<20), s.Seconds, float64(s.Entries)/s.Seconds/1e6))
	}
	if len(xys) == 0 {
		return f, fmt.Errorf("no snapshot pull succeeded")
	}
	if err := addLine(p, "snapshot pull", xys, style{color: palette[0], points: true}); err != nil {
		return f, err
	}
	if err := addLabels(p, xys, labels, belowRight); err != nil {
		return f, err
	}
	lo, hi := xs[0]/1.5, xs[len(xs)-1]*2.5
	if _, err := kneeSeries(p, "pull time", xs, ys, lo, hi, 1); err != nil {
		return f, err
	}
	p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
	p.X.Min, p.X.Max = lo, hi
	p.X.Tick.Marker = logTicks(xs, func(v float64) string { return millions(int(v)) })
	p.Y.Min, p.Y.Max = slices.Min(ys)/2, slices.Max(ys)*4
	p.Y.Tick.Marker = decadeTicks(p.Y.Min, p.Y.Max, func(v float64) string { return fmt.Sprintf("%g", v) })
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.XOffs = vg.Points(6)
	f.plots = [][]*plot.Plot{{p}}
	return f, nil
}
