package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/peterbourgon/ff/v3/ffcli"

	"github.com/kvrouter-ha/kvrouter-ha/demo"
	"github.com/kvrouter-ha/kvrouter-ha/replica"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

func demoCommand(stdout, stderr io.Writer) *ffcli.Command {
	fs := flag.NewFlagSet("kvrouter-ha demo", flag.ContinueOnError)
	var cfg demo.Config
	scenario := fs.String("scenario", "ha", "ha: three replica processes behind HAProxy, the leader killed half-way (make demo); scale: three replicas find their workers in a fleet file (--discovery file:PATH) that grows by --scale-up at one third and shrinks by --scale-down at two thirds, beside a fixed fleet of the same average size (make demo-scale); compare: side-by-side runs of --policies x --replicas x --modes; capacity: each of --policies on the same slice at every --load-workers fleet size, --runs times, and the highest load each serves with TTFT p90 within --ttft-target (tables and JSON into --out)")
	fs.StringVar(&cfg.HAProxyConfig, "haproxy-config", "", "ha: the HAProxy config (its addresses come from KVR_LISTEN and KVR_REPLICA0..2; empty: the bundled deploy/haproxy.cfg, built into the binary)")
	policies := fs.String("policies", "kv,round-robin", "comma-separated policies to compare ("+strings.Join(routing.Policies(), ", ")+")")
	topologies := fs.String("replicas", "1", "router topologies to compare: N replicas behind a round-robin client, N-nogossip for N replicas that share nothing but bindings (e.g. 1,3,3-nogossip)")
	modes := fs.String("modes", "approximate", "index modes to compare: approximate (the router learns from its own decisions) and/or precise (the workers publish vLLM KV events)")
	fs.Float64Var(&cfg.PrefillWeight, "prefill-weight", 1, "compare, capacity: the kv policy's weight of prefill blocks in its cost, as serve's flag of that name (to try a tuning on the same runs)")
	fs.Float64Var(&cfg.OverlapWeight, "overlap-weight", routing.DefaultOverlapWeight, "compare, capacity: the kv policy's weight of uncached prompt blocks against queued prefill, as serve's flag of that name")
	fs.IntVar(&cfg.Workers, "workers", 8, "simulated workers (aggregated; see --fleet); scale: the fleet it starts with")
	fs.IntVar(&cfg.ScaleUp, "scale-up", 4, "scale: simulated workers started and added to the fleet file at one third of the replay")
	fs.IntVar(&cfg.ScaleDown, "scale-down", 4, "scale: the oldest workers taken out of the fleet file at two thirds of the replay, and stopped once every replica has drained them")
	fs.BoolVar(&cfg.ScaleNoFixed, "scale-no-fixed", false, "scale: skip the run over a fixed fleet of the same average size")
	fleets := fs.String("fleet", "", "compare: worker fleets to compare at the same number of simulated GPUs, as counts of p (prefill), d (decode) and agg (aggregated) workers, e.g. 8agg,4p4d (default: --workers aggregated)")
	disagg := fs.String("disagg", routing.DisaggConditional, "compare: the routers' disaggregation modes to run on fleets with prefill workers: "+strings.Join(routing.DisaggModes(), ", "))
	fs.IntVar(&cfg.MinUncachedTokens, "disagg-min-uncached-tokens", 1024, "compare: conditional disaggregation's threshold, as serve's flag of that name")
	fs.IntVar(&cfg.Sim.ChunkedPrefillTokens, "chunked-prefill-tokens", 0, "simulated workers prefill in chunks of this many tokens in the steps that decode, slowing those decodes, as vLLM's chunked prefill does (0: a separate prefill stage that never slows decoding)")
	fs.DurationVar(&cfg.Sim.TransferPerBlock, "kv-transfer-per-block", 20*time.Microsecond, "simulated decode workers' KV transfer time per block pulled from a prefill worker")
	fs.IntVar(&cfg.CapacityBlocks, "capacity-blocks", 32768, "each worker's KV cache in 16-token blocks (too small to hold the whole trace)")
	fs.DurationVar(&cfg.ApproxTTL, "approx-ttl", 0, "the routers' approximate-index TTL in trace time (0: none: the per-worker cap, --capacity-blocks as the workers' own cache, stands in for their eviction alone, as their LRU does)")
	fs.IntVar(&cfg.GossipBudget, "gossip-max-bytes-per-second", replica.DefaultGossipBudget, "compare: each replica's outbound gossip budget (as serve's flag of that name)")
	fs.StringVar(&cfg.TracePath, "trace", "", "Mooncake-format trace (default: the bundled synthetic trace)")
	fs.IntVar(&cfg.Start, "start", 2500, "first request of the trace to replay (the trace's reuse builds up over time; 2500 starts where sessions are in full swing)")
	fs.IntVar(&cfg.Limit, "requests", 1000, "requests to replay (0: all)")
	fs.Float64Var(&cfg.Speedup, "speedup", 10, "replay and simulate this many times faster than real time")
	fs.IntVar(&cfg.Concurrency, "concurrency", 256, "most requests in flight")
	fs.IntVar(&cfg.MaxOutput, "max-output-tokens", 0, "cap each request's output tokens (0: as in the trace)")
	fs.DurationVar(&cfg.Sim.PrefillPerToken, "prefill-per-token", 50*time.Microsecond, "simulated prefill time per uncached token")
	fs.DurationVar(&cfg.Sim.DecodePerToken, "decode-per-token", 10*time.Millisecond, "simulated time per output token")
	fs.StringVar(&cfg.JSONPath, "json", "", "also write the summaries as JSON to this file")
	fs.StringVar(&cfg.RequestLogDir, "request-log", "", "compare: write each run's requests (predicted and cached tokens, replica, worker, session) as JSON lines into this directory")
	fs.BoolVar(&cfg.Progress, "progress", true, "show a progress bar")
	fs.BoolVar(&cfg.NoStream, "no-stream", false, "replay non-streaming requests (the first token is seen with the last) instead of streaming ones")
	recordAt := fs.String("record-at", "dispatch", "compare: where routers record their decisions, to show the difference: dispatch (at dispatch and again when the worker finishes), dispatch-only (not again at the end) and/or commit (only at the worker's first answer, the behaviour before recording at dispatch)")
	loadWorkers := fs.String("load-workers", "8,6,4,3,2", "capacity: the load levels, as the fleet sizes the same slice is replayed on (fewer workers: more load on each)")
	fs.IntVar(&cfg.Runs, "runs", 3, "capacity: runs of each policy at each level (the table shows their medians and spread)")
	fs.IntVar(&cfg.Parallel, "parallel", 1, "capacity: replays run at once; each is paced by the trace, not the processor, so a machine with cores to spare runs the sweep this many times faster (each replay's simulated workers keep their pace only while they get the processor: two cores take one)")
	fs.DurationVar(&cfg.TTFTTarget, "ttft-target", 500*time.Millisecond, "capacity: the TTFT p90 a load level must stay within, as the replay measures it (at --speedup)")
	fs.StringVar(&cfg.OutDir, "out", "", "capacity: folder to write the tables (capacity.md) and the runs (capacity.json) into; bench-report --capacity-plots DIR draws the plots from them")
	logLevel := fs.String("log-level", "error", "router and worker log level: debug, info, warn or error")
	return &ffcli.Command{
		Name:       "demo",
		ShortUsage: "kvrouter-ha demo [flags]",
		ShortHelp:  "a trace slice replayed over simulated workers: three replicas with the leader killed half-way (default), a fleet that grows and shrinks, policies side by side, or a capacity sweep",
		FlagSet:    fs,
		Exec: func(ctx context.Context, _ []string) error {
			cfg.Policies = splitList(*policies)
			cfg.Modes = splitList(*modes)
			cfg.RecordAt = splitList(*recordAt)
			cfg.DisaggModes = splitList(*disagg)
			for _, m := range cfg.DisaggModes {
				if !slices.Contains(routing.DisaggModes(), m) {
					return fmt.Errorf("--disagg: %q is not one of %s", m, strings.Join(routing.DisaggModes(), ", "))
				}
			}
			for _, f := range splitList(*fleets) {
				fl, err := demo.ParseFleet(f)
				if err != nil {
					return err
				}
				cfg.Fleets = append(cfg.Fleets, fl)
			}
			for _, r := range cfg.RecordAt {
				if !slices.Contains(demo.RecordPoints(), r) {
					return fmt.Errorf("--record-at: %q is not one of %s", r, strings.Join(demo.RecordPoints(), ", "))
				}
			}
			for _, t := range splitList(*topologies) {
				tp, err := demo.ParseTopology(t)
				if err != nil {
					return err
				}
				cfg.Topologies = append(cfg.Topologies, tp)
			}
			for _, m := range cfg.Modes {
				if m != "approximate" && m != "precise" {
					return fmt.Errorf("--modes: %q is neither approximate nor precise", m)
				}
			}
			log, err := newLogger(stderr, *logLevel)
			if err != nil {
				return err
			}
			cfg.Logger = log
			var progress io.Writer
			if cfg.Progress {
				progress = stderr
			}
			switch *scenario {
			case "ha":
				return demo.HA(ctx, cfg, stdout, progress)
			case "scale":
				_, err := demo.Scale(ctx, cfg, stdout, progress)
				return err
			case "compare":
				return demo.Compare(ctx, cfg, stdout, progress)
			case "capacity":
				if cfg.LoadWorkers, err = demo.ParseLoadWorkers(*loadWorkers); err != nil {
					return err
				}
				_, err := demo.Capacity(ctx, cfg, stdout, stderr)
				return err
			}
			return fmt.Errorf("--scenario %q: want ha, scale, compare or capacity", *scenario)
		},
	}
}
