package replica

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

// rankedAddr returns a loopback host:port whose port + n - 1 on the same host was free as
// well a moment ago, for a worker of n ranks whose rank r binds the port + r, as vLLM's do.
func rankedAddr(t *testing.T, n int) string {
	t.Helper()
	for range 20 {
		a := loopbacktest.Addr(t)
		host, port, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatal(err)
		}
		p, err := strconv.Atoi(port)
		if err != nil {
			t.Fatal(err)
		}
		free := p+n-1 <= 65535
		for r := 1; free && r < n; r++ {
			ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(p+r)))
			if free = err == nil; free {
				ln.Close()
			}
		}
		if free {
			return a
		}
	}
	t.Fatalf("no loopback address with %d free ports in a row", n)
	return ""
}

// dpEventWorker is one simulated worker of several data-parallel ranks behind one HTTP
// API, each rank publishing its KV events (with replay) on the base ports + its rank.
type dpEventWorker struct {
	t        *testing.T
	spec     routing.WorkerSpec
	httpAddr string
	dp       *sim.DataParallel
}

func startDPEventWorker(t *testing.T, id string, size int) *dpEventWorker {
	return startDPEventWorkerTo(t, id, size, "")
}

// startDPEventWorkerTo is startDPEventWorker whose ranks, when routerBind is not empty,
// connect their events to a router bound there instead of binding their own ports: rank r to
// routerBind's port + r, as vLLM does with an endpoint that names a host. Their topic is
// kv@<worker host:port>@sim-model, the router's default topic pattern.
func startDPEventWorkerTo(t *testing.T, id string, size int, routerBind string) *dpEventWorker {
	t.Helper()
	pubAddr, replayAddr := rankedAddr(t, size), rankedAddr(t, size)
	listen := loopbacktest.Addr(t)
	if routerBind != "" {
		// The router takes a worker's events only from its URL's host, and the ranks'
		// publishers connect from 127.0.0.1.
		listen = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ranks := make([]*sim.Worker, size)
	var pubs []*kvevents.Publisher
	t.Cleanup(func() {
		for _, p := range pubs {
			p.Close()
		}
	})
	t.Cleanup(cancel)
	for r := range ranks {
		pc := kvevents.PublisherConfig{
			Endpoint: "tcp://" + pubAddr, Bind: true, ReplayEndpoint: "tcp://" + replayAddr, DPRank: r,
		}
		if routerBind != "" {
			pc.Endpoint, pc.Bind, pc.Topic = "tcp://"+routerBind, false, "kv@"+ln.Addr().String()+"@"+sim.DefaultModel
		}
		pub, err := kvevents.NewPublisher(pc)
		if err != nil {
			t.Fatalf("rank %d publisher: %v", r, err)
		}
		pubs = append(pubs, pub)
		c := simConfig(0)
		c.ID = id
		c.OnEvent = sim.PublishEvents(ctx, pub, sim.DefaultBlockSize, nil)
		if ranks[r], err = sim.New(c); err != nil {
			t.Fatal(err)
		}
	}
	dp, err := sim.NewDataParallel(ranks...)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := dp.Serve(ctx, ln); err != nil {
			t.Errorf("worker %s: %v", id, err)
		}
	}()
	// Registered last, so it runs first: the server stops before its publishers close.
	t.Cleanup(func() { cancel(); <-done })
	w := &dpEventWorker{t: t, httpAddr: ln.Addr().String(), dp: dp}
	w.spec = routing.WorkerSpec{
		ID: id, URL: "http://" + w.httpAddr, DPSize: size,
		KVEvents: "tcp://" + pubAddr, KVReplay: "tcp://" + replayAddr,
	}
	if routerBind != "" {
		w.spec.KVEvents = ""
	}
	return w
}

