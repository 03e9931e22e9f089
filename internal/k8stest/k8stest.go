// Package k8stest starts a real etcd and kube-apiserver on loopback for tests, built by
// build.sh from the nested tools module into a cache directory named by KVROUTER_K8S_ASSETS.
// Without the binaries a test skips, unless KVROUTER_REQUIRE_K8S=1 (CI) makes it fail.
//
// There is no kubelet, scheduler or controller: a test creates pods and sets their status
// (IP, Ready condition) itself through the status subresource; an unscheduled pod is deleted
// at once.
package k8stest

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// AssetsEnv names the directory holding the kube-apiserver and etcd binaries.
const AssetsEnv = "KVROUTER_K8S_ASSETS"

// RequireEnv, set to 1, makes a test that cannot start the API server fail instead of skip.
const RequireEnv = "KVROUTER_REQUIRE_K8S"

// startWithin bounds how long etcd and the API server take to answer.
const startWithin = 90 * time.Second

// Server is a running etcd and kube-apiserver.
type Server struct {
	// Kubeconfig is the path of a kubeconfig file for the API server (a static admin token).
	Kubeconfig string
	// URL is the API server's https URL.
	URL string
	// Token is the bearer token of the kubeconfig's user.
	Token string

	etcd, api *proc.Process
}

// Options change how the API server runs.
type Options struct {
	// RBAC authorizes requests by RBAC (as a real cluster does) instead of allowing all: a
	// user is then allowed what its Roles and bindings grant (the admin token, in
	// system:masters, everything).
	RBAC bool
}

// Start starts etcd and the API server for t; both stop in t's cleanup.
func Start(t testing.TB) *Server {
	t.Helper()
	return StartWith(t, Options{})
}

// StartWith is Start with opts.
func StartWith(t testing.TB, opts Options) *Server {
	t.Helper()
	dir := os.Getenv(AssetsEnv)
	unavailable := func(format string, args ...any) {
		t.Helper()
		if os.Getenv(RequireEnv) == "1" {
			t.Fatalf(format, args...)
		}
		t.Skipf(format+" (set "+AssetsEnv+" to the directory internal/k8stest/build.sh prints)", args...)
	}
	if dir == "" {
		unavailable("%s is not set", AssetsEnv)
	}
	for _, b := range []string{"etcd", "kube-apiserver"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			unavailable("no %s: %v", b, err)
		}
	}
	tmp := t.TempDir()
	s := &Server{}
	if err := s.start(t, dir, tmp, opts); err != nil {
		t.Fatal(err)
	}
	return s
}

func (s *Server) start(t testing.TB, bin, tmp string, opts Options) error {
	client, err := loopback.Addr()
	if err != nil {
		return err
	}
	peer, err := loopback.Addr()
	if err != nil {
		return err
	}
	s.etcd = proc.New(proc.Spec{
		Name: "etcd",
		Argv: []string{filepath.Join(bin, "etcd"),
			"--name", "k8stest", "--data-dir", filepath.Join(tmp, "etcd"),
			"--listen-client-urls", "http://" + client, "--advertise-client-urls", "http://" + client,
			"--listen-peer-urls", "http://" + peer, "--initial-advertise-peer-urls", "http://" + peer,
			"--initial-cluster", "k8stest=http://" + peer, "--log-level", "warn"},
		LogPath: filepath.Join(tmp, "etcd.log"),
	})
	if err := s.etcd.Start(); err != nil {
		return err
	}
	t.Cleanup(func() { stop(s.etcd) })

	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	keyFile := filepath.Join(tmp, "sa.key")
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}), 0o600); err != nil {
		return err
	}
	tok := make([]byte, 16)
	if _, err := rand.Read(tok); err != nil {
		return err
	}
	s.Token = hex.EncodeToString(tok)
	tokens := filepath.Join(tmp, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(s.Token+",admin,admin,system:masters\n"), 0o600); err != nil {
		return err
	}
	addr, err := loopback.Addr()
	if err != nil {
		return err
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	s.URL = "https://" + addr
	authz := "AlwaysAllow"
	if opts.RBAC {
		authz = "RBAC"
	}
	s.api = proc.New(proc.Spec{
		Name: "kube-apiserver",
		Argv: []string{filepath.Join(bin, "kube-apiserver"),
			"--etcd-servers", "http://" + client,
			"--bind-address", host, "--advertise-address", host, "--secure-port", port,
			"--cert-dir", filepath.Join(tmp, "certs"),
			"--token-auth-file", tokens, "--authorization-mode", authz,
			"--service-account-issuer", "https://kubernetes.default.svc",
			"--service-account-key-file", keyFile, "--service-account-signing-key-file", keyFile,
			"--service-cluster-ip-range", "10.0.0.0/24",
			"--disable-admission-plugins", "ServiceAccount",
			"--endpoint-reconciler-type", "none",
			"--enable-priority-and-fairness=false"},
		LogPath: filepath.Join(tmp, "kube-apiserver.log"),
	})
	s.Kubeconfig = filepath.Join(tmp, "kubeconfig")
	if err := s.WriteKubeconfig(s.Kubeconfig, s.Token); err != nil {
		return err
	}
	t.Cleanup(func() { stop(s.api) })
	if err := s.StartAPI(); err != nil {
		return fmt.Errorf("%w (log: %s)", err, filepath.Join(tmp, "kube-apiserver.log"))
	}
	return nil
}

