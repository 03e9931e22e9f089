// Package benchreport runs, within a bounded time, the benchmarks and trace replays behind
// kvrouter-ha's performance and quality claims, and writes a folder with a Markdown report and
// PNG plots (`make bench-report`, docs/bench-report/).
//
// What it measures, each with the command and the machine named on every plot:
//
//   - routing quality on the bundled trace, through demo.Compare: TTFT CDFs per policy, hit
//     rate against each worker's cache size per policy (the unlimited-cache ceiling drawn),
//     and hit rate, prediction error and gossip traffic against the number of replicas;
//   - a failover: three replica processes of this binary, the Raft leader killed with SIGKILL
//     half-way through a replay, requests per 100 ms (ok and failed) and leader changes;
//   - cost curves in this process: one selection against the number of workers and against the
//     index size (with memory), an index lookup against the index size, the snapshot pull of a
//     joining replica against the index size, and session-bind throughput against 3, 5 and 7
//     replicas;
//   - the microsecond-scale percentiles, each beside the percentile of a fixed arithmetic chain
//     of the same length timed in the same run (the noise floor of BenchmarkNoiseFloor), with
//     the median and the best of several rounds;
//   - the repository's own benchmarks (go test -bench), when the source tree and a Go
//     toolchain are at hand.
//
// Every server listens on loopback; every process and server it starts, it stops.
package benchreport

import (
	"time"
)

// Config is one report: what to run and where to write it. Default is `make bench-report`;
// Tiny is the few-second configuration the tests run.
type Config struct {
	// Out is the folder the report is written to (created; old PNGs in it are replaced).
	Out string
	// Command is the command line that made the report, printed on every plot.
	Command string
	// Binary is the kvrouter-ha executable the failover runs as its replicas (default: this
	// process's own).
	Binary string
	// RepoDir is the source tree the go test benchmarks run in ("": the current directory);
	// without a go.mod there, or without a go command, that section says it was skipped.
	RepoDir string
	// HAProxyConfig is the balancer config the failover puts in front of its replicas when
	// haproxy is installed ("": none, the client sends to the replicas in turn).
	HAProxyConfig string

	// Trace is a Mooncake-format trace ("": the bundled one); Start and Requests pick the
	// slice every replay uses, Speedup its pace.
	Trace    string
	Start    int
	Requests int
	Speedup  float64
	// Workers is the number of simulated workers, CapacityBlocks each one's KV cache in
	// 16-token blocks (the demo's defaults: 8 and 32,768).
	Workers        int
	CapacityBlocks int

	// Policies are compared on the slice (TTFT CDF); SweepPolicies against every size of
	// SweepCapacities (the run at CapacityBlocks is shared with the policy comparison).
	Policies        []string
	SweepPolicies   []string
	SweepCapacities []int
	// Replicas are the router topologies compared with the kv policy (1 is shared with the
	// policy comparison when kv is among Policies).
	Replicas []int
	// A replay during which others (processes, or other virtual machines through steal) took
	// more than RerunAbove of the machine's processor time is run once more, and the less disturbed run kept; at most MaxReruns
	// times in all.
	RerunAbove float64
	MaxReruns  int

	// CapacityWorkers are the capacity sweep's load levels (fleet sizes for the same slice;
	// none: the sweep is left out), each policy of Policies run CapacityRuns times at each
	// on CapacityRequests requests (0: Requests); a level counts when its TTFT p90 stays
	// within CapacityTarget (demo.Capacity).
	CapacityWorkers  []int
	CapacityRuns     int
	CapacityRequests int
	CapacityTarget   time.Duration

	// Failover runs the leader kill; FailoverRequests is its slice (0: Requests).
	Failover         bool
	FailoverRequests int

	// WorkerCounts are the fleet sizes the selection is timed at, over an index of
	// WorkerCurveEntries entries.
	WorkerCounts       []int
	WorkerCurveEntries int
	// IndexSizes are the index sizes (entries) lookups and selections are timed at, 64
	// workers; SnapshotSizes those (a subset) the snapshot pull is timed at.
	IndexSizes    []int
	SnapshotSizes []int
	// Rounds is N of "best of N": each microsecond-scale measurement runs in Rounds rounds
	// of at most RoundCalls calls and RoundTime each.
	Rounds     int
	RoundCalls int
	RoundTime  time.Duration

	// BindReplicas are the cluster sizes session-bind throughput is measured at, each for
	// BindDuration with BindConcurrency clients.
	BindReplicas    []int
	BindDuration    time.Duration
	BindConcurrency int

	// GoBenches are the repository benchmarks run with go test (none: the section is left out).
	GoBenches []GoBench

	// FastPNG compresses the plots least, for speed (tests).
	FastPNG bool
}

