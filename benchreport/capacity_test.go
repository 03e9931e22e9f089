package benchreport

import (
	"image/png"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/demo"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
)

// TestCapacityPlotIsDrawnFromTheDemosJSON writes a capacity report as the demo does and draws
// its figure from the folder alone, as `bench-report --capacity-plots DIR` does; a folder
// without the demo's JSON is an error, not an empty plot.
func TestCapacityPlotIsDrawnFromTheDemosJSON(t *testing.T) {
	levels := []demo.CapacityLevel{{Workers: 8, Load: 0.5}, {Workers: 4, Load: 1}}
	var runs []demo.CapacityRun
	for i, pol := range []string{"kv", "round-robin"} {
		for r := range 2 {
			for l, lv := range levels {
				p90 := float64(200 * (l + 1) * (i + 1))
				runs = append(runs, demo.CapacityRun{Policy: pol, Workers: lv.Workers, Run: r,
					Summary: &replay.Summary{Requests: 10, OK: 10, TTFTP90Ms: p90 + float64(50*r), HitRate: 0.3 - 0.1*float64(i)}})
			}
		}
	}
	rep := demo.NewCapacityReport(500*time.Millisecond, []string{"kv", "round-robin"}, levels, 2, runs)
	dir := t.TempDir()
	if err := rep.Write(dir); err != nil {
		t.Fatal(err)
	}
	file, err := PlotCapacity(dir)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := png.DecodeConfig(f)
	if err != nil || c.Width != 1000 || c.Height < 800 {
		t.Errorf("%s: %dx%d, %v; want a PNG 1000 wide with both plots", file, c.Width, c.Height, err)
	}
	if _, err := PlotCapacity(t.TempDir()); err == nil {
		t.Error("a folder without capacity.json drew a plot")
	}
	// A report with nothing to plot, or a level no plot can place, is refused.
	for _, bad := range []*demo.CapacityReport{
		{Levels: []demo.CapacityLevel{{Workers: 1, Load: 1}}},
		{Levels: []demo.CapacityLevel{{Workers: 1, Load: 0}}, Policies: rep.Policies, Points: rep.Points},
	} {
		d := t.TempDir()
		if err := bad.Write(d); err != nil {
			t.Fatal(err)
		}
		if _, err := PlotCapacity(d); err == nil {
			t.Errorf("%+v: drew a plot", bad.Levels)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, demo.CapacityTableFile)); err != nil {
		t.Error(err)
	}
}
