package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
)

// event is one line of go test -json (cmd/test2json's TestEvent, and the build events).
type event struct {
	Action     string
	Package    string
	Test       string
	Output     string
	ImportPath string // build-output
}

// skip is a test that skipped, and what it said.
type skip struct {
	pkg, test, reason string
}

// reporter follows go test -json's events: it prints what go test prints without -v and
// keeps the skipped tests.
type reporter struct {
	w       io.Writer
	verbose bool
	pending map[string][]string // a running test's output lines, by package and test
	skips   []skip
}

func newReporter(w io.Writer, verbose bool) *reporter {
	return &reporter{w: w, verbose: verbose, pending: map[string][]string{}}
}

// maxLine bounds one line of go test -json (a test can print a long line).
const maxLine = 16 << 20

// read follows the events until r ends; a line that is not an event is printed as it is.
func (p *reporter) read(r io.Reader) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxLine)
	for sc.Scan() {
		var e event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil || e.Action == "" {
			fmt.Fprintln(p.w, sc.Text())
			continue
		}
		p.handle(e)
	}
	return sc.Err()
}

func (p *reporter) handle(e event) {
	key := e.Package + "\x00" + e.Test
	if p.verbose && e.Output != "" {
		fmt.Fprint(p.w, e.Output)
	}
	switch {
	case e.Action == "build-output":
		if !p.verbose {
			fmt.Fprint(p.w, e.Output)
		}
	case e.Test == "":
		// The package's own lines: ok, FAIL, a panic outside any test.
		if e.Action == "output" && !p.verbose && e.Output != "PASS\n" {
			fmt.Fprint(p.w, e.Output)
		}
		if e.Action == "fail" {
			// Tests still running when the package failed (a timeout, a panic): their output.
			for k, lines := range p.pending {
				if strings.HasPrefix(k, e.Package+"\x00") {
					p.flush(lines)
					delete(p.pending, k)
				}
			}
		}
	case e.Action == "output":
		p.pending[key] = append(p.pending[key], e.Output)
	case e.Action == "fail":
		p.flush(p.pending[key])
		delete(p.pending, key)
	case e.Action == "skip":
		p.skips = append(p.skips, skip{pkg: e.Package, test: e.Test, reason: skipReason(p.pending[key])})
		delete(p.pending, key)
	case e.Action == "pass":
		delete(p.pending, key)
	}
}

func (p *reporter) flush(lines []string) {
	if p.verbose {
		return // printed as they came
	}
	for _, l := range lines {
		if !strings.HasPrefix(l, "=== ") { // RUN, PAUSE, CONT: -v's framing
			fmt.Fprint(p.w, l)
		}
	}
}

// skipReason is what a skipped test printed, without go test's own framing lines.
func skipReason(lines []string) string {
	var parts []string
	for _, l := range lines {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "=== ") || strings.HasPrefix(l, "--- SKIP") {
			continue
		}
		parts = append(parts, l)
	}
	if len(parts) == 0 {
		return "(no reason given)"
	}
	return strings.Join(parts, " / ")
}

// summary prints every skipped test and whether the allow-list names it, and returns how
// many it does not.
func (p *reporter) summary(w io.Writer, allow []allowed, allowPath string) int {
	if len(p.skips) == 0 {
		fmt.Fprintln(w, "skipped tests: none")
		return 0
	}
	unexpected := 0
	fmt.Fprintf(w, "skipped tests: %d\n", len(p.skips))
	for _, s := range p.skips {
		verdict := "NOT in " + allowPath
		if a, ok := match(allow, s); ok {
			verdict = "allowed: " + a.reason
		} else {
			unexpected++
		}
		fmt.Fprintf(w, "  SKIP %s %s: %s [%s]\n", s.pkg, s.test, s.reason, verdict)
	}
	return unexpected
}

// allowed is one entry of the allow-list.
type allowed struct {
	pkg, pattern, reason string
}

// match is the first entry that names s's package and test.
func match(allow []allowed, s skip) (allowed, bool) {
	for _, a := range allow {
		if s.pkg != a.pkg && !strings.HasSuffix(s.pkg, "/"+a.pkg) {
			continue
		}
		if ok, _ := path.Match(a.pattern, s.test); ok {
			return a, true
		}
	}
	return allowed{}, false
}

// readAllowList reads the allow-list file at name.
func readAllowList(name string) ([]allowed, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return nil, fmt.Errorf("allow-list: %w", err)
	}
	return parseAllowList(name, string(b))
}

// parseAllowList parses an allow-list: package, test pattern and reason, one entry a line.
func parseAllowList(name, text string) ([]allowed, error) {
	var out []allowed
	for i, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 3 {
			return nil, fmt.Errorf("%s:%d: want a package, a test name pattern and the reason it may skip, got %q", name, i+1, line)
		}
		if _, err := path.Match(f[1], ""); err != nil {
			return nil, fmt.Errorf("%s:%d: test name pattern %q: %w", name, i+1, f[1], err)
		}
		out = append(out, allowed{pkg: strings.TrimPrefix(f[0], "./"), pattern: f[1], reason: strings.Join(f[2:], " ")})
	}
	return out, nil
}
