package system_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// migrationStream is what one client of TestStreamsOutliveAWorkerKilledMidStream read.
type migrationStream struct {
	ended  atomic.Bool // the client is done reading
	worker string      // X-Kvrouter-Worker: where the stream started
	ids    map[string]bool
	text   strings.Builder
	done   bool   // [DONE] came
	errEv  string // the error event's code, "" for none
	err    error
}

// TestStreamsOutliveAWorkerKilledMidStream: 20 concurrent streams (chat and completions)
// through a replica in front of three simulated worker processes, and the worker with the
// most streams still running SIGKILLed once every stream has its first tokens. With
// --migration-limit 1 every stream completes, each with one id, and reads exactly the text
// an uninterrupted run generates (the simulator's output is a function of the prompt and
// the tokens before, so a duplicated or missing token shows); the moves are counted. Answers
// not streamed, in flight beside them, are retried whole and read exactly too. With
// --migration-limit 0 each stream cut on the killed worker ends with an error event in the
// API's shape (counted), and the others complete as before.
func TestStreamsOutliveAWorkerKilledMidStream(t *testing.T) {
	const streams, maxTokens = 20, 200
	// The uninterrupted answers, from an in-process simulator with the same tokenizer and
	// generator as the worker processes, without their pace.
	ref, err := sim.New(sim.Config{ID: "ref", Speedup: 1e6})
	if err != nil {
		t.Fatal(err)
	}
	refSrv := httptest.NewServer(ref.Handler())
	t.Cleanup(refSrv.Close)
	type request struct{ path, body string }
	reqs := make([]request, streams)
	want := make([]string, streams)
	for i := range reqs {
		if i%2 == 0 {
			reqs[i] = request{"/v1/chat/completions", fmt.Sprintf(`{"model":%q,"max_tokens":%d,"messages":[{"role":"user","content":"stream %d: tell me a long story"}]}`, sim.DefaultModel, maxTokens, i)}
		} else {
			reqs[i] = request{"/v1/completions", fmt.Sprintf(`{"model":%q,"max_tokens":%d,"prompt":"stream %d: once upon a time"}`, sim.DefaultModel, maxTokens, i)}
		}
		want[i] = wholeText(t, refSrv.URL+reqs[i].path, reqs[i].body)
	}

	tests := []struct {
		name  string
		limit string
	}{
		{"migration on", "1"},
		{"migration off", "0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
			defer cancel()
			// 200 tokens at 50 ms: a stream lasts 10 s, far longer than starting them all.
			workers, workerURL := map[string]*proc.Process{}, map[string]string{}
			var specs []string
			for i := range 3 {
				id, addr := fmt.Sprintf("w%d", i), loopbacktest.Addr(t)
				p := newProcess(t, proc.Spec{Name: id, Argv: []string{binary, "sim-worker", "--listen", addr, "--id", id,
					"--decode-per-token", "50ms", "--log-level", "warn"}})
				if err := p.Start(); err != nil {
					t.Fatal(err)
				}
				if err := proc.WaitReady(ctx, nil, "http://"+addr+"/health", 30*time.Second); err != nil {
					t.Fatal(err)
				}
				workers[id], workerURL[id] = p, "http://"+addr
				specs = append(specs, id+"=http://"+addr)
			}
			r := startClusterOf(t, binary, 1, specs, "--migration-limit", tt.limit).replicas[0]

			var wg sync.WaitGroup
			got := make([]*migrationStream, streams)
			started := make(chan int, streams)
			for i := range reqs {
				got[i] = &migrationStream{ids: map[string]bool{}}
				wg.Go(func() {
					body := strings.Replace(reqs[i].body, "{", `{"stream":true,`, 1)
					readStream(ctx, "http://"+r.Client+reqs[i].path, body, sessionOf(tt.name, i), got[i], func() { started <- i })
				})
			}
			// Every stream has its first tokens (bounded), then the worker with the most
			// streams still running dies.
			for range streams {
				select {
				case <-started:
				case <-ctx.Done():
					t.Fatalf("streams did not all start: %v", ctx.Err())
				}
			}
			running := map[string]int{}
			for _, s := range got {
				if !s.ended.Load() {
					running[s.worker]++
				}
			}
			victim := ""
			for w, n := range running {
				if victim == "" || n > running[victim] {
					victim = w
				}
			}
			cut := make([]bool, streams)
			for i, s := range got {
				cut[i] = s.worker == victim && !s.ended.Load()
			}
			// Beside them, two answers not streamed, of sessions bound to the victim, in
			// flight there at the kill: a worker that dies before its answer is whole has sent
			// the client nothing, so the request is retried from scratch elsewhere (with
			// migration off too).
			var alongside []int
			for i := range got {
				if cut[i] && len(alongside) < 2 {
					alongside = append(alongside, i)
				}
			}
			whole := make([]string, len(alongside))
			for k, i := range alongside {
				wg.Go(func() {
					whole[k] = wholeTextVia("http://"+r.Client+reqs[i].path, reqs[i].body, sessionOf(tt.name, i))
				})
			}
			poll.Until(t, 30*time.Second, func() error {
				var st struct {
					Stats sim.Stats `json:"stats"`
				}
				status, body, err := getJSON(ctx, workerURL[victim]+"/sim/stats")
				if err == nil && status != http.StatusOK {
					err = fmt.Errorf("/sim/stats: %d %s", status, body)
				}
				if err == nil {
					err = json.Unmarshal([]byte(body), &st)
				}
				if err != nil {
					return err
				}
				if n := st.Stats.Running + st.Stats.Waiting; n < running[victim]+len(alongside) {
					return fmt.Errorf("%s runs %d requests, want %d", victim, n, running[victim]+len(alongside))
				}
				return nil
			})
			workers[victim].Kill()
			t.Logf("streams running per worker %v; SIGKILLed %s", running, victim)
			if running[victim] == 0 {
				t.Fatal("no stream was running at the kill")
			}
			wg.Wait()

			// A stream of the killed worker that had all its tokens already ends whole either
			// way; every other one moves (migration on) or ends with an error event (off).
			broken := 0
			for i, s := range got {
				if s.err != nil {
					t.Errorf("stream %d (on %s): %v", i, s.worker, s.err)
					continue
				}
				if len(s.ids) != 1 {
					t.Errorf("stream %d (on %s): ids %v, want one", i, s.worker, s.ids)
				}
				if tt.limit == "0" && cut[i] && !s.done {
					broken++
					if s.errEv != "upstream_broken" {
						t.Errorf("stream %d of the killed worker ended with error event %q, want upstream_broken", i, s.errEv)
					}
					if !strings.HasPrefix(want[i], s.text.String()) {
						t.Errorf("stream %d of the killed worker read %q, not a prefix of the answer %q", i, s.text.String(), want[i])
					}
					continue
				}
				if s.errEv != "" || !s.done || s.text.String() != want[i] {
					t.Errorf("stream %d (on %s): error event %q, done %v, read\n%q\nwant\n%q", i, s.worker, s.errEv, s.done, s.text.String(), want[i])
				}
			}
			for k, i := range alongside {
				if whole[k] != want[i] {
					t.Errorf("answer %d, not streamed, read %q, want %q", i, whole[k], want[i])
				}
			}
			outcome := "moved"
			if tt.limit == "0" {
				outcome = "disabled"
			}
			n, err := metricValue(ctx, r, fmt.Sprintf(`kvrouter_migrations_total{outcome=%q}`, outcome))
			if err != nil {
				t.Fatal(err)
			}
			switch {
			case tt.limit == "0" && (broken == 0 || int(n) != broken):
				t.Errorf("%d streams ended with an error event and migrations{outcome=%q} = %v; want them equal, and not 0", broken, outcome, n)
			case tt.limit != "0" && (n < 1 || int(n) > running[victim]):
				t.Errorf("migrations{outcome=%q} = %v, want from 1 to the %d streams running on the killed worker", outcome, n, running[victim])
			}
			retries, err := metricValue(ctx, r, "kvrouter_retries_total")
			if err != nil || int(retries) < len(alongside) {
				t.Errorf("kvrouter_retries_total = %v (%v), want the %d answers not streamed retried at least", retries, err, len(alongside))
			}
			t.Logf("%d of %d streams were running on the killed worker; migrations{outcome=%q} = %v; error events %d; retries before the first byte = %v",
				running[victim], streams, outcome, n, broken, retries)
		})
	}
}

