package main

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// events is a go test -json stream of one package: a passing test, a failing one, one that
// skips, a skipped subtest, and the package's lines.
const events = `{"Action":"start","Package":"m/p"}
{"Action":"run","Package":"m/p","Test":"TestPass"}
{"Action":"output","Package":"m/p","Test":"TestPass","Output":"=== RUN   TestPass\n"}
{"Action":"output","Package":"m/p","Test":"TestPass","Output":"    p_test.go:5: quiet on success\n"}
{"Action":"pass","Package":"m/p","Test":"TestPass"}
{"Action":"run","Package":"m/p","Test":"TestFail"}
{"Action":"output","Package":"m/p","Test":"TestFail","Output":"=== RUN   TestFail\n"}
{"Action":"output","Package":"m/p","Test":"TestFail","Output":"    p_test.go:9: it broke\n"}
{"Action":"output","Package":"m/p","Test":"TestFail","Output":"--- FAIL: TestFail (0.00s)\n"}
{"Action":"fail","Package":"m/p","Test":"TestFail"}
{"Action":"run","Package":"m/p","Test":"TestNeedsRoot"}
{"Action":"output","Package":"m/p","Test":"TestNeedsRoot","Output":"=== RUN   TestNeedsRoot\n"}
{"Action":"output","Package":"m/p","Test":"TestNeedsRoot","Output":"    p_test.go:12: network namespaces need root\n"}
{"Action":"output","Package":"m/p","Test":"TestNeedsRoot","Output":"--- SKIP: TestNeedsRoot (0.00s)\n"}
{"Action":"skip","Package":"m/p","Test":"TestNeedsRoot"}
{"Action":"run","Package":"m/p","Test":"TestTable/slow"}
{"Action":"output","Package":"m/p","Test":"TestTable/slow","Output":"    --- SKIP: TestTable/slow (0.00s)\n"}
{"Action":"skip","Package":"m/p","Test":"TestTable/slow"}
not json: printed as it is
{"Action":"output","Package":"m/p","Output":"FAIL\n"}
{"Action":"output","Package":"m/p","Output":"FAIL\tm/p\t0.01s\n"}
{"Action":"fail","Package":"m/p"}
{"Action":"skip","Package":"m/q"}
`

func TestReporterPrintsFailuresAndKeepsSkips(t *testing.T) {
	cases := []struct {
		name           string
		allow          string
		verbose        bool
		wantUnexpected int
		wantOut        []string // in the output, in this order
		notOut         []string
	}{
		{name: "nothing allowed", wantUnexpected: 2,
			wantOut: []string{"p_test.go:9: it broke", "--- FAIL: TestFail", "not json: printed as it is", "FAIL\tm/p",
				"skipped tests: 2", "SKIP m/p TestNeedsRoot: p_test.go:12: network namespaces need root [NOT in allow]",
				"SKIP m/p TestTable/slow: (no reason given) [NOT in allow]"},
			notOut: []string{"quiet on success", "=== RUN", "m/q"}},
		{name: "both allowed, by path in the module and by pattern", allow: "p TestNeedsRoot CI is root, a laptop is not\nm/p TestTable/* slow\n",
			wantOut: []string{"[allowed: CI is root, a laptop is not]", "TestTable/slow: (no reason given) [allowed: slow]"}},
		{name: "another package's entry does not count", allow: "q TestNeedsRoot no\np TestTable/* slow\n", wantUnexpected: 1,
			wantOut: []string{"TestNeedsRoot: p_test.go:12: network namespaces need root [NOT in allow]"}},
		{name: "verbose prints every line", verbose: true, allow: "p Test* all\np Test*/* subtests too\n",
			wantOut: []string{"=== RUN   TestPass", "quiet on success", "it broke"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			allow, err := parseAllowList("allow", tc.allow)
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			r := newReporter(&out, tc.verbose)
			if err := r.read(strings.NewReader(events)); err != nil {
				t.Fatal(err)
			}
			if got := r.summary(&out, allow, "allow"); got != tc.wantUnexpected {
				t.Errorf("unexpected skips: %d, want %d", got, tc.wantUnexpected)
			}
			s := out.String()
			at := 0
			for _, w := range tc.wantOut {
				i := strings.Index(s[at:], w)
				if i < 0 {
					t.Fatalf("output lacks %q after offset %d:\n%s", w, at, s)
				}
				at += i + len(w)
			}
			for _, n := range tc.notOut {
				if strings.Contains(s, n) {
					t.Errorf("output has %q:\n%s", n, s)
				}
			}
		})
	}
}

