package cluster

import (
	"crypto/tls"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/internal/testpki"
)

// replicaTLS is a replica's TLS config: a certificate from ca for 127.0.0.1, trusting trust.
func replicaTLS(ca *testpki.CA, name string, trust *testpki.CA) *tls.Config {
	return testpki.MutualConfig(ca.Issue(name, testpki.ServerAndClient, "127.0.0.1"), trust)
}

// tlsTestTransport is a Raft TLS transport on 127.0.0.1, closed at cleanup.
func tlsTestTransport(t *testing.T, cfg *tls.Config) *raft.NetworkTransport {
	t.Helper()
	tr, err := listenTransport("127.0.0.1:0", nil, cfg, nil, 2, 5*time.Second, hclog.NewNullLogger())
	if err != nil {
		t.Fatalf("TLS transport: %v", err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

// answerAppendEntries answers every AppendEntries that reaches tr with success, and
// counts them on got.
func answerAppendEntries(t *testing.T, tr *raft.NetworkTransport) <-chan *raft.AppendEntriesRequest {
	got := make(chan *raft.AppendEntriesRequest, 16)
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	go func() {
		for {
			select {
			case <-done:
				return
			case rpc := <-tr.Consumer():
				req, ok := rpc.Command.(*raft.AppendEntriesRequest)
				if !ok {
					rpc.Respond(nil, nil)
					continue
				}
				got <- req
				rpc.Respond(&raft.AppendEntriesResponse{Term: req.Term, LastLog: req.PrevLogEntry + uint64(len(req.Entries)), Success: true}, nil)
			}
		}
	}()
	return got
}

func appendOne(from *raft.NetworkTransport, to raft.ServerAddress) (*raft.AppendEntriesResponse, error) {
	req := &raft.AppendEntriesRequest{
		RPCHeader: raft.RPCHeader{ID: []byte("a"), Addr: []byte(from.LocalAddr())},
		Term:      3, PrevLogEntry: 7, PrevLogTerm: 2,
		Entries: []*raft.Log{{Index: 8, Term: 3, Type: raft.LogCommand, Data: []byte("bind")}},
	}
	var resp raft.AppendEntriesResponse
	err := from.AppendEntries("b", to, req, &resp)
	return &resp, err
}

func TestRaftTLSTransportsExchangeAppendEntries(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	a := tlsTestTransport(t, replicaTLS(ca, "a", ca))
	b := tlsTestTransport(t, replicaTLS(ca, "b", ca))
	got := answerAppendEntries(t, b)
	resp, err := appendOne(a, b.LocalAddr())
	if err != nil {
		t.Fatalf("AppendEntries over mutual TLS: %v", err)
	}
	if !resp.Success || resp.Term != 3 || resp.LastLog != 8 {
		t.Fatalf("answer %+v, want success at term 3, last log 8", resp)
	}
	select {
	case req := <-got:
		if len(req.Entries) != 1 || string(req.Entries[0].Data) != "bind" {
			t.Fatalf("entries arrived as %+v", req.Entries)
		}
	default:
		t.Fatal("b answered but its consumer saw no AppendEntries")
	}
}

func TestRaftTLSRefusesUntrustedPeersBothWays(t *testing.T) {
	ca, other := testpki.NewCA(t, "cluster CA"), testpki.NewCA(t, "another CA")
	member := tlsTestTransport(t, replicaTLS(ca, "member", ca))
	got := answerAppendEntries(t, member)

	// A forged client: its certificate is from another CA, though it trusts the cluster's.
	forged := tlsTestTransport(t, replicaTLS(other, "forged", ca))
	if _, err := appendOne(forged, member.LocalAddr()); err == nil {
		t.Fatal("a replica with a certificate from another CA got an AppendEntries answered")
	} else if !strings.Contains(err.Error(), "certificate") {
		t.Errorf("the refusal does not mention the certificate: %v", err)
	} else {
		t.Logf("forged client refused: %v", err)
	}

	// A member dialling a server whose certificate is from another CA refuses it.
	stranger := tlsTestTransport(t, replicaTLS(other, "stranger", other))
	strangerGot := answerAppendEntries(t, stranger)
	if _, err := appendOne(member, stranger.LocalAddr()); err == nil {
		t.Fatal("a member sent AppendEntries to a server with a certificate from another CA")
	} else if !strings.Contains(err.Error(), "unknown authority") {
		t.Errorf("the refusal does not say the authority is unknown: %v", err)
	} else {
		t.Logf("stranger refused: %v", err)
	}

	// Plain TCP Raft gets no answer from a TLS port.
	plain, err := raft.NewTCPTransportWithLogger("127.0.0.1:0", nil, 1, 2*time.Second, hclog.NewNullLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if _, err := appendOne(plain, member.LocalAddr()); err == nil {
		t.Fatal("a plaintext AppendEntries was answered on the TLS port")
	}

	select {
	case req := <-got:
		t.Fatalf("the member's consumer received an RPC from an untrusted peer: %+v", req)
	case req := <-strangerGot:
		t.Fatalf("the stranger received the member's RPC: %+v", req)
	default:
	}
}

func TestRaftTLSTransportAdvertisesItsAdvertiseAddress(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	adv := &net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 7999}
	tr, err := listenTransport("127.0.0.1:0", adv, replicaTLS(ca, "a", ca), nil, 1, time.Second, hclog.NewNullLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if got := tr.LocalAddr(); got != "127.0.0.1:7999" {
		t.Fatalf("LocalAddr %s, want the advertised 127.0.0.1:7999", got)
	}
	if _, err := listenTransport("127.0.0.1:0", &net.TCPAddr{IP: net.IPv4zero, Port: 1}, replicaTLS(ca, "b", ca), nil, 1, time.Second, hclog.NewNullLogger()); err == nil {
		t.Fatal("an unspecified advertise address was accepted")
	}
	if _, err := listenTransport("127.0.0.1:0", nil, &tls.Config{}, nil, 1, time.Second, hclog.NewNullLogger()); err == nil {
		t.Fatal("a TLS config without a certificate was accepted")
	}
}
