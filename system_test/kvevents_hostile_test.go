package system_test

import (
	"bytes"
	"context"
	byteorder "encoding/binary"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/internal/zmtptest"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

// The KV-events port (--kv-events-bind) against publishers that are no worker, or that lie:
// issue 26, item 1.

const (
	kvBlocks = 8                                   // blocks of each test prompt
	kvTokens = kvBlocks * indexer.DefaultBlockSize // its tokens
)

// startEventsReplica starts one replica of bin in front of fl with --kv-events-bind, and
// returns it with the bound address.
func startEventsReplica(t *testing.T, bin string, fl *fleet) (*replica, string) {
	t.Helper()
	bind := loopbacktest.Addr(t)
	var workers []string
	for i, u := range fl.urls {
		workers = append(workers, fl.ids[i]+"="+u)
	}
	c := startClusterOf(t, bin, 1, workers, "--kv-events-bind", "tcp://"+bind)
	return c.replicas[0], bind
}

// kvTopic is the topic a worker at url publishes under (serve's default pattern).
func kvTopic(url string) string { return "kv@" + url[len("http://"):] + "@" + sim.DefaultModel }

// kvPrompt is test prompt n's tokens.
func kvPrompt(n int) []uint32 {
	p := make([]uint32, kvTokens)
	for i := range p {
		p[i] = uint32(n*100000 + i + 1)
	}
	return p
}

// kvStored is a BlockStored of a prompt's blocks, with engine hashes from base.
func kvStored(tokens []uint32, base uint64) kvevents.Event {
	hs := make([]kvevents.EngineHash, len(tokens)/indexer.DefaultBlockSize)
	for i := range hs {
		hs[i] = kvevents.EngineHash(base + uint64(i))
	}
	return kvevents.Event{Kind: indexer.Stored, BlockHashes: hs, TokenIDs: tokens, BlockSize: indexer.DefaultBlockSize}
}

// kvSend sends one vLLM message [topic, seq, payload] over c.
func kvSend(t *testing.T, c *zmtptest.Conn, topic string, seq uint64, evs ...kvevents.Event) error {
	t.Helper()
	payload, err := kvevents.Encode(kvevents.Batch{Events: evs}, false)
	if err != nil {
		t.Fatal(err)
	}
	return c.Send([]byte(topic), byteorder.BigEndian.AppendUint64(nil, seq), payload)
}

// kvRoute asks the replica where tokens would go: the worker and its predicted overlap. It
// asks with one token more, so that every full block of tokens can be a hit (the engine
// computes a prompt's last token however much of it is cached, and the router predicts so).
func kvRoute(ctx context.Context, r *replica, tokens []uint32) (worker string, overlap int, err error) {
	prompt := append(tokens[:len(tokens):len(tokens)], 1)
	body, _ := json.Marshal(map[string]any{"model": sim.DefaultModel, "prompt": prompt, "max_tokens": 1})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.Client+"/v1/route", bytes.NewReader(body))
	if err != nil {
		return "", 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := httpClient.Do(req)
	if err != nil {
		return "", 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", 0, fmt.Errorf("/v1/route: %s", resp.Status)
	}
	var ans struct {
		Worker  string `json:"worker"`
		Overlap int    `json:"overlap_blocks"`
	}
	err = json.NewDecoder(resp.Body).Decode(&ans)
	return ans.Worker, ans.Overlap, err
}

// waitPredicted waits (bounded) until tokens route to worker with every block predicted.
func waitPredicted(t *testing.T, r *replica, worker string, tokens []uint32) {
	t.Helper()
	poll.Until(t, 30*time.Second, func() error {
		w, o, err := kvRoute(t.Context(), r, tokens)
		if err != nil {
			return err
		}
		if w != worker || o != kvBlocks {
			return fmt.Errorf("routed to %s with %d blocks predicted, want %s with %d", w, o, worker, kvBlocks)
		}
		return nil
	})
}

// refused is the replica's count of refused or failed publisher connections for reason.
func refused(ctx context.Context, r *replica, reason string) float64 {
	m, err := luaScrape(ctx, r.Admin)
	if err != nil {
		return -1
	}
	return luaSum(m, "kvrouter_kvevents_refused_connections_total", `reason="`+reason+`"`)
}

func TestForgedEventsFromAStrangerChangeNothing(t *testing.T) {
	fl := startFleetAt(t, "127.0.0.2", "127.0.0.3")
	r, bind := startEventsReplica(t, binary, fl)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	// w0's publisher, from w0's host, stores prompt 1.
	w0, err := zmtptest.Dial(ctx, "127.0.0.2", bind, "PUB")
	if err != nil {
		t.Fatal(err)
	}
	defer w0.Close()
	poll.Until(t, 30*time.Second, func() error { // the SUB may still be binding its socket
		if err := kvSend(t, w0, kvTopic(fl.urls[0]), 1, kvStored(kvPrompt(1), 1000)); err != nil {
			return err
		}
		_, o, err := kvRoute(ctx, r, kvPrompt(1))
		if err == nil && o != kvBlocks {
			err = fmt.Errorf("%d blocks predicted", o)
		}
		return err
	})
	waitPredicted(t, r, "w0", kvPrompt(1))
	if _, o, err := kvRoute(ctx, r, kvPrompt(2)); err != nil || o != 0 {
		t.Fatalf("prompt 2 predicted %d blocks before anyone stored it (%v)", o, err)
	}

	// A stranger on 127.0.0.9 forges, under w1's topic, the store of prompt 2 (which would
	// steer it to w1); under w0's, an AllBlocksCleared; and, as a "new publisher" whose
	// sequence starts again, a store that would purge w0. Each on its own connection, as a
	// publisher that reconnects would.
	// Last, w1's own host speaks for w0: a restart that would purge it.
	forged := []struct {
		from  string
		topic string
		seq   uint64
		ev    kvevents.Event
	}{
		{"127.0.0.9", kvTopic(fl.urls[1]), 1, kvStored(kvPrompt(2), 5000)},
		{"127.0.0.9", kvTopic(fl.urls[0]), 2, kvevents.Event{Kind: indexer.Cleared}},
		{"127.0.0.9", kvTopic(fl.urls[0]), 0, kvStored(kvPrompt(3), 9000)},
		{"127.0.0.3", kvTopic(fl.urls[0]), 0, kvevents.Event{Kind: indexer.Cleared}},
	}
	sent := 0
	for _, f := range forged {
		c, err := zmtptest.Dial(ctx, f.from, bind, "PUB")
		if err != nil {
			continue // refused before its handshake
		}
		if kvSend(t, c, f.topic, f.seq, f.ev) == nil {
			sent++
		}
		defer c.Close()
	}
	t.Logf("forged messages the port took in: %d of %d", sent, len(forged))
	// Either the connections were refused (counted) or the forgeries landed: wait for one.
	poll.Until(t, 30*time.Second, func() error {
		if refused(ctx, r, "not_a_worker") >= 3 && refused(ctx, r, "wrong_worker") >= 1 {
			return nil
		}
		if w, o, err := kvRoute(ctx, r, kvPrompt(2)); err == nil && o > 0 {
			t.Fatalf("a forged BlockStored steered prompt 2 to %s (%d blocks)", w, o)
		}
		if _, o, err := kvRoute(ctx, r, kvPrompt(1)); err == nil && o != kvBlocks {
			t.Fatalf("forged events took w0's prompt 1 (%d blocks left)", o)
		}
		return fmt.Errorf("refusals counted: %v not a worker, %v wrong worker", refused(ctx, r, "not_a_worker"), refused(ctx, r, "wrong_worker"))
	})
	waitPredicted(t, r, "w0", kvPrompt(1))
	if w, o, err := kvRoute(ctx, r, kvPrompt(2)); err != nil || o != 0 {
		t.Fatalf("prompt 2 routed to %s with %d blocks predicted after the forgery (%v)", w, o, err)
	}
	// The honest stream goes on where it was.
	if err := kvSend(t, w0, kvTopic(fl.urls[0]), 2, kvStored(kvPrompt(4), 2000)); err != nil {
		t.Fatal(err)
	}
	waitPredicted(t, r, "w0", kvPrompt(4))
	waitPredicted(t, r, "w0", kvPrompt(1))
}

// limitedBinary wraps the release build (no race detector, whose shadow memory makes an
// address-space limit impractical) so that it runs under an address-space limit (RLIMIT_AS) of
// limitBytes (prlimit, util-linux; it execs, so the wrapper's pid is the replica's).
func limitedBinary(t *testing.T, limitBytes int64) string {
	t.Helper()
	if _, err := exec.LookPath("prlimit"); err != nil {
		t.Fatal("prlimit (util-linux) not installed")
	}
	wrapper := filepath.Join(t.TempDir(), "kvrouter-ha-limited")
	script := fmt.Sprintf("#!/bin/sh\nexec prlimit --as=%d -- %s \"$@\"\n", limitBytes, releaseBuild(t, ""))
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return wrapper
}

func TestFrameFloodLeavesTheReplicaAliveAndBounded(t *testing.T) {
	const (
		addressSpace = 3 << 30 // the probe's limit: today's replica dies of it
		peakBound    = 1 << 30 // the bound asserted on peak RSS
		frameSize    = 60 << 20
		framesPerMsg = 12
		floodConns   = 8 // at once, from a worker's own host
		rounds       = 3 // connections each flooder opens in turn
		strangers    = 4 // flooders from an address that is no worker's
	)
	bin := limitedBinary(t, addressSpace)
	fl := startFleetAt(t, "127.0.0.1")
	r, bind := startEventsReplica(t, bin, fl)
	pid := strconv.Itoa(r.proc.PID())
	before, err := proc.ReadMemory(pid)
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	body := make([]byte, frameSize)
	topic := kvTopic(fl.urls[0])
	var wg sync.WaitGroup
	var mu sync.Mutex
	var sentFrames, handshakes int
	flood := func(local string) {
		defer wg.Done()
		for range rounds {
			if ctx.Err() != nil {
				return
			}
			c, err := zmtptest.Dial(ctx, local, bind, "PUB")
			if err != nil {
				continue
			}
			mu.Lock()
			handshakes++
			mu.Unlock()
			_ = c.SetWriteDeadline(time.Now().Add(30 * time.Second))
			// w0's own topic and a sequence, so that only the sizes can stop the message.
			head := append(zmtptest.Header(zmtptest.More, uint64(len(topic))), topic...)
			head = append(append(head, zmtptest.Header(zmtptest.More, 8)...), make([]byte, 8)...)
			if _, err := c.Write(head); err != nil {
				_ = c.Close()
				continue
			}
			for range framesPerMsg {
				if _, err := c.Write(zmtptest.Header(zmtptest.More, frameSize)); err != nil {
					break
				}
				if _, err := c.Write(body); err != nil {
					break
				}
				mu.Lock()
				sentFrames++
				mu.Unlock()
			}
			_ = c.Close()
		}
	}
	start := time.Now()
	for range floodConns {
		wg.Add(1)
		go flood("127.0.0.1")
	}
	for range strangers {
		wg.Add(1)
		go flood("127.0.0.9")
	}
	wg.Wait()
	t.Logf("flood: %d handshakes, %d frames of %d MiB written in %v", handshakes, sentFrames, frameSize>>20, time.Since(start).Round(time.Millisecond))

	if r.proc.Exited() {
		t.Fatalf("the replica died under the flood (exit %d)", r.proc.ExitCode())
	}
	after, err := proc.ReadMemory(pid)
	if err != nil {
		t.Fatalf("the replica is gone: %v", err)
	}
	t.Logf("replica RSS: %d MiB before, %d MiB after, peak %d MiB (bound %d MiB, address space %d MiB)",
		before.RSS>>20, after.RSS>>20, after.PeakRSS>>20, peakBound>>20, addressSpace>>20)
	if after.PeakRSS > peakBound {
		t.Fatalf("peak RSS %d MiB over the bound of %d MiB", after.PeakRSS>>20, peakBound>>20)
	}
	// It still serves: clients, and the worker's honest events.
	if err := proc.WaitReady(ctx, httpClient, "http://"+r.Client+"/readyz", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	w0, err := zmtptest.Dial(ctx, "127.0.0.1", bind, "PUB")
	if err != nil {
		t.Fatal(err)
	}
	defer w0.Close()
	if err := kvSend(t, w0, kvTopic(fl.urls[0]), 1, kvStored(kvPrompt(1), 1000)); err != nil {
		t.Fatal(err)
	}
	waitPredicted(t, r, "w0", kvPrompt(1))
	t.Logf("connections refused or failed: %v not a worker, %v too large, %v wrong worker",
		refused(ctx, r, "not_a_worker"), refused(ctx, r, "too_large"), refused(ctx, r, "wrong_worker"))
}
