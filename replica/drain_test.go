package replica

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// gatedWorker is an OpenAI-shaped worker whose streams send one chunk and then wait for the
// test to release them, so a test decides exactly when an in-flight stream ends. Answers
// that are not streamed come back at once.
type gatedWorker struct {
	srv     *httptest.Server
	release chan struct{}
	once    sync.Once
}

func startGatedWorker(t *testing.T) *gatedWorker {
	t.Helper()
	g := &gatedWorker{release: make(chan struct{})}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, sim.DefaultModel)
	})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Stream bool `json:"stream"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if !body.Stream {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"c1","object":"text_completion","model":%q,"choices":[{"index":0,"text":"done","finish_reason":"stop"}],"usage":{"prompt_tokens":32,"completion_tokens":1,"total_tokens":33}}`, sim.DefaultModel)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		chunk := func(text string) {
			fmt.Fprintf(w, "data: {\"id\":\"s1\",\"object\":\"text_completion\",\"model\":%q,\"choices\":[{\"index\":0,\"text\":%q}]}\n\n", sim.DefaultModel, text)
			_ = http.NewResponseController(w).Flush()
		}
		chunk("first")
		select {
		case <-g.release:
		case <-r.Context().Done():
			return
		}
		chunk("last")
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	g.srv = httptest.NewServer(mux)
	// Cleanups run last-in first-out: the replica, started after this worker, closes first.
	t.Cleanup(func() {
		g.finish()
		g.srv.Close()
	})
	return g
}

// finish lets every stream, held or to come, run to its end.
func (g *gatedWorker) finish() { g.once.Do(func() { close(g.release) }) }

func (g *gatedWorker) spec() routing.WorkerSpec {
	return routing.WorkerSpec{ID: "gate", URL: g.srv.URL}
}

// startGatedReplica starts a lone replica in front of gate; the tests check what Close
// returns themselves, so the cleanup only makes sure it ran, without the delay.
func startGatedReplica(t *testing.T, gate *gatedWorker, server string, delay, timeout time.Duration) *Replica {
	t.Helper()
	cfg := Config{
		Listen: "127.0.0.1:0", AdminListen: "127.0.0.1:0", ID: "drain-replica",
		Workers:   []routing.WorkerSpec{gate.spec()},
		Router:    routing.Config{Policy: "kv"},
		ApproxTTL: 2 * time.Minute, ApproxMaxBlocks: 1 << 20,
		SessionTTL: 10 * time.Minute, MaxSessions: 10_000,
		Health:        openai.HealthConfig{Interval: time.Hour},
		Cluster:       testClusterConfig(t),
		Logger:        slog.New(slog.DiscardHandler),
		ShutdownDelay: delay, ShutdownTimeout: timeout,
		ClientPort: ClientPortConfig{Server: server},
	}
	rep, err := Start(t.Context(), cfg)
	if err != nil {
		t.Fatalf("startReplica: %v", err)
	}
	t.Cleanup(func() {
		// A test that failed before ending the delay must not leave its cleanup waiting it out.
		now := make(chan struct{})
		close(now)
		_ = rep.Shutdown(now)
	})
	return rep
}

