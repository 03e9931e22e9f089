package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
)

// raftTLSHandshakeTimeout bounds an accepted Raft connection's TLS handshake. Raft reads
// an accepted connection without a deadline, so a peer (or a port scanner) that connects
// and says nothing would otherwise hold a goroutine and a descriptor for ever.
const raftTLSHandshakeTimeout = 10 * time.Second

// newTLSTransport is Raft's network transport over mutual TLS: the listener on bind
// requires a client certificate that verifies against cfg.ClientCAs, and dials verify the
// server against cfg.RootCAs (ServerName defaults to the dialled host, so certificates
// need a SAN for every address replicas advertise) while presenting cfg's certificate.
// advertise is what other replicas dial, as with raft.NewTCPTransport.
func newTLSTransport(bind string, advertise net.Addr, cfg *tls.Config, maxPool int, timeout time.Duration, logger hclog.Logger) (*raft.NetworkTransport, error) {
	stream, err := newTLSStreamLayer(bind, advertise, cfg)
	if err != nil {
		return nil, err
	}
	return raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: stream, MaxPool: maxPool, Timeout: timeout, Logger: logger,
	}), nil
}

// tlsStreamLayer is a raft.StreamLayer over TCP with mutual TLS.
type tlsStreamLayer struct {
	ln        net.Listener
	advertise net.Addr
	server    *tls.Config
	client    *tls.Config
}

func newTLSStreamLayer(bind string, advertise net.Addr, cfg *tls.Config) (*tlsStreamLayer, error) {
	if cfg == nil || len(cfg.Certificates) == 0 && cfg.GetCertificate == nil {
		return nil, errors.New("cluster: raft TLS needs this replica's certificate")
	}
	server := cfg.Clone()
	// Mutual TLS is the point: a replica that cannot show a certificate from the cluster's
	// CA must not get a word of the log.
	server.ClientAuth = tls.RequireAndVerifyClientCert
	client := cfg.Clone()
	ln, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, err
	}
	if advertise == nil {
		advertise = ln.Addr()
	}
	// The same checks raft.NewTCPTransport makes: peers must be able to dial what we tell them.
	addr, ok := advertise.(*net.TCPAddr)
	if !ok {
		ln.Close()
		return nil, fmt.Errorf("cluster: raft advertise address %s is not TCP", advertise)
	}
	if addr.IP == nil || addr.IP.IsUnspecified() {
		ln.Close()
		return nil, fmt.Errorf("cluster: raft advertise address %s is not one peers can dial", advertise)
	}
	return &tlsStreamLayer{ln: ln, advertise: advertise, server: server, client: client}, nil
}

// Accept returns the next connection; its TLS handshake runs on its first read or write,
// in Raft's per-connection goroutine, so a slow client never stalls the accept loop.
func (s *tlsStreamLayer) Accept() (net.Conn, error) {
	c, err := s.ln.Accept()
	if err != nil {
		return nil, err
	}
	return &tlsServerConn{Conn: tls.Server(c, s.server), timeout: raftTLSHandshakeTimeout}, nil
}

// Close stops the listener.
func (s *tlsStreamLayer) Close() error { return s.ln.Close() }

// Addr is the advertised address, which Raft tells the other replicas.
func (s *tlsStreamLayer) Addr() net.Addr { return s.advertise }

// Dial connects and completes the TLS handshake within timeout. With TLS 1.3 a server
// that rejects our certificate says so on the first read, which Raft reports as the RPC's
// error.
func (s *tlsStreamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	ctx := context.Background()
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	// tls.Dialer takes ServerName from the dialled host when the config leaves it empty.
	d := tls.Dialer{Config: s.client}
	c, err := d.DialContext(ctx, "tcp", string(address))
	if err != nil {
		return nil, fmt.Errorf("raft TLS dial %s: %w", address, err)
	}
	return c, nil
}

// tlsServerConn is an accepted connection whose handshake is bounded in time.
type tlsServerConn struct {
	*tls.Conn
	timeout time.Duration
	once    sync.Once
	err     error
}

func (c *tlsServerConn) handshake() error {
	c.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
		defer cancel()
		if err := c.Conn.HandshakeContext(ctx); err != nil {
			c.err = fmt.Errorf("raft TLS handshake with %s: %w", c.RemoteAddr(), err)
		}
	})
	return c.err
}

func (c *tlsServerConn) Read(p []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	return c.Conn.Read(p)
}

func (c *tlsServerConn) Write(p []byte) (int, error) {
	if err := c.handshake(); err != nil {
		return 0, err
	}
	return c.Conn.Write(p)
}
