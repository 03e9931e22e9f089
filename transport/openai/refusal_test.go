package openai

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// refusingAffinity refuses every session, as a cut-off replica's store does.
type refusingAffinity struct{ *routing.MemoryAffinity }

func (refusingAffinity) Acquire(context.Context, string, *indexer.Worker) (routing.Lease, error) {
	return nil, &routing.Refusal{Reason: "cut_off", Err: fmt.Errorf("no leader known: %w", routing.ErrUnavailable)}
}

// bindFirstAffinity is a store whose leases want a new binding committed before dispatch
// (a replica whose contact with its quorum is stale) and whose Commit fails with fail (nil:
// it binds).
type bindFirstAffinity struct {
	*routing.MemoryAffinity
	fail error
}

func (a bindFirstAffinity) Acquire(ctx context.Context, key string, explicit *indexer.Worker) (routing.Lease, error) {
	l, err := a.MemoryAffinity.Acquire(ctx, key, explicit)
	if err != nil {
		return nil, err
	}
	return bindFirstLease{Lease: l, fail: a.fail}, nil
}

type bindFirstLease struct {
	routing.Lease
	fail error
}

func (bindFirstLease) BindFirst() bool { return true }

func (l bindFirstLease) Commit(ctx context.Context, w indexer.Worker, model string) (routing.Binding, error) {
	if l.fail != nil {
		return routing.Binding{}, l.fail
	}
	return l.Lease.Commit(ctx, w, model)
}

// TestOnlyARequestNoWorkerSawIsAnswered503: a load balancer retries the router's 503s on
// another replica, so a refusal (before any worker) is a 503 with Retry-After and
// X-Kvrouter-Refused, and a worker's own 503 (it saw the request) goes out as a 502 without
// the marker.
func TestOnlyARequestNoWorkerSawIsAnswered503(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		workerBody := `{"error":{"message":"engine overloaded","type":"ServiceUnavailable","code":503}}`
		cases := []struct {
			name       string
			session    string
			worker     http.HandlerFunc
			refuse     bool
			affinity   func(*routing.MemoryAffinity) routing.AffinityStore
			wantStatus int
			wantMarker string
			wantAsked  int
		}{
			{"refused by a cut-off replica", "s-1", okJSON, true, nil, http.StatusServiceUnavailable, "cut_off", 0},
			{"a new session bound first, the bind failed", "s-2", okJSON, false, func(m *routing.MemoryAffinity) routing.AffinityStore {
				return bindFirstAffinity{m, fmt.Errorf("raft apply: leadership lost while committing log")}
			}, http.StatusServiceUnavailable, "bind_failed", 0},
			{"a new session bound first", "s-3", okJSON, false, func(m *routing.MemoryAffinity) routing.AffinityStore {
				return bindFirstAffinity{m, nil}
			}, http.StatusOK, "", 1},
			{"no healthy worker", "", okJSON, false, nil, http.StatusServiceUnavailable, "no_worker", 0},
			{"every worker answering 503", "", func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusServiceUnavailable)
				_, _ = io.WriteString(w, workerBody)
			}, false, nil, http.StatusBadGateway, "", 2},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				w0, w1 := newFakeWorker(t, tc.worker), newFakeWorker(t, tc.worker)
				opts := rigOptions{server: server, router: roundRobin}
				if tc.refuse {
					opts.affinity = func(m *routing.MemoryAffinity) routing.AffinityStore { return refusingAffinity{m} }
				}
				if tc.affinity != nil {
					opts.affinity = tc.affinity
				}
				rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL), spec("w1", w1.URL)}, opts)
				if tc.wantMarker == "no_worker" {
					rg.workers.SetHealthy("w0", false, "test")
					rg.workers.SetHealthy("w1", false, "test")
				}
				headers := map[string]string{}
				if tc.session != "" {
					headers[headerSession] = tc.session
				}
				resp, body := rg.post("/v1/completions", completionBody, headers)
				if resp.StatusCode != tc.wantStatus || resp.Header.Get(HeaderRefused) != tc.wantMarker {
					t.Fatalf("status %d %s %q, want %d and %q: %s", resp.StatusCode, HeaderRefused, resp.Header.Get(HeaderRefused),
						tc.wantStatus, tc.wantMarker, body)
				}
				if asked := w0.requests() + w1.requests(); asked != tc.wantAsked {
					t.Fatalf("workers asked %d times, want %d", asked, tc.wantAsked)
				}
				if tc.wantStatus == http.StatusServiceUnavailable {
					if resp.Header.Get("Retry-After") == "" {
						t.Fatal("a refusal without Retry-After")
					}
					if e := errorOf(t, body); e.Type != TypeUnavailable {
						t.Fatalf("refusal %+v, want type %s", e, TypeUnavailable)
					}
				} else if tc.wantStatus == http.StatusBadGateway && body != workerBody {
					t.Fatalf("body %q, want the worker's own", body)
				}
			})
		}
	})
}
