package demo

import (
	"bytes"
	"context"
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
)

// TestCapacityIsTheHeaviestLevelServedWithEveryLighterOne computes capacities from synthetic
// runs: the median p90 over runs decides a level, a level with more than 1% failed is not
// served however fast its successes were, a heavier level that happens to pass after a
// lighter one failed does not count, and the spread is each run's own capacity.
func TestCapacityIsTheHeaviestLevelServedWithEveryLighterOne(t *testing.T) {
	levels := []CapacityLevel{{Workers: 8, Load: 0.5}, {Workers: 4, Load: 1}, {Workers: 2, Load: 2}}
	// p90s[run][level] in ms; failed likewise (nil: none), over 100 requests a run.
	type runs struct {
		p90s   [][]float64
		failed [][]int
	}
	for _, tc := range []struct {
		name string
		runs runs
		want PolicyCapacity
		// wantP90 is the median p90 at each level.
		wantP90 []float64
	}{
		{
			name:    "every level within",
			runs:    runs{p90s: [][]float64{{100, 200, 300}}},
			want:    PolicyCapacity{Workers: 2, Load: 2, RunMin: 2, RunMax: 2},
			wantP90: []float64{100, 200, 300},
		},
		{
			name:    "none within",
			runs:    runs{p90s: [][]float64{{600, 700, 800}}},
			want:    PolicyCapacity{},
			wantP90: []float64{600, 700, 800},
		},
		{
			name:    "the target itself is within",
			runs:    runs{p90s: [][]float64{{100, 500, 501}}},
			want:    PolicyCapacity{Workers: 4, Load: 1, RunMin: 1, RunMax: 1},
			wantP90: []float64{100, 500, 501},
		},
		{
			name:    "a heavier level passing after a lighter one failed does not count",
			runs:    runs{p90s: [][]float64{{100, 900, 400}}},
			want:    PolicyCapacity{Workers: 8, Load: 0.5, RunMin: 0.5, RunMax: 0.5},
			wantP90: []float64{100, 900, 400},
		},
		{
			name: "the median of three runs decides; the spread shows the outlier",
			runs: runs{p90s: [][]float64{
				{100, 450, 900},
				{120, 800, 950},
				{110, 480, 400},
			}},
			want:    PolicyCapacity{Workers: 4, Load: 1, RunMin: 0.5, RunMax: 2},
			wantP90: []float64{110, 480, 900},
		},
		{
			name:    "the median of an even number of runs is the mean of the middle two",
			runs:    runs{p90s: [][]float64{{100, 400, 600}, {200, 550, 800}}},
			want:    PolicyCapacity{Workers: 4, Load: 1, RunMin: 0.5, RunMax: 1},
			wantP90: []float64{150, 475, 700},
		},
		{
			name: "more than 1% failed is not served, however fast",
			runs: runs{
				p90s:   [][]float64{{100, 200, 300}},
				failed: [][]int{{1, 2, 0}},
			},
			want:    PolicyCapacity{Workers: 8, Load: 0.5, RunMin: 0.5, RunMax: 0.5},
			wantP90: []float64{100, 200, 300},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var all []CapacityRun
			for r, p90s := range tc.runs.p90s {
				for l, p90 := range p90s {
					s := &replay.Summary{Requests: 100, TTFTP90Ms: p90, HitRate: 0.1 * float64(r+1)}
					if tc.runs.failed != nil {
						s.Failed = tc.runs.failed[r][l]
						s.OK = 100 - s.Failed
					}
					all = append(all, CapacityRun{Policy: "kv", Workers: levels[l].Workers, Run: r, Summary: s})
				}
			}
			// Another policy's runs, all over the target, must change nothing of kv's.
			for l := range levels {
				all = append(all, CapacityRun{Policy: "round-robin", Workers: levels[l].Workers, Summary: &replay.Summary{Requests: 100, TTFTP90Ms: 5000}})
			}
			rep := NewCapacityReport(500*time.Millisecond, []string{"kv", "round-robin"}, levels, len(tc.runs.p90s), all)
			want := tc.want
			want.Policy = "kv"
			if len(rep.Capacities) != 2 || !reflect.DeepEqual(rep.Capacities[0], want) {
				t.Fatalf("capacities %+v, want kv's %+v", rep.Capacities, want)
			}
			if rr := rep.Capacities[1]; rr.Workers != 0 || rr.RunMax != 0 {
				t.Errorf("round-robin's capacity %+v, want none", rr)
			}
			for l, wantP90 := range tc.wantP90 {
				p := rep.Point("kv", levels[l].Workers)
				if p == nil || p.TTFTP90Ms != wantP90 || len(p.Summaries) != len(tc.runs.p90s) {
					t.Errorf("level %d: point %+v, want median p90 %g over %d runs", levels[l].Workers, p, wantP90, len(tc.runs.p90s))
				}
			}
			md := rep.Markdown()
			for _, s := range []string{"| kv |", "| round-robin | none |", "2 workers (2.000)"} {
				if !strings.Contains(md, s) {
					t.Errorf("table lacks %q:\n%s", s, md)
				}
			}
		})
	}
}

