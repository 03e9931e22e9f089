package replica

import (
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// addWorker adds spec through the admin API.
func addWorker(t *testing.T, rep *Replica, spec routing.WorkerSpec) {
	t.Helper()
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if status, body := adminSend(t, rep, http.MethodPost, "/admin/workers", "", string(b)); status >= 300 {
		t.Fatalf("add %s: %d %s", spec.ID, status, body)
	}
}

// removeWorker removes worker id through the admin API.
func removeWorker(t *testing.T, rep *Replica, id string) {
	t.Helper()
	if status, body := adminDo(t, rep, http.MethodDelete, "/admin/workers/"+id, ""); status >= 300 {
		t.Fatalf("remove %s: %d %s", id, status, body)
	}
}

// waitInRegistry waits until worker id is (or is not) in the replica's registry.
func waitInRegistry(t *testing.T, rep *Replica, id string, want bool) {
	t.Helper()
	eventually(t, fmt.Sprintf("%s in the registry: %v", id, want), func() (bool, string) {
		_, ok := rep.registry.Lookup(id)
		return ok == want, fmt.Sprintf("in the registry: %v", ok)
	})
}

// routePredicts checks that POST /v1/route sends a prompt extending prefix to id, crediting
// it with blocks cached blocks.
func routePredicts(t *testing.T, rep *Replica, prefix []uint32, id string, blocks int) {
	t.Helper()
	client := newRouterClient(t, rep)
	ans := client.post("/v1/route", completionBody(concat(prefix, promptTokens(999, 4*16)), 2, false), nil).mustOK(t)
	var route struct {
		Worker  string `json:"worker"`
		Overlap int    `json:"overlap_blocks"`
	}
	if err := json.Unmarshal(ans.body, &route); err != nil {
		t.Fatalf("route answer %s: %v", ans.body, err)
	}
	if route.Worker != id || route.Overlap != blocks {
		t.Fatalf("/v1/route chose %s with %d blocks of overlap; the events say %s holds %d", route.Worker, route.Overlap, id, blocks)
	}
}

// assertNoLaterEvents checks that gone's events published from now on are not applied: gone
// caches a prompt, then still, a worker the replica follows, caches one; once still's is
// credited, gone's (sent first, on loopback) would have been too had its subscriber run on.
func assertNoLaterEvents(t *testing.T, rep *Replica, gone, still *eventWorker) {
	t.Helper()
	late, marker := promptTokens(61, 16*16), promptTokens(62, 16*16)
	gone.direct(late)
	still.direct(marker)
	waitPrecise(t, rep, still.spec.ID, marker, 16)
	if got := preciseBlocks(rep, gone.spec.ID, late); got != 0 {
		t.Fatalf("events of removed worker %s are still applied: %d blocks credited", gone.spec.ID, got)
	}
}

func TestWorkerAddedThroughTheAdminAPIGetsItsEventsAndLosesThemWhenRemoved(t *testing.T) {
	a, b := startEventWorker(t, "w0"), startEventWorker(t, "w1")
	rep := startPreciseReplica(t, a)
	addWorker(t, rep, b.spec)
	waitInRegistry(t, rep, "w1", true)
	prefix := promptTokens(71, 32*16)
	b.direct(prefix) // past the router: only w1's events can say where this prefix is
	waitPrecise(t, rep, "w1", prefix, 32)
	routePredicts(t, rep, prefix, "w1", 32)

	removeWorker(t, rep, "w1")
	waitInRegistry(t, rep, "w1", false)
	if got := preciseBlocks(rep, "w1", prefix); got != 0 {
		t.Fatalf("removed w1 is still credited with %d blocks", got)
	}
	assertNoLaterEvents(t, rep, b, a)
}

func TestWorkerFromFlagsRemovedAtRunTimeHasItsEventsNoLongerApplied(t *testing.T) {
	a, b := startEventWorker(t, "w0"), startEventWorker(t, "w1")
	rep := startPreciseReplica(t, a, b)
	prefix := promptTokens(72, 16*16)
	a.direct(prefix)
	waitPrecise(t, rep, "w0", prefix, 16)
	removeWorker(t, rep, "w0")
	waitInRegistry(t, rep, "w0", false)
	if got := preciseBlocks(rep, "w0", prefix); got != 0 {
		t.Fatalf("removed w0 is still credited with %d blocks", got)
	}
	assertNoLaterEvents(t, rep, a, b)
}

// writeFleetFile writes specs as the discovery file.
func writeFleetFile(t *testing.T, path string, specs ...routing.WorkerSpec) {
	t.Helper()
	if err := proc.WriteFleetFile(path, specs); err != nil {
		t.Fatal(err)
	}
}

func TestWorkerDiscoveredThroughTheFileSourceGetsItsEventsAndLosesThemWhenGone(t *testing.T) {
	a, b := startEventWorker(t, "w0"), startEventWorker(t, "w1")
	path := filepath.Join(t.TempDir(), "fleet.json")
	writeFleetFile(t, path)
	rep := startTestReplica(t, testFleet{{spec: a.spec}}, func(c *Config) {
		c.OverlayTTL = time.Second
		c.Discovery = DiscoveryConfig{Sources: []string{"file:" + path}, Interval: 50 * time.Millisecond,
			DrainFor: 50 * time.Millisecond, SuspectFor: 50 * time.Millisecond}
	})
	writeFleetFile(t, path, b.spec)
	waitInRegistry(t, rep, "w1", true)
	prefix := promptTokens(73, 32*16)
	b.direct(prefix)
	waitPrecise(t, rep, "w1", prefix, 32)
	routePredicts(t, rep, prefix, "w1", 32)

	writeFleetFile(t, path) // gone: drained, then removed
	waitInRegistry(t, rep, "w1", false)
	if got := preciseBlocks(rep, "w1", prefix); got != 0 {
		t.Fatalf("gone w1 is still credited with %d blocks", got)
	}
	assertNoLaterEvents(t, rep, b, a)
}

func TestBoundSocketAdmitsAWorkerAddedAtRunTimeAndNotOnceRemoved(t *testing.T) {
	bind := rankedAddr(t, 1)
	// The worker known at start is at 127.0.0.2: the publisher below, on 127.0.0.1, is no
	// worker's until w1 (at 127.0.0.1) is added.
	elsewhere := routing.WorkerSpec{ID: "w0", URL: "http://127.0.0.2:9"}
	rep := startTestReplica(t, testFleet{{spec: elsewhere}}, func(c *Config) {
		c.OverlayTTL = time.Second
		c.KVEventsBind = "tcp://" + bind
		c.TopicPattern = "kv@{host:port}@{model}"
	})
	w := startDPEventWorkerTo(t, "w1", 1, bind)
	client := newRouterClient(t, rep)
	refused := func() float64 {
		return client.scrapeMetrics()[`kvrouter_kvevents_refused_connections_total{reason="not_a_worker"}`]
	}
	eventually(t, "the publisher of a worker not yet added to be refused", func() (bool, string) {
		n := refused()
		return n > 0, fmt.Sprintf("%v refusals", n)
	})
	addWorker(t, rep, w.spec)
	waitInRegistry(t, rep, "w1", true)
	w1 := indexer.Worker{ID: "w1"}
	// ZMQ drops what a publisher sends before its connection is up: cache fresh prompts
	// until one is heard.
	seed := uint64(300)
	var tokens []uint32
	var sent time.Time
	eventually(t, "the router to hear w1 on its bound socket", func() (bool, string) {
		if tokens != nil && rankBlocks(rep, w1, tokens) > 0 {
			return true, ""
		}
		if tokens == nil || time.Since(sent) > time.Second {
			tokens, sent = promptTokens(seed, 8*16), time.Now()
			seed++
			w.direct(tokens, 1, 0)
		}
		return false, fmt.Sprintf("%d prompts cached, none credited yet", seed-300)
	})
	routePredicts(t, rep, tokens, "w1", 8)

	removeWorker(t, rep, "w1")
	waitInRegistry(t, rep, "w1", false)
	// The registry lists w1 as gone a moment before its entries are purged (the purge runs
	// on the registry's change), so the test waits for the purge rather than race it.
	eventually(t, "the removed worker's entries to be purged", func() (bool, string) {
		got := rankBlocks(rep, w1, tokens)
		return got == 0, fmt.Sprintf("removed w1 is still credited with %d blocks", got)
	})
	unknown := func() float64 { return client.scrapeMetrics()["kvrouter_kvevents_unknown_publisher_total"] }
	before := unknown()
	late := promptTokens(400, 8*16)
	w.direct(late, 1, 0)
	eventually(t, "the removed worker's message to be dropped as an unknown publisher's", func() (bool, string) {
		n := unknown()
		return n > before, fmt.Sprintf("%v unknown-publisher messages, %v before", n, before)
	})
	if got := rankBlocks(rep, w1, late); got != 0 {
		t.Fatalf("removed w1's events are still applied: %d blocks", got)
	}
}
