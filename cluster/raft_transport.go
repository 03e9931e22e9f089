package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
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

// newTransport is Raft's network transport on ln (bound by the caller, or by
// listenTransport), advertising advertise (nil: ln's own address). With cfg it runs mutual
// TLS: accepted connections must present a client certificate that verifies against
// cfg.ClientCAs, and dials verify the server against cfg.RootCAs (ServerName defaults to the
// dialled host, so certificates need a SAN for every address replicas advertise) while
// presenting cfg's certificate. verify (nil: none) then checks the verified client
// certificate of each accepted connection: an error closes the connection before Raft reads
// a byte of it, so a certificate of the CA that names no replica gets no RPC applied. It
// takes ln over: closing the transport closes it, and so does a failure here.
func newTransport(ln net.Listener, advertise net.Addr, cfg *tls.Config, verify func(*x509.Certificate) error, maxPool int, timeout time.Duration, logger hclog.Logger) (*raft.NetworkTransport, error) {
	stream, err := newStreamLayer(ln, advertise, cfg, verify)
	if err != nil {
		ln.Close()
		return nil, err
	}
	return raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: stream, MaxPool: maxPool, Timeout: timeout, Logger: logger,
	}), nil
}

// listenTransport binds bind and returns newTransport on it.
func listenTransport(bind string, advertise net.Addr, cfg *tls.Config, verify func(*x509.Certificate) error, maxPool int, timeout time.Duration, logger hclog.Logger) (*raft.NetworkTransport, error) {
	ln, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, err
	}
	return newTransport(ln, advertise, cfg, verify, maxPool, timeout, logger)
}

// streamLayer is a raft.StreamLayer over TCP, with mutual TLS when server and client are set.
type streamLayer struct {
	ln        net.Listener
	advertise net.Addr
	server    *tls.Config
	client    *tls.Config
	verify    func(*x509.Certificate) error // nil: the CA's word is enough
}

func newStreamLayer(ln net.Listener, advertise net.Addr, cfg *tls.Config, verify func(*x509.Certificate) error) (*streamLayer, error) {
	s := &streamLayer{ln: ln, advertise: advertise, verify: verify}
	if cfg != nil {
		if len(cfg.Certificates) == 0 && cfg.GetCertificate == nil {
			return nil, errors.New("cluster: raft TLS needs this replica's certificate")
		}
		s.server = cfg.Clone()
		// Mutual TLS is the point: a replica that cannot show a certificate from the cluster's
		// CA must not get a word of the log.
		s.server.ClientAuth = tls.RequireAndVerifyClientCert
		s.client = cfg.Clone()
	}
	if s.advertise == nil {
		s.advertise = ln.Addr()
	}
	// The same checks raft.NewTCPTransport makes: peers must be able to dial what we tell them.
	addr, ok := s.advertise.(*net.TCPAddr)
	if !ok {
		return nil, fmt.Errorf("cluster: raft advertise address %s is not TCP", s.advertise)
	}
	if addr.IP == nil || addr.IP.IsUnspecified() {
		return nil, fmt.Errorf("cluster: raft advertise address %s is not one peers can dial", s.advertise)
	}
	return s, nil
}

// Accept returns the next connection; under TLS its handshake runs on its first read or
// write, in Raft's per-connection goroutine, so a slow client never stalls the accept loop.
func (s *streamLayer) Accept() (net.Conn, error) {
	c, err := s.ln.Accept()
	if err != nil || s.server == nil {
		return c, err
	}
	return &tlsServerConn{Conn: tls.Server(c, s.server), timeout: raftTLSHandshakeTimeout, verify: s.verify}, nil
}

// Close stops the listener.
func (s *streamLayer) Close() error { return s.ln.Close() }

// Addr is the advertised address, which Raft tells the other replicas.
func (s *streamLayer) Addr() net.Addr { return s.advertise }

// Dial connects (and completes the TLS handshake) within timeout. With TLS 1.3 a server
// that rejects our certificate says so on the first read, which Raft reports as the RPC's
// error.
func (s *streamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	if s.client == nil {
		return net.DialTimeout("tcp", string(address), timeout)
	}
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

// tlsServerConn is an accepted connection whose handshake is bounded in time, and whose
// client certificate passes verify before a byte is read.
type tlsServerConn struct {
	*tls.Conn
	timeout time.Duration
	verify  func(*x509.Certificate) error
	once    sync.Once
	err     error
}

func (c *tlsServerConn) handshake() error {
	c.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
		defer cancel()
		if err := c.Conn.HandshakeContext(ctx); err != nil {
			c.err = fmt.Errorf("raft TLS handshake with %s: %w", c.RemoteAddr(), err)
			return
		}
		if c.verify == nil {
			return
		}
		// RequireAndVerifyClientCert guarantees a verified certificate here.
		if err := c.verify(c.ConnectionState().PeerCertificates[0]); err != nil {
			c.err = fmt.Errorf("raft connection from %s refused: %w", c.RemoteAddr(), err)
			_ = c.Conn.Close()
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
