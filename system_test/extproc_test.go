package system_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrouter-ha/kvrouter-ha/internal/envoytest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// startPickers starts three replicas with their endpoint pickers in front of fl (with the
// extra flags), and a gateway connected to each picker.
func startPickers(t *testing.T, fl *fleet, extra ...string) (*cluster, map[*replica]*envoytest.Gateway) {
	t.Helper()
	var workers []string
	for i, u := range fl.urls {
		workers = append(workers, fl.ids[i]+"="+u)
	}
	c := startClusterTuned(t, binary, 3, workers, func(r *proc.Replica) {
		addr, err := loopback.Addr()
		if err != nil {
			t.Fatal(err)
		}
		r.ExtProc = addr
	}, extra...)
	gws := map[*replica]*envoytest.Gateway{}
	for _, r := range c.replicas {
		gw, err := envoytest.Dial(r.ExtProc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { gw.Close() })
		gws[r] = gw
	}
	return c, gws
}

func chatBody(prompt string) []byte {
	return fmt.Appendf(nil, `{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":4}`, sim.DefaultModel, prompt)
}

// TestPickersAreActiveActiveAndKeepSessionsThroughAReplicaKill: three pickers over one
// fleet, each reporting serving; a session's requests sent through the three pick one
// endpoint; the replica holding a request's stream (the leader) is killed with SIGKILL
// before the answer: the gateway's stream breaks, and the session's next request, through
// another replica, goes to the same endpoint, as do every other session's.
func TestPickersAreActiveActiveAndKeepSessionsThroughAReplicaKill(t *testing.T) {
	fl := startFleet(t, 4)
	c, gws := startPickers(t, fl)
	ctx := t.Context()
	for r, gw := range gws {
		eventually(t, 30*time.Second, func() error {
			for _, svc := range []string{"readiness", "envoy.service.ext_proc.v3.ExternalProcessor"} {
				if s, err := gw.Health(ctx, svc); err != nil || s != healthpb.HealthCheckResponse_SERVING {
					return fmt.Errorf("%s %s: %v %v", r.ID, svc, s, err)
				}
			}
			return nil
		})
	}
	endpoints := map[string]string{}
	for i := range 6 {
		session := fmt.Sprintf("gw-session-%d", i)
		h := http.Header{"X-Session-Id": {session}}
		for j := range c.replicas {
			r := c.replicas[(i+j)%len(c.replicas)]
			res, err := gws[r].Do(ctx, envoytest.Request{Path: "/v1/chat/completions", Header: h,
				Body: chatBody(fmt.Sprintf("turn %d of session %d", j, i))})
			if err != nil || res.Status != http.StatusOK {
				t.Fatalf("session %s via %s: %v %+v", session, r.ID, err, res)
			}
			if want, ok := endpoints[session]; ok && res.Endpoint != want {
				t.Fatalf("session %s via %s went to %s, via another replica to %s", session, r.ID, res.Endpoint, want)
			}
			endpoints[session] = res.Endpoint
		}
	}

	leader := c.leader()
	h := http.Header{"X-Session-Id": {"gw-session-0"}}
	st, res, err := gws[leader].Open(ctx, envoytest.Request{Path: "/v1/chat/completions", Header: h, Body: chatBody("mid-stream turn")})
	if err != nil || res.Endpoint != endpoints["gw-session-0"] {
		t.Fatalf("open on the leader %s: %v %+v", leader.ID, err, res)
	}
	c.kill(leader)
	if err := st.Respond(http.StatusOK, "", []byte(`{}`)); err == nil {
		t.Fatalf("the stream on the killed replica %s still answers", leader.ID)
	}
	for i := range 6 {
		session := fmt.Sprintf("gw-session-%d", i)
		r := c.others(leader)[i%2]
		var got *envoytest.Result
		// The survivors elect a leader; a session's existing binding is read meanwhile.
		eventually(t, 30*time.Second, func() error {
			res, err := gws[r].Do(ctx, envoytest.Request{Path: "/v1/chat/completions",
				Header: http.Header{"X-Session-Id": {session}}, Body: chatBody("after the kill")})
			if err != nil {
				return err
			}
			if res.Status != http.StatusOK {
				return fmt.Errorf("status %d: %s", res.Status, res.Body)
			}
			got = res
			return nil
		})
		if got.Endpoint != endpoints[session] {
			t.Fatalf("after the kill, session %s via %s went to %s, before to %s", session, r.ID, got.Endpoint, endpoints[session])
		}
	}
}
