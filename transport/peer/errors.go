package peer

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrouter-ha/kvrouter-ha/transport/peer/peerpb"
)

// CallError is a failed peer call other than a redirect (a redirect is *NotLeaderError).
// It unwraps to ErrInvalid, ErrUnavailable, ErrPermission, ErrNotWarm (IndexSnapshot only),
// context.Canceled or context.DeadlineExceeded when its code means one of those, so callers
// test it with errors.Is and need not know gRPC codes.
type CallError struct {
	Addr    string // the peer address called
	Method  string // Apply, ReadIndex, ...
	Code    codes.Code
	Message string
}

// Error describes the failed call.
func (e *CallError) Error() string {
	return fmt.Sprintf("peer %s %s: %s: %s", e.Addr, e.Method, e.Code, e.Message)
}

// Unwrap maps the gRPC code to the sentinel errors of this package and of context.
func (e *CallError) Unwrap() error {
	switch e.Code {
	case codes.InvalidArgument:
		return ErrInvalid
	case codes.Unavailable:
		return ErrUnavailable
	case codes.PermissionDenied:
		return ErrPermission
	case codes.Canceled:
		return context.Canceled
	case codes.DeadlineExceeded:
		return context.DeadlineExceeded
	case codes.FailedPrecondition:
		// Only IndexSnapshot answers FailedPrecondition without a redirect detail.
		if e.Method == "IndexSnapshot" {
			return ErrNotWarm
		}
	}
	return nil
}

// GRPCStatus lets status.Code and status.FromError see the original code.
func (e *CallError) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

// toStatus turns a handler's error into the gRPC status the caller receives.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	var nl *NotLeaderError
	switch {
	case errors.As(err, &nl):
		st, derr := status.New(codes.FailedPrecondition, nl.Error()).
			WithDetails(&peerpb.NotLeader{LeaderId: nl.LeaderID, LeaderPeerAddr: nl.LeaderAddr})
		if derr != nil {
			return status.Error(codes.Internal, fmt.Sprintf("encoding a redirect: %v", derr))
		}
		return st.Err()
	case errors.Is(err, ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, ErrPermission):
		return status.Error(codes.PermissionDenied, err.Error())
	case errors.Is(err, ErrNotWarm):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, ErrUnavailable):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	}
	if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown {
		return st.Err()
	}
	return status.Error(codes.Internal, err.Error())
}

// fromStatus turns the error of a gRPC call into *NotLeaderError or *CallError.
func fromStatus(addr, method string, err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return &CallError{Addr: addr, Method: method, Code: codes.Unknown, Message: err.Error()}
	}
	if st.Code() == codes.FailedPrecondition {
		for _, d := range st.Details() {
			if nl, ok := d.(*peerpb.NotLeader); ok {
				return &NotLeaderError{LeaderID: nl.GetLeaderId(), LeaderAddr: nl.GetLeaderPeerAddr()}
			}
		}
	}
	return &CallError{Addr: addr, Method: method, Code: st.Code(), Message: st.Message()}
}
