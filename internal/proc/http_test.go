package proc

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// flaky answers 503 to its first failures requests, then 200.
func flaky(t *testing.T, failures int32) *httptest.Server {
	t.Helper()
	var n atomic.Int32
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if n.Add(1) <= failures {
			http.Error(w, "no quorum", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	}))
	t.Cleanup(s.Close)
	return s
}

func TestWaitReady(t *testing.T) {
	cases := []struct {
		name     string
		failures int32
		within   time.Duration
		cancel   bool
		wantErr  string // "" for success
	}{
		{name: "ready at once", failures: 0, within: 5 * time.Second},
		{name: "ready after two 503s", failures: 2, within: 5 * time.Second},
		{name: "never ready", failures: 1 << 30, within: 300 * time.Millisecond, wantErr: "status 503: no quorum"},
		{name: "ctx ended", failures: 1 << 30, within: time.Hour, cancel: true, wantErr: "context canceled"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := flaky(t, tc.failures)
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			if tc.cancel {
				time.AfterFunc(100*time.Millisecond, cancel)
			}
			began := time.Now()
			err := WaitReady(ctx, s.Client(), s.URL+"/readyz", tc.within)
			took := time.Since(began)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("WaitReady: %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("WaitReady: %v, want an error with %q", err, tc.wantErr)
			case tc.wantErr != "" && took > tc.within+5*time.Second && !tc.cancel:
				t.Fatalf("WaitReady gave up after %s, bound %s", took, tc.within)
			}
			var se *StatusError
			if tc.wantErr != "" && !tc.cancel && (!errors.As(err, &se) || se.Code != http.StatusServiceUnavailable) {
				t.Fatalf("WaitReady: %v, want it to carry the last *StatusError (503)", err)
			}
		})
	}
}

// admin serves GET /admin/cluster saying state; a "hang" replica answers only when the
// request is given up.
func admin(t *testing.T, state string) string {
	t.Helper()
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/admin/cluster" {
			http.NotFound(w, r)
			return
		}
		if state == "hang" {
			<-r.Context().Done()
			return
		}
		fmt.Fprintf(w, `{"self":{"id":"x","state":%q,"leader_id":"r1","term":7},"bindings":3,"servers":[]}`, state)
	}))
	t.Cleanup(s.Close)
	return strings.TrimPrefix(s.URL, "http://")
}

func TestFindLeader(t *testing.T) {
	cases := []struct {
		name   string
		states []string
		want   int // -1: none leads
	}{
		{name: "the second leads", states: []string{"Follower", "Leader", "Follower"}, want: 1},
		{name: "a paused replica does not hold it up", states: []string{"hang", "Follower", "Leader"}, want: 2},
		{name: "an election", states: []string{"Candidate", "Follower", "Candidate"}, want: -1},
		{name: "nobody to ask", want: -1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var admins []string
			for _, s := range tc.states {
				admins = append(admins, admin(t, s))
			}
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			got, err := FindLeader(ctx, nil, admins)
			if tc.want < 0 {
				if !errors.Is(err, ErrNoLeader) {
					t.Fatalf("FindLeader: %d %v, want ErrNoLeader", got, err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("FindLeader: %d %v, want %d", got, err, tc.want)
			}
		})
	}
}

func TestGetStatus(t *testing.T) {
	st, err := GetStatus(t.Context(), nil, admin(t, "Leader"))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Leads() || st.Self.LeaderID != "r1" || st.Self.Term != 7 || st.Bindings != 3 {
		t.Fatalf("decoded %+v", st)
	}
	_, err = GetStatus(t.Context(), nil, strings.TrimPrefix(flaky(t, 1<<30).URL, "http://"))
	var se *StatusError
	if !errors.As(err, &se) || se.Code != http.StatusServiceUnavailable {
		t.Fatalf("GetStatus of a 503: %v, want a *StatusError", err)
	}
}

// electing serves GET /admin/cluster as a Candidate for its first asks answers, then as
// the Leader.
func electing(t *testing.T, asks int32) string {
	t.Helper()
	var n atomic.Int32
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		state := "Leader"
		if n.Add(1) <= asks {
			state = "Candidate"
		}
		fmt.Fprintf(w, `{"self":{"id":"x","state":%q,"term":7},"bindings":0,"servers":[]}`, state)
	}))
	t.Cleanup(s.Close)
	return strings.TrimPrefix(s.URL, "http://")
}

func TestAwaitLeader(t *testing.T) {
	cases := []struct {
		name    string
		admins  func(t *testing.T) []string
		within  time.Duration
		cancel  bool
		want    int    // -1: none
		wantErr string // for want -1
	}{
		{name: "a leader at once", admins: func(t *testing.T) []string { return []string{admin(t, "Follower"), admin(t, "Leader")} },
			within: 10 * time.Second, want: 1},
		{name: "a leader after an election", admins: func(t *testing.T) []string { return []string{admin(t, "Follower"), electing(t, 5)} },
			within: time.Minute, want: 1},
		{name: "a leader after asks that time out", admins: func(t *testing.T) []string { return []string{admin(t, "hang"), electing(t, 3)} },
			within: time.Minute, want: 1},
		{name: "never a leader", admins: func(t *testing.T) []string { return []string{admin(t, "Candidate"), admin(t, "hang")} },
			within: 300 * time.Millisecond, want: -1, wantErr: "no leader within 300ms"},
		{name: "ctx ended", admins: func(t *testing.T) []string { return []string{admin(t, "Candidate")} },
			within: time.Hour, cancel: true, want: -1, wantErr: "context canceled"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
			defer cancel()
			if tc.cancel {
				time.AfterFunc(100*time.Millisecond, cancel)
			}
			got, err := AwaitLeader(ctx, nil, tc.admins(t), tc.within, 200*time.Millisecond)
			if tc.want < 0 {
				if !errors.Is(err, ErrNoLeader) || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("AwaitLeader: %d %v, want ErrNoLeader and %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("AwaitLeader: %d %v, want %d", got, err, tc.want)
			}
		})
	}
}
