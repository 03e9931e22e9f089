package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/testpki"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// peerTLS gives the replica of cfg a certificate from ca for the addresses other replicas
// dial, and ca's CA file to verify them with.
func peerTLS(ca *testpki.CA, cfg *serveConfig) tlsConfig {
	cert, key := ca.IssueFiles(cfg.ReplicaID, testpki.ServerAndClient, cfg.Cluster.RaftListen, cfg.Cluster.PeerListen)
	return tlsConfig{CertFile: cfg.TLS.CertFile, KeyFile: cfg.TLS.KeyFile, PeerCertFile: cert, PeerKeyFile: key, PeerCAFile: ca.CAFile}
}

// logBuffer collects a replica's log lines for a test to search.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *logBuffer) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// line returns the first line holding every one of parts ("" if none).
func (l *logBuffer) line(parts ...string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, ln := range strings.Split(l.b.String(), "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(ln, p)
		}
		if all {
			return ln
		}
	}
	return ""
}

// startTLSCluster is three replicas with mutual TLS between them, logging to logs.
func startTLSCluster(t *testing.T, ca *testpki.CA, logs *logBuffer) (*gossipCluster, testFleet) {
	t.Helper()
	fleet := startWorkers(t, 2, simConfig(0))
	gc := startGossipCluster(t, fleet, 3, func(_ int, cfg *serveConfig) {
		cfg.TLS = peerTLS(ca, cfg)
		if logs != nil {
			cfg.Logger = logs.logger()
		}
	})
	return gc, fleet
}

// leaderIndex waits for a leader among gc's replicas and returns its index.
func leaderIndex(t *testing.T, gc *gossipCluster, n int) int {
	t.Helper()
	at := -1
	eventually(t, "a leader", func() (bool, string) {
		for i := range n {
			if gc.rep(i).cluster.node.IsLeader() {
				at = i
				return true, ""
			}
		}
		return false, "no replica leads"
	})
	return at
}

// raftServers lists the ids in replica i's Raft configuration.
func raftServers(t *testing.T, gc *gossipCluster, i int) []string {
	t.Helper()
	f := gc.rep(i).cluster.node.Raft().GetConfiguration()
	if err := f.Error(); err != nil {
		t.Fatalf("raft configuration of replica %d: %v", i, err)
	}
	var ids []string
	for _, s := range f.Configuration().Servers {
		ids = append(ids, string(s.ID))
	}
	return ids
}

func TestReplicasTalkOverMutualTLS(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	gc, _ := startTLSCluster(t, ca, nil)
	lead := leaderIndex(t, gc, 3)
	if ids := raftServers(t, gc, lead); len(ids) != 3 {
		t.Fatalf("raft configuration %v, want the three replicas", ids)
	}
	var followers []int
	for i := range 3 {
		if i != lead {
			followers = append(followers, i)
		}
	}
	// Bound on a follower: the bind travels to the leader over the peer port and back to
	// every replica over Raft.
	const session = "tls-session"
	prompt := promptTokens(900, 4*blockTokens)
	first := gc.client(followers[0]).complete(prompt, 2, hdr("X-Session-ID", session)).mustOK(t)
	rev := first.revision(t)
	if rev == 0 {
		t.Fatal("the first request of a session carried no binding revision")
	}
	other := gc.rep(followers[1])
	eventually(t, "the binding to reach the other follower's state machine", func() (bool, string) {
		b, ok := other.cluster.node.FSM().Get(session)
		return ok && b.Worker == first.worker() && b.Revision == rev, fmt.Sprintf("%+v %v", b, ok)
	})
	again := gc.client(followers[1]).complete(promptTokens(901, 4*blockTokens), 2, hdr("X-Session-ID", session)).mustOK(t)
	if again.worker() != first.worker() || again.revision(t) != rev {
		t.Fatalf("the other follower sent the session to %s at revision %d; it is bound to %s at %d",
			again.worker(), again.revision(t), first.worker(), rev)
	}

	leader := gc.rep(lead).cluster
	t.Run("plain raft gets no answer", func(t *testing.T) {
		plain, err := raft.NewTCPTransportWithLogger("127.0.0.1:0", nil, 1, 2*time.Second, hclog.NewNullLogger())
		if err != nil {
			t.Fatal(err)
		}
		defer plain.Close()
		var resp raft.RequestVoteResponse
		err = plain.RequestVote("probe", raft.ServerAddress(leader.raftAdvert), &raft.RequestVoteRequest{
			RPCHeader: raft.RPCHeader{ID: []byte("probe"), Addr: []byte(plain.LocalAddr())}, Term: 1 << 40,
		}, &resp)
		if err == nil {
			t.Fatalf("a plaintext RequestVote to the TLS Raft port was answered: %+v", resp)
		}
		t.Logf("plaintext Raft refused: %v", err)
	})
	t.Run("plain and certificate-less gRPC get no answer", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			tls  *tls.Config
		}{
			{"plaintext", nil},
			{"TLS without a client certificate", testpki.ClientConfig(ca)},
		} {
			pool := peer.NewPool(peer.ClientOptions{TLS: tc.tls})
			c, err := pool.Get(leader.peerAdvert)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			st, err := c.Status(ctx)
			cancel()
			pool.Close()
			if err == nil {
				t.Fatalf("%s: the peer port answered Status: %+v", tc.name, st)
			}
			t.Logf("%s refused: %v", tc.name, err)
		}
	})
}

