package proc

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
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

// HAProxyPolicy is the part of an HAProxy configuration that decides which requests are
// retried and how fast a replica leaves the rotation: directives of the defaults section
// (retries, redispatch, retry-on, the connect and check timeouts) and of the backend (balance,
// the health check and its pace). HAProxyConfig writes them around its own frontend, logging
// and servers.
type HAProxyPolicy struct {
	// Defaults and Backend are whole directive lines, without indentation or comments.
	Defaults, Backend []string
}

// HarnessPolicy is the fault harness's own policy: it retries a request on another replica
// not only when the connection failed or a replica refused it (503) but also on an empty
// answer, so the balancer hides a replica killed or cut off mid-request, as the harness's
// availability figures assume, and it checks every 300ms. deploy/haproxy.cfg deliberately
// retries only connection failures and 503s, a replica's refusals before any worker (an empty
// answer may come from a replica that died with the request on a worker), and checks less
// often (inter 1s); ReadHAProxyPolicy takes its policy instead.
func HarnessPolicy() HAProxyPolicy {
	return HAProxyPolicy{
		Defaults: []string{"timeout connect 1s", "retries 2", "option redispatch", "retry-on conn-failure empty-response 503"},
		Backend:  []string{"balance roundrobin", "option httpchk GET /readyz", "http-check expect status 200", "default-server inter 300ms fall 2 rise 2"},
	}
}

// policyDirective reports whether a directive line of the given section belongs to a policy.
func policyDirective(section, line string) bool {
	var prefixes []string
	switch section {
	case "defaults":
		prefixes = []string{"retries ", "retry-on ", "option redispatch", "timeout connect ", "timeout check "}
	case "backend":
		prefixes = []string{"balance ", "option httpchk", "http-check ", "default-server "}
	}
	for _, p := range prefixes {
		if line == strings.TrimSpace(p) || strings.HasPrefix(line, p) {
			return true
		}
	}
	return false
}

// ReadHAProxyPolicy takes the policy out of an HAProxy configuration with one defaults
// section and one backend, such as deploy/haproxy.cfg: from defaults its retries, retry-on,
// option redispatch, timeout connect and timeout check lines; from the backend its balance,
// option httpchk, http-check and default-server lines. A file without retry-on, option
// httpchk or default-server, or with more than one defaults or backend section, is refused:
// the harness would otherwise run a policy nobody wrote.
func ReadHAProxyPolicy(cfg string) (HAProxyPolicy, error) {
	var p HAProxyPolicy
	section := ""
	seen := map[string]int{}
	for _, line := range strings.Split(cfg, "\n") {
		line, _, _ = strings.Cut(line, "#")
		line = strings.Join(strings.Fields(line), " ")
		if line == "" {
			continue
		}
		word, _, _ := strings.Cut(line, " ")
		switch word {
		case "global", "defaults", "frontend", "backend", "listen", "resolvers", "peers", "userlist",
			"mailers", "program", "http-errors", "ring", "cache", "fcgi-app":
			section = word
			seen[word]++
			continue
		}
		if !policyDirective(section, line) {
			continue
		}
		if section == "defaults" {
			p.Defaults = append(p.Defaults, line)
		} else {
			p.Backend = append(p.Backend, line)
		}
	}
	var errs []error
	for _, s := range []string{"defaults", "backend"} {
		if seen[s] != 1 {
			errs = append(errs, fmt.Errorf("%d %s sections, want one", seen[s], s))
		}
	}
	for _, want := range []struct{ section, prefix string }{{"defaults", "retry-on "}, {"backend", "option httpchk"}, {"backend", "default-server "}} {
		lines := p.Defaults
		if want.section == "backend" {
			lines = p.Backend
		}
		if !slices.ContainsFunc(lines, func(l string) bool { return strings.HasPrefix(l, want.prefix) }) {
			errs = append(errs, fmt.Errorf("no %s line in its %s section", strings.TrimSpace(want.prefix), want.section))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return HAProxyPolicy{}, fmt.Errorf("haproxy policy: %w", err)
	}
	return p, nil
}

// HAProxyConfig is an HAProxy configuration for the fault harness, which deploy/haproxy.cfg
// does not fit as it stands: it names any number of replicas (the harness runs up to nine),
// takes its retries and health checks from policy (HarnessPolicy, or deploy/haproxy.cfg's
// through ReadHAProxyPolicy), and logs one line per request to its standard output, in the form
// HAProxyLogLine reads: the request's X-Jepsen-Op header, the server that answered last, how
// many times HAProxy retried the request, the status and the termination state, so the harness
// can tell which requests the balancer retried. Every proxy logs (log global in defaults), so
// a server taken out of the rotation or put back shows in the log too.
func HAProxyConfig(listen string, replicas []Replica, policy HAProxyPolicy) string {
	var b strings.Builder
	b.WriteString(`global
    maxconn 2048
    log stdout format raw local0 info

defaults
    mode http
    log global
    option http-no-delay
    timeout client 60s
    timeout server 60s
    timeout http-request 10s
`)
	for _, l := range policy.Defaults {
		fmt.Fprintf(&b, "    %s\n", l)
	}
	b.WriteString(`
frontend kvrouter
    bind ` + listen + `
    http-request capture req.hdr(` + HeaderOpTag + `) len 40
    log-format "` + haproxyLogPrefix + ` %[capture.req.hdr(0)] %s %rc %ST %ts"
    default_backend replicas

backend replicas
`)
	for _, l := range policy.Backend {
		fmt.Fprintf(&b, "    %s\n", l)
	}
	for _, r := range replicas {
		fmt.Fprintf(&b, "    server %s %s check\n", r.ID, r.Client)
	}
	return b.String()
}
