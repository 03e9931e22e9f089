package openai

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// heldAffinity is the in-memory store with a slow Raft commit: every lease's Commit
// announces itself (started), then waits for release; fails[i], when set, is what the i-th
// Commit returns instead of binding.
type heldAffinity struct {
	*routing.MemoryAffinity
	started   chan struct{}
	startOnce sync.Once
	release   chan struct{}
	fails     []error
	commits   atomic.Int32 // Commits begun
	returned  atomic.Int32 // Commits that have returned
}

func (h *heldAffinity) Acquire(ctx context.Context, session string, explicit *indexer.Worker) (routing.Lease, error) {
	l, err := h.MemoryAffinity.Acquire(ctx, session, explicit)
	if err != nil {
		return nil, err
	}
	return &heldLease{Lease: l, h: h}, nil
}

type heldLease struct {
	routing.Lease
	h *heldAffinity
}

func (l *heldLease) Commit(ctx context.Context, w indexer.Worker, model string) (routing.Binding, error) {
	h := l.h
	n := int(h.commits.Add(1)) - 1
	h.startOnce.Do(func() { close(h.started) })
	select {
	case <-h.release:
	case <-ctx.Done():
		return routing.Binding{}, ctx.Err()
	}
	defer h.returned.Add(1)
	if n < len(h.fails) && h.fails[n] != nil {
		return routing.Binding{}, h.fails[n]
	}
	return l.Lease.Commit(ctx, w, model)
}

