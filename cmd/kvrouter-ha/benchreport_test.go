package main

import (
	"bytes"
	"encoding/json"
	"image/png"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/benchreport"
)

// childIsMain, set in the environment, makes this test binary run as kvrouter-ha itself: the
// bench report's failover starts its replicas as child processes of the binary it is given.
const childIsMain = "BENCHREPORT_TEST_CHILD_IS_KVROUTER"

func TestMain(m *testing.M) {
	if os.Getenv(childIsMain) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestBenchReportWritesTheReportAndItsPlots runs `bench-report --tiny` (cmd/bench-report's
// command line): every section on toy sizes, the failover's three replicas being this test
// binary run as kvrouter-ha (which is why the test lives here), and checks that the folder
// holds the report, readable PNGs of the figures it names, and the results.
func TestBenchReportWritesTheReportAndItsPlots(t *testing.T) {
	if testing.Short() {
		t.Skip("runs replays, a three-process failover and the cost curves on toy sizes (about 20 s)")
	}
	t.Setenv(childIsMain, "1")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "report")
	var stdout, stderr bytes.Buffer
	err = benchreport.Main(t.Context(), []string{"--tiny", "--no-go-bench", "--out", out, "--binary", self}, &stdout, &stderr)
	if err != nil {
		t.Fatalf("bench-report: %v\n%s", err, stderr.String())
	}
	report, err := os.ReadFile(filepath.Join(out, benchreport.ReportFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, section := range []string{"Routing policies on the trace", "Hit rate against each worker's cache size",
		"against router replicas", "a fleet's capacity", "Failover", "Bind throughput", "against the number of workers",
		"against the index size", "Snapshot pull", "measured fairly", "Left out"} {
		if !bytes.Contains(report, []byte(section)) {
			t.Errorf("the report has no section on %q", section)
		}
	}
	if !bytes.Contains(report, []byte("shared machine")) {
		t.Error("the report's header does not say the machine is shared")
	}
	// Every figure the report shows is there and is a PNG of the plots' size.
	figs := regexp.MustCompile(`!\[[^]]*\]\(([^)]+\.png)\)`).FindAllSubmatch(report, -1)
	if len(figs) < 9 {
		t.Errorf("the report shows %d figures, want the 9 plots", len(figs))
	}
	for _, f := range figs {
		name := string(f[1])
		file, err := os.Open(filepath.Join(out, name))
		if err != nil {
			t.Errorf("figure %s: %v", name, err)
			continue
		}
		c, err := png.DecodeConfig(file)
		file.Close()
		if err != nil {
			t.Errorf("figure %s is not a PNG: %v", name, err)
			continue
		}
		if c.Width != 1000 || c.Height < 500 {
			t.Errorf("figure %s is %dx%d pixels, want 1000 wide and at least 500 high", name, c.Width, c.Height)
		}
	}
	pngs, _ := filepath.Glob(filepath.Join(out, "*.png"))
	if len(pngs) != len(figs) {
		t.Errorf("%d PNGs in the folder, %d in the report", len(pngs), len(figs))
	}
	b, err := os.ReadFile(filepath.Join(out, benchreport.ResultsFile))
	if err != nil {
		t.Fatal(err)
	}
	var res benchreport.Results
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatalf("results.json: %v", err)
	}
	if res.HA == nil || res.HA.Killed == "" || len(res.HA.Bins) == 0 {
		t.Errorf("the failover killed no leader or recorded no requests: %+v", res.HA)
	}
	if c := res.Capacity; c == nil || len(c.Points) != len(c.Policies)*len(c.Levels) || len(c.Capacities) != len(c.Policies) {
		t.Errorf("the capacity sweep has not every policy at every level: %+v", c)
	}
	if res.Machine.Hostname == "" || res.Machine.Cores == 0 || !strings.HasPrefix(res.Machine.GoVersion, "go") {
		t.Errorf("the machine is not described: %+v", res.Machine)
	}
	if !strings.Contains(stdout.String(), benchreport.ReportFile) {
		t.Errorf("stdout %q does not name the report", stdout.String())
	}
	if testing.Verbose() {
		t.Log(stderr.String())
	}
}