func TestReplicaWithCertificateFromAnotherCACannotJoin(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	var clusterLogs, intruderLogs logBuffer
	gc, _ := startTLSCluster(t, ca, &clusterLogs)
	lead := leaderIndex(t, gc, 3)

	// Another cluster's certificate and CA (a replica deployed with the wrong files, or a
	// host that holds the gossip key but no certificate from this cluster's CA).
	other := testpki.NewCA(t, "another CA")
	cfg := gc.cfgs[0]
	cfg.ReplicaID = "intruder"
	cfg.Listen, cfg.AdminListen = loopbacktest.Addr(t), loopbacktest.Addr(t)
	cfg.Cluster.DataDir = t.TempDir()
	cfg.Cluster.RaftListen, cfg.Cluster.PeerListen, cfg.Cluster.Gossip.Listen = loopbacktest.Addr(t), loopbacktest.Addr(t), loopbacktest.Addr(t)
	cfg.TLS = peerTLS(other, &cfg)
	cfg.Logger = intruderLogs.logger()
	rep, err := startReplica(t.Context(), cfg)
	if err != nil {
		// Refusing at start is fine too, if it says why.
		if !strings.Contains(err.Error(), "certificate") {
			t.Fatalf("the intruder failed to start without naming the certificate: %v", err)
		}
		t.Logf("refused at start: %v", err)
		return
	}
	t.Cleanup(func() { rep.Close() })

	// The intruder says why it cannot join ...
	eventually(t, "the intruder to log why it cannot join", func() (bool, string) {
		return intruderLogs.line("joining the cluster", "certificate signed by unknown authority") != "", "no such line yet"
	})
	t.Logf("intruder: %s", intruderLogs.line("joining the cluster"))
	// ... and the leader, which met it over gossip (it has the gossip key), refuses to make
	// it a voter and says why.
	eventually(t, "the leader to refuse the intruder as a voter", func() (bool, string) {
		return clusterLogs.line("gossip member not added to raft", "member=intruder", "certificate") != "", "no such line yet"
	})
	t.Logf("cluster: %s", clusterLogs.line("gossip member not added to raft", "member=intruder"))

	for i := range 3 {
		for _, id := range raftServers(t, gc, i) {
			if id == "intruder" {
				t.Errorf("replica %d has the intruder in its raft configuration", i)
			}
		}
	}
	if id := rep.cluster.node.ClusterID(); id != "" {
		t.Errorf("the intruder took cluster id %s", id)
	}
	if err := rep.cluster.node.Ready(); err == nil {
		t.Error("the intruder reports ready")
	}
	// The cluster carries on.
	gc.client(lead).complete(promptTokens(950, 2*blockTokens), 2, hdr("X-Session-ID", "after-intruder")).mustOK(t)
}

// httpsClient is a router client for rep's TLS client port, trusting roots.
func httpsClient(t *testing.T, rep *replica, roots *x509.CertPool) *routerClient {
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &routerClient{t: t, base: "https://" + rep.Addr(), admin: "http://" + rep.AdminAddr(), hc: &http.Client{Transport: tr, Timeout: pollTimeout}}
}

// requireNoAdminRoutes checks the client port answers 404 to every admin route.
func requireNoAdminRoutes(t *testing.T, c *routerClient) {
	t.Helper()
	for _, r := range []struct{ method, path string }{
		{http.MethodGet, "/metrics"},
		{http.MethodGet, "/admin/workers"},
		{http.MethodGet, "/admin/cluster"},
		{http.MethodGet, "/admin/sessions/s1"},
		{http.MethodDelete, "/admin/sessions/s1"},
		{http.MethodPost, "/admin/cluster/snapshot"},
		{http.MethodPost, "/admin/cluster/transfer-leadership"},
	} {
		a, err := c.do(t.Context(), r.method, r.path, nil, hdr("Authorization", "Bearer tok"))
		if err != nil {
			t.Fatalf("%s %s on the client port: %v", r.method, r.path, err)
		}
		if a.status != http.StatusNotFound {
			t.Errorf("%s %s on the client port: %d %s, want 404", r.method, r.path, a.status, a.body)
		}
	}
}

