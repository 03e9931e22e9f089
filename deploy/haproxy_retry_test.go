package deploy

import (
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestHAProxyRetriesOnlyWhatNoWorkerSaw: deploy/haproxy.cfg resends a request to another
// replica on a refused connection and on a replica's refusal (503: every 503 the router
// answers was asked of no worker), and on nothing that may have reached a worker (an empty
// answer, a timeout, a 502 or 504 after a worker was asked).
func TestHAProxyRetriesOnlyWhatNoWorkerSaw(t *testing.T) {
	cfg, err := os.ReadFile("haproxy.cfg")
	if err != nil {
		t.Fatal(err)
	}
	directives := map[string][]string{}
	for _, line := range strings.Split(string(cfg), "\n") {
		line, _, _ = strings.Cut(line, "#")
		f := strings.Fields(line)
		switch {
		case len(f) >= 2 && f[0] == "retry-on", len(f) >= 2 && f[0] == "retries":
			directives[f[0]] = f[1:]
		case len(f) >= 2 && f[0] == "option" && f[1] == "redispatch":
			directives["option redispatch"] = f[2:]
		}
	}
	cases := []struct {
		directive string
		check     func([]string) bool
		want      string
	}{
		{"retry-on", func(v []string) bool {
			s := slices.Sorted(slices.Values(v))
			return slices.Equal(s, []string{"503", "conn-failure"})
		}, "exactly conn-failure and 503"},
		{"retries", func(v []string) bool {
			n, err := strconv.Atoi(v[0])
			return err == nil && n >= 1
		}, "at least 1"},
		{"option redispatch", func(v []string) bool { return len(v) == 0 || v[0] == "1" }, "every retry to another server"},
	}
	for _, tc := range cases {
		v, ok := directives[tc.directive]
		if !ok || !tc.check(v) {
			t.Errorf("haproxy.cfg: %s %v (present %v), want %s", tc.directive, v, ok, tc.want)
		}
	}
}
