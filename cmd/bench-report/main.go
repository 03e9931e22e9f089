// Command bench-report runs the benchmarks and trace replays behind kvrouter-ha's performance
// and quality claims and writes a Markdown report with PNG plots (`make bench-report`,
// docs/bench-report/). It is a command of its own, beside kvrouter-ha, so that the router's
// binary carries neither the plotting library nor its fonts; the failover it measures runs
// kvrouter-ha (--binary, by default the one beside this executable or bin/kvrouter-ha).
//
//	bench-report [--out docs/bench-report] [--binary bin/kvrouter-ha] [--tiny] [flags]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvrouter-ha/kvrouter-ha/benchreport"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := benchreport.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "bench-report:", err)
		os.Exit(1)
	}
}
