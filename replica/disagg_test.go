package replica

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// pdFleet is two prefill and two decode simulated workers.
func pdFleet(t *testing.T) testFleet {
	t.Helper()
	return startRoleWorkers(t, []workerRole{
		{"p0", routing.RolePrefill}, {"p1", routing.RolePrefill},
		{"d0", routing.RoleDecode}, {"d1", routing.RoleDecode},
	}, simConfig(0))
}

// TestDisaggregatedTurnsOverSimulatedWorkers runs a session over simulated prefill and
// decode workers speaking vLLM's protocol, through a replica in conditional mode: the first
// turn (2,048 uncached tokens) is prefilled on a prefill worker, its KV pulled by the decode
// worker, which then holds the prompt; the session binds that decode worker; the next turn,
// mostly cached there, is served aggregated on it.
func TestDisaggregatedTurnsOverSimulatedWorkers(t *testing.T) {
	fleet := pdFleet(t)
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)
	first := promptTokens(1, 2048)
	h := hdr("X-Session-ID", "pd-chat")
	a := c.post("/v1/completions", completionBody(first, 8, true), h).mustOK(t)
	decode, prefill := a.worker(), a.header.Get(openai.HeaderPrefillWorker)
	if !strings.HasPrefix(decode, "d") || !strings.HasPrefix(prefill, "p") {
		t.Fatalf("first turn: decode worker %q, prefill worker %q", decode, prefill)
	}
	pw, dw := fleet.byID(t, prefill), fleet.byID(t, decode)
	if st := dw.Stats(); st.KVTransfers != 1 || st.KVTransferBlocks != 2048/16 {
		t.Fatalf("decode worker %s: %d transfers of %d blocks, want 1 of 128", decode, st.KVTransfers, st.KVTransferBlocks)
	}
	if st := pw.Stats(); st.PromptTokens != 2048 || st.KVTransfersHeld != 0 {
		t.Fatalf("prefill worker %s: prefilled %d tokens, %d transfers still held (want 2048 and 0: pulled)", prefill, st.PromptTokens, st.KVTransfersHeld)
	}
	if held := dw.Cache().Blocks; held < 2048/16 {
		t.Fatalf("decode worker holds %d blocks after the transfer, want the prompt's 128", held)
	}
	waitRouterIdle(t, rep)

	// The next turn extends the first: the decode worker holds all but its new tokens.
	next := concat(first, promptTokens(2, 200))
	b := c.post("/v1/completions", completionBody(next, 8, false), h).mustOK(t)
	if b.worker() != decode || b.header.Get(openai.HeaderPrefillWorker) != "" {
		t.Fatalf("second turn on %q (prefill %q), want its bound decode worker %s, aggregated", b.worker(), b.header.Get(openai.HeaderPrefillWorker), decode)
	}
	if got := b.cachedTokens(t); got < 2048 {
		t.Fatalf("second turn found %d tokens cached on the decode worker, want the first turn's 2048", got)
	}
	waitRouterIdle(t, rep)
}

// TestPrefillWorkersDownServesAggregated: with every prefill worker gone, a disaggregated
// request is served aggregated on its decode worker, and no load is left behind.
func TestPrefillWorkersDownServesAggregated(t *testing.T) {
	fleet := pdFleet(t)
	rep := startTestReplica(t, fleet, func(cfg *Config) { cfg.Router.Disagg.Mode = routing.DisaggAlways })
	fleet.byID(t, "p0").stop()
	fleet.byID(t, "p1").stop()
	c := newRouterClient(t, rep)
	a := c.post("/v1/completions", completionBody(promptTokens(3, 512), 4, true), nil).mustOK(t)
	if w := a.worker(); !strings.HasPrefix(w, "d") || a.header.Get(openai.HeaderPrefillWorker) != "" {
		t.Fatalf("served on %q with prefill %q, want a decode worker, aggregated", w, a.header.Get(openai.HeaderPrefillWorker))
	}
	if st := fleet.byID(t, a.worker()).Stats(); st.KVTransfers != 0 || st.PromptTokens != 512 {
		t.Fatalf("decode worker: %d transfers, %d prompt tokens prefilled; want 0 and 512", st.KVTransfers, st.PromptTokens)
	}
	waitRouterIdle(t, rep)
	if n := c.scrapeMetrics()[`kvrouter_disagg_requests_total{outcome="prefill_failed"}`]; n != 1 {
		t.Fatalf("prefill_failed outcomes: %v, want 1", n)
	}
}

