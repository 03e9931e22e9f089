package proc

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
)

// HAProxy is an HAProxy in front of the replicas, run in the foreground from a configuration
// file. The deployment's own file, deploy/haproxy.cfg, takes its addresses from the
// environment (DeployEnv); where it does not fit, HAProxyConfig writes one that does.
type HAProxy struct {
	// Binary is the haproxy executable; "haproxy" (looked up on PATH) when empty.
	Binary string
	// Config is the configuration file.
	Config string
	// Env is added to the environment, for a file that reads its addresses from it.
	Env []string
}

func (h HAProxy) binary() string {
	if h.Binary == "" {
		return "haproxy"
	}
	return h.Binary
}

// Check validates the configuration (haproxy -c) with Env set, and returns HAProxy's own
// words when it is refused.
func (h HAProxy) Check(ctx context.Context) error {
	cmd := exec.CommandContext(ctx, h.binary(), "-c", "-f", h.Config)
	cmd.Env = append(cmd.Environ(), h.Env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("haproxy -c -f %s: %w: %s", h.Config, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Spec is how to run it in the foreground (haproxy -db); the caller adds where its output
// goes, and a wrapper when it must run elsewhere.
func (h HAProxy) Spec() Spec {
	return Spec{Name: "haproxy", Argv: []string{h.binary(), "-db", "-f", h.Config}, Env: h.Env}
}

// DeployReplicas is how many replicas deploy/haproxy.cfg names.
const DeployReplicas = 3

// DeployEnv returns the environment deploy/haproxy.cfg reads its addresses from: KVR_LISTEN,
// where clients connect, and KVR_REPLICA0..2, the replicas' client ports. The file names
// exactly three replicas; other counts are refused rather than left to its defaults.
func DeployEnv(listen string, replicas []Replica) ([]string, error) {
	if len(replicas) != DeployReplicas {
		return nil, fmt.Errorf("deploy/haproxy.cfg names %d replicas, not %d", DeployReplicas, len(replicas))
	}
	env := []string{"KVR_LISTEN=" + listen}
	for i, r := range replicas {
		env = append(env, fmt.Sprintf("KVR_REPLICA%d=%s", i, r.Client))
	}
	return env, nil
}

// HAProxyConfig is an HAProxy configuration for the fault harness, which deploy/haproxy.cfg
// does not fit: it names any number of replicas (the harness runs up to nine), and retries a
// request on another replica not only when the connection failed but also on an empty
// answer or a 503, so the balancer hides a replica killed or cut off mid-request, as the
// harness's availability figures assume. deploy/haproxy.cfg deliberately retries only
// connection failures and 503s, a replica's refusals before any worker (an empty answer may
// come from a replica that died with the request on a worker), and checks less often (inter 1s
// against 300ms here). Like it, it checks /readyz, so an unready replica (no quorum) is
// drained. It logs one line per request to its standard output, in the form HAProxyLogLine
// reads: the request's X-Jepsen-Op header, the server that answered last, how many times
// HAProxy retried the request, the status and the termination state, so the harness can tell
// which requests the balancer retried.
func HAProxyConfig(listen string, replicas []Replica) string {
	var b strings.Builder
	b.WriteString(`global
    maxconn 2048
    log stdout format raw local0 info

defaults
    mode http
    option http-no-delay
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    timeout http-request 10s
    retries 2
    option redispatch
    retry-on conn-failure empty-response 503

frontend kvrouter
    bind ` + listen + `
    log global
    http-request capture req.hdr(` + HeaderOpTag + `) len 40
    log-format "` + haproxyLogPrefix + ` %[capture.req.hdr(0)] %s %rc %ST %ts"
    default_backend replicas

backend replicas
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter 300ms fall 2 rise 2
`)
	for _, r := range replicas {
		fmt.Fprintf(&b, "    server %s %s check\n", r.ID, r.Client)
	}
	return b.String()
}