// TestFirstByteWaitsForTheBindingProposedAtDispatch checks the order a new session's first
// request keeps now that its binding is proposed as it is dispatched: the Raft commit runs
// while the worker prefills (the worker sees the commit begun before it answers), and no
// byte of an answer reaches the client before the commit has returned, whatever it
// returned. The commit is held until the client has its answer or for hold: a proxy that
// let a byte out early would be caught with the commit still held.
func TestFirstByteWaitsForTheBindingProposedAtDispatch(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		const hold = 300 * time.Millisecond
		draining := fmt.Errorf("bind: %w", routing.ErrWorkerDraining)
		cases := []struct {
			name   string
			stream bool
			// failFirst: the first worker answers 500 (after its binding was proposed);
			// refuseFirst: 400, the client's fault.
			failFirst, refuseFirst bool
			fails                  []error
			// wantFrom: which worker's answer the client gets (0 the first called, 1 the
			// second, -1 none: a 503 of the router's own).
			wantFrom int
		}{
			{name: "a streamed answer waits for a late commit", stream: true, wantFrom: 0},
			{name: "a whole answer waits for a late commit", wantFrom: 0},
			{name: "a failed commit lets no byte out", stream: true, fails: []error{errors.New("no leader")}, wantFrom: -1},
			{name: "a failed commit lets no whole answer out", fails: []error{errors.New("no leader")}, wantFrom: -1},
			{name: "a worker that began draining hands over to the next choice", stream: true, fails: []error{draining}, wantFrom: 1},
			{name: "a worker that fails after its binding was made is replaced by compare-and-set", stream: true, failFirst: true, wantFrom: 1},
			{name: "a worker that refuses the request leaves no binding", stream: true, refuseFirst: true, wantFrom: -2},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				aff := &heldAffinity{started: make(chan struct{}), release: make(chan struct{}), fails: tc.fails}
				var calls atomic.Int32
				var order []string // worker ids in the order they were called
				var mu sync.Mutex
				proposedEarly := make(chan bool, 1)
				handler := func(id string) http.HandlerFunc {
					return func(w http.ResponseWriter, r *http.Request) {
						mu.Lock()
						order = append(order, id)
						mu.Unlock()
						if calls.Add(1) == 1 {
							// The first worker answers only once the commit has begun, within a
							// bound: a router that proposes after the answer never begins it.
							select {
							case <-aff.started:
								proposedEarly <- true
							case <-time.After(2 * time.Second):
								proposedEarly <- false
							case <-r.Context().Done():
								return
							}
							if tc.failFirst {
								http.Error(w, "engine died", http.StatusInternalServerError)
								return
							}
							if tc.refuseFirst {
								http.Error(w, "max_tokens too large", http.StatusBadRequest)
								return
							}
						}
						if tc.stream {
							w.Header().Set("Content-Type", "text/event-stream")
							_, _ = io.WriteString(w, "data: {\"from\":\""+id+"\"}\n\n")
							_ = http.NewResponseController(w).Flush()
							// The stream stays open until the commit is let go, so that its first
							// chunk is a byte the router holds, not one it sends with the end.
							select {
							case <-aff.release:
							case <-r.Context().Done():
								return
							}
							_, _ = io.WriteString(w, "data: [DONE]\n\n")
							return
						}
						w.Header().Set("Content-Type", "application/json")
						_, _ = io.WriteString(w, `{"id":"x","object":"text_completion","choices":[{"text":"`+id+`"}]}`)
					}
				}
				w0, w1 := newFakeWorker(t, handler("w0")), newFakeWorker(t, handler("w1"))
				rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL), spec("w1", w1.URL)}, rigOptions{server: server,
					affinity: func(m *routing.MemoryAffinity) routing.AffinityStore { aff.MemoryAffinity = m; return aff },
				})
				var releaseOnce sync.Once
				release := func() { releaseOnce.Do(func() { close(aff.release) }) }
				t.Cleanup(release)

				body := `{"model":"m","prompt":"hello there","stream":` + strconv.FormatBool(tc.stream) + `}`
				req, _ := http.NewRequest(http.MethodPost, rg.front.URL+"/v1/completions", strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set(headerSession, "s-1")
				type answer struct {
					resp *http.Response
					err  error
					// returned: Commits that had returned when the answer's headers arrived.
					returned int32
				}
				got := make(chan answer, 1)
				go func() {
					resp, err := rg.front.Client().Do(req)
					got <- answer{resp: resp, err: err, returned: aff.returned.Load()}
				}()
				var a answer
				select {
				case a = <-got:
				case <-time.After(hold):
					release()
					a = <-got
				}
				release()
				if a.err != nil {
					t.Fatal(a.err)
				}
				defer a.resp.Body.Close()
				text, err := io.ReadAll(a.resp.Body)
				if err != nil {
					t.Fatal(err)
				}
				if !<-proposedEarly {
					t.Fatal("the first worker answered before the session's binding was proposed: it was not proposed at dispatch")
				}
				if a.returned == 0 {
					t.Fatalf("the client had its answer (%d, %q) while the session's commit was still held", a.resp.StatusCode, text)
				}
				mu.Lock()
				called := append([]string(nil), order...)
				mu.Unlock()
				b, bound, _ := aff.Peek(context.Background(), "s-1")
				if tc.wantFrom == -2 {
					// The worker's own refusal, and the binding proposed for it dropped again.
					if a.resp.StatusCode != http.StatusBadRequest || a.resp.Header.Get(HeaderRevision) != "" || bound || aff.Len() != 0 {
						t.Fatalf("a refused first request: %d (revision %q), session bound %+v (%v), %d sessions; want the 400 and no session",
							a.resp.StatusCode, a.resp.Header.Get(HeaderRevision), b, bound, aff.Len())
					}
					return
				}
				if tc.wantFrom < 0 {
					// 502, not 503: the worker was asked, so the balancer must not resend it
					// (a 503 is a refusal before any worker, HeaderRefused).
					if a.resp.StatusCode != http.StatusBadGateway || a.resp.Header.Get(HeaderRefused) != "" || strings.Contains(string(text), called[0]) {
						t.Fatalf("a failed commit answered %d %q; want the router's 502 and nothing of %s", a.resp.StatusCode, text, called[0])
					}
					if bound {
						t.Fatalf("a failed commit left a binding: %+v", b)
					}
					return
				}
				if len(called) <= tc.wantFrom {
					t.Fatalf("workers called %v; want the answer of call %d", called, tc.wantFrom)
				}
				from := called[tc.wantFrom]
				if a.resp.StatusCode != http.StatusOK || a.resp.Header.Get(HeaderWorker) != from || !strings.Contains(string(text), from) {
					t.Fatalf("answer %d from %q: %q; want %s's", a.resp.StatusCode, a.resp.Header.Get(HeaderWorker), text, from)
				}
				if strings.Contains(string(text), called[0]) && from != called[0] {
					t.Fatalf("a byte of %s's answer reached the client: %q", called[0], text)
				}
				// The answer's worker is the session's, at the revision the client was told.
				if !bound || b.Worker.ID != from || a.resp.Header.Get(HeaderRevision) != strconv.FormatUint(b.Revision, 10) {
					t.Fatalf("session bound %+v (%v); the client was told %s at revision %s", b, bound, from, a.resp.Header.Get(HeaderRevision))
				}
				poll.Holds(t, 10*time.Second, "load to be released", rg.idle)
			})
		}
	})
}
