package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

func TestSimWorkerDPSizeGivesEachRankItsOwnCache(t *testing.T) {
	start := func(t *testing.T, args ...string) string {
		t.Helper()
		addr := loopbacktest.Addr(t)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- run(ctx, append([]string{"sim-worker", "--listen", addr, "--speedup", "200", "--log-level", "error"}, args...),
				io.Discard, io.Discard)
		}()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("sim-worker: %v", err)
			}
		})
		poll.Until(t, 15*time.Second, func() error {
			resp, err := http.Get("http://" + addr + "/health")
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("/health: %s", resp.Status)
			}
			return nil
		})
		return "http://" + addr
	}
	// A prompt of four whole blocks and one token more, as token ids.
	prompt := make([]string, 4*16+1)
	for i := range prompt {
		prompt[i] = strconv.Itoa(int(sim.FirstPieceToken) + 7*i)
	}
	body := `{"model":"` + sim.DefaultModel + `","prompt":[` + strings.Join(prompt, ",") + `],"max_tokens":2}`
	type answer struct {
		status int
		rank   string
		cached int
	}
	send := func(t *testing.T, url, rank string) answer {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, url+"/v1/completions", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		if rank != "" {
			req.Header.Set(sim.DPRankHeader, rank)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var usage struct {
			Usage struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&usage)
		return answer{status: resp.StatusCode, rank: resp.Header.Get(sim.DPRankHeader), cached: usage.Usage.Details.Cached}
	}
	ok := func(t *testing.T, a answer) answer {
		t.Helper()
		if a.status != http.StatusOK {
			t.Fatalf("status %d, want 200", a.status)
		}
		return a
	}

	t.Run("two ranks", func(t *testing.T) {
		url := start(t, "--dp-size", "2")
		for i, want := range []int{0, 4 * 16} {
			a := ok(t, send(t, url, "1"))
			if a.rank != "1" {
				t.Fatalf("request %d served by rank %q, want 1", i, a.rank)
			}
			if a.cached != want {
				t.Fatalf("request %d to rank 1: %d cached tokens, want %d", i, a.cached, want)
			}
		}
		if got := ok(t, send(t, url, "0")).cached; got != 0 {
			t.Fatalf("rank 0 reports %d cached tokens for a prompt only rank 1 saw", got)
		}
		if a := send(t, url, "2"); a.status != http.StatusBadRequest {
			t.Fatalf("rank 2 of 2: status %d, want 400", a.status)
		}
	})
	t.Run("default is one worker that ignores the header", func(t *testing.T) {
		url := start(t)
		if a := ok(t, send(t, url, "5")); a.rank != "" {
			t.Fatalf("a worker without ranks answered with rank %q", a.rank)
		}
	})
}

func TestSimWorkerRejectsADPSizeOutOfRange(t *testing.T) {
	for _, n := range []string{"0", "-1", strconv.Itoa(kvevents.MaxDPRank + 2)} {
		// The context is over: a command that did not check would serve nothing for long.
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		err := run(ctx, []string{"sim-worker", "--listen", loopbacktest.Addr(t), "--dp-size", n}, io.Discard, io.Discard)
		if err == nil || !strings.Contains(err.Error(), "--dp-size") {
			t.Errorf("--dp-size %s: got %v, want an error naming --dp-size", n, err)
		}
	}
}
