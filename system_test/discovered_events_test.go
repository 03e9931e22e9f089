package system_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

// startEventWorker serves a simulated worker id on 127.0.0.1 that publishes its KV events on
// a bound PUB socket, and returns its URL and events endpoint.
func startEventWorker(t *testing.T, id string) (url, events string) {
	t.Helper()
	pub, err := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", Bind: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	w, err := sim.New(sim.Config{ID: id, OnEvent: sim.PublishEvents(ctx, pub, sim.DefaultBlockSize, nil)})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: w.Handler()}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close(); cancel(); pub.Close() })
	return "http://" + l.Addr().String(), "tcp://" + pub.Addr().String()
}

// tokenBody is a completion of token ids.
func tokenBody(tokens []uint32) []byte {
	b, _ := json.Marshal(map[string]any{"model": sim.DefaultModel, "prompt": tokens, "max_tokens": 1})
	return b
}

func TestDiscoveredWorkersKVEventsReachEveryReplicaAndStopWhenItIsGone(t *testing.T) {
	fl := startFleet(t, 1) // w0: from flags, without events
	url, events := startEventWorker(t, "e0")
	path := filepath.Join(t.TempDir(), "fleet.json")
	spec := map[string]string{"id": "e0", "url": url, "kv_events": events}
	if err := proc.WriteFleetFile(path, []map[string]string{}); err != nil {
		t.Fatal(err)
	}
	c := startCluster(t, 3, fl, discoveryFlags("file:"+path)...)
	if err := proc.WriteFleetFile(path, []map[string]string{spec}); err != nil {
		t.Fatal(err)
	}
	waitFleet(t, c.replicas, []string{"e0", "w0"}, 30*time.Second)

	// A prompt reaches e0's cache past the router: only e0's KV events can tell the replicas.
	const blocks = 24
	prefix := make([]uint32, blocks*sim.DefaultBlockSize)
	for i := range prefix {
		prefix[i] = uint32(1000 + i)
	}
	direct := func(tokens []uint32) {
		t.Helper()
		resp, err := httpClient.Post(url+"/v1/completions", "application/json", bytes.NewReader(tokenBody(tokens)))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("direct request: %s", resp.Status)
		}
	}
	// ZMQ drops what a PUB sends before a SUB is connected: send again until heard.
	start := time.Now()
	var sent time.Time
	eventually(t, 30*time.Second, func() error {
		for _, r := range c.replicas {
			w, n, err := kvRoute(t.Context(), r, prefix)
			if err != nil {
				return err
			}
			if w != "e0" || n != blocks {
				if time.Since(sent) > time.Second {
					direct(prefix)
					sent = time.Now()
				}
				return fmt.Errorf("%s routes the prefix to %s with %d blocks, want e0 with %d", r.ID, w, n, blocks)
			}
		}
		return nil
	})
	t.Logf("every replica predicted e0's %d cached blocks %s after it was listed", blocks, time.Since(start).Round(time.Millisecond))

	if err := proc.WriteFleetFile(path, []map[string]string{}); err != nil {
		t.Fatal(err)
	}
	waitFleet(t, c.replicas, []string{"w0"}, 30*time.Second)
	direct(prefix) // published after e0 is gone: applied nowhere
	for _, r := range c.replicas {
		w, n, err := kvRoute(t.Context(), r, prefix)
		if err != nil {
			t.Fatal(err)
		}
		if w != "w0" || n != 0 {
			t.Fatalf("%s routes the gone worker's prefix to %s with %d blocks of overlap, want w0 with 0", r.ID, w, n)
		}
	}
	for _, r := range c.replicas {
		seq, err := metricValue(t.Context(), r, `kvrouter_kvevents_last_sequence{worker="e0"}`)
		if err == nil {
			t.Fatalf("%s still reports e0's last sequence (%v): its subscriber was not forgotten", r.ID, seq)
		}
	}
}