// WriteKubeconfig writes a kubeconfig file at path for the API server with a bearer token.
func (s *Server) WriteKubeconfig(path, token string) error {
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: k8stest
  cluster:
    server: %s
    insecure-skip-tls-verify: true
users:
- name: user
  user:
    token: %s
contexts:
- name: k8stest
  context: {cluster: k8stest, user: user}
current-context: k8stest
`, s.URL, token)
	return os.WriteFile(path, []byte(kc), 0o600)
}

// StopAPI stops the API server (etcd keeps running).
func (s *Server) StopAPI() { stop(s.api) }

// StartAPI starts the API server again and waits until it is ready.
func (s *Server) StartAPI() error {
	if err := s.api.Start(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), startWithin)
	defer cancel()
	return poll.Wait(startWithin, func() error {
		select {
		case <-s.api.Done():
			return errors.New("kube-apiserver exited")
		default:
		}
		return s.ready(ctx)
	})
}

// stop ends a process: SIGTERM, then SIGKILL after a grace period.
func stop(p *proc.Process) {
	if !p.Running() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := p.Stop(ctx, syscall.SIGTERM, 10*time.Second); err != nil {
		p.Kill()
	}
}

// ready asks the API server's /readyz.
func (s *Server) ready(ctx context.Context) error {
	resp, err := s.get(ctx, "/readyz")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("kube-apiserver /readyz: %s", resp.Status)
	}
	return nil
}

// NamespaceWatches is how many WATCH requests on resource (pods, inferencepools) within a
// namespace (the whole namespace, or one object by its name) the API server is serving now,
// by its apiserver_longrunning_requests gauge: a client that stopped watching has none left
// open. The API server's own informers watch across every namespace, and are not counted.
func (s *Server) NamespaceWatches(ctx context.Context, resource string) (int, error) {
	resp, err := s.get(ctx, "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("kube-apiserver /metrics: %s", resp.Status)
	}
	parser := expfmt.NewTextParser(model.LegacyValidation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return 0, fmt.Errorf("kube-apiserver /metrics: %w", err)
	}
	n := 0
	for _, m := range families["apiserver_longrunning_requests"].GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		if labels["verb"] == "WATCH" && labels["scope"] != "cluster" && labels["resource"] == resource {
			n += int(m.GetGauge().GetValue())
		}
	}
	return n, nil
}

// get asks the API server for path as the kubeconfig's user.
func (s *Server) get(ctx context.Context, path string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+s.Token)
	// The API server's certificate is self-signed for this run; the server is on loopback.
	// No connection is kept: a test may count its own goroutines.
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, DisableKeepAlives: true}}
	return hc.Do(req)
}
