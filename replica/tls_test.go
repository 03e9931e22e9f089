package replica

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net/http"
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

// peerTLS gives the replica of cfg a certificate from ca naming it (its id) and the
// addresses other replicas dial, and ca's CA file to verify them with.
func peerTLS(ca *testpki.CA, cfg *Config) TLSFiles {
	cert, key := ca.IssueReplicaFiles(cfg.ID, cfg.Cluster.RaftListen, cfg.Cluster.PeerListen)
	return TLSFiles{CertFile: cfg.TLS.CertFile, KeyFile: cfg.TLS.KeyFile, PeerCertFile: cert, PeerKeyFile: key, PeerCAFile: ca.CAFile}
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
	gc := startGossipCluster(t, fleet, 3, func(_ int, cfg *Config) {
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
			if gc.rep(i).node.IsLeader() {
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
	servers, err := gc.rep(i).node.Servers()
	if err != nil {
		t.Fatalf("raft configuration of replica %d: %v", i, err)
	}
	var ids []string
	for _, s := range servers {
		ids = append(ids, s.ID)
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
		b, ok := other.node.FSM().Get(session)
		return ok && b.Worker == first.worker() && b.Revision == rev, fmt.Sprintf("%+v %v", b, ok)
	})
	again := gc.client(followers[1]).complete(promptTokens(901, 4*blockTokens), 2, hdr("X-Session-ID", session)).mustOK(t)
	if again.worker() != first.worker() || again.revision(t) != rev {
		t.Fatalf("the other follower sent the session to %s at revision %d; it is bound to %s at %d",
			again.worker(), again.revision(t), first.worker(), rev)
	}

	leader := gc.rep(lead)
	t.Run("plain raft gets no answer", func(t *testing.T) {
		plain, err := raft.NewTCPTransportWithLogger("127.0.0.1:0", nil, 1, 2*time.Second, hclog.NewNullLogger())
		if err != nil {
			t.Fatal(err)
		}
		defer plain.Close()
		var resp raft.RequestVoteResponse
		err = plain.RequestVote("probe", raft.ServerAddress(leader.raftAdvert()), &raft.RequestVoteRequest{
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
			c, err := pool.Get(leader.peerAdvert())
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
	cfg.ID = "intruder"
	cfg.Listen, cfg.AdminListen = loopbacktest.Addr(t), loopbacktest.Addr(t)
	cfg.Cluster.DataDir = t.TempDir()
	cfg.Cluster.RaftListen, cfg.Cluster.PeerListen, cfg.Cluster.Gossip.Listen = loopbacktest.Addr(t), loopbacktest.Addr(t), loopbacktest.Addr(t)
	cfg.TLS = peerTLS(other, &cfg)
	cfg.Logger = intruderLogs.logger()
	rep, err := Start(t.Context(), cfg)
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
	if id := rep.node.ClusterID(); id != "" {
		t.Errorf("the intruder took cluster id %s", id)
	}
	if err := rep.node.Ready(); err == nil {
		t.Error("the intruder reports ready")
	}
	// The cluster carries on.
	gc.client(lead).complete(promptTokens(950, 2*blockTokens), 2, hdr("X-Session-ID", "after-intruder")).mustOK(t)
}

// httpsClient is a router client for rep's TLS client port, trusting roots.
func httpsClient(t *testing.T, rep *Replica, roots *x509.CertPool) *routerClient {
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

// TestClientPortServesTLS, on both HTTP servers (--http-server).
func TestClientPortServesTLS(t *testing.T) {
	for _, server := range []string{ServerNet, ServerFast} {
		t.Run(server, func(t *testing.T) { clientPortServesTLS(t, server) })
	}
}

func clientPortServesTLS(t *testing.T, server string) {
	ca := testpki.NewCA(t, "client CA")
	cert, key := ca.IssueFiles("router", testpki.ServerOnly, "127.0.0.1")
	fleet := startWorkers(t, 2, simConfig(0))
	rep := startTestReplica(t, fleet, func(cfg *Config) {
		cfg.TLS = TLSFiles{CertFile: cert, KeyFile: key}
		cfg.AdminToken = "tok"
		cfg.ClientPort.Server = server
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
	rep := startTestReplica(t, fleet, func(cfg *Config) { cfg.AdminToken = "tok" })
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
