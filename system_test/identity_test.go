package system_test

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/cluster/hints"
	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/internal/testpki"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// hardenedCluster starts n replicas in front of fl with mutual TLS between them (each with
// its own certificate from ca, naming its id and its Raft and peer hosts) plus extra flags.
func hardenedCluster(t *testing.T, n int, fl *fleet, ca *testpki.CA, extra ...string) *cluster {
	t.Helper()
	var workers []string
	for i, u := range fl.urls {
		workers = append(workers, fl.ids[i]+"="+u)
	}
	return startClusterWith(t, binary, n, workers, nil, func(m proc.Replica) []string {
		cert, key := ca.IssueReplicaFiles(m.ID, m.Raft, m.Peer)
		return []string{"--peer-tls-cert-file", cert, "--peer-tls-key-file", key, "--peer-tls-ca-file", ca.CAFile}
	}, extra...)
}

// intruderStream is a raft.StreamLayer that dials with a certificate of the cluster's CA
// issued to a host that is no replica; it accepts nothing worth serving.
type intruderStream struct {
	ln  net.Listener
	cfg *tls.Config
}

func (s *intruderStream) Accept() (net.Conn, error) { return s.ln.Accept() }
func (s *intruderStream) Close() error              { return s.ln.Close() }
func (s *intruderStream) Addr() net.Addr            { return s.ln.Addr() }
func (s *intruderStream) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := tls.Dialer{NetDialer: &net.Dialer{Timeout: timeout}, Config: s.cfg}
	return d.Dial("tcp", string(addr))
}

// terms reads every replica's Raft term and the leader's id, by replica id.
func terms(t *testing.T, c *cluster) (map[string]uint64, string) {
	t.Helper()
	out := map[string]uint64{}
	leader := ""
	for _, r := range c.replicas {
		st, err := r.status()
		if err != nil {
			t.Fatal(err)
		}
		out[r.ID] = st.Self.Term
		if st.Leads() {
			leader = r.ID
		}
	}
	return out, leader
}