// TestDecodeWorkerFailingGetsAFreshPrefill: a decode worker that fails before its first byte
// is replaced, and the request is prefilled again for its new decode worker (the KV that
// was to go to the failed one is not reused).
func TestDecodeWorkerFailingGetsAFreshPrefill(t *testing.T) {
	fleet := pdFleet(t)
	rep := startTestReplica(t, fleet, func(cfg *Config) { cfg.Router.Disagg.Mode = routing.DisaggAlways })
	c := newRouterClient(t, rep)
	// The first request shows which decode worker the router picks; that one then fails.
	prompt := promptTokens(4, 512)
	a := c.post("/v1/completions", completionBody(prompt, 4, false), nil).mustOK(t)
	bad := fleet.byID(t, a.worker())
	if err := bad.SetFaults(sim.Faults{ErrorRate: 1}); err != nil {
		t.Fatal(err)
	}
	waitRouterIdle(t, rep)
	legs := func() uint64 { return fleet.byID(t, "p0").Stats().Served + fleet.byID(t, "p1").Stats().Served }
	before := legs()
	b := c.post("/v1/completions", completionBody(prompt, 4, false), nil).mustOK(t)
	if b.worker() == bad.spec.ID || !strings.HasPrefix(b.worker(), "d") {
		t.Fatalf("served on %s after %s failed", b.worker(), bad.spec.ID)
	}
	if got := legs() - before; got != 2 {
		t.Fatalf("%d prefill legs for a request whose first decode worker failed, want 2 (a fresh one for the second)", got)
	}
	if st := fleet.byID(t, b.worker()).Stats(); st.KVTransfers == 0 {
		t.Fatalf("the second decode worker pulled nothing: %+v", st)
	}
	waitRouterIdle(t, rep)
}

// TestClientLeavingDuringThePrefillLegFreesItsLoad: a client that goes away while its
// prefill leg computes leaves no load in the router, and nothing reaches a decode worker.
func TestClientLeavingDuringThePrefillLegFreesItsLoad(t *testing.T) {
	slow := simConfig(0)
	slow.PrefillPerToken = 2 * time.Millisecond * itSpeedup // 2 ms of wall time per token
	fleet := startRoleWorkers(t, []workerRole{{"p0", routing.RolePrefill}, {"d0", routing.RoleDecode}}, slow)
	rep := startTestReplica(t, fleet, func(cfg *Config) { cfg.Router.Disagg.Mode = routing.DisaggAlways })
	c := newRouterClient(t, rep)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := c.do(ctx, http.MethodPost, "/v1/completions", bytes.NewReader(completionBody(promptTokens(5, 4096), 4, true)), nil)
		done <- err
	}()
	eventually(t, "the prefill leg to be computing", func() (bool, string) {
		st := fleet.byID(t, "p0").Stats()
		return st.Running > 0 && workerLoad(rep, "p0").PrefillTokens > 0, fmt.Sprintf("p0 %+v, load %+v", st, workerLoad(rep, "p0"))
	})
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("client: %v, want canceled", err)
	}
	waitRouterIdle(t, rep)
	eventually(t, "the prefill worker to drop the leg", func() (bool, string) {
		st := fleet.byID(t, "p0").Stats()
		return st.Running == 0 && st.Aborted == 1, fmt.Sprintf("%+v", st)
	})
	if st := fleet.byID(t, "d0").Stats(); st.Served != 0 || st.Running+st.Waiting != 0 || st.KVTransfers != 0 {
		t.Fatalf("the decode worker saw the cancelled request: %+v", st)
	}
}
