package proc

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// deployConfig is deploy/haproxy.cfg, relative to this package.
var deployConfig = filepath.Join("..", "..", "deploy", "haproxy.cfg")

func haproxyBinary(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("haproxy is not in PATH (apt-get install haproxy)")
	}
	return bin
}

// fakeReplicas are n HTTP servers that answer every request with 200 and their id.
func fakeReplicas(t *testing.T, n int) []Replica {
	t.Helper()
	var rs []Replica
	for i := range n {
		id := fmt.Sprintf("r%d", i)
		s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("X-Kvrouter-Replica", id)
		}))
		t.Cleanup(s.Close)
		rs = append(rs, Replica{ID: id, Client: strings.TrimPrefix(s.URL, "http://")})
	}
	return rs
}

func TestDeployEnvNamesExactlyThreeReplicas(t *testing.T) {
	rs := fakeReplicas(t, 4)
	env, err := DeployEnv("127.0.0.1:1", rs[:3])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"KVR_LISTEN=127.0.0.1:1", "KVR_REPLICA0=" + rs[0].Client, "KVR_REPLICA1=" + rs[1].Client, "KVR_REPLICA2=" + rs[2].Client}
	if strings.Join(env, " ") != strings.Join(want, " ") {
		t.Fatalf("DeployEnv = %q, want %q", env, want)
	}
	// The file must read every variable DeployEnv sets.
	b, err := os.ReadFile(deployConfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range env {
		if name, _, _ := strings.Cut(kv, "="); !strings.Contains(string(b), "${"+name) {
			t.Errorf("%s does not read %s", deployConfig, name)
		}
	}
	for _, n := range []int{2, 4} {
		if _, err := DeployEnv("127.0.0.1:1", rs[:n]); err == nil {
			t.Errorf("DeployEnv with %d replicas succeeded", n)
		}
	}
}

func TestHAProxyConfigNamesEveryReplica(t *testing.T) {
	rs := fakeReplicas(t, 9)
	cfg := HAProxyConfig("127.0.0.1:1", rs, HarnessPolicy())
	for _, want := range []string{"bind 127.0.0.1:1\n", "retry-on conn-failure empty-response 503\n", "option httpchk GET /readyz\n"} {
		if !strings.Contains(cfg, want) {
			t.Errorf("config misses %q:\n%s", want, cfg)
		}
	}
	for _, r := range rs {
		if want := fmt.Sprintf("    server %s %s check\n", r.ID, r.Client); !strings.Contains(cfg, want) {
			t.Errorf("config misses %q", want)
		}
	}
}

