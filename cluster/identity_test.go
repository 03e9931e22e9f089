package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/internal/testpki"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

func TestCertNamesItsReplicaByIDOrAdvertisedHost(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	leaf := func(hosts ...string) *x509.Certificate {
		return ca.Issue("leaf", testpki.ServerAndClient, hosts...).Leaf
	}
	for _, tc := range []struct {
		name  string
		cert  *x509.Certificate
		id    string
		addrs []string
		want  bool
	}{
		{"DNS SAN equal to the id", leaf("r1"), "r1", nil, true},
		{"id compared without case", leaf("R1"), "r1", nil, true},
		{"IP SAN of the raft address's host", leaf("127.0.0.7"), "r1", []string{"127.0.0.7:7000"}, true},
		{"DNS SAN of the peer address's host", leaf("r1.kvrouter.svc"), "r1", []string{"127.0.0.7:7000", "r1.kvrouter.svc:7001"}, true},
		{"another replica's id", leaf("r2"), "r1", []string{"127.0.0.7:7000"}, false},
		{"another host", leaf("intruder.example", "127.0.0.8"), "r1", []string{"127.0.0.7:7000", "r1.kvrouter.svc:7001"}, false},
		{"a wildcard covers the advertised host", leaf("*.kvrouter.svc"), "r1", []string{"r1.kvrouter.svc:7001"}, true},
		{"a wildcard is no id", leaf("*.kvrouter.svc"), "r1", []string{"127.0.0.7:7000"}, false},
		{"empty id and address", leaf("intruder.example"), "", []string{""}, false},
		{"no certificate", nil, "r1", []string{"127.0.0.7:7000"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := certNames(tc.cert, tc.id, tc.addrs...); got != tc.want {
				t.Fatalf("certNames = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestRaftTLSRefusesACertificateOfTheCAThatVerifyRefuses(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	// The member's check admits the replica named "a" and nobody else, as Node.verifyRaftPeer
	// admits only the servers of its configuration.
	verify := func(c *x509.Certificate) error {
		if !certNames(c, "a") {
			return errNotReplica
		}
		return nil
	}
	member, err := listenTransport("127.0.0.1:0", nil, replicaTLS(ca, "member", ca), verify, 2, 5*time.Second, hclog.NewNullLogger())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { member.Close() })
	got := answerAppendEntries(t, member)

	named := tlsTestTransport(t, testpki.MutualConfig(ca.Issue("a", testpki.ServerAndClient, "a", "127.0.0.1"), ca))
	if _, err := appendOne(named, member.LocalAddr()); err != nil {
		t.Fatalf("a replica the check admits was refused: %v", err)
	}
	<-got
	stranger := tlsTestTransport(t, testpki.MutualConfig(ca.Issue("intruder", testpki.ServerAndClient, "intruder.example", "127.0.0.1"), ca))
	if resp, err := appendOne(stranger, member.LocalAddr()); err == nil {
		t.Fatalf("a certificate of the CA naming no replica got an answer: %+v", resp)
	}
	select {
	case req := <-got:
		t.Fatalf("the member's consumer received the stranger's RPC: %+v", req)
	default:
	}
}

func TestANodeWithoutConfigurationTakesAnyCertificateOfItsCA(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	n := &Node{} // no raft yet: no configuration
	if err := n.verifyRaftPeer(ca.Issue("anyone", testpki.ServerAndClient, "anyone.example").Leaf); err != nil {
		t.Fatalf("a node with no configuration refused a certificate of its CA: %v", err)
	}
}

// certifiedMem is a Remote whose every replica answers Status as st, over a certificate
// cert.
type certifiedMem struct {
	Remote
	st   peer.Status
	cert *x509.Certificate
}

func (r certifiedMem) CertifiedStatusOf(context.Context, string) (peer.Status, *x509.Certificate, error) {
	return r.st, r.cert, nil
}

func TestReconcileMovesAServerOnlyForACertificateNamingIt(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	r1 := raft.Server{ID: "r1", Address: "127.0.0.1:7000", Suffrage: raft.Voter}
	// r1 "moves" to 127.0.0.9: gossip and its (new) peer port agree on it.
	m := gossip.Member{Name: "r1", State: gossip.Alive, Meta: gossip.Meta{ID: "r1", RaftAddr: "127.0.0.9:7000", PeerAddr: "127.0.0.9:7001"}}
	st := peer.Status{ID: "r1", RaftAddr: "127.0.0.9:7000", PeerAddr: "127.0.0.9:7001"}
	for _, tc := range []struct {
		name   string
		cert   *x509.Certificate
		server *raft.Server
		moves  bool
	}{
		{"a certificate for the new host only", ca.Issue("intruder", testpki.ServerAndClient, "127.0.0.9").Leaf, &r1, false},
		{"a certificate naming r1's id", ca.Issue("r1", testpki.ServerAndClient, "r1", "127.0.0.9").Leaf, &r1, true},
		{"a certificate naming r1's address", ca.Issue("r1", testpki.ServerAndClient, "127.0.0.1", "127.0.0.9").Leaf, &r1, true},
		{"a new member proves only its own host", ca.Issue("r1", testpki.ServerAndClient, "127.0.0.9").Leaf, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := &Node{cfg: Config{RaftTLS: &tls.Config{}, Remote: certifiedMem{st: st, cert: tc.cert}}, fsm: fsm.New(fsm.Options{})}
			why := n.confirmMember(t.Context(), m, tc.server)
			if (why == "") != tc.moves {
				t.Fatalf("confirmMember = %q, want admitted %v", why, tc.moves)
			}
		})
	}
}