func TestACertificateOfTheClusterCAForANonReplicaIsRefusedOnThePeerAndRaftPorts(t *testing.T) {
	fl := startFleet(t, 2)
	ca := testpki.NewCA(t, "kvrouter-ha cluster CA")
	c := hardenedCluster(t, 3, fl, ca)
	lead := c.leader()
	var follower *replica
	for _, r := range c.others(lead) {
		follower = r
		break
	}
	// The intruder's certificate is genuine (the cluster's CA signed it, for client and
	// server auth) but names a host that is no replica. (A certificate naming the host it
	// joins at is a replica's to be: what the CA signs is a member, hence a CA dedicated to
	// the cluster.)
	intruder := testpki.MutualConfig(ca.Issue("intruder", testpki.ServerAndClient, "intruder.example"), ca)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()

	// The peer port: a forwarded Bind, a read-index and joins in another's name are refused.
	pc, err := peer.Dial(ctx, lead.Peer, peer.ClientOptions{TLS: intruder.Clone()})
	if err != nil {
		t.Fatalf("the peer port should still complete the handshake with a certificate of its CA: %v", err)
	}
	defer pc.Close()
	bind, err := fsm.Encode(&fsm.Bind{Session: "hijacked", Worker: fl.ids[0], TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := pc.Apply(ctx, bind); !errors.Is(err, peer.ErrPermission) {
		t.Errorf("forwarded Bind from a non-replica: got %v, want PermissionDenied", err)
	}
	if _, err := pc.ReadIndex(ctx); !errors.Is(err, peer.ErrPermission) {
		t.Errorf("read-index from a non-replica: got %v, want PermissionDenied", err)
	}
	for _, j := range []peer.JoinRequest{
		{ID: "r9", RaftAddr: "127.0.0.1:1", PeerAddr: "127.0.0.1:2", Voter: true},
		{ID: follower.ID, RaftAddr: "127.0.0.1:1", PeerAddr: "127.0.0.1:2", Voter: true},
	} {
		if err := pc.Join(ctx, j); !errors.Is(err, peer.ErrPermission) {
			t.Errorf("join as %s from a certificate that does not name it: got %v, want PermissionDenied", j.ID, err)
		}
	}
	if err := pc.Leave(ctx, follower.ID); !errors.Is(err, peer.ErrPermission) {
		t.Errorf("leave of %s from a non-replica: got %v, want PermissionDenied", follower.ID, err)
	}
	var sv admin.SessionView
	if err := proc.Get(ctx, httpClient, "http://"+lead.Admin+"/admin/sessions/hijacked", &sv); err == nil {
		t.Errorf("the non-replica's Bind was applied: %+v", sv)
	}
	var view admin.ClusterView
	if err := proc.Get(ctx, httpClient, "http://"+lead.Admin+"/admin/cluster", &view); err != nil {
		t.Fatal(err)
	}
	if len(view.Servers) != 3 {
		t.Errorf("the configuration changed: %+v", view.Servers)
	}

	// The Raft port: an AppendEntries at term+1 to the leader and a RequestVote at term+1 to
	// a follower, over raft's own transport with the intruder's certificate.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	trans := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: &intruderStream{ln: ln, cfg: intruder.Clone()}, MaxPool: 1, Timeout: 5 * time.Second, Logger: hclog.NewNullLogger(),
	})
	defer trans.Close()
	before, leaderBefore := terms(t, c)
	term := before[lead.ID]
	hdr := raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("r9"), Addr: []byte(trans.LocalAddr())}
	var ae raft.AppendEntriesResponse
	aeErr := trans.AppendEntries("r9", raft.ServerAddress(lead.Raft), &raft.AppendEntriesRequest{
		RPCHeader: hdr, Term: term + 1, PrevLogEntry: 0, PrevLogTerm: 0, LeaderCommitIndex: 0,
	}, &ae)
	if aeErr == nil {
		t.Errorf("the leader answered a non-replica's AppendEntries at term %d: %+v", term+1, ae)
	}
	var rv raft.RequestVoteResponse
	rvErr := trans.RequestVote("r9", raft.ServerAddress(follower.Raft), &raft.RequestVoteRequest{
		RPCHeader: hdr, Term: before[follower.ID] + 1, LastLogIndex: 1 << 40, LastLogTerm: before[follower.ID] + 1,
	}, &rv)
	if rvErr == nil {
		t.Errorf("a follower answered a non-replica's RequestVote at term %d: %+v", before[follower.ID]+1, rv)
	}
	t.Logf("raft port answers to the intruder: AppendEntries %v; RequestVote %v", aeErr, rvErr)
	after, leaderAfter := terms(t, c)
	for id, tm := range before {
		if after[id] != tm {
			t.Errorf("%s moved from term %d to %d after the intruder's RPCs", id, tm, after[id])
		}
	}
	if leaderAfter != leaderBefore {
		t.Errorf("the leader changed from %q to %q after the intruder's RPCs", leaderBefore, leaderAfter)
	}
	// The replicas themselves still work: a session binds through a follower.
	if a, err := chat(ctx, follower, "honest", "hello"); err != nil || a.status != http.StatusOK {
		t.Errorf("a session through %s after the intrusion: %+v, %v", follower.ID, a, err)
	}
}

// gossipIntruder joins the cluster's gossip with its key alone (no certificate, no Raft
// address) and reports every worker of ids down, as a replica whose probes all fail would.
func gossipIntruder(t *testing.T, ctx context.Context, name string, key []byte, seeds, ids []string) *gossip.Gossip {
	t.Helper()
	addr, err := loopback.Addr()
	if err != nil {
		t.Fatal(err)
	}
	g, err := gossip.New(gossip.Config{Name: name, BindAddr: addr, Seeds: seeds, SecretKey: key,
		Meta: gossip.Meta{ID: name}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = g.Shutdown() })
	if _, err := g.Join(ctx); err != nil {
		t.Fatalf("%s joins gossip: %v", name, err)
	}
	v := hints.NewHealthView(name, hints.HealthViewOptions{})
	for _, id := range ids {
		for range 5 {
			v.Observe(id, false)
		}
	}
	go v.Run(ctx, g, 100*time.Millisecond)
	return g
}

