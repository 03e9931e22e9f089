package peer

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"runtime/debug"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	grpcpeer "google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kvrouter-ha/kvrouter-ha/transport/peer/peerpb"
)

// Defaults of ServerOptions.
const (
	DefaultStopTimeout      = 5 * time.Second
	DefaultHandshakeTimeout = 10 * time.Second
)

// ServerOptions configure a Server; the zero value serves plaintext with default limits.
type ServerOptions struct {
	// TLS, when set, serves TLS; set ClientAuth to tls.RequireAndVerifyClientCert and
	// ClientCAs for mutual TLS between replicas.
	TLS *tls.Config
	// Logger receives handler failures and recovered panics; nil discards them.
	Logger *slog.Logger
	// MaxMessageBytes bounds a received or sent message; 0 means DefaultMaxMessageBytes.
	MaxMessageBytes int
	// StopTimeout bounds the graceful part of Stop; 0 means DefaultStopTimeout.
	StopTimeout time.Duration
	// HandshakeTimeout bounds a new connection's handshake (TLS and HTTP/2 preface), so
	// a peer that connects and stalls or sends garbage cannot hold a slot; 0 means
	// DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// Snapshots, when set, serves IndexSnapshot; nil answers it Unimplemented.
	Snapshots SnapshotSource
	// Member, when set, is asked before every call that only a member of the cluster may
	// make (Apply, ReadIndex, Touch, Leave, IndexSnapshot; not Status, which any replica may
	// ask, nor Join, whose handler checks the joiner): an error refuses the call with
	// PermissionDenied. It reads the caller's certificate with ClientCertificate.
	Member func(ctx context.Context) error
}

// Server serves a Handler on the peer port.
type Server struct {
	grpc        *grpc.Server
	stopTimeout time.Duration
}

// NewServer returns a server that dispatches peer calls to h.
func NewServer(h Handler, opts ServerOptions) *Server {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	limit := maxBytes(opts.MaxMessageBytes)
	handshake := opts.HandshakeTimeout
	if handshake <= 0 {
		handshake = DefaultHandshakeTimeout
	}
	gopts := []grpc.ServerOption{
		grpc.MaxRecvMsgSize(limit),
		grpc.MaxSendMsgSize(limit),
		// Replicas keep long-lived connections; let their keepalive pings through
		// (client pings every 10 s) but cut a peer that pings abusively.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
		grpc.ConnectionTimeout(handshake),
		grpc.ChainUnaryInterceptor(recoverInterceptor(log), memberUnaryInterceptor(opts.Member, log)),
		grpc.ChainStreamInterceptor(memberStreamInterceptor(opts.Member, log)),
	}
	if opts.TLS != nil {
		gopts = append(gopts, grpc.Creds(credentials.NewTLS(opts.TLS)))
	}
	gs := grpc.NewServer(gopts...)
	peerpb.RegisterPeerServer(gs, &service{h: h, log: log, snap: opts.Snapshots, limit: limit})
	stop := opts.StopTimeout
	if stop <= 0 {
		stop = DefaultStopTimeout
	}
	return &Server{grpc: gs, stopTimeout: stop}
}

// Serve accepts connections on l until Stop; it returns nil after Stop.
func (s *Server) Serve(l net.Listener) error {
	if err := s.grpc.Serve(l); err != nil {
		return fmt.Errorf("peer serve %s: %w", l.Addr(), err)
	}
	return nil
}

// Stop stops accepting calls, lets calls in flight finish for up to StopTimeout, then
// closes every connection.
func (s *Server) Stop() {
	done := make(chan struct{})
	go func() {
		s.grpc.GracefulStop()
		close(done)
	}()
	t := time.NewTimer(s.stopTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		s.grpc.Stop()
		<-done
	}
}

