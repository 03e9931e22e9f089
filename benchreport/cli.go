package benchreport

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// Main is the bench-report command (cmd/bench-report, `make bench-report`): it parses args,
// runs the report and says where it went. It is a command of its own, not a kvrouter-ha
// subcommand, so that the router's binary carries neither the plotting library nor its fonts.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench-report", flag.ContinueOnError)
	fs.SetOutput(stderr)
	def := Default()
	out := fs.String("out", def.Out, "folder to write the report into (report.md, PNG plots, results.json)")
	command := fs.String("command", "", "the command line printed on every plot (default: this one)")
	binary := fs.String("binary", "", "the kvrouter-ha executable the failover runs as its replicas (default: kvrouter-ha beside this executable, then bin/kvrouter-ha, then on PATH)")
	tiny := fs.Bool("tiny", false, "toy sizes that run in seconds (for tests: the figures mean nothing)")
	repo := fs.String("repo", ".", "source tree to run the repository's go test benchmarks in")
	noGoBench := fs.Bool("no-go-bench", false, "leave out the repository's go test benchmarks")
	haproxy := fs.String("haproxy-config", def.HAProxyConfig, "failover: the HAProxy config to put in front of the replicas when haproxy is installed (empty: none)")
	trace := fs.String("trace", "", "Mooncake-format trace (default: the bundled synthetic trace)")
	start := fs.Int("start", def.Start, "first request of the trace slice")
	requests := fs.Int("requests", def.Requests, "requests in the slice every replay uses")
	speedup := fs.Float64("speedup", def.Speedup, "replay and simulate this many times faster than real time")
	policies := fs.String("policies", strings.Join(def.Policies, ","), "policies to compare (TTFT CDF and cache-size sweep)")
	capacities := fs.String("capacities", joinList(def.SweepCapacities), "each worker's KV cache sizes (16-token blocks) for the hit-rate sweep (every list flag: empty leaves its section out)")
	replicas := fs.String("replicas", joinList(def.Replicas), "router replica counts to compare (1 to 7)")
	failover := fs.Bool("failover", true, "run the leader kill (three kvrouter-ha serve processes)")
	workers := fs.String("worker-counts", joinList(def.WorkerCounts), "fleet sizes the selection is timed at")
	indexSizes := fs.String("index-sizes", joinList(def.IndexSizes), "index sizes (entries) lookups and selections are timed at")
	snapshotSizes := fs.String("snapshot-sizes", joinList(def.SnapshotSizes), "index sizes (entries, among --index-sizes) the snapshot pull is timed at")
	bindReplicas := fs.String("bind-replicas", joinList(def.BindReplicas), "cluster sizes session-bind throughput is measured at")
	rounds := fs.Int("rounds", def.Rounds, "rounds of each microsecond-scale measurement (the N of best-of-N)")
	roundCalls := fs.Int("round-calls", def.RoundCalls, "most timed calls of an operation per round")
	roundTime := fs.Duration("round-time", def.RoundTime, "most time per round")
	reruns := fs.Int("max-reruns", def.MaxReruns, "replays run once more when others took more than 30% of the CPU during them, at most this many")
	capWorkers := fs.String("capacity-workers", joinList(def.CapacityWorkers), "capacity sweep: the fleet sizes (load levels) the same slice is replayed on, each policy at each")
	capRuns := fs.Int("capacity-runs", def.CapacityRuns, "capacity sweep: runs of each policy at each level")
	capRequests := fs.Int("capacity-requests", def.CapacityRequests, "capacity sweep: requests in its slice (0: --requests)")
	capTarget := fs.Duration("ttft-target", def.CapacityTarget, "capacity sweep: the TTFT p90 a load level must stay within")
	capPlots := fs.String("capacity-plots", "", "measure nothing: draw capacity.png into this folder from the capacity.json that kvrouter-ha demo --scenario capacity --out wrote there")
	renderOnly := fs.Bool("render-only", false, "measure nothing: rewrite the report and plots in --out from its results.json")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *capPlots != "" {
		file, err := PlotCapacity(*capPlots)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s\n", file)
		return nil
	}
	if *renderOnly {
		if _, err := Render(*out); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "rewrote %s from %s\n", filepath.Join(*out, ReportFile), ResultsFile)
		return nil
	}
	cfg := Default()
	if *tiny {
		cfg = Tiny()
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	ints := func(name, v string, dst *[]int) error {
		if !set[name] {
			return nil
		}
		xs, err := parseList(v)
		if err != nil {
			return fmt.Errorf("--%s: %w", name, err)
		}
		*dst = xs
		return nil
	}
	if err := errors.Join(
		ints("capacities", *capacities, &cfg.SweepCapacities),
		ints("replicas", *replicas, &cfg.Replicas),
		ints("worker-counts", *workers, &cfg.WorkerCounts),
		ints("index-sizes", *indexSizes, &cfg.IndexSizes),
		ints("snapshot-sizes", *snapshotSizes, &cfg.SnapshotSizes),
		ints("bind-replicas", *bindReplicas, &cfg.BindReplicas),
		ints("capacity-workers", *capWorkers, &cfg.CapacityWorkers),
	); err != nil {
		return err
	}
	for _, n := range cfg.Replicas {
		if n > 7 {
			return fmt.Errorf("--replicas: %d is not from 1 to 7", n)
		}
	}
	if set["policies"] {
		cfg.Policies = splitList(*policies)
		cfg.SweepPolicies = cfg.Policies
	}
	for name, apply := range map[string]func(){
		"start": func() { cfg.Start = *start }, "requests": func() { cfg.Requests = *requests },
		"speedup": func() { cfg.Speedup = *speedup }, "rounds": func() { cfg.Rounds = *rounds },
		"round-calls": func() { cfg.RoundCalls = *roundCalls }, "round-time": func() { cfg.RoundTime = *roundTime },
		"haproxy-config": func() { cfg.HAProxyConfig = *haproxy }, "failover": func() { cfg.Failover = *failover },
		"max-reruns":    func() { cfg.MaxReruns = *reruns },
		"capacity-runs": func() { cfg.CapacityRuns = *capRuns }, "capacity-requests": func() { cfg.CapacityRequests = *capRequests },
		"ttft-target": func() { cfg.CapacityTarget = *capTarget },
	} {
		if set[name] {
			apply()
		}
	}
	cfg.Out, cfg.RepoDir, cfg.Trace = *out, *repo, *trace
	if *noGoBench {
		cfg.GoBenches = nil
	}
	cfg.Command = *command
	if cfg.Command == "" {
		var flags []string
		fs.Visit(func(f *flag.Flag) { flags = append(flags, "--"+f.Name+"="+f.Value.String()) })
		cfg.Command = strings.TrimSpace("bench-report " + strings.Join(flags, " "))
	}
	if cfg.Failover {
		var err error
		if cfg.Binary, err = findRouter(*binary); err != nil {
			return err
		}
	}
	res, err := Run(ctx, cfg, stderr)
	if res != nil && err == nil {
		fmt.Fprintf(stdout, "wrote %s in %.0f s\n", filepath.Join(cfg.Out, ReportFile), res.Seconds)
	}
	return err
}

