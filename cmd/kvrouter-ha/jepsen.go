package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/peterbourgon/ff/v3/ffcli"

	"github.com/kvrouter-ha/kvrouter-ha/deploy"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/jepsen"
)

// jepsenServeArgs collects repeated --serve-arg flags.
type jepsenServeArgs []string

func (a *jepsenServeArgs) String() string { return strings.Join(*a, " ") }

func (a *jepsenServeArgs) Set(v string) error {
	*a = append(*a, v)
	return nil
}

func jepsenCommand(stdout, stderr io.Writer) *ffcli.Command {
	fs := flag.NewFlagSet("kvrouter-ha jepsen", flag.ContinueOnError)
	var cfg jepsen.Config
	fs.StringVar(&cfg.Binary, "binary", "", "kvrouter-ha binary to test (default: this one)")
	fs.IntVar(&cfg.Replicas, "replicas", 3, "replica processes")
	fs.IntVar(&cfg.Workers, "workers", 3, "simulated worker processes")
	fs.IntVar(&cfg.Clients, "clients", 8, "concurrent clients, each owning a few sessions")
	fs.DurationVar(&cfg.Duration, "duration", 2*time.Minute, "how long the workload runs (faults stop 8s before the end)")
	fs.Int64Var(&cfg.Seed, "seed", 1, "seed of the fault schedule and the clients' choices")
	faults := fs.String("faults", "kill,stop,restart,partition,worker,stale", "fault kinds: kill, stop, restart, partition, worker, stale, discovery (a new worker listed in a discovery file, then taken out), or all")
	fs.StringVar(&cfg.OutDir, "out", "jepsen-out", "directory for summary.txt, report.json, history.json, logs and porcupine pages")
	fs.BoolVar(&cfg.HAProxy, "haproxy", false, "put HAProxy (from PATH) in front of the replicas; --lb-share of the requests go through it")
	fs.Float64Var(&cfg.LBShare, "lb-share", 0.5, "with --haproxy: share of the requests sent through it (above 0, at most 1; the rest go straight to a random replica)")
	lbConfig := fs.String("lb-config", "harness", "where HAProxy's retries and health checks come from: harness (its own, which also retries an empty answer), deploy (deploy/haproxy.cfg, built in) or the path of an HAProxy config file")
	fs.StringVar(&cfg.Netns, "netns", "auto", "network namespaces (needed for partitions; root on Linux): auto, on or off")
	fs.StringVar(&cfg.Consistency, "consistency", "bounded", "replicas' --consistency, and what the checker holds them to")
	fs.DurationVar(&cfg.StaleBound, "stale-bound", time.Second, "replicas' --stale-bound")
	fs.DurationVar(&cfg.BindWait, "bind-wait", 3*time.Second, "replicas' --bind-wait")
	fs.DurationVar(&cfg.SessionTTL, "session-ttl", 30*time.Second, "replicas' --session-ttl (short enough that some sessions idle out)")
	fs.DurationVar(&cfg.HealthInterval, "health-interval", 500*time.Millisecond, "replicas' --health-interval")
	fs.DurationVar(&cfg.RequestTimeout, "request-timeout", 10*time.Second, "a client request past this is recorded as unknown")
	var serveArgs jepsenServeArgs
	fs.Var(&serveArgs, "serve-arg", "extra flag for every replica (repeatable), e.g. --serve-arg=--log-level=debug")
	fs.BoolVar(&cfg.KeepData, "keep-data", false, "keep the replicas' data directories")
	recheck := fs.String("recheck", "", "check a saved history.json again instead of running (uses --consistency, --stale-bound, --session-ttl)")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	return &ffcli.Command{
		Name:       "jepsen",
		ShortUsage: "kvrouter-ha jepsen [--replicas 3] [--duration 2m] [--seed 1] [--faults ...] [--out DIR] [--haproxy]",
		ShortHelp:  "run a cluster of this binary under faults and check what clients saw",
		LongHelp: strings.TrimSpace(`
Starts --replicas replica processes of this binary (each with its own data directory) and
--workers simulated workers, drives --clients clients with sessions, some streaming, and has a
seeded nemesis kill -9, SIGSTOP, restart the whole cluster, crash or hang workers and, as root on
Linux with ip and iptables, partition replicas in network namespaces. It then checks the history:
porcupine on each session's binding, binding changes nothing explains, bindings lost across a full
restart, and availability under each kind of fault. It exits non-zero on any violation.`),
		FlagSet: fs,
		Exec: func(ctx context.Context, _ []string) error {
			log, err := newLogger(stderr, *logLevel)
			if err != nil {
				return err
			}
			cfg.Logger = log
			cfg.ServeArgs = serveArgs
			if *recheck != "" {
				return jepsenRecheck(stdout, *recheck, &cfg)
			}
			if cfg.LBPolicy, cfg.LBPolicySource, err = jepsenLBPolicy(*lbConfig); err != nil {
				return err
			}
			if cfg.Faults, err = jepsen.ParseFaults(*faults); err != nil {
				return err
			}
			if cfg.Binary == "" {
				if cfg.Binary, err = os.Executable(); err != nil {
					return fmt.Errorf("find this binary: %w", err)
				}
			}
			rep, err := jepsen.Run(ctx, cfg)
			if rep != nil {
				if werr := rep.WriteText(stdout); werr != nil && err == nil {
					err = werr
				}
			}
			if err != nil {
				return err
			}
			if !rep.Valid() {
				return fmt.Errorf("jepsen: %d violations (see %s)", len(rep.Analysis.Violations), cfg.OutDir)
			}
			return nil
		},
	}
}

func jepsenRecheck(stdout io.Writer, path string, cfg *jepsen.Config) error {
	h, err := jepsen.ReadHistoryFile(path)
	if err != nil {
		return err
	}
	if cfg.Consistency != "bounded" && cfg.Consistency != "linearizable" && cfg.Consistency != "local" {
		return fmt.Errorf("consistency %q: want bounded, linearizable or local", cfg.Consistency)
	}
	cc := cfg.CheckConfig()
	rep := jepsen.Recheck(h, cc)
	if err := rep.WriteText(stdout); err != nil {
		return err
	}
	if !rep.Valid() {
		return errors.New("jepsen: violations in the history")
	}
	return nil
}

// jepsenLBPolicy reads --lb-config: the harness's own retries and checks, deploy/haproxy.cfg's
// (the copy built into this binary), or those of the HAProxy config file it names.
func jepsenLBPolicy(from string) (proc.HAProxyPolicy, string, error) {
	var text, source string
	switch from {
	case "harness":
		return proc.HAProxyPolicy{}, "", nil // the harness's default
	case "deploy":
		text, source = deploy.HAProxyConfig, "deploy/haproxy.cfg (built in)"
	default:
		b, err := os.ReadFile(from)
		if err != nil {
			return proc.HAProxyPolicy{}, "", fmt.Errorf("--lb-config: %w", err)
		}
		text, source = string(b), from
	}
	p, err := proc.ReadHAProxyPolicy(text)
	if err != nil {
		return proc.HAProxyPolicy{}, "", fmt.Errorf("--lb-config %s: %w", from, err)
	}
	return p, source, nil
}