// recoverInterceptor keeps a panicking handler from taking the replica down: the caller
// gets Internal and the stack goes to the log.
func recoverInterceptor(log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (resp any, err error) {
		defer func() {
			if r := recover(); r != nil {
				log.Error("peer handler panicked", "method", info.FullMethod, "panic", r, "stack", string(debug.Stack()))
				resp, err = nil, status.Errorf(codes.Internal, "handler panicked: %v", r)
			}
		}()
		resp, err = next(ctx, req)
		if err != nil && status.Code(err) == codes.Internal {
			log.Warn("peer call failed", "method", info.FullMethod, "err", err)
		}
		return resp, err
	}
}

// openMethod reports whether any caller the transport admits may make method: Status (a
// joiner asks the seeds before it is anyone's member) and Join (the handler checks that the
// caller's certificate names the joiner).
func openMethod(method string) bool {
	return method == peerpb.Peer_Status_FullMethodName || method == peerpb.Peer_Join_FullMethodName
}

// refuseNonMember asks member (nil: everyone is one) whether the caller may make method.
func refuseNonMember(ctx context.Context, member func(context.Context) error, method string, log *slog.Logger) error {
	if member == nil || openMethod(method) {
		return nil
	}
	if err := member(ctx); err != nil {
		addr := "unknown"
		if p, ok := grpcpeer.FromContext(ctx); ok && p.Addr != nil {
			addr = p.Addr.String()
		}
		log.Warn("peer call refused", "method", method, "from", addr, "err", err)
		if !errors.Is(err, ErrPermission) {
			err = fmt.Errorf("%w: %w", ErrPermission, err)
		}
		return toStatus(err)
	}
	return nil
}

// memberUnaryInterceptor refuses member-only unary calls of non-members.
func memberUnaryInterceptor(member func(context.Context) error, log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		if err := refuseNonMember(ctx, member, info.FullMethod, log); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

// memberStreamInterceptor refuses member-only streams (index snapshots) of non-members.
func memberStreamInterceptor(member func(context.Context) error, log *slog.Logger) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, next grpc.StreamHandler) error {
		if err := refuseNonMember(ss.Context(), member, info.FullMethod, log); err != nil {
			return err
		}
		return next(srv, ss)
	}
}

// ClientCertificate is the verified client certificate of the peer call ctx belongs to
// (nil: plaintext, or no certificate).
func ClientCertificate(ctx context.Context) *x509.Certificate {
	p, ok := grpcpeer.FromContext(ctx)
	if !ok {
		return nil
	}
	return verifiedLeaf(p.AuthInfo)
}

// verifiedLeaf is the other side's verified certificate of a connection (nil: plaintext, or
// none presented).
func verifiedLeaf(info credentials.AuthInfo) *x509.Certificate {
	ti, ok := info.(credentials.TLSInfo)
	if !ok || len(ti.State.VerifiedChains) == 0 || len(ti.State.VerifiedChains[0]) == 0 {
		return nil
	}
	return ti.State.VerifiedChains[0][0]
}

// service adapts a Handler to the generated gRPC interface.
type service struct {
	peerpb.UnimplementedPeerServer
	h     Handler
	log   *slog.Logger
	snap  SnapshotSource // nil: IndexSnapshot is Unimplemented
	limit int            // message bound, which snapshot chunks stay well under
}

func (s *service) Apply(ctx context.Context, req *peerpb.ApplyRequest) (*peerpb.ApplyResponse, error) {
	if len(req.GetCommand()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "apply: empty command")
	}
	res, idx, err := s.h.Apply(ctx, req.GetCommand())
	if err != nil {
		return nil, toStatus(err)
	}
	return &peerpb.ApplyResponse{Result: res, Index: idx}, nil
}

func (s *service) ReadIndex(ctx context.Context, _ *peerpb.ReadIndexRequest) (*peerpb.ReadIndexResponse, error) {
	idx, err := s.h.ReadIndex(ctx)
	if err != nil {
		return nil, toStatus(err)
	}
	return &peerpb.ReadIndexResponse{Index: idx}, nil
}

