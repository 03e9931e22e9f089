package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/peterbourgon/ff/v3/ffcli"

	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
)

func replayCommand(stdout, stderr io.Writer) *ffcli.Command {
	fs := flag.NewFlagSet("kvrouter-ha replay", flag.ContinueOnError)
	cfg := replay.DefaultConfig()
	target := fs.String("target", "", "router base URL, e.g. http://127.0.0.1:8080")
	workers := fs.String("workers", "", "comma-separated worker base URLs, sent round-robin with no router (a baseline)")
	tracePath := fs.String("trace", "", "Mooncake-format JSONL trace (default: the bundled synthetic trace)")
	start := fs.Int("start", 0, "first request of the trace to replay")
	fs.IntVar(&cfg.Limit, "requests", 0, "requests to replay (0: all)")
	fs.Float64Var(&cfg.Speedup, "speedup", 1, "divide arrival times by this")
	fs.IntVar(&cfg.Concurrency, "concurrency", 256, "most requests in flight")
	fs.DurationVar(&cfg.Timeout, "timeout", 10*time.Minute, "per-request timeout")
	fs.StringVar(&cfg.Model, "model", "sim-model", "model name sent in requests")
	fs.BoolVar(&cfg.Stream, "stream", true, "send streaming requests (SSE, TTFT measured at the first token); false sends non-streaming ones (the first token is seen with the last)")
	fs.IntVar(&cfg.MaxOutputTokens, "max-output-tokens", 0, "cap each request's output tokens (0: as in the trace)")
	fs.IntVar(&cfg.RouterBlockSize, "router-block-size", 16, "the router's block size, to turn predicted overlap into tokens")
	fs.StringVar(&cfg.Label, "label", "replay", "name of this run in the summary")
	jsonPath := fs.String("json", "", "also write the summary as JSON to this file")
	progress := fs.Bool("progress", true, "show a progress bar")
	return &ffcli.Command{
		Name:       "replay",
		ShortUsage: "kvrouter-ha replay --target http://127.0.0.1:8080 [flags]",
		ShortHelp:  "replay a Mooncake-format trace against a router or workers and summarise routing quality",
		FlagSet:    fs,
		Exec: func(ctx context.Context, _ []string) error {
			cfg.Target = *target
			cfg.Workers = splitList(*workers)
			if (cfg.Target == "") == (len(cfg.Workers) == 0) {
				return errors.New("give exactly one of --target or --workers")
			}
			reqs, err := trace.ForReplay(*tracePath, *start)
			if err != nil {
				return err
			}
			cfg.Requests = reqs
			if *progress {
				cfg.Progress = stderr
			}
			sum, err := replay.Run(ctx, cfg)
			if sum != nil {
				sum.WriteText(stdout)
				if *jsonPath != "" {
					b, jerr := json.MarshalIndent(sum, "", "  ")
					if jerr == nil {
						jerr = os.WriteFile(*jsonPath, b, 0o644)
					}
					if jerr != nil {
						return fmt.Errorf("write %s: %w", *jsonPath, jerr)
					}
				}
			}
			return err
		},
	}
}
