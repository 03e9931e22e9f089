// Command testreport runs a go test command with -json and prints what go test would print
// without -v (the ok and FAIL lines, a failing test's output), then every test that
// skipped, with its reason. It fails when a test skipped that the allow-list does not name:
// a skip is a test that did not run, and CI must not hide one.
//
//	go run ./internal/testreport -allow .ci/skips-allowed -- go test -race ./...
//
// The allow-list has one entry a line: a package (its import path, or the path inside the
// module), a test name pattern (path.Match: TestX, TestX/*) and the reason it may skip.
// Blank lines and lines starting with # are ignored; an entry without a reason is an error.
// The exit status is go test's when it failed, else 1 for a skip not allowed, else 0.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run is main with its arguments and outputs; it returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("testreport", flag.ContinueOnError)
	fs.SetOutput(stderr)
	allowPath := fs.String("allow", "", "the allow-list of tests that may skip, each with its reason (required)")
	verbose := fs.Bool("v", false, "print every line of output, as go test -v does (for a fuzz run's progress)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	command := fs.Args()
	if *allowPath == "" || len(command) == 0 {
		fmt.Fprintln(stderr, "usage: testreport -allow FILE [-v] -- go test [flags] [packages]")
		return 2
	}
	allow, err := readAllowList(*allowPath)
	if err != nil {
		fmt.Fprintln(stderr, "testreport:", err)
		return 2
	}
	cmd := exec.Command(command[0], withJSON(command[1:])...)
	cmd.Stderr = stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		fmt.Fprintln(stderr, "testreport:", err)
		return 2
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(stderr, "testreport:", err)
		return 2
	}
	r := newReporter(stdout, *verbose)
	readErr := r.read(out)
	waitErr := cmd.Wait()
	unexpected := r.summary(stdout, allow, *allowPath)
	var exit *exec.ExitError
	switch {
	case readErr != nil:
		fmt.Fprintln(stderr, "testreport: reading go test's output:", readErr)
		return 2
	case errors.As(waitErr, &exit):
		return exit.ExitCode()
	case waitErr != nil:
		fmt.Fprintln(stderr, "testreport:", waitErr)
		return 2
	case unexpected > 0:
		fmt.Fprintf(stderr, "testreport: %d skipped test(s) not in %s: make each run, or add it there with the reason it may skip\n", unexpected, *allowPath)
		return 1
	}
	return 0
}

// withJSON is go test's arguments with -json after "test" (once).
func withJSON(args []string) []string {
	if slices.Contains(args, "-json") {
		return args
	}
	i := slices.Index(args, "test")
	if i < 0 {
		return args
	}
	return slices.Concat(args[:i+1], []string{"-json"}, args[i+1:])
}
