package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/peterbourgon/ff/v3/ffcli"

	"github.com/kvrouter-ha/kvrouter-ha/benchreport"
)

func benchReportCommand(stdout, stderr io.Writer) *ffcli.Command {
	fs := flag.NewFlagSet("kvrouter-ha bench-report", flag.ContinueOnError)
	def := benchreport.Default()
	out := fs.String("out", def.Out, "folder to write the report into (report.md, PNG plots, results.json)")
	command := fs.String("command", "", "the command line printed on every plot (default: this one)")
	tiny := fs.Bool("tiny", false, "toy sizes that run in seconds (for tests: the figures mean nothing)")
	repo := fs.String("repo", ".", "source tree to run the repository's go test benchmarks in")
	noGoBench := fs.Bool("no-go-bench", false, "leave out the repository's go test benchmarks")
	haproxy := fs.String("haproxy-config", def.HAProxyConfig, "failover: the HAProxy config to put in front of the replicas when haproxy is installed (empty: none)")
	trace := fs.String("trace", "", "Mooncake-format trace (default: the bundled synthetic trace)")
	start := fs.Int("start", def.Start, "first request of the trace slice")
	requests := fs.Int("requests", def.Requests, "requests in the slice every replay uses")
	speedup := fs.Float64("speedup", def.Speedup, "replay and simulate this many times faster than real time")
	policies := fs.String("policies", strings.Join(def.Policies, ","), "policies to compare (TTFT CDF and cache-size sweep)")
	capacities := fs.String("capacities", reportJoin(def.SweepCapacities), "each worker's KV cache sizes (16-token blocks) for the hit-rate sweep (each list flag: empty leaves its section out)")
	replicas := fs.String("replicas", reportJoin(def.Replicas), "router replica counts to compare (1 to 7)")
	failover := fs.Bool("failover", true, "run the leader kill (three replica processes of this binary)")
	workers := fs.String("worker-counts", reportJoin(def.WorkerCounts), "fleet sizes the selection is timed at")
	indexSizes := fs.String("index-sizes", reportJoin(def.IndexSizes), "index sizes (entries) lookups and selections are timed at")
	snapshotSizes := fs.String("snapshot-sizes", reportJoin(def.SnapshotSizes), "index sizes (entries, among --index-sizes) the snapshot pull is timed at")
	bindReplicas := fs.String("bind-replicas", reportJoin(def.BindReplicas), "cluster sizes session-bind throughput is measured at")
	rounds := fs.Int("rounds", def.Rounds, "rounds of each microsecond-scale measurement (the N of best-of-N)")
	roundCalls := fs.Int("round-calls", def.RoundCalls, "most timed calls of an operation per round")
	roundTime := fs.Duration("round-time", def.RoundTime, "most time per round")
	return &ffcli.Command{
		Name:       "bench-report",
		ShortUsage: "kvrouter-ha bench-report [flags]",
		ShortHelp:  "run the benchmarks and replays behind the performance claims and write a report with plots (make bench-report)",
		FlagSet:    fs,
		Exec: func(ctx context.Context, args []string) error {
			cfg := benchreport.Default()
			if *tiny {
				cfg = benchreport.Tiny()
			}
			set := map[string]bool{}
			fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
			ints := func(name, v string, dst *[]int) error {
				if !set[name] {
					return nil
				}
				xs, err := reportInts(v)
				if err != nil {
					return fmt.Errorf("--%s: %w", name, err)
				}
				*dst = xs
				return nil
			}
			for _, e := range []error{
				ints("capacities", *capacities, &cfg.SweepCapacities),
				ints("replicas", *replicas, &cfg.Replicas),
				ints("worker-counts", *workers, &cfg.WorkerCounts),
				ints("index-sizes", *indexSizes, &cfg.IndexSizes),
				ints("snapshot-sizes", *snapshotSizes, &cfg.SnapshotSizes),
				ints("bind-replicas", *bindReplicas, &cfg.BindReplicas),
			} {
				if e != nil {
					return e
				}
			}
			for _, n := range cfg.Replicas {
				if n < 1 || n > 7 {
					return fmt.Errorf("--replicas: %d is not from 1 to 7", n)
				}
			}
			if set["policies"] {
				cfg.Policies = reportList(*policies)
				cfg.SweepPolicies = cfg.Policies
			}
			for name, v := range map[string]func(){
				"start": func() { cfg.Start = *start }, "requests": func() { cfg.Requests = *requests },
				"speedup": func() { cfg.Speedup = *speedup }, "rounds": func() { cfg.Rounds = *rounds },
				"round-calls": func() { cfg.RoundCalls = *roundCalls }, "round-time": func() { cfg.RoundTime = *roundTime },
				"haproxy-config": func() { cfg.HAProxyConfig = *haproxy }, "failover": func() { cfg.Failover = *failover },
			} {
				if set[name] {
					v()
				}
			}
			cfg.Out, cfg.RepoDir, cfg.Trace = *out, *repo, *trace
			if *noGoBench {
				cfg.GoBenches = nil
			}
			cfg.Command = *command
			if cfg.Command == "" {
				cfg.Command = strings.TrimSpace("kvrouter-ha bench-report " + strings.Join(reportFlagArgs(fs), " "))
			}
			res, err := benchreport.Run(ctx, cfg, stderr)
			if res != nil && err == nil {
				fmt.Fprintf(stdout, "wrote %s/%s in %.0f s\n", cfg.Out, benchreport.ReportFile, res.Seconds)
			}
			return err
		},
	}
}

// reportFlagArgs renders the flags set on the command line.
func reportFlagArgs(fs *flag.FlagSet) []string {
	var out []string
	fs.Visit(func(f *flag.Flag) { out = append(out, "--"+f.Name+"="+f.Value.String()) })
	return out
}

// reportList splits a comma-separated list, dropping empty items.
func reportList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// reportInts reads a comma-separated list of positive integers.
func reportInts(s string) ([]int, error) {
	var out []int
	for _, f := range reportList(s) {
		v, err := strconv.Atoi(strings.ReplaceAll(f, "_", ""))
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%q is not a positive integer", f)
		}
		out = append(out, v)
	}
	return out, nil
}

// reportJoin is the list reportInts reads.
func reportJoin(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}