// freshGet is a GET on a new connection, so it shows what a client connecting now gets.
func freshGet(ctx context.Context, url string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	req.Close = true
	resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// waitClosed waits (bounded) for a shutdown to return and gives its result.
func waitClosed(t *testing.T, closed <-chan error) error {
	t.Helper()
	select {
	case err := <-closed:
		return err
	case <-time.After(pollTimeout):
		t.Fatalf("shutdown did not return within %s", pollTimeout)
		return nil
	}
}

func TestDrainFailsReadyzFirstThenFinishesTheInFlightStream(t *testing.T) {
	for _, server := range []string{ServerNet, ServerFast} {
		t.Run(server, func(t *testing.T) { drainFailsReadyzFirstThenFinishesTheInFlightStream(t, server) })
	}
}

func drainFailsReadyzFirstThenFinishesTheInFlightStream(t *testing.T, server string) {
	gate := startGatedWorker(t)
	// The delay is far longer than the test: the test ends it through skip once it has seen
	// what must happen during it, so nothing depends on how fast the machine is.
	rep := startGatedReplica(t, gate, server, time.Hour, 4*pollTimeout)
	c := newRouterClient(t, rep)
	waitReady(t, c, http.StatusOK)

	stream := c.openStream(promptTokens(1, 64), 8, nil)
	stream.firstChunk(t)

	skip := make(chan struct{})
	endDelay := sync.OnceFunc(func() { close(skip) })
	t.Cleanup(endDelay) // runs before the replica's cleanup, which would wait on this shutdown
	closed := make(chan error, 1)
	go func() { closed <- rep.Shutdown(skip) }()

	// 1. /readyz fails at once, saying why, while the port still takes new connections.
	eventually(t, "/readyz 503 shutting down", func() (bool, string) {
		code, body, err := freshGet(t.Context(), c.base+"/readyz")
		if err != nil {
			return false, err.Error()
		}
		return code == http.StatusServiceUnavailable && strings.Contains(body, "shutting down"), fmt.Sprintf("%d %s", code, body)
	})
	// 2. ... and a new request is still served, told not to keep its connection.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, c.base+"/v1/completions",
		bytes.NewReader(completionBody(promptTokens(2, 64), 1, false)))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		t.Fatalf("request during the delay: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get(openai.HeaderWorker) != "gate" {
		t.Fatalf("request during the delay: %d from %q, want 200 from gate: %s", resp.StatusCode, resp.Header.Get(openai.HeaderWorker), body)
	}
	if !resp.Close {
		t.Fatal("answer during the delay keeps its connection: the client's next request on it would meet the port closing")
	}
	select {
	case err := <-closed:
		t.Fatalf("shutdown returned during its delay: %v", err)
	default:
	}

	// 3. The delay ends: the port closes to new connections while the stream is still open.
	endDelay()
	eventually(t, "client port closed", func() (bool, string) {
		conn, err := net.DialTimeout("tcp", rep.Addr(), time.Second)
		if err != nil {
			return true, ""
		}
		conn.Close()
		return false, "still accepting"
	})
	select {
	case err := <-closed:
		t.Fatalf("shutdown returned with a stream in flight: %v", err)
	default:
	}

	// 4. The stream finishes whole, and only then does the shutdown return, cleanly.
	gate.finish()
	var events []string
	for {
		data, err := stream.next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("stream cut after %v: %v", events, err)
		}
		events = append(events, data)
	}
	if len(events) != 2 || chunkText(t, events[0]) != "last" || events[1] != "[DONE]" {
		t.Fatalf("rest of the stream = %q, want the last chunk and [DONE]", events)
	}
	if err := waitClosed(t, closed); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if err := rep.Close(); err != nil {
		t.Fatalf("second Close: %v, want the first's nil", err)
	}
}

func TestShutdownTimeoutCutsAStuckStream(t *testing.T) {
	for _, server := range []string{ServerNet, ServerFast} {
		t.Run(server, func(t *testing.T) { shutdownTimeoutCutsAStuckStream(t, server) })
	}
}

func shutdownTimeoutCutsAStuckStream(t *testing.T, server string) {
	gate := startGatedWorker(t)
	rep := startGatedReplica(t, gate, server, 0, 200*time.Millisecond)
	c := newRouterClient(t, rep)
	waitReady(t, c, http.StatusOK)
	stream := c.openStream(promptTokens(3, 64), 8, nil)
	stream.firstChunk(t)

	closed := make(chan error, 1)
	go func() { closed <- rep.Close() }()
	err := waitClosed(t, closed)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "--shutdown-timeout") {
		t.Fatalf("Close = %v, want the shutdown timeout named", err)
	}
	// The stream was never released: its client sees the body end without [DONE].
	for {
		data, err := stream.next()
		if data == "[DONE]" {
			t.Fatal("the held stream finished; it should have been cut")
		}
		if err != nil {
			break
		}
	}
}

