package cluster

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// A certificate names a replica (DESIGN.md, "A certificate names its replica") when one of
// its DNS SANs is the replica's id, or when it is valid, as a server certificate would be,
// for the host of an address the replica advertises: its Raft address in the
// configuration, its peer address in the FSM's member record (an IP SAN, a DNS SAN, or a
// wildcard DNS SAN covering it). The CA vouches for the certificate; the name ties it to a
// replica, so a certificate the same CA issued to some other host is no replica's.

// errNotReplica is the refusal of a certificate that names no replica allowed to make the call.
var errNotReplica = errors.New("the client certificate names no replica in the raft configuration")

// certNames reports whether cert names the replica id, or one of addrs (host:port or host).
func certNames(cert *x509.Certificate, id string, addrs ...string) bool {
	if cert == nil {
		return false
	}
	if id != "" && slices.ContainsFunc(cert.DNSNames, func(d string) bool { return strings.EqualFold(d, id) }) {
		return true
	}
	for _, a := range addrs {
		host := a
		if h, _, err := net.SplitHostPort(a); err == nil {
			host = h
		}
		if host != "" && cert.VerifyHostname(host) == nil {
			return true
		}
	}
	return false
}

// configuredServer returns the id of the server of the current Raft configuration that
// cert names ("": none); empty reports that there is no configuration yet.
func (n *Node) configuredServer(cert *x509.Certificate) (id string, empty bool) {
	servers := n.servers()
	for _, s := range servers {
		if certNames(cert, string(s.ID), n.memberAddrs(s)...) {
			return string(s.ID), false
		}
	}
	return "", len(servers) == 0
}

// servers is the latest Raft configuration's servers (none before Raft runs or has one).
func (n *Node) servers() []raft.Server {
	r := n.raftp.Load()
	if r == nil {
		return nil
	}
	f := r.GetConfiguration()
	if f.Error() != nil {
		return nil
	}
	return f.Configuration().Servers
}

// memberAddrs are server s's addresses: its Raft address, and its peer address when the
// FSM records one.
func (n *Node) memberAddrs(s raft.Server) []string {
	addrs := []string{string(s.Address)}
	if m, ok := n.fsm.Member(string(s.ID)); ok {
		addrs = append(addrs, m.PeerAddr)
	}
	return addrs
}

// verifyRaftPeer is the Raft port's check of a connection's client certificate, after the
// handshake verified it against the CA: it must name a server of the current configuration.
// A node with no configuration yet (new, waiting to be bootstrapped or added) takes any
// certificate of the CA: the leader adding it is not in a configuration it does not have,
// and it has no state a stranger could damage.
func (n *Node) verifyRaftPeer(cert *x509.Certificate) error {
	id, empty := n.configuredServer(cert)
	if id != "" || empty {
		return nil
	}
	return fmt.Errorf("raft: %w (subject %q)", errNotReplica, cert.Subject.String())
}

// AuthorizeMember is the peer port's check for calls only a configured replica may make
// (forwarded commands, read-index, touches, leave, index snapshots): under mutual TLS the
// caller's certificate must name a server of the Raft configuration. Without TLS there is
// no identity to check (nil).
func (n *Node) AuthorizeMember(ctx context.Context) error {
	if n.cfg.RaftTLS == nil {
		return nil
	}
	cert := peer.ClientCertificate(ctx)
	if cert == nil {
		return fmt.Errorf("%w: no client certificate", peer.ErrPermission)
	}
	if id, _ := n.configuredServer(cert); id == "" {
		return fmt.Errorf("%w: %w (subject %q)", peer.ErrPermission, errNotReplica, cert.Subject.String())
	}
	return nil
}

// authorizeJoin is the peer port's check of a join: under mutual TLS the caller's
// certificate must name the replica it asks to add. For a replica already in the
// configuration that means its id or the addresses it has there (a join that moves it to
// new addresses needs a certificate naming its id); for a new one, its id or the Raft or
// peer address it asks to be added at. So one replica's certificate cannot add another,
// or move it, and a stranger's cannot take a replica's place.
func (n *Node) authorizeJoin(ctx context.Context, req peer.JoinRequest) error {
	if n.cfg.RaftTLS == nil {
		return nil
	}
	cert := peer.ClientCertificate(ctx)
	var names bool
	if addrs, known := n.serverAddrs(req.ID); known {
		names = certNames(cert, req.ID, addrs...)
	} else {
		names = certNames(cert, req.ID, req.RaftAddr, req.PeerAddr)
	}
	if !names {
		subject := "none"
		if cert != nil {
			subject = cert.Subject.String()
		}
		return fmt.Errorf("%w: a join for replica %s at %s must come with a certificate naming it (client certificate %q)",
			peer.ErrPermission, req.ID, req.RaftAddr, subject)
	}
	return nil
}

// serverAddrs returns the addresses server id has in the current configuration (its Raft
// address, and its peer address when the FSM records one); known is false when it has none.
func (n *Node) serverAddrs(id string) (addrs []string, known bool) {
	for _, s := range n.servers() {
		if string(s.ID) == id {
			return n.memberAddrs(s), true
		}
	}
	return nil, false
}

// IsServer reports whether id is a voter of the current Raft configuration (under mutual
// TLS, one admitted by its certificate). It is what makes a gossip member's word count.
func (n *Node) IsServer(id string) bool {
	for _, s := range n.servers() {
		if string(s.ID) == id {
			return s.Suffrage == raft.Voter
		}
	}
	return false
}