func TestClientPortServesTLS(t *testing.T) {
	ca := testpki.NewCA(t, "client CA")
	cert, key := ca.IssueFiles("router", testpki.ServerOnly, "127.0.0.1")
	fleet := startWorkers(t, 2, simConfig(0))
	rep := startTestReplica(t, fleet, func(cfg *serveConfig) {
		cfg.TLS = tlsConfig{CertFile: cert, KeyFile: key}
		cfg.AdminToken = "tok"
	})
	c := httpsClient(t, rep, ca.Pool)
	waitReady(t, c, http.StatusOK)
	ans := c.complete(promptTokens(1000, 2*blockTokens), 2, hdr("X-Session-ID", "https-session")).mustOK(t)
	if ans.worker() == "" {
		t.Fatal("the HTTPS answer names no worker")
	}
	requireNoAdminRoutes(t, c)

	// Plain HTTP to the TLS port gets no completion.
	plain := newRouterClient(t, rep)
	a, err := plain.do(t.Context(), http.MethodPost, "/v1/completions", bytes.NewReader(completionBody(promptTokens(1001, 2*blockTokens), 2, false)), nil)
	if err == nil && (a.status == http.StatusOK || a.worker() != "") {
		t.Fatalf("plain HTTP got an answer from the TLS port: %d %s", a.status, a.body)
	}
	t.Logf("plain HTTP: err %v, status %d %q", err, a.status, strings.TrimSpace(string(a.body)))

	// A client that does not trust the certificate's CA does not get through either.
	stranger := httpsClient(t, rep, testpki.NewCA(t, "another CA").Pool)
	if _, err := stranger.do(t.Context(), http.MethodGet, "/readyz", nil, nil); err == nil {
		t.Fatal("a client that does not trust the router's CA got an answer")
	} else if !strings.Contains(err.Error(), "unknown authority") {
		t.Errorf("untrusted-CA failure does not say so: %v", err)
	}
}

func TestAdminRoutesOnlyOnTheAdminPort(t *testing.T) {
	// The 401 without the token is TestAdminAPIWithoutTheTokenIs401 (admin_test.go).
	fleet := startWorkers(t, 1, simConfig(0))
	rep := startTestReplica(t, fleet, func(cfg *serveConfig) { cfg.AdminToken = "tok" })
	c := newRouterClient(t, rep)
	requireNoAdminRoutes(t, c)
	// The same routes are there on the admin port.
	if m := c.scrapeMetrics(); len(m) == 0 {
		t.Fatal("admin port /metrics is empty")
	}
	if status, body := adminDo(t, rep, http.MethodGet, "/admin/workers", "tok"); status != http.StatusOK {
		t.Fatalf("admin port /admin/workers with the token: %d %s", status, body)
	}
	if status, _ := adminDo(t, rep, http.MethodGet, "/admin/workers", ""); status != http.StatusUnauthorized {
		t.Fatalf("admin port /admin/workers without the token: %d, want 401", status)
	}
}