// GoBench is one go test -bench invocation.
type GoBench struct {
	// Pkg is the package (./routing), Pattern the -bench expression.
	Pkg, Pattern string
	// Benchtime and Count are go test's flags of those names.
	Benchtime string
	Count     int
	// Why says which claim it backs.
	Why string
}

// Default is `make bench-report`: about 25 minutes on two cores, the capacity sweep (48
// replays) taking 15 of them.
func Default() Config {
	return Config{
		Out:                "docs/bench-report",
		Command:            "make bench-report",
		HAProxyConfig:      "deploy/haproxy.cfg",
		Start:              2500,
		Requests:           1000,
		Speedup:            10,
		Workers:            8,
		CapacityBlocks:     32768,
		Policies:           []string{"kv", "cache-aware", "round-robin", "session-hash"},
		SweepPolicies:      []string{"kv", "cache-aware", "round-robin", "session-hash"},
		SweepCapacities:    []int{8192, 32768, 131072},
		Replicas:           []int{1, 3, 5, 7},
		RerunAbove:         0.3,
		MaxReruns:          3,
		CapacityWorkers:    []int{8, 6, 4, 3},
		CapacityRuns:       3,
		CapacityRequests:   500,
		CapacityTarget:     500 * time.Millisecond,
		Failover:           true,
		WorkerCounts:       []int{8, 16, 32, 64, 128, 256, 512, 1024},
		WorkerCurveEntries: 1_000_000,
		IndexSizes:         []int{1_000_000, 2_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000},
		SnapshotSizes:      []int{1_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000},
		Rounds:             5,
		RoundCalls:         20_000,
		RoundTime:          400 * time.Millisecond,
		BindReplicas:       []int{3, 5, 7},
		BindDuration:       4 * time.Second,
		BindConcurrency:    32,
		GoBenches: []GoBench{
			{Pkg: "./routing", Pattern: "^(BenchmarkSelect8k|BenchmarkSelect8kPrehashed|BenchmarkNoiseFloor)$", Benchtime: "1s", Count: 5,
				Why: "one selection (8k-token prompt, 64 workers, about 1M entries), beside the noise floor timed in the same process"},
			{Pkg: "./indexer", Pattern: "^BenchmarkFindMatches512$/^(shared-fleet|popular-16|all-64-holders)$", Benchtime: "1s", Count: 3,
				Why: "the lookup target: a 512-block prompt against 1M entries over 64 workers, p99 at most 5 us (indexer/DESIGN.md)"},
			{Pkg: "./indexer", Pattern: "^(BenchmarkMemoryPerEntry|BenchmarkApply)$", Benchtime: "1x", Count: 1,
				Why: "memory per entry and write rate of the index"},
			{Pkg: "./transport/openai", Pattern: "^(BenchmarkAddedLatency|BenchmarkAddedLatencyFloor)$/^(json|sse|json-upstream|sse-upstream)$", Benchtime: "2000x", Count: 3,
				Why: "what the router adds to a request's latency, beside a bare proxy over the same upstream client (its floor)"},
		},
	}
}

// Tiny is a configuration that runs in seconds: every section and plot, on toy sizes. The
// figures mean nothing; it is there so that a test catches a broken report.
func Tiny() Config {
	c := Default()
	c.Command = "benchreport tiny test"
	c.HAProxyConfig = ""
	c.Requests = 16
	c.Speedup = 20
	c.Workers = 4
	c.CapacityBlocks = 8192
	c.Policies = []string{"kv", "round-robin"}
	c.SweepPolicies = []string{"kv"}
	c.SweepCapacities = []int{2048, 8192}
	c.Replicas = []int{1, 3}
	c.MaxReruns = 0
	c.CapacityWorkers = []int{4, 2}
	c.CapacityRuns = 1
	c.CapacityRequests = 0
	c.FailoverRequests = 30
	c.WorkerCounts = []int{8, 16}
	c.WorkerCurveEntries = 20_000
	c.IndexSizes = []int{20_000, 40_000}
	c.SnapshotSizes = []int{20_000}
	c.Rounds = 2
	c.RoundCalls = 200
	c.RoundTime = 20 * time.Millisecond
	c.BindReplicas = []int{3}
	c.BindDuration = 300 * time.Millisecond
	c.BindConcurrency = 4
	c.GoBenches = nil
	c.FastPNG = true
	return c
}