// TestCapacityRejectsABadSweep checks that a sweep with nothing to run, or a level of no
// workers, is refused before any replay starts.
func TestCapacityRejectsABadSweep(t *testing.T) {
	base := Config{Policies: []string{"kv"}, LoadWorkers: []int{2}, Runs: 1, TTFTTarget: time.Second, Limit: 4, Speedup: 10,
		Logger: slog.New(slog.DiscardHandler)}
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"no policies", func(c *Config) { c.Policies = nil }, "no policies"},
		{"no levels", func(c *Config) { c.LoadWorkers = nil }, "no load levels"},
		{"no runs", func(c *Config) { c.Runs = 0 }, "at least one run"},
		{"no target", func(c *Config) { c.TTFTTarget = 0 }, "TTFT target"},
		{"no workers", func(c *Config) { c.LoadWorkers = []int{2, 0} }, "0 workers"},
		{"one request", func(c *Config) { c.Limit = 1 }, "at least two requests"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base
			tc.edit(&c)
			_, err := Capacity(context.Background(), c, &bytes.Buffer{}, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
	for _, tc := range []struct {
		in   string
		want []int
		err  bool
	}{
		{in: "8,6, 4,3,2", want: []int{8, 6, 4, 3, 2}},
		{in: "", err: true},
		{in: "8,0", err: true},
		{in: "8,x", err: true},
		{in: "65", err: true},
	} {
		got, err := ParseLoadWorkers(tc.in)
		if (err != nil) != tc.err || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseLoadWorkers(%q) = %v, %v; want %v (error %v)", tc.in, got, err, tc.want, tc.err)
		}
	}
}

// TestCapacitySweepRunsEveryPolicyAtEveryLevel runs a tiny sweep for real (simulated workers,
// a one-replica Raft cluster on loopback): 2 policies, 2 levels, 1 run of a few requests, two
// replays at once.
// Every point must hold its run with every request answered, and the files must read back
// as the report. The figures themselves mean nothing at this size and are only logged.
func TestCapacitySweepRunsEveryPolicyAtEveryLevel(t *testing.T) {
	if testing.Short() {
		t.Skip("replays through real routers")
	}
	dir := t.TempDir()
	cfg := Config{
		Policies: []string{"kv", "round-robin"}, LoadWorkers: []int{1, 2}, Runs: 1, TTFTTarget: 500 * time.Millisecond,
		CapacityBlocks: 32768, Start: 2500, Limit: 24, Speedup: 20, Concurrency: 32, MaxOutput: 16,
		Parallel: 2, OutDir: dir, Logger: slog.New(slog.DiscardHandler),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rep, err := Capacity(ctx, cfg, &out, nil)
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	if got := []int{rep.Levels[0].Workers, rep.Levels[1].Workers}; !reflect.DeepEqual(got, []int{2, 1}) {
		t.Errorf("levels %v, want the lightest load (most workers) first", got)
	}
	if rep.Levels[1].Load != 2*rep.Levels[0].Load {
		t.Errorf("loads %+v: one worker should carry twice the load of two", rep.Levels)
	}
	for _, pol := range cfg.Policies {
		for _, w := range []int{1, 2} {
			p := rep.Point(pol, w)
			if p == nil || len(p.Summaries) != 1 || p.Requests != cfg.Limit || p.Failed != 0 {
				t.Errorf("%s at %d workers: %+v, want one run of %d requests, none failed", pol, w, p, cfg.Limit)
				continue
			}
			// The level's fleet is what served it: round-robin spreads over every worker of
			// it, and no policy finds a worker more.
			if n := len(p.Summaries[0].Workers); n > w || pol == "round-robin" && n != w {
				t.Errorf("%s at %d workers: served by %d workers", pol, w, n)
			}
		}
	}
	back, err := ReadCapacityReport(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back.Capacities, rep.Capacities) || back.Markdown() != rep.Markdown() {
		t.Errorf("capacity.json reads back as %+v, want %+v", back.Capacities, rep.Capacities)
	}
}
