// Command kvrouter-ha is a highly available, KV-cache-aware router for LLM serving fleets.
//
//	kvrouter-ha serve       run a router replica
//	kvrouter-ha sim-worker  run a simulated OpenAI-compatible inference worker
//	kvrouter-ha replay      replay a request trace against a router or workers
//	kvrouter-ha demo        simulated workers and three replicas, the leader killed half-way (and other scenarios)
//	kvrouter-ha ctl         operate a running cluster (workers, sessions, raft)
//	kvrouter-ha jepsen      run a cluster under faults and check what clients saw
//	kvrouter-ha version     print the version (also --version)
//
// Every flag can also be set from the environment: --foo-bar is KVROUTER_FOO_BAR.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"

	"github.com/peterbourgon/ff/v3"
	"github.com/peterbourgon/ff/v3/ffcli"

	"github.com/kvrouter-ha/kvrouter-ha/internal/version"
)

// envPrefix names the environment variables that mirror flags.
const envPrefix = "KVROUTER"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "kvrouter-ha:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvrouter-ha", flag.ContinueOnError)
	showVersion := fs.Bool("version", false, "print the version and exit")
	root := &ffcli.Command{
		Name:       "kvrouter-ha",
		ShortUsage: "kvrouter-ha <serve|sim-worker|replay|demo|ctl|jepsen|version> [flags]",
		ShortHelp:  "a highly available, KV-cache-aware router for LLM serving fleets",
		LongHelp: strings.TrimSpace(`
kvrouter-ha routes OpenAI-compatible requests to the inference worker that already holds
their prompt prefix in its KV cache, keeps sessions on their worker, and balances the rest.

Every flag can also come from the environment: --foo-bar is KVROUTER_FOO_BAR.`),
		FlagSet: fs,
		Subcommands: []*ffcli.Command{
			serveCommand(stdout, stderr),
			simWorkerCommand(stderr),
			replayCommand(stdout, stderr),
			demoCommand(stdout, stderr),
			ctlCommand(stdout, stderr),
			jepsenCommand(stdout, stderr),
			versionCommand(stdout),
		},
	}
	root.Exec = func(_ context.Context, rest []string) error {
		switch {
		case *showVersion:
			return printVersion(stdout)
		case len(rest) > 0:
			names := make([]string, len(root.Subcommands))
			for i, c := range root.Subcommands {
				names[i] = c.Name
			}
			return fmt.Errorf("unknown subcommand %q: want one of %s (kvrouter-ha --help)", rest[0], strings.Join(names, ", "))
		}
		return flag.ErrHelp
	}
	for _, c := range root.Subcommands {
		c.FlagSet.SetOutput(stderr)
		c.Options = append(c.Options, ff.WithEnvVarPrefix(envPrefix))
	}
	root.FlagSet.SetOutput(stderr)
	return root.ParseAndRun(ctx, args)
}

// versionCommand prints the version, as --version does.
func versionCommand(stdout io.Writer) *ffcli.Command {
	return &ffcli.Command{
		Name:       "version",
		ShortUsage: "kvrouter-ha version",
		ShortHelp:  "print the version (as --version)",
		FlagSet:    flag.NewFlagSet("kvrouter-ha version", flag.ContinueOnError),
		Exec: func(_ context.Context, rest []string) error {
			if len(rest) > 0 {
				return fmt.Errorf("version takes no arguments, got %q", rest)
			}
			return printVersion(stdout)
		},
	}
}

// printVersion writes the version line: the stamped release (make build) or the source
// tree's release with the VCS revision, and the Go toolchain.
func printVersion(stdout io.Writer) error {
	_, err := fmt.Fprintf(stdout, "kvrouter-ha %s (%s)\n", version.String(), runtime.Version())
	return err
}

// newLogger returns a text logger at the named level.
func newLogger(w io.Writer, level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: %w", level, err)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}
