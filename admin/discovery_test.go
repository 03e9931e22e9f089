package admin

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

// follower is a replica that does not lead: the Cluster methods the discovery view asks.
type follower struct {
	Cluster
	id, leader, leaderPeer string
}

func (f follower) ID() string { return f.id }
func (f follower) Leader() (string, string, bool) {
	return f.leader, f.leaderPeer, f.leader != ""
}

// owners is the registry's owners (the Workers method the discovery view asks).
type owners struct {
	Workers
	m map[string]workers.Owned
}

func (o owners) Owners() map[string]workers.Owned { return o.m }

// duty is a discovery duty's status.
type duty struct {
	running bool
	looks   []SourceView
}

func (d duty) Sources() []string            { return []string{"file:/a", "dns:b:80"} }
func (d duty) Status() (bool, []SourceView) { return d.running, d.looks }

// noBindings is a replica without bindings.
type noBindings struct{}

func (noBindings) Range(func(fsm.Binding) bool)   {}
func (noBindings) Get(string) (fsm.Binding, bool) { return fsm.Binding{}, false }
func (noBindings) Len() int                       { return 0 }

func TestDiscoveryViewCountsEachSourcesWorkersAndRunsOnlyOnTheLeader(t *testing.T) {
	reg := owners{m: map[string]workers.Owned{
		"a1": {Source: workers.DiscoveryOwner("file:/a")}, "a2": {Source: workers.DiscoveryOwner("file:/a")},
		"a3": {Source: workers.DiscoveryOwner("file:/a"), Gone: true}, "b1": {Source: workers.DiscoveryOwner("dns:b:80")},
		"admin": {},
	}}
	failing := SourceView{Source: "file:/a", FailingSince: time.Unix(100, 0).UTC(), Failures: 3, LastError: "boom", Workers: 99}
	for _, tc := range []struct {
		name    string
		cluster follower
		duty    duty
		want    DiscoveryView
	}{
		{"a follower names the leader and gives no looks", follower{id: "r2", leader: "r1", leaderPeer: "127.0.0.1:7001"}, duty{},
			DiscoveryView{Replica: "r2", LeaderID: "r1", LeaderPeerAddr: "127.0.0.1:7001", Sources: []SourceView{
				{Source: "file:/a", Workers: 2, Gone: 1}, {Source: "dns:b:80", Workers: 1}}}},
		{"the leader gives its looks, with the registry's counts", follower{id: "r1", leader: "r1"},
			duty{running: true, looks: []SourceView{failing, {Source: "dns:b:80", LastGood: time.Unix(200, 0).UTC()}}},
			DiscoveryView{Replica: "r1", Running: true, LeaderID: "r1", Sources: []SourceView{
				{Source: "file:/a", FailingSince: time.Unix(100, 0).UTC(), Failures: 3, LastError: "boom", Workers: 2, Gone: 1},
				{Source: "dns:b:80", LastGood: time.Unix(200, 0).UTC(), Workers: 1}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := Handler(Config{Cluster: tc.cluster, Workers: reg, Bindings: noBindings{}, Discovery: tc.duty})
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