// findRouter is the kvrouter-ha executable: the one named, else kvrouter-ha beside this
// executable, else bin/kvrouter-ha, else on PATH.
func findRouter(named string) (string, error) {
	if named != "" {
		if _, err := os.Stat(named); err != nil {
			return "", fmt.Errorf("--binary: %w", err)
		}
		return filepath.Abs(named)
	}
	var tried []string
	if self, err := os.Executable(); err == nil {
		tried = append(tried, filepath.Join(filepath.Dir(self), "kvrouter-ha"))
	}
	tried = append(tried, filepath.Join("bin", "kvrouter-ha"))
	for _, p := range tried {
		if st, err := os.Stat(p); err == nil && !st.IsDir() {
			return filepath.Abs(p)
		}
	}
	if p, err := exec.LookPath("kvrouter-ha"); err == nil {
		return p, nil
	}
	return "", fmt.Errorf("no kvrouter-ha executable for the failover (tried %s and PATH): build it (make build) or give --binary, or --failover=false",
		strings.Join(tried, ", "))
}

// splitList splits a comma-separated list, dropping empty items.
func splitList(s string) []string {
	var out []string
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// parseList reads a comma-separated list of positive integers (empty: none).
func parseList(s string) ([]int, error) {
	var out []int
	for _, f := range splitList(s) {
		v, err := strconv.Atoi(strings.ReplaceAll(f, "_", ""))
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%q is not a positive integer", f)
		}
		out = append(out, v)
	}
	return out, nil
}

// joinList is the list parseList reads.
func joinList(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}