// sessionOf is the session of stream i of the subtest named name.
func sessionOf(name string, i int) string {
	return fmt.Sprintf("%s-%d", strings.ReplaceAll(name, " ", "-"), i)
}

// wholeText is the text of the non-streamed answer to body at url.
func wholeText(t *testing.T, url, body string) string {
	t.Helper()
	text := wholeTextVia(url, body, "")
	if strings.HasPrefix(text, "error: ") {
		t.Fatalf("reference answer: %s", text)
	}
	return text
}

// wholeTextVia is wholeText in a session ("": none), with a failure as the text, "error: ...".
func wholeTextVia(url, body, session string) string {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return "error: " + err.Error()
	}
	req.Header.Set("Content-Type", "application/json")
	if session != "" {
		req.Header.Set("X-Session-ID", session)
	}
	resp, err := (&http.Client{Timeout: 2 * time.Minute}).Do(req)
	if err != nil {
		return "error: " + err.Error()
	}
	defer resp.Body.Close()
	var a struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&a); err != nil || len(a.Choices) != 1 {
		return fmt.Sprintf("error: %s, %v", resp.Status, err)
	}
	return a.Choices[0].Text + a.Choices[0].Message.Content
}

// readStream reads one streamed chat or completion into s, calling first once: at its first
// content, or as it ends without any.
func readStream(ctx context.Context, url, body, session string, s *migrationStream, first func()) {
	called := false
	defer func() {
		s.ended.Store(true)
		if !called {
			first()
		}
	}()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		s.err = err
		return
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.err = err
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		s.err = fmt.Errorf("%s: %s", resp.Status, b)
		return
	}
	s.worker = resp.Header.Get("X-Kvrouter-Worker")
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			s.done = true
			continue
		}
		var ev struct {
			ID      string `json:"id"`
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Error *struct {
				Code string `json:"code"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			s.err = fmt.Errorf("event %q: %w", data, err)
			return
		}
		if ev.Error != nil {
			s.errEv = ev.Error.Code
			continue
		}
		s.ids[ev.ID] = true
		for _, c := range ev.Choices {
			if !called && c.Text+c.Delta.Content != "" {
				called = true
				first()
			}
			s.text.WriteString(c.Text + c.Delta.Content)
		}
	}
	if err := sc.Err(); err != nil {
		s.err = err
	}
}