func (s *service) Touch(ctx context.Context, req *peerpb.TouchRequest) (*peerpb.TouchResponse, error) {
	ts := make([]Touch, 0, len(req.GetTouches()))
	for _, t := range req.GetTouches() {
		ts = append(ts, Touch{Session: t.GetSession(), Revision: t.GetRevision(), End: t.GetEnd(), Age: time.Duration(max(t.GetAgeNanos(), 0))})
	}
	if err := s.h.Touch(ctx, ts); err != nil {
		return nil, toStatus(err)
	}
	return &peerpb.TouchResponse{}, nil
}

func (s *service) Status(ctx context.Context, _ *peerpb.StatusRequest) (*peerpb.StatusResponse, error) {
	st, err := s.h.Status(ctx)
	if err != nil {
		return nil, toStatus(err)
	}
	return statusToPB(st), nil
}

func (s *service) Join(ctx context.Context, req *peerpb.JoinRequest) (*peerpb.JoinResponse, error) {
	err := s.h.Join(ctx, JoinRequest{
		ID: req.GetId(), RaftAddr: req.GetRaftAddr(), PeerAddr: req.GetPeerAddr(),
		ClusterID: req.GetClusterId(), Voter: req.GetVoter(),
	})
	if err != nil {
		return nil, toStatus(err)
	}
	return &peerpb.JoinResponse{}, nil
}

func (s *service) Leave(ctx context.Context, req *peerpb.LeaveRequest) (*peerpb.LeaveResponse, error) {
	if req.GetId() == "" {
		return nil, status.Error(codes.InvalidArgument, "leave: empty replica id")
	}
	if err := s.h.Leave(ctx, req.GetId()); err != nil {
		return nil, toStatus(err)
	}
	return &peerpb.LeaveResponse{}, nil
}

func statusToPB(s Status) *peerpb.StatusResponse {
	p := &peerpb.StatusResponse{
		Id: s.ID, RaftAddr: s.RaftAddr, PeerAddr: s.PeerAddr, State: s.State,
		LeaderId: s.LeaderID, LeaderPeerAddr: s.LeaderPeerAddr, Term: s.Term,
		CommitIndex: s.CommitIndex, AppliedIndex: s.AppliedIndex, LastContactMs: s.LastContactMs,
		ClusterId: s.ClusterID, Version: s.Version,
	}
	for _, d := range s.Discovery {
		p.Discovery = append(p.Discovery, &peerpb.DiscoverySource{
			Source: d.Source, LastGoodUnixMs: unixMs(d.LastGood), FailingSinceUnixMs: unixMs(d.FailingSince),
			Failures: uint32(max(d.Failures, 0)), LastError: d.LastError, SuspectDrains: uint32(max(d.SuspectDrains, 0)),
		})
	}
	return p
}

func statusFromPB(p *peerpb.StatusResponse) Status {
	s := Status{
		ID: p.GetId(), RaftAddr: p.GetRaftAddr(), PeerAddr: p.GetPeerAddr(), State: p.GetState(),
		LeaderID: p.GetLeaderId(), LeaderPeerAddr: p.GetLeaderPeerAddr(), Term: p.GetTerm(),
		CommitIndex: p.GetCommitIndex(), AppliedIndex: p.GetAppliedIndex(), LastContactMs: p.GetLastContactMs(),
		ClusterID: p.GetClusterId(), Version: p.GetVersion(),
	}
	for _, d := range p.GetDiscovery() {
		s.Discovery = append(s.Discovery, DiscoverySource{
			Source: d.GetSource(), LastGood: fromUnixMs(d.GetLastGoodUnixMs()), FailingSince: fromUnixMs(d.GetFailingSinceUnixMs()),
			Failures: int(min(d.GetFailures(), math.MaxInt32)), LastError: d.GetLastError(), SuspectDrains: int(min(d.GetSuspectDrains(), math.MaxInt32)),
		})
	}
	return s
}

// unixMs is t in Unix milliseconds, 0 for the zero time.
func unixMs(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMilli()
}

// fromUnixMs is the time of Unix milliseconds ms, the zero time for 0 (or less).
func fromUnixMs(ms int64) time.Time {
	if ms <= 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms).UTC()
}
