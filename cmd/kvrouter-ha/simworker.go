package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/peterbourgon/ff/v3/ffcli"

	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

func simWorkerCommand(stderr io.Writer) *ffcli.Command {
	fs := flag.NewFlagSet("kvrouter-ha sim-worker", flag.ContinueOnError)
	var cfg sim.Config
	listen := fs.String("listen", "127.0.0.1:8001", "listen address")
	fs.StringVar(&cfg.ID, "id", sim.DefaultID, "worker id, sent as X-Worker-ID")
	fs.StringVar(&cfg.Model, "model", sim.DefaultModel, "served model name")
	fs.Func("lora-modules", "LoRA adapters served on top of --model, comma-separated (listed in GET /v1/models with --model as their parent)", func(v string) error {
		for l := range strings.SplitSeq(v, ",") {
			if l = strings.TrimSpace(l); l != "" {
				cfg.LoRAs = append(cfg.LoRAs, l)
			}
		}
		return nil
	})
	fs.IntVar(&cfg.BlockSize, "block-size", sim.DefaultBlockSize, "KV block size in tokens")
	fs.IntVar(&cfg.CapacityBlocks, "capacity-blocks", sim.DefaultCapacityBlocks, "KV cache size in blocks")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", 262144, "largest prompt plus max_tokens")
	fs.DurationVar(&cfg.Overhead, "overhead", sim.DefaultOverhead, "fixed part of time to first token")
	fs.DurationVar(&cfg.PrefillPerToken, "prefill-per-token", sim.DefaultPrefillPerToken, "prefill time per uncached prompt token")
	fs.DurationVar(&cfg.DecodePerToken, "decode-per-token", sim.DefaultDecodePerToken, "time between output tokens")
	fs.IntVar(&cfg.MaxRunning, "max-running", sim.DefaultMaxRunning, "requests running at once; more wait")
	fs.Float64Var(&cfg.Speedup, "speedup", 1, "divide every simulated duration by this")
	fs.Float64Var(&cfg.ErrorRate, "error-rate", 0, "share of requests answered 500")
	fs.Float64Var(&cfg.StallRate, "stall-rate", 0, "share of requests that hang before the first byte")
	fs.DurationVar(&cfg.Stall, "stall", 0, "how long a stalled request hangs (0: until the client leaves)")
	fs.Int64Var(&cfg.Seed, "seed", 1, "seed of the fault draws")
	fs.StringVar(&cfg.Role, "role", sim.RoleBoth, "prefill/decode disaggregation role: both, prefill (refuses decode legs: kv_transfer_params with do_remote_prefill) or decode (refuses prefill legs: do_remote_decode); requests without kv_transfer_params are served by every role")
	fs.DurationVar(&cfg.KVTransferTimeout, "kv-transfer-timeout", sim.DefaultKVTransferTimeout, "how long a prefill leg's prompt blocks stay pinned for a decode worker to pull them (wall clock, as vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
	fs.DurationVar(&cfg.TransferPerBlock, "kv-transfer-per-block", sim.DefaultTransferPerBlock, "simulated KV transfer time per block a decode leg pulls and did not hold already")
	fs.IntVar(&cfg.ChunkedPrefillTokens, "chunked-prefill-tokens", 0, "chunked prefill: the engine runs in steps of at most this many prompt tokens, and a decode step sharing a step with a prefill chunk takes that chunk's prefill time longer (0: off, a separate FIFO prefill stage)")
	fs.IntVar(&cfg.SlidingWindow, "sliding-window", 0, "a hybrid-attention model (gpt-oss, Gemma 3): KV events of two groups, full attention and a sliding window of this many tokens, whose blocks leave the window as vLLM removes them (0: one full-attention group)")
	var pub kvevents.PublisherConfig
	fs.StringVar(&pub.Endpoint, "kv-events-endpoint", "", "publish KV events in vLLM's ZMQ format: tcp://*:5557 binds, tcp://host:port connects to a router (empty: off)")
	fs.StringVar(&pub.Topic, "kv-events-topic", "", "topic frame of every KV event message (e.g. kv@127.0.0.1:8001@sim-model)")
	fs.BoolVar(&pub.Bind, "kv-events-bind", false, "bind the PUB socket even when the endpoint names a host (vLLM binds only for a wildcard; a loopback address keeps the socket off other interfaces)")
	fs.BoolVar(&pub.MapEncoding, "kv-events-map-encoding", false, "encode batches as maps (newer vLLM) instead of arrays (older vLLM)")
	fs.BoolVar(&pub.BytesHashes, "kv-events-bytes-hashes", false, "send block hashes as bytes instead of integers")
	fs.StringVar(&pub.ReplayEndpoint, "kv-events-replay", "", "bind a replay (ROUTER) socket here, e.g. tcp://*:5558 (empty: none)")
	fs.IntVar(&pub.ReplayBuffer, "kv-events-replay-buffer", 10000, "batches kept for replay")
	dpSize := fs.Int("dp-size", 1, "data-parallel ranks, as vLLM's --data-parallel-size: each rank has its own cache and serves the requests whose X-Data-Parallel-Rank names it (the rest go to the least busy rank); rank r publishes KV events and answers replay on the endpoints' ports + r")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	return &ffcli.Command{
		Name:       "sim-worker",
		ShortUsage: "kvrouter-ha sim-worker [--listen 127.0.0.1:8001] [--id w0] [flags]",
		ShortHelp:  "run a simulated OpenAI-compatible inference worker with a paged prefix cache",
		FlagSet:    fs,
		Exec: func(ctx context.Context, _ []string) error {
			// A bad rank count or worker config fails before any socket is opened.
			if *dpSize < 1 || *dpSize > kvevents.MaxDPRank+1 {
				return fmt.Errorf("--dp-size %d: must be in [1, %d]", *dpSize, kvevents.MaxDPRank+1)
			}
			log, err := newLogger(stderr, *logLevel)
			if err != nil {
				return err
			}
			cfg.Logger = log
			if err := cfg.Validate(); err != nil {
				return err
			}
			ranks := make([]*sim.Worker, *dpSize)
			for r := range ranks {
				rc := cfg
				if *dpSize > 1 {
					rc.Logger = log.With("dp_rank", r)
					// Ranks draw their faults apart, as separate engines would fail apart.
					rc.Seed = cfg.Seed + int64(r)
				}
				if pub.Endpoint != "" {
					pc := pub
					pc.Logger, pc.DPRank = rc.Logger, r
					p, err := kvevents.NewPublisher(pc)
					if err != nil {
						return fmt.Errorf("kv events (dp rank %d): %w", r, err)
					}
					defer p.Close()
					rc.OnEvent = sim.PublishEvents(ctx, p, cfg.BlockSize, rc.Logger)
					rc.Logger.Info("publishing KV events", "endpoint", pub.Endpoint, "replay", pub.ReplayEndpoint)
				}
				if ranks[r], err = sim.New(rc); err != nil {
					return err
				}
			}
			serve := ranks[0].Serve
			if *dpSize > 1 {
				dp, err := sim.NewDataParallel(ranks...)
				if err != nil {
					return err
				}
				serve = dp.Serve
			}
			ln, err := net.Listen("tcp", *listen)
			if err != nil {
				return fmt.Errorf("listen: %w", err)
			}
			// The worker (or the data-parallel front) logs its one "serving" line itself.
			return serve(ctx, ln)
		},
	}
}
