package demo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
)

// TestNoKillIsReportedWithItsReason: a run whose leader was never killed says why (the
// replay ended first, or no replica led in time), and HA turns that into its error.
func TestNoKillIsReportedWithItsReason(t *testing.T) {
	candidate := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, `{"self":{"id":"r0","state":"Candidate","term":3},"bindings":0}`)
	}))
	t.Cleanup(candidate.Close)
	cases := []struct {
		name    string
		after   time.Duration
		within  time.Duration // how long the replay runs
		wantErr string
		wantIs  error
	}{
		{name: "the replay ended before the half-way point", after: time.Hour, within: 100 * time.Millisecond, wantErr: "the replay ended before the half-way point"},
		{name: "no replica leads", after: 0, within: time.Second, wantErr: "no leader to kill from 0.0 s on", wantIs: proc.ErrNoLeader},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := &haCluster{hc: candidate.Client(), admins: []string{strings.TrimPrefix(candidate.URL, "http://")}}
			ctx, cancel := context.WithTimeout(t.Context(), tc.within)
			defer cancel()
			k := h.killLeader(ctx, time.Now(), tc.after)
			if k.killed != "" || k.err == nil || !strings.Contains(k.err.Error(), tc.wantErr) || tc.wantIs != nil && !errors.Is(k.err, tc.wantIs) {
				t.Fatalf("killLeader: killed %q, err %v; want none killed and an error with %q", k.killed, k.err, tc.wantErr)
			}
			var out bytes.Buffer
			h.report(&out, &replay.Summary{Requests: 1, Errors: map[string]int{"timeout": 1}, Failed: 1}, k, &leaderWatch{})
			for _, want := range []string{"no leader was killed: " + k.err.Error(), "requests failed: 1 of 1 (timeout 1)"} {
				if !strings.Contains(out.String(), want) {
					t.Errorf("report lacks %q:\n%s", want, out.String())
				}
			}
			if strings.Contains(out.String(), "map[") {
				t.Errorf("report prints Go map syntax:\n%s", out.String())
			}
		})
	}
}