// direct sends a completion straight to rank r of the worker, bypassing the router: only
// that rank's KV events can tell the router about it.
func (w *dpEventWorker) direct(tokens []uint32, maxTokens, rank int) {
	w.t.Helper()
	req, err := http.NewRequestWithContext(w.t.Context(), http.MethodPost, "http://"+w.httpAddr+"/v1/completions",
		bytes.NewReader(completionBody(tokens, maxTokens, false)))
	if err != nil {
		w.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(sim.DPRankHeader, strconv.Itoa(rank))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		w.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || resp.Header.Get(sim.DPRankHeader) != strconv.Itoa(rank) {
		w.t.Fatalf("direct request to rank %d: %s, served by rank %q: %s", rank, resp.Status, resp.Header.Get(sim.DPRankHeader), body)
	}
}

// rankBlocks is how many leading blocks of tokens the replica's event-fed index credits to
// one rank of a worker.
func rankBlocks(rep *Replica, w indexer.Worker, tokens []uint32) int {
	seq := indexer.SequenceHashes(tokens, indexer.DefaultBlockSize, indexer.BaseSeed, nil)
	for _, m := range rep.precise.FindMatches(seq, nil) {
		if m.Worker == w {
			return m.Blocks
		}
	}
	return 0
}

func TestDataParallelRanksAreLearnedFromTheirOwnEventPorts(t *testing.T) {
	w := startDPEventWorker(t, "w0", 2)
	rep := startTestReplica(t, testFleet{{spec: w.spec}}, func(c *Config) { c.OverlayTTL = time.Second })
	client := newRouterClient(t, rep)
	rank0, rank1 := indexer.Worker{ID: "w0"}, indexer.Worker{ID: "w0", DPRank: 1}

	// Events published before a subscriber is connected are lost to ZMQ (replay brings them
	// back, but waiting makes the test not depend on it).
	for r := range 2 {
		ep, err := kvevents.OffsetPort(w.spec.KVEvents, r)
		if err != nil {
			t.Fatal(err)
		}
		eventually(t, "the router to subscribe to rank "+strconv.Itoa(r), func() (bool, string) {
			n := client.scrapeMetrics()[`kvrouter_kvevents_connects_total{endpoint="`+ep+`",result="ok"}`]
			return n > 0, fmt.Sprintf("%v connects to %s", n, ep)
		})
	}

	// Each rank caches a prompt of its own, sent past the router; 17 output tokens make the
	// final store a second batch, so a lost first batch shows as a gap and is replayed.
	onRank1, onRank0 := promptTokens(61, 32*16), promptTokens(62, 24*16)
	w.direct(onRank1, 17, 1)
	w.direct(onRank0, 17, 0)

	var route struct {
		Worker  string `json:"worker"`
		DPRank  uint32 `json:"dp_rank"`
		Overlap int    `json:"overlap_blocks"`
	}
	eventually(t, "the router to predict the prompt on w0 rank 1", func() (bool, string) {
		a := client.post("/v1/route", completionBody(onRank1, 2, false), nil)
		if a.status != http.StatusOK {
			return false, fmt.Sprintf("route: %d %s", a.status, a.body)
		}
		if err := json.Unmarshal(a.body, &route); err != nil {
			return false, fmt.Sprintf("route answer %s: %v", a.body, err)
		}
		return route.Worker == "w0" && route.DPRank == 1 && route.Overlap > 0, string(a.body)
	})
	waitPrecise := func(who indexer.Worker, tokens []uint32, want int) {
		t.Helper()
		eventually(t, fmt.Sprintf("the events to credit %s with %d blocks", who, want), func() (bool, string) {
			got := rankBlocks(rep, who, tokens)
			return got == want, fmt.Sprintf("credited %d", got)
		})
	}
	waitPrecise(rank0, onRank0, 24)
	// Each rank is credited only with what it cached: its events came on its own port.
	for _, c := range []struct {
		who    indexer.Worker
		tokens []uint32
	}{{rank0, onRank1}, {rank1, onRank0}} {
		if got := rankBlocks(rep, c.who, c.tokens); got != 0 {
			t.Fatalf("%s is credited with %d blocks of a prompt only the other rank cached", c.who, got)
		}
	}

	ans := client.complete(onRank1, 2, nil).mustOK(t)
	if got := ans.header.Get(sim.DPRankHeader); got != "1" {
		t.Fatalf("the request was served by rank %q, want 1 (router chose %s)", got, ans.worker())
	}
	if ans.worker() != rank1.String() {
		t.Fatalf("the router says it chose %s, want %s", ans.worker(), rank1)
	}
	if cached := ans.cachedTokens(t); cached == 0 {
		t.Fatal("rank 1 reports no cached tokens for the prompt it cached")
	}
	if s := w.dp.Rank(0).Stats(); s.Served != 1 {
		t.Fatalf("rank 0 served %d requests, want only the one sent to it directly", s.Served)
	}
}

func TestDataParallelRanksConnectingToTheRouterAreHeardOnTheirPorts(t *testing.T) {
	bind := rankedAddr(t, 2)
	w := startDPEventWorkerTo(t, "w0", 2, bind)
	rep := startTestReplica(t, testFleet{{spec: w.spec}}, func(c *Config) {
		c.OverlayTTL = time.Second
		c.KVEventsBind = "tcp://" + bind
		c.TopicPattern = "kv@{host:port}@{model}"
	})
	rank0, rank1 := indexer.Worker{ID: "w0"}, indexer.Worker{ID: "w0", DPRank: 1}
	// The ranks connect on their own schedule and ZMQ drops what a publisher sends before its
	// connection is up, so each rank caches fresh prompts until one of them is heard; only the
	// bound socket on the rank's own port can hear it.
	for _, c := range []struct {
		rank int
		w    indexer.Worker
	}{{1, rank1}, {0, rank0}} {
		seed := uint64(80 + 10*c.rank)
		var tokens []uint32
		var sent time.Time
		eventually(t, fmt.Sprintf("the router to hear rank %d on its port", c.rank), func() (bool, string) {
			if tokens != nil && rankBlocks(rep, c.w, tokens) > 0 {
				return true, ""
			}
			if tokens == nil || time.Since(sent) > time.Second {
				// Nothing heard of the last prompt: it may have gone out before the rank's
				// connection was up, so cache a fresh one.
				tokens, sent = promptTokens(seed, 8*16), time.Now()
				seed++
				w.direct(tokens, 1, c.rank)
			}
			return false, fmt.Sprintf("%d prompts cached on rank %d, none credited yet", seed-uint64(80+10*c.rank), c.rank)
		})
	}
}
