package kvevents

import (
	"context"
	"net/netip"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

func TestSetWorkersReplacesWhoABoundSocketServes(t *testing.T) {
	sub, err := NewSubscriber(Config{
		Endpoint: "tcp://127.0.0.1:0", Mode: Bind, TopicPattern: "kv@{host:port}@{model}", BlockSize: 16,
		URLs:   map[string]string{"old": "http://10.0.0.1:8000"},
		Hosts:  map[string][]string{"old": {"10.0.0.1"}},
		Topics: map[string]indexer.Worker{"explicit": {ID: "fixed"}},
		Sink:   newSink(),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	old, added := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	// A stream of the old worker, as a message would have made it.
	sub.acquire()
	sub.stream(indexer.Worker{ID: "old"})
	sub.release()
	if err := sub.SetWorkers(ctx, Workers{
		URLs:  map[string]string{"new": "http://10.0.0.2:8000"},
		Hosts: map[string][]string{"new": {"10.0.0.2"}},
	}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		topic, want string
		ok          bool
	}{
		{"kv@10.0.0.2:8000@m", "new", true},
		{"kv@10.0.0.1:8000@m", "", false},
		{"explicit", "fixed", true}, // Topics never change
	} {
		if got, ok := sub.workerOf(c.topic); got != c.want || ok != c.ok {
			t.Errorf("workerOf(%q) = %q, %v; want %q, %v", c.topic, got, ok, c.want, c.ok)
		}
	}
	for _, c := range []struct {
		ip   netip.Addr
		want bool
	}{{added, true}, {old, false}} {
		if got := sub.from.any(ctx, c.ip); got != c.want {
			t.Errorf("publisher from %s admitted: %v, want %v", c.ip, got, c.want)
		}
	}
	if !sub.serves(indexer.Worker{ID: "new", DPRank: 3}) || sub.serves(indexer.Worker{ID: "old"}) {
		t.Error("engine maps would be restored for the wrong workers")
	}
	if _, ok := sub.streams[indexer.Worker{ID: "old"}]; ok {
		t.Error("the removed worker's stream (and engine map) is kept")
	}
	if err := sub.SetWorkers(ctx, Workers{URLs: map[string]string{"bad": "::"}}); err == nil {
		t.Error("a URL without host:port was taken")
	}
	if got, ok := sub.workerOf("kv@10.0.0.2:8000@m"); got != "new" || !ok {
		t.Error("a refused SetWorkers changed the workers")
	}
}

func TestSetWorkersRefusesAConnectSubscriber(t *testing.T) {
	sub, err := NewSubscriber(Config{Endpoint: "tcp://127.0.0.1:1", Worker: indexer.Worker{ID: "w"}, BlockSize: 16, Sink: newSink()})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetWorkers(context.Background(), Workers{}); err == nil {
		t.Fatal("a connect-mode subscriber took a set of workers")
	}
}

func TestForgetDropsAStoppedSubscribersWorkers(t *testing.T) {
	m, err := NewMetrics(nil)
	if err != nil {
		t.Fatal(err)
	}
	w := indexer.Worker{ID: "w", DPRank: 1}
	sub, err := NewSubscriber(Config{Endpoint: "tcp://127.0.0.1:1", Worker: w, BlockSize: 16, Sink: newSink(), Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	sub.acquire()
	sub.stream(w).lastSeq.Set(7)
	sub.release()
	sub.Forget()
	if len(sub.streams) != 0 {
		t.Error("streams kept")
	}
	if n := testutil.CollectAndCount(m.lastSeq); n != 0 {
		t.Errorf("%d last-sequence series kept for a forgotten worker", n)
	}
}