func TestGossipMembersWithTheKeyAloneTakeNoWorkerOutAndChangeNoBinding(t *testing.T) {
	fl := startFleet(t, 2)
	ca := testpki.NewCA(t, "kvrouter-ha cluster CA")
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	const grace = 2 * time.Second
	c := hardenedCluster(t, 3, fl, ca, "--gossip-key", base64.StdEncoding.EncodeToString(key), "--worker-grace", grace.String())
	lead := c.leader()
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()

	// Sessions bound before the intruders come.
	type bound struct {
		worker   string
		revision uint64
	}
	sessions := map[string]bound{}
	for i := range 8 {
		s := fmt.Sprintf("s%d", i)
		a, err := chat(ctx, c.replicas[i%3], s, "a prompt of session "+s)
		if err != nil || a.status != http.StatusOK {
			t.Fatalf("session %s: %+v, %v", s, a, err)
		}
		sessions[s] = bound{a.worker, a.revision}
	}

	var seeds []string
	for _, r := range c.replicas {
		seeds = append(seeds, r.Gossip)
	}
	for _, name := range []string{"intruder1", "intruder2"} {
		gossipIntruder(t, ctx, name, key, seeds, fl.ids)
	}
	// Every replica counts the intruders as live gossip members (3 replicas + 2).
	for _, r := range c.replicas {
		poll.Until(t, 30*time.Second, func() error {
			m, err := luaScrape(ctx, r.Admin)
			if err != nil {
				return err
			}
			if n := luaSum(m, "kvrouter_gossip_members", `state="alive"`); n != 5 {
				return fmt.Errorf("%s sees %v alive gossip members, want 5", r.ID, n)
			}
			return nil
		})
	}

	// For three graces (the reports are resent every second and stay fresh) every replica
	// stays ready with every worker routable, and new requests succeed. The first failure is
	// reported and the window still runs out, so that the bindings are checked past the grace.
	end := time.Now().Add(3 * grace)
	checks, failures := 0, 0
	fail := func(format string, args ...any) {
		if failures == 0 {
			t.Errorf(format, args...)
		}
		failures++
	}
	pace := time.NewTicker(20 * time.Millisecond) // a round at most every 20 ms: the window, not the count, ends the loop
	defer pace.Stop()
	for ; time.Now().Before(end) && checks < 1000; <-pace.C {
		for _, r := range c.replicas {
			if err := r.ready(); err != nil {
				fail("after %d checks: %v", checks, err)
			}
			var ws []admin.WorkerView
			if err := proc.Get(ctx, httpClient, "http://"+r.Admin+"/admin/workers", &ws); err != nil {
				t.Fatal(err)
			}
			for _, w := range ws {
				if !w.Healthy {
					fail("after %d checks: %s took worker %s out of rotation on gossip's word: %+v", checks, r.ID, w.Spec.ID, w.WorkerStatus)
				}
			}
		}
		if a, err := chat(ctx, c.replicas[checks%3], "", fmt.Sprintf("prompt %d", checks)); err != nil || a.status != http.StatusOK {
			fail("a request during the intrusion: %+v, %v", a, err)
		}
		checks++
	}
	if failures > 0 {
		t.Errorf("%d failed checks in %d rounds", failures, checks)
	}
	t.Logf("%d rounds of checks over %s with two keyed gossip intruders reporting every worker down", checks, 3*grace)

	// No binding moved: the leader saw its own probes succeed throughout.
	for s, b := range sessions {
		var sv admin.SessionView
		if err := proc.Get(ctx, httpClient, "http://"+lead.Admin+"/admin/sessions/"+s, &sv); err != nil {
			t.Errorf("session %s: %v", s, err)
			continue
		}
		if sv.Worker != b.worker || sv.Revision != b.revision {
			t.Errorf("session %s moved from %s@%d to %s@%d", s, b.worker, b.revision, sv.Worker, sv.Revision)
		}
	}
}
