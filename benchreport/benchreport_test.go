package benchreport

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestParseBenchReadsResultLinesAndAggregatesRuns(t *testing.T) {
	out := `goos: linux
goarch: amd64
pkg: github.com/kvrouter-ha/kvrouter-ha/routing
cpu: Intel(R) Xeon(R) Processor
BenchmarkSelect8k-2   	  100000	     12011 ns/op	     11500 p50-ns	     13000 p90-ns	     16000 p98-ns	     31000 p99-ns	     160 B/op	       1 allocs/op
BenchmarkSelect8k-2   	  100000	     12500 ns/op	     11900 p50-ns	     13100 p90-ns	     16500 p98-ns	     29000 p99-ns	     160 B/op	       1 allocs/op
BenchmarkNoiseFloor-2 	  200000	     11800 ns/op	     11700 p50-ns	     11900 p90-ns	     15000 p98-ns	     33000 p99-ns
BenchmarkFindMatches512/shared-fleet-2   1000000   2100 ns/op   1900 p50-ns   4400 p99-ns   8.5 matches/op
--- FAIL: BenchmarkBroken
PASS
ok  	github.com/kvrouter-ha/kvrouter-ha/routing	12.3s
`
	res := aggregate("./routing", parseBench(strings.NewReader(out)))
	if len(res) != 3 {
		t.Fatalf("got %d benchmarks, want 3: %+v", len(res), res)
	}
	sel := res[0]
	if sel.Name != "BenchmarkSelect8k" || sel.Runs != 2 {
		t.Fatalf("first is %s with %d runs", sel.Name, sel.Runs)
	}
	p99 := sel.Metrics["p99-ns"]
	if p99.Min != 29000 || p99.Max != 31000 || p99.Median != 29000 {
		t.Errorf("p99 over the runs: %+v", p99)
	}
	if sel.Order[0] != "ns/op" || sel.Order[len(sel.Order)-1] != "allocs/op" {
		t.Errorf("metric order %v", sel.Order)
	}
	if res[2].Name != "BenchmarkFindMatches512/shared-fleet" || res[2].Metrics["matches/op"].Median != 8.5 {
		t.Errorf("sub-benchmark: %+v", res[2])
	}
}

func TestLinearFitFindsWhereACurveStopsBeingLinear(t *testing.T) {
	xs := []float64{8, 16, 32, 64, 128, 256}
	line := []float64{10, 12, 16, 24, 40, 72} // 8 + x/4
	if a, b, knee := linearFit(xs, line, 3, 0.25); knee != -1 || math.Abs(a-8) > 1e-9 || math.Abs(b-0.25) > 1e-9 {
		t.Errorf("a straight line: a %v, b %v, knee %d", a, b, knee)
	}
	bent := []float64{10, 12, 16, 24, 80, 300}
	if _, _, knee := linearFit(xs, bent, 3, 0.25); knee != 4 {
		t.Errorf("knee at %d, want 4 (x = 128)", knee)
	}
}

func TestTimelineBinsRequestsBySendTime(t *testing.T) {
	log := `{"index":1,"sent_ms":5,"ok":true,"prompt_tokens":1,"cached_tokens":0,"predicted_tokens":0,"ttft_ms":1}
{"index":2,"sent_ms":99.9,"ok":false,"cause":"transport","prompt_tokens":0,"cached_tokens":0,"predicted_tokens":-1,"ttft_ms":0}
{"index":3,"sent_ms":250,"ok":true,"prompt_tokens":1,"cached_tokens":0,"predicted_tokens":0,"ttft_ms":1}
`
	bins, err := timeline(strings.NewReader(log))
	if err != nil {
		t.Fatal(err)
	}
	if len(bins) != 3 || bins[0].OK != 1 || bins[0].Failed != 1 || bins[1].OK+bins[1].Failed != 0 || bins[2].OK != 1 || bins[2].At != 0.2 {
		t.Errorf("bins %+v", bins)
	}
}

func TestMeasurePutsTheFloorBesideTheOperation(t *testing.T) {
	x := 0
	tm := measure("spin", measureOpts{rounds: 3, calls: 200, roundTime: 50 * time.Millisecond}, nil, func() {
		for i := range 2000 {
			x += i
		}
	})
	if tm.Rounds != 3 || tm.Calls == 0 || tm.FloorIter < 1 {
		t.Fatalf("%+v", tm)
	}
	if tm.P50 <= 0 || tm.FloorP50 <= 0 || tm.P99Best > tm.P99Worst || tm.FloorP99Best > tm.FloorP99 {
		t.Errorf("percentiles out of order: %+v", tm)
	}
	_ = x
}

func TestWrapAndNumbersRead(t *testing.T) {
	if got := wrap("one two three four", 10); len(got) != 2 || got[0] != "one two" || got[1] != "three four" {
		t.Errorf("wrap: %q", got)
	}
	for in, want := range map[int]string{1_000_000: "1M", 2_500_000: "2.5M", 40_000: "40k", 512: "512"} {
		if got := millions(in); got != want {
			t.Errorf("millions(%d) = %q, want %q", in, got, want)
		}
	}
	if got := comma(1234567); got != "1,234,567" {
		t.Errorf("comma: %q", got)
	}
}

func TestRenderRewritesTheReportFromItsResults(t *testing.T) {
	dir := t.TempDir()
	res := &Results{Command: "test", Machine: thisMachine(), Config: Tiny(), Seconds: 1,
		Steps: []Step{{Name: "selection against workers", Seconds: 1}},
		Workers: []WorkerPoint{{Workers: 8, Select: Timing{Name: "select, 8 workers", P50: 1000, P99: 2000, P99Best: 1500, P99Worst: 2500, FloorP50: 1000, FloorP99: 1800}},
			{Workers: 16, Select: Timing{Name: "select, 16 workers", P50: 1200, P99: 2400, P99Best: 1800, P99Worst: 2600, FloorP50: 1200, FloorP99: 2000}}}}
	if err := write(dir, res); err != nil {
		t.Fatal(err)
	}
	got, err := Render(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Workers) != 2 || got.Command != "test" {
		t.Errorf("results read back: %+v", got)
	}
	b, err := os.ReadFile(filepath.Join(dir, ReportFile))
	if err != nil || !strings.Contains(string(b), figWorkers) {
		t.Errorf("report: %v\n%s", err, b)
	}
	if _, err := os.Stat(filepath.Join(dir, figWorkers)); err != nil {
		t.Error(err)
	}
}