func TestTLSFlagsAreCheckedBeforeAnythingStarts(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	other := testpki.NewCA(t, "another CA")
	cert, key := ca.IssueFiles("r0", testpki.ServerAndClient, "127.0.0.1")
	otherCert, otherKey := other.IssueFiles("r0-other", testpki.ServerAndClient, "127.0.0.1")
	serverOnly, serverOnlyKey := ca.IssueFiles("server-only", testpki.ServerOnly, "127.0.0.1")
	notPEM := filepath.Join(t.TempDir(), "not.pem")
	if err := os.WriteFile(notPEM, []byte("this is not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(t.TempDir(), "missing.pem")
	peerFlags := func(cert, key, caFile string) []string {
		return []string{"--peer-tls-cert-file", cert, "--peer-tls-key-file", key, "--peer-tls-ca-file", caFile}
	}
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want []string
	}{
		{"client cert without key", []string{"--tls-cert-file", cert}, nil, []string{"--tls-cert-file and --tls-key-file go together"}},
		{"client key without cert", []string{"--tls-key-file", key}, nil, []string{"--tls-cert-file and --tls-key-file go together"}},
		{"client cert from the environment without key", nil, map[string]string{"KVROUTER_TLS_CERT_FILE": cert}, []string{"--tls-cert-file and --tls-key-file go together"}},
		{"peer cert and key without CA", []string{"--peer-tls-cert-file", cert, "--peer-tls-key-file", key}, nil, []string{"go together", "--peer-tls-ca-file"}},
		{"missing client cert file", []string{"--tls-cert-file", missing, "--tls-key-file", key}, nil, []string{"--tls-cert-file", "no such file"}},
		{"missing peer key file", peerFlags(cert, missing, ca.CAFile), nil, []string{"--peer-tls-key-file", "no such file"}},
		{"missing CA file", peerFlags(cert, key, missing), nil, []string{"--peer-tls-ca-file", "no such file"}},
		{"CA file not PEM", peerFlags(cert, key, notPEM), nil, []string{"--peer-tls-ca-file", "no PEM certificate"}},
		{"cert file not PEM", []string{"--tls-cert-file", notPEM, "--tls-key-file", key}, nil, []string{"--tls-cert-file", "PEM"}},
		{"key of another cert", []string{"--tls-cert-file", cert, "--tls-key-file", otherKey}, nil, []string{"--tls-cert-file", "does not match"}},
		{"peer cert from another CA", peerFlags(otherCert, otherKey, ca.CAFile), nil, []string{"does not verify against --peer-tls-ca-file", "unknown authority"}},
		{"peer cert only for servers", peerFlags(serverOnly, serverOnlyKey, ca.CAFile), nil, []string{"lacks clientAuth"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			listen := loopbacktest.Addr(t)
			dataDir := filepath.Join(t.TempDir(), "data")
			args := append([]string{"serve", "--listen", listen, "--admin-listen", loopbacktest.Addr(t),
				"--raft-listen", loopbacktest.Addr(t), "--peer-listen", loopbacktest.Addr(t), "--gossip-listen", loopbacktest.Addr(t),
				"--data-dir", dataDir, "--worker", "w0=http://127.0.0.1:9", "--admin-token", "tok"}, tc.args...)
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			var out, errOut bytes.Buffer
			err := run(ctx, args, &out, &errOut)
			if err == nil {
				t.Fatalf("serve started; stdout %s", out.String())
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			t.Logf("error: %v", err)
			if _, serr := os.Stat(dataDir); !errors.Is(serr, os.ErrNotExist) {
				t.Errorf("the data directory was created (%v): something started", serr)
			}
			ln, lerr := net.Listen("tcp", listen)
			if lerr != nil {
				t.Errorf("the client address is taken after the refusal: %v", lerr)
			} else {
				ln.Close()
			}
		})
	}
}

func TestTLSReplicaLogsNoSecrets(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	listen, raftAddr, peerAddr := loopbacktest.Addr(t), loopbacktest.Addr(t), loopbacktest.Addr(t)
	clientCert, clientKey := ca.IssueFiles("router", testpki.ServerAndClient, listen)
	peerCert, peerKey := ca.IssueFiles("r0", testpki.ServerAndClient, raftAddr, peerAddr)
	const token = "admin-token-that-must-not-leak"
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KVROUTER_GOSSIP_KEY", testGossipKey)
	args := []string{"serve", "--log-level", "debug", "--replica-id", "r0",
		"--listen", listen, "--admin-listen", loopbacktest.Addr(t), "--raft-listen", raftAddr, "--peer-listen", peerAddr,
		"--gossip-listen", loopbacktest.Addr(t), "--data-dir", filepath.Join(t.TempDir(), "data"),
		"--worker", "w0=http://127.0.0.1:9", "--admin-token-file", tokenFile,
		"--tls-cert-file", clientCert, "--tls-key-file", clientKey,
		"--peer-tls-cert-file", peerCert, "--peer-tls-key-file", peerKey, "--peer-tls-ca-file", ca.CAFile,
		"--raft-heartbeat-timeout", "100ms", "--raft-election-timeout", "100ms", "--raft-leader-lease-timeout", "50ms",
		"--shutdown-delay", "0s"}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var out, errOut logBuffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, &out, &errOut) }()
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool}}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 2 * time.Second}
	eventually(t, "the replica to be ready over HTTPS", func() (bool, string) {
		select {
		case err := <-done:
			t.Fatalf("serve stopped: %v\n%s", err, errOut.String())
		default:
		}
		resp, err := hc.Get("https://" + listen + "/readyz")
		if err != nil {
			return false, err.Error()
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("serve returned %v", err)
		}
	case <-time.After(pollTimeout):
		t.Fatal("serve did not stop")
	}
	logged := out.String() + errOut.String()
	if !strings.Contains(logged, "mutual TLS") || !strings.Contains(logged, "https://") {
		t.Errorf("the log does not say TLS is on:\n%s", logged)
	}
	secrets := map[string]string{"admin token": token, "gossip key": testGossipKey}
	for name, file := range map[string]string{"client key": clientKey, "peer key": peerKey} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		// Every base64 line of the key's PEM body (the first starts with a header all P-256
		// keys share; the others hold the key).
		for i, ln := range strings.Split(string(b), "\n") {
			if ln != "" && !strings.HasPrefix(ln, "-----") {
				secrets[fmt.Sprintf("%s (PEM line %d)", name, i)] = ln
			}
		}
	}
	for name, s := range secrets {
		if strings.Contains(logged, s) {
			t.Errorf("the %s appears in the output", name)
		}
	}
}
