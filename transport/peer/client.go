package peer

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	grpcpeer "google.golang.org/grpc/peer"

	"github.com/kvrouter-ha/kvrouter-ha/transport/peer/peerpb"
)

// ClientOptions configure a Client or a Pool; the zero value dials plaintext with default
// limits.
type ClientOptions struct {
	// TLS, when set, dials TLS; give it RootCAs (the cluster CA) and, for mutual TLS,
	// Certificates. ServerName defaults to the host of the dialled address.
	TLS *tls.Config
	// MaxMessageBytes bounds a sent or received message; 0 means DefaultMaxMessageBytes.
	MaxMessageBytes int
}

// Client calls one replica's peer port. Its methods mirror Handler: a redirect comes back
// as *NotLeaderError, any other failure as *CallError. It is safe for concurrent use.
type Client struct {
	addr   string
	conn   *grpc.ClientConn
	rpc    peerpb.PeerClient
	pooled bool // owned by a Pool: Close is the pool's job
}

// Dial connects to the peer port at addr (host:port) and waits until the connection is
// ready or ctx ends, so a wrong or dead address fails here with a clear error. A Pool
// connects lazily instead.
func Dial(ctx context.Context, addr string, opts ClientOptions) (*Client, error) {
	c, err := newClient(addr, opts)
	if err != nil {
		return nil, err
	}
	c.conn.Connect()
	for {
		s := c.conn.GetState()
		if s == connectivity.Ready {
			return c, nil
		}
		if !c.conn.WaitForStateChange(ctx, s) {
			c.conn.Close()
			return nil, fmt.Errorf("dial peer %s (last state %s): %w", addr, s, ctx.Err())
		}
	}
}

func newClient(addr string, opts ClientOptions) (*Client, error) {
	if addr == "" {
		return nil, fmt.Errorf("%w: empty peer address", ErrInvalid)
	}
	limit := maxBytes(opts.MaxMessageBytes)
	creds := insecure.NewCredentials()
	if opts.TLS != nil {
		creds = credentials.NewTLS(opts.TLS)
	}
	conn, err := grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(limit), grpc.MaxCallSendMsgSize(limit)),
		// Notice a leader that vanished without a FIN (kill -9 of its host, a partition)
		// within seconds rather than at the OS's TCP timeout.
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 3 * time.Second, PermitWithoutStream: true}),
		// A replica that restarts comes back within seconds; gRPC's default reconnect
		// backoff (up to 120 s) would keep its pooled connection failing long after.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 2 * time.Second,
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("peer client %s: %w", addr, err)
	}
	return &Client{addr: addr, conn: conn, rpc: peerpb.NewPeerClient(conn)}, nil
}

// Addr is the peer address this client calls.
func (c *Client) Addr() string { return c.addr }

// Close releases the connection; on a client from a Pool it does nothing (Pool.Close
// owns it).
func (c *Client) Close() error {
	if c.pooled {
		return nil
	}
	return c.close()
}

func (c *Client) close() error {
	if err := c.conn.Close(); err != nil {
		return fmt.Errorf("close peer client %s: %w", c.addr, err)
	}
	return nil
}

// Apply forwards one encoded command; the answering replica must lead.
func (c *Client) Apply(ctx context.Context, command []byte) ([]byte, uint64, error) {
	resp, err := c.rpc.Apply(ctx, &peerpb.ApplyRequest{Command: command})
	if err != nil {
		return nil, 0, fromStatus(c.addr, "Apply", err)
	}
	return resp.GetResult(), resp.GetIndex(), nil
}

// ReadIndex asks the leader for its confirmed commit index.
func (c *Client) ReadIndex(ctx context.Context) (uint64, error) {
	resp, err := c.rpc.ReadIndex(ctx, &peerpb.ReadIndexRequest{})
	if err != nil {
		return 0, fromStatus(c.addr, "ReadIndex", err)
	}
	return resp.GetIndex(), nil
}

// Touch sends coalesced idle-timer touches to the leader.
func (c *Client) Touch(ctx context.Context, touches []Touch) error {
	req := &peerpb.TouchRequest{Touches: make([]*peerpb.Touch, len(touches))}
	for i, t := range touches {
		req.Touches[i] = &peerpb.Touch{Session: t.Session, Revision: t.Revision, End: t.End, AgeNanos: int64(t.Age)}
	}
	_, err := c.rpc.Touch(ctx, req)
	return fromStatus(c.addr, "Touch", err)
}

// Status asks the replica to describe itself.
func (c *Client) Status(ctx context.Context) (Status, error) {
	st, _, err := c.StatusCertified(ctx)
	return st, err
}

// StatusCertified is Status with the certificate the replica presented (nil over
// plaintext). The handshake verified it against the CA and the dialled host; whether it
// names the replica the answer describes is for the caller to check.
func (c *Client) StatusCertified(ctx context.Context) (Status, *x509.Certificate, error) {
	var p grpcpeer.Peer
	resp, err := c.rpc.Status(ctx, &peerpb.StatusRequest{}, grpc.Peer(&p))
	if err != nil {
		return Status{}, nil, fromStatus(c.addr, "Status", err)
	}
	return statusFromPB(resp), verifiedLeaf(p.AuthInfo), nil
}

// Join asks the leader to add a replica.
func (c *Client) Join(ctx context.Context, req JoinRequest) error {
	_, err := c.rpc.Join(ctx, &peerpb.JoinRequest{
		Id: req.ID, RaftAddr: req.RaftAddr, PeerAddr: req.PeerAddr, ClusterId: req.ClusterID, Voter: req.Voter,
	})
	return fromStatus(c.addr, "Join", err)
}

// Leave asks the leader to remove a replica.
func (c *Client) Leave(ctx context.Context, id string) error {
	_, err := c.rpc.Leave(ctx, &peerpb.LeaveRequest{Id: id})
	return fromStatus(c.addr, "Leave", err)
}

// Pool keeps one lazily connected Client per peer address, so replicas share long-lived
// connections instead of dialling per call. It is safe for concurrent use.
type Pool struct {
	opts    ClientOptions
	mu      sync.Mutex
	clients map[string]*Client
	closed  bool
}

// NewPool returns an empty pool whose clients use opts.
func NewPool(opts ClientOptions) *Pool {
	return &Pool{opts: opts, clients: map[string]*Client{}}
}

// Get returns the pool's client for addr, creating it on first use. It does not wait for
// a connection: a dead address shows up as an Unavailable *CallError on the first call.
func (p *Pool) Get(addr string) (*Client, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, ErrClosed
	}
	if c, ok := p.clients[addr]; ok {
		return c, nil
	}
	c, err := newClient(addr, p.opts)
	if err != nil {
		return nil, err
	}
	c.pooled = true
	p.clients[addr] = c
	return c, nil
}

// Forget closes and drops the client of addr (a replica that left for good); a later Get
// dials anew.
func (p *Pool) Forget(addr string) {
	p.mu.Lock()
	c, ok := p.clients[addr]
	delete(p.clients, addr)
	p.mu.Unlock()
	if ok {
		_ = c.close()
	}
}

// Close closes every client; Get fails with ErrClosed afterwards.
func (p *Pool) Close() error {
	p.mu.Lock()
	cs := p.clients
	p.clients, p.closed = nil, true
	p.mu.Unlock()
	var first error
	for _, c := range cs {
		if err := c.close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}
