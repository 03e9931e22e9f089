package cluster

import (
	"context"
	"crypto/x509"
	"log/slog"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// peerRemote is the Remote of a real replica: gRPC over the peer port, leader-only calls
// through a Forwarder, linearizable reads batched so concurrent readers share a round.
type peerRemote struct {
	pool  *peer.Pool
	fwd   *peer.Forwarder
	reads *peer.ReadIndexBatcher
}

// newPeerRemote returns the Remote that reaches other replicas through pool; leader names
// the current leader's peer address as this replica's Raft view knows it.
func newPeerRemote(pool *peer.Pool, leader peer.LeaderFunc, log *slog.Logger) Remote {
	// A short backoff: while a new leader is elected, a bind should go through the moment it exists.
	fwd := peer.NewForwarder(pool, leader, peer.ForwarderOptions{Logger: log, MaxBackoff: 40 * time.Millisecond})
	return &peerRemote{pool: pool, fwd: fwd, reads: peer.NewReadIndexBatcher(fwd.ReadIndex)}
}

func (r *peerRemote) Apply(ctx context.Context, cmd []byte) ([]byte, uint64, error) {
	return r.fwd.Forward(ctx, cmd)
}

func (r *peerRemote) ReadIndex(ctx context.Context) (uint64, error) { return r.reads.ReadIndex(ctx) }

func (r *peerRemote) Touch(ctx context.Context, ts []peer.Touch) error { return r.fwd.Touch(ctx, ts) }

func (r *peerRemote) Leave(ctx context.Context, id string) error { return r.fwd.Leave(ctx, id) }

func (r *peerRemote) StatusOf(ctx context.Context, addr string) (peer.Status, error) {
	c, err := r.pool.Get(addr)
	if err != nil {
		return peer.Status{}, err
	}
	return c.Status(ctx)
}

// CertifiedStatusOf is StatusOf with the certificate the replica presented.
func (r *peerRemote) CertifiedStatusOf(ctx context.Context, addr string) (peer.Status, *x509.Certificate, error) {
	c, err := r.pool.Get(addr)
	if err != nil {
		return peer.Status{}, nil, err
	}
	return c.StatusCertified(ctx)
}

func (r *peerRemote) JoinAt(ctx context.Context, addr string, req peer.JoinRequest) error {
	return r.fwd.JoinVia(ctx, addr, req)
}