func TestParseAllowListWantsAReasonPerEntry(t *testing.T) {
	cases := []struct {
		name, text, wantErr string
		want                int
	}{
		{name: "comments and blanks", text: "# why\n\n  \nindexer TestX the race detector\n./deploy TestY/* no systemd\n", want: 2},
		{name: "no reason", text: "indexer TestX\n", wantErr: "allow:1: want a package, a test name pattern and the reason"},
		{name: "a bad pattern", text: "# c\nindexer Test[ reason\n", wantErr: "allow:2: test name pattern"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseAllowList("allow", tc.text)
			switch {
			case tc.wantErr != "":
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("parseAllowList: %v, want an error with %q", err, tc.wantErr)
				}
			case err != nil || len(got) != tc.want:
				t.Fatalf("parseAllowList: %d entries, %v; want %d", len(got), err, tc.want)
			}
		})
	}
}

func TestWithJSON(t *testing.T) {
	cases := []struct{ in, want []string }{
		{[]string{"test", "-race", "./..."}, []string{"test", "-json", "-race", "./..."}},
		{[]string{"test", "-json", "./..."}, []string{"test", "-json", "./..."}},
		{[]string{"vet", "./..."}, []string{"vet", "./..."}},
	}
	for _, tc := range cases {
		if got := withJSON(tc.in); !slices.Equal(got, tc.want) {
			t.Errorf("withJSON(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestRunFailsOnASkipNotAllowed runs the real go test on a package written here whose one
// test skips: the exit status is 1 with an empty allow-list, 0 with the test on it, and go
// test's own when a test fails.
func TestRunFailsOnASkipNotAllowed(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		t.Helper()
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("go.mod", "module example.com/skips\n\ngo 1.22\n")
	write("skips_test.go", `package skips

import ("os"; "testing")

func TestSkips(t *testing.T) { t.Skip("needs a thing CI lacks") }

func TestMayFail(t *testing.T) {
	if os.Getenv("SKIPS_FAIL") != "" {
		t.Fatal("asked to fail")
	}
}
`)
	empty := write("allow-empty", "# nothing may skip\n")
	listed := write("allow-listed", "example.com/skips TestSkips the thing is optional\n")
	cases := []struct {
		name, allow, fail string
		want              int
		wantOut           string
	}{
		{name: "skip not allowed", allow: empty, want: 1, wantOut: "needs a thing CI lacks [NOT in"},
		{name: "skip allowed", allow: listed, want: 0, wantOut: "[allowed: the thing is optional]"},
		{name: "a failure keeps go test's status", allow: listed, fail: "1", want: 1, wantOut: "asked to fail"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("SKIPS_FAIL", tc.fail)
			t.Chdir(dir)
			var out, errOut bytes.Buffer
			got := run([]string{"-allow", tc.allow, "--", "go", "test", "-count=1", "."}, &out, &errOut)
			if got != tc.want || !strings.Contains(out.String(), tc.wantOut) {
				t.Fatalf("exit %d, want %d and output with %q:\n%s\n%s", got, tc.want, tc.wantOut, out.String(), errOut.String())
			}
		})
	}
}

// FuzzReport feeds any go test output and any allow-list through the reporter: nothing in
// them may crash it.
func FuzzReport(f *testing.F) {
	f.Add(events, "p TestNeedsRoot reason\n# c\n")
	f.Add(`{"Action":"skip","Package":"m","Test":"T"}`, "m T[ bad\n")
	f.Fuzz(func(t *testing.T, stream, allowText string) {
		allow, _ := parseAllowList("allow", allowText)
		var out bytes.Buffer
		r := newReporter(&out, len(stream)%2 == 0)
		_ = r.read(strings.NewReader(stream))
		if n := r.summary(&out, allow, "allow"); n < 0 || n > len(r.skips) {
			t.Fatalf("%d unexpected skips of %d", n, len(r.skips))
		}
	})
}
