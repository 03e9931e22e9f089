package admin

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

// replicaOf is a replica's id and the leader it knows: the Cluster methods the discovery
// view asks.
type replicaOf struct {
	Cluster
	id, leader, leaderPeer string
}

func (f replicaOf) ID() string { return f.id }
func (f replicaOf) Leader() (string, string, bool) {
	return f.leader, f.leaderPeer, f.leader != ""
}

// owners is the registry's owners (the Workers method the discovery view asks).
type owners struct {
	Workers
	m map[string]workers.Owned
}

func (o owners) Owners() map[string]workers.Owned { return o.m }

// duty is a discovery duty's status, and the leader's peer Status.
type duty struct {
	running bool
	looks   []peer.DiscoverySource
	leader  peer.Status
	err     error
}

func (d duty) Sources() []string                                 { return []string{"file:/a", "dns:b:80"} }
func (d duty) Looks() (bool, []peer.DiscoverySource)             { return d.running, d.looks }
func (d duty) LeaderStatus(context.Context) (peer.Status, error) { return d.leader, d.err }

// noBindings is a replica without bindings.
type noBindings struct{}

func (noBindings) Range(func(fsm.Binding) bool)   {}
func (noBindings) Get(string) (fsm.Binding, bool) { return fsm.Binding{}, false }
func (noBindings) Len() int                       { return 0 }

func TestDiscoveryViewShowsTheLeadersLooksWithTheRegistrysWorkers(t *testing.T) {
	reg := owners{m: map[string]workers.Owned{
		"a1": {Source: workers.DiscoveryOwner("file:/a")}, "a2": {Source: workers.DiscoveryOwner("file:/a")},
		"a3": {Source: workers.DiscoveryOwner("file:/a"), Gone: true}, "b1": {Source: workers.DiscoveryOwner("dns:b:80")},
		"admin": {},
	}}
	failing := peer.DiscoverySource{Source: "file:/a", FailingSince: time.Unix(100, 0).UTC(), Failures: 3, LastError: "boom"}
	good := peer.DiscoverySource{Source: "dns:b:80", LastGood: time.Unix(200, 0).UTC()}
	looks := []SourceView{{DiscoverySource: failing, Workers: 2, Gone: 1}, {DiscoverySource: good, Workers: 1}}
	bare := []SourceView{{DiscoverySource: peer.DiscoverySource{Source: "file:/a"}, Workers: 2, Gone: 1},
		{DiscoverySource: peer.DiscoverySource{Source: "dns:b:80"}, Workers: 1}}
	for _, tc := range []struct {
		name    string
		replica replicaOf
		duty    duty
		want    DiscoveryView
	}{
		{"the leader shows its own looks", replicaOf{id: "r1", leader: "r1"},
			duty{running: true, looks: []peer.DiscoverySource{failing, good}},
			DiscoveryView{Replica: "r1", Running: true, LooksFrom: "r1", LeaderID: "r1", Sources: looks}},
		{"a follower shows the leader's looks", replicaOf{id: "r2", leader: "r1", leaderPeer: "127.0.0.1:7001"},
			duty{leader: peer.Status{ID: "r1", Discovery: []peer.DiscoverySource{failing, good}}},
			DiscoveryView{Replica: "r2", LooksFrom: "r1", LeaderID: "r1", LeaderPeerAddr: "127.0.0.1:7001", Sources: looks}},
		{"a follower that cannot ask the leader says why", replicaOf{id: "r2", leader: "r1", leaderPeer: "127.0.0.1:7001"},
			duty{err: errors.New("connection refused")},
			DiscoveryView{Replica: "r2", LeaderID: "r1", LeaderPeerAddr: "127.0.0.1:7001", LeaderError: "connection refused", Sources: bare}},
		{"a leader without discovery", replicaOf{id: "r2", leader: "r1"}, duty{leader: peer.Status{ID: "r1"}},
			DiscoveryView{Replica: "r2", LeaderID: "r1", Sources: bare,
				LeaderError: "the leader r1 runs no discovery (started without --discovery, or its term just began)"}},
		{"no leader", replicaOf{id: "r2"}, duty{}, DiscoveryView{Replica: "r2", Sources: bare}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := Handler(Config{Cluster: tc.replica, Workers: reg, Bindings: noBindings{}, Discovery: tc.duty})
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/admin/discovery", nil))
			var got DiscoveryView
			if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &got) != nil {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			a, _ := json.Marshal(got)
			b, _ := json.Marshal(tc.want)
			if string(a) != string(b) {
				t.Errorf("got  %s\nwant %s", a, b)
			}
		})
	}
}