func TestShutdownOfTheLeaderHandsOverLeadershipBeforeThePortCloses(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(0))
	logs := make([]*logBuffer, 3)
	gc := startGossipCluster(t, fleet, 3, func(i int, cfg *Config) {
		logs[i] = &logBuffer{}
		cfg.Logger = logs[i].logger()
	})
	leader := leaderIndex(t, gc, 3)
	gc.stop(leader)

	// The steps ran in order, and the transfer named another replica.
	log := logs[leader].String()
	steps := []string{"/readyz now fails", "shutdown: leadership transferred", "client port closed", "in-flight requests finished", "shutdown: stopped"}
	at := 0
	for _, s := range steps {
		i := strings.Index(log[at:], s)
		if i < 0 {
			t.Fatalf("step %q missing or out of order in the leader's log:\n%s", s, log)
		}
		at += i + len(s)
	}
	eventually(t, "a new leader among the others", func() (bool, string) {
		for i := range 3 {
			if i != leader && gc.rep(i).node.IsLeader() {
				return true, ""
			}
		}
		return false, "no other replica leads"
	})
}

func TestHandOverLogSaysWhenNoLeaderIsKnown(t *testing.T) {
	cases := []struct {
		leader      string
		want, never string
	}{
		{leader: "r2", want: `msg="shutdown: leadership transferred" leader=r2`},
		{leader: "", want: "no leader known yet", never: `leader=""`},
	}
	for _, tc := range cases {
		t.Run(tc.leader, func(t *testing.T) {
			var b bytes.Buffer
			logHandedOver(slog.New(slog.NewTextHandler(&b, nil)), tc.leader)
			if !strings.Contains(b.String(), tc.want) || tc.never != "" && strings.Contains(b.String(), tc.never) {
				t.Fatalf("logged %q, want %q and never %q", b.String(), tc.want, tc.never)
			}
		})
	}
}

func TestUnwindGivesUpOnAPartThatDoesNotCloseAndClosesTheRest(t *testing.T) {
	cases := []struct {
		name  string
		stuck string // the part whose close never returns ("": none)
	}{
		{name: "every part closes"},
		{name: "the raft node hangs", stuck: "raft node"},
		{name: "the first part closed hangs", stuck: "client port"},
	}
	parts := []string{"peer clients", "raft node", "background loops", "client port"} // opened in this order
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			r := &Replica{log: slog.New(slog.NewTextHandler(&b, nil))}
			hang := make(chan struct{})
			t.Cleanup(func() { close(hang) })
			var mu sync.Mutex
			var closed []string
			for _, p := range parts {
				r.onClose(p, func() {
					if p == tc.stuck {
						<-hang
						return
					}
					mu.Lock()
					closed = append(closed, p)
					mu.Unlock()
				})
			}
			done := make(chan struct{})
			var err error
			go func() {
				defer close(done)
				err = r.unwind(200 * time.Millisecond)
			}()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("unwind did not return 30s after its 200ms bound")
			}
			mu.Lock()
			defer mu.Unlock()
			if want := len(parts) - min(len(tc.stuck), 1); len(closed) != want {
				t.Fatalf("closed %v, want every part but %q", closed, tc.stuck)
			}
			log := b.String()
			if tc.stuck == "" {
				if err != nil || strings.Contains(log, "gave up") {
					t.Fatalf("gave up on a part that closed (%v):\n%s", err, log)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.stuck) {
				t.Fatalf("unwind returned %v, want an error naming %q", err, tc.stuck)
			}
			if !strings.Contains(log, fmt.Sprintf("part=%q", tc.stuck)) || !strings.Contains(log, "goroutine ") {
				t.Fatalf("the log does not name %q with the goroutines' stacks:\n%.2000s", tc.stuck, log)
			}
		})
	}
}
