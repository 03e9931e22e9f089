package cluster

import (
	"context"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// TestLocalSessionsKeepTheirOwnCopyOfTheKey: the session key a request brings is a slice of
// its head; the replica's table of sessions in flight keys its entry by a copy, so that an
// entry does not keep the whole head alive (transport/h1's values share one string).
func TestLocalSessionsKeepTheirOwnCopyOfTheKey(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	a := NewAffinity(c.nodes[0])
	head := "x-session-id: s1\r\n" + strings.Repeat("x", 4096)
	key := head[len("x-session-id: ") : len("x-session-id: ")+2]
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := a.Acquire(ctx, key, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if _, err := l.Commit(ctx, indexer.Worker{ID: "w1"}, ""); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	found := false
	for k := range a.local {
		if k != key {
			continue
		}
		found = true
		if unsafe.StringData(k) == unsafe.StringData(key) {
			t.Fatal("the session in flight is keyed by the caller's string, and with it the whole head")
		}
	}
	if !found {
		t.Fatalf("no session in flight under %q", key)
	}
}