// TestHAProxyRunsInFrontOfReplicas runs the real HAProxy, from deploy/haproxy.cfg and from
// HAProxyConfig, in front of three fake replicas, and waits until it answers through them.
func TestHAProxyRunsInFrontOfReplicas(t *testing.T) {
	bin := haproxyBinary(t)
	rs := fakeReplicas(t, 3)
	cases := []struct {
		name  string
		setup func(t *testing.T, listen string) HAProxy
		// logsTags: the balancer logs each request with its X-Jepsen-Op tag.
		logsTags bool
	}{
		{name: "deploy/haproxy.cfg", setup: func(t *testing.T, listen string) HAProxy {
			env, err := DeployEnv(listen, rs)
			if err != nil {
				t.Fatal(err)
			}
			return HAProxy{Binary: bin, Config: deployConfig, Env: env}
		}},
		{name: "HAProxyConfig", setup: func(t *testing.T, listen string) HAProxy {
			path := filepath.Join(t.TempDir(), "haproxy.cfg")
			if err := os.WriteFile(path, []byte(HAProxyConfig(listen, rs, HarnessPolicy())), 0o644); err != nil {
				t.Fatal(err)
			}
			return HAProxy{Config: path} // haproxy from PATH
		}, logsTags: true},
		{name: "HAProxyConfig with deploy/haproxy.cfg's policy", setup: func(t *testing.T, listen string) HAProxy {
			policy := deployPolicy(t)
			path := filepath.Join(t.TempDir(), "haproxy.cfg")
			if err := os.WriteFile(path, []byte(HAProxyConfig(listen, rs, policy)), 0o644); err != nil {
				t.Fatal(err)
			}
			return HAProxy{Config: path}
		}, logsTags: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			listen, err := loopback.Addr()
			if err != nil {
				t.Fatal(err)
			}
			h := tc.setup(t, listen)
			if err := h.Check(t.Context()); err != nil {
				t.Fatal(err)
			}
			spec := h.Spec()
			spec.LogPath = filepath.Join(t.TempDir(), "haproxy.log")
			p := New(spec)
			if err := p.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(p.Kill)
			if err := WaitReady(t.Context(), nil, "http://"+listen+"/readyz", 30*time.Second); err != nil {
				b, _ := os.ReadFile(spec.LogPath)
				t.Fatalf("%v\nhaproxy log:\n%s", err, b)
			}
			if tc.logsTags {
				// HAProxy logs a request when its transaction ends; the log is read until the
				// tagged line is there, before HAProxy stops.
				req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+listen+"/readyz", nil)
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set(HeaderOpTag, "tagged-1")
				req.Close = true
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				poll.Until(t, 10*time.Second, func() error {
					b, err := os.ReadFile(spec.LogPath)
					if err != nil {
						return err
					}
					for line := range strings.Lines(string(b)) {
						req, ok, err := ParseHAProxyLogLine(line)
						if err != nil {
							t.Fatal(err)
						}
						if ok && req.Tag == "tagged-1" {
							if !strings.HasPrefix(req.Server, "r") || req.Status != 200 || req.Retries != 0 || req.Termination != "--" {
								t.Fatalf("tagged request in the log: %+v", req)
							}
							return nil
						}
					}
					return fmt.Errorf("no line of the tagged request in haproxy's log:\n%s", b)
				})
			}
			if err := p.Stop(t.Context(), syscall.SIGTERM, 10*time.Second); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestHAProxyCheckRefusesABadConfig(t *testing.T) {
	haproxyBinary(t)
	path := filepath.Join(t.TempDir(), "bad.cfg")
	if err := os.WriteFile(path, []byte("frontend x\n    bind\n    no-such-keyword 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := (HAProxy{Config: path}).Check(t.Context()); err == nil {
		t.Fatal("haproxy -c accepted a broken config")
	}
}

// deployPolicy is deploy/haproxy.cfg's policy.
func deployPolicy(t *testing.T) HAProxyPolicy {
	t.Helper()
	b, err := os.ReadFile(deployConfig)
	if err != nil {
		t.Fatal(err)
	}
	p, err := ReadHAProxyPolicy(string(b))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestReadHAProxyPolicyTakesDeploysRetriesAndChecks(t *testing.T) {
	p := deployPolicy(t)
	// deploy/haproxy.cfg's own lines, as the harness must run them.
	want := HAProxyPolicy{
		Defaults: []string{"timeout connect 1s", "timeout check 2s", "retries 3", "option redispatch 1", "retry-on conn-failure 503"},
		Backend:  []string{"balance leastconn", "option httpchk GET /readyz", "http-check expect status 200", "default-server inter 1s fastinter 250ms fall 2 rise 2"},
	}
	if !slices.Equal(p.Defaults, want.Defaults) || !slices.Equal(p.Backend, want.Backend) {
		t.Fatalf("policy of %s:\n%q\n%q\nwant\n%q\n%q", deployConfig, p.Defaults, p.Backend, want.Defaults, want.Backend)
	}
}

func TestReadHAProxyPolicyRefusesAFileWithoutOne(t *testing.T) {
	const backend = "backend b\n  option httpchk GET /readyz\n  default-server inter 1s\n"
	cases := []struct{ name, cfg, want string }{
		{"empty", "", "0 defaults sections"},
		{"no retry-on", "defaults\n  retries 3\n" + backend, "no retry-on line"},
		{"retry-on commented out", "defaults\n  # retry-on 503\n" + backend, "no retry-on line"},
		{"retry-on in the backend only", "defaults\n  retries 3\nbackend b\n  retry-on 503\n  option httpchk\n  default-server inter 1s\n", "no retry-on line"},
		{"no health check", "defaults\n  retry-on 503\nbackend b\n  default-server inter 1s\n", "no option httpchk line"},
		{"two backends", "defaults\n  retry-on 503\n" + backend + backend, "2 backend sections"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, err := ReadHAProxyPolicy(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("ReadHAProxyPolicy: %v (%+v), want an error about %q", err, p, tc.want)
			}
		})
	}
}

// FuzzReadHAProxyPolicy: any text is read without a panic, and a policy read from it holds
// only the directives a policy takes, one line each.
func FuzzReadHAProxyPolicy(f *testing.F) {
	if b, err := os.ReadFile(deployConfig); err == nil {
		f.Add(string(b))
	}
	f.Add("defaults\n retry-on 503 # x\nbackend b\n option httpchk\n default-server inter 1s\n")
	f.Fuzz(func(t *testing.T, cfg string) {
		p, err := ReadHAProxyPolicy(cfg)
		if err != nil {
			return
		}
		for _, l := range append(slices.Clone(p.Defaults), p.Backend...) {
			if l == "" || strings.ContainsAny(l, "\n#") || !policyDirective("defaults", l) && !policyDirective("backend", l) {
				t.Fatalf("policy line %q", l)
			}
		}
	})
}
