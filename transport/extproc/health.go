package extproc

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// The health services the protocol lists. Liveness is the process answering; readiness and
// the ext_proc service's own are the replica's readiness, on every replica alike: there is
// no leader among pickers, each one picks (active-active).
const (
	serviceLiveness  = "liveness"
	serviceReadiness = "readiness"
	serviceExtProc   = "envoy.service.ext_proc.v3.ExternalProcessor"
)

// health is the gRPC health service.
type health struct {
	healthpb.UnimplementedHealthServer
	p *Picker
}

// watchEvery is how often Watch looks at the readiness for a change.
const watchEvery = time.Second

func (h *health) status(service string) (healthpb.HealthCheckResponse_ServingStatus, error) {
	switch service {
	case serviceLiveness:
		return healthpb.HealthCheckResponse_SERVING, nil
	case "", serviceReadiness, serviceExtProc:
		if h.p.ready() != nil {
			return healthpb.HealthCheckResponse_NOT_SERVING, nil
		}
		return healthpb.HealthCheckResponse_SERVING, nil
	}
	return healthpb.HealthCheckResponse_SERVICE_UNKNOWN, status.Errorf(codes.NotFound, "unknown service %q", service)
}

// Check answers one service's status.
func (h *health) Check(_ context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	s, err := h.status(req.GetService())
	if err != nil {
		return nil, err
	}
	return &healthpb.HealthCheckResponse{Status: s}, nil
}

// List answers every service's status.
func (h *health) List(context.Context, *healthpb.HealthListRequest) (*healthpb.HealthListResponse, error) {
	out := &healthpb.HealthListResponse{Statuses: map[string]*healthpb.HealthCheckResponse{}}
	for _, svc := range []string{"", serviceLiveness, serviceReadiness, serviceExtProc} {
		s, _ := h.status(svc)
		out.Statuses[svc] = &healthpb.HealthCheckResponse{Status: s}
	}
	return out, nil
}

// Watch sends a service's status, then each change, until the caller goes.
func (h *health) Watch(req *healthpb.HealthCheckRequest, srv healthpb.Health_WatchServer) error {
	// A Watch holds its stream as long as the caller likes: it counts against the cap.
	if !h.p.admit() {
		return status.Errorf(codes.ResourceExhausted, "ext_proc: %d streams open, the most this picker takes (--ext-proc-max-streams)", h.p.cfg.MaxStreams)
	}
	defer h.p.release()
	last := healthpb.HealthCheckResponse_ServingStatus(-1)
	t := time.NewTicker(watchEvery)
	defer t.Stop()
	for {
		s, _ := h.status(req.GetService())
		if s != last {
			if err := srv.Send(&healthpb.HealthCheckResponse{Status: s}); err != nil {
				return err
			}
			last = s
		}
		select {
		case <-srv.Context().Done():
			return nil
		case <-t.C:
		}
	}
}
