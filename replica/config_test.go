package replica

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
)

// TestBeyondLoopback checks which addresses count as reachable from other hosts. The
// addresses are data for the check: nothing here listens on them (tests bind loopback only).
func TestBeyondLoopback(t *testing.T) {
	for _, tc := range []struct {
		addr string
		want bool
	}{
		{"127.0.0.1:7000", false},
		{"127.3.2.1:7000", false},
		{"[::1]:7000", false},
		{"localhost:7000", false},
		{"[::ffff:127.0.0.1]:7000", false},
		{"0.0.0.0:7000", true},
		{"[::]:7000", true},
		{":7000", true},
		{"10.0.0.10:7000", true},
		{"192.0.2.7:7000", true},
		{"kvrouter-ha-0.kvrouter-ha-peers.ns.svc.cluster.local:7000", true},
		{"not an address", true},
	} {
		if got := beyondLoopback(tc.addr); got != tc.want {
			t.Errorf("beyondLoopback(%q) = %v, want %v", tc.addr, got, tc.want)
		}
	}
}

// TestOpenClusterRefusedWithoutMTLSAndGossipKey checks the rule: a cluster port beyond
// loopback needs peer mutual TLS and a gossip key (none with --no-gossip), or the explicit
// override; the refusal names what is missing and the flags that fix it. Config.check only
// reads the addresses: nothing is bound.
func TestOpenClusterRefusedWithoutMTLSAndGossipKey(t *testing.T) {
	key := bytes.Repeat([]byte("k"), 32)
	mtls := TLSFiles{PeerCertFile: "c.pem", PeerKeyFile: "k.pem", PeerCAFile: "ca.pem"}
	base := func() Config {
		return Config{ID: "r0", Cluster: ClusterConfig{RaftListen: "127.0.0.1:7000", PeerListen: "127.0.0.1:7001",
			Gossip: GossipConfig{Listen: "127.0.0.1:7002"}}}
	}
	for _, tc := range []struct {
		name string
		tune func(*Config)
		want []string // substrings of the error; nil: accepted
	}{
		{"all loopback, nothing protected", func(*Config) {}, nil},
		{"peer listen on every interface", func(c *Config) { c.Cluster.PeerListen = "0.0.0.0:7001" },
			[]string{"--peer-listen 0.0.0.0:7001", "--peer-tls-cert-file", "--peer-tls-ca-file", "--gossip-key-file", "--insecure-open-cluster"}},
		{"raft advertise beyond", func(c *Config) { c.Cluster.RaftAdvert = "10.0.0.10:7000" },
			[]string{"--raft-advertise 10.0.0.10:7000", "peer mutual TLS", "gossip key"}},
		{"gossip advertise beyond", func(c *Config) { c.Cluster.Gossip.Advertise = "192.0.2.1:7002" },
			[]string{"--gossip-advertise 192.0.2.1:7002"}},
		{"mTLS without gossip key", func(c *Config) { c.Cluster.RaftListen = "[::]:7000"; c.TLS = mtls },
			[]string{"no gossip key"}},
		{"gossip key without mTLS", func(c *Config) { c.Cluster.RaftListen = "[::]:7000"; c.Cluster.Gossip.Key = key },
			[]string{"no peer mutual TLS"}},
		{"half the mTLS files", func(c *Config) {
			c.Cluster.RaftListen = "[::]:7000"
			c.Cluster.Gossip.Key = key
			c.TLS = TLSFiles{PeerCertFile: "c.pem", PeerKeyFile: "k.pem"}
		}, []string{"peer mutual TLS"}},
		{"mTLS and gossip key", func(c *Config) { c.Cluster.RaftListen = "[::]:7000"; c.TLS = mtls; c.Cluster.Gossip.Key = key }, nil},
		{"no gossip needs no key", func(c *Config) { c.Cluster.PeerListen = "0.0.0.0:7001"; c.TLS = mtls; c.NoGossip = true }, nil},
		{"no gossip still needs mTLS", func(c *Config) { c.Cluster.PeerListen = "0.0.0.0:7001"; c.NoGossip = true },
			[]string{"peer mutual TLS"}},
		{"override", func(c *Config) { c.Cluster.PeerListen = "0.0.0.0:7001"; c.InsecureOpenCluster = true }, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base()
			tc.tune(&c)
			err := c.check()
			if tc.want == nil {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}

// TestOpenClusterWarnsPerOpenPort checks the override's warning: one line per port that
// reaches beyond loopback unprotected, none for the others.
func TestOpenClusterWarnsPerOpenPort(t *testing.T) {
	c := Config{ID: "r0", InsecureOpenCluster: true, Cluster: ClusterConfig{
		RaftListen: "127.0.0.1:7000", RaftAdvert: "192.0.2.1:7000", PeerListen: "127.0.0.1:7001",
		Gossip: GossipConfig{Listen: "0.0.0.0:7002", Key: bytes.Repeat([]byte("k"), 16)}}}
	var buf bytes.Buffer
	c.warnOpenCluster(slog.New(slog.NewTextHandler(&buf, nil)))
	out := buf.String()
	if n := strings.Count(out, "level=WARN"); n != 1 {
		t.Errorf("%d warnings, want 1 (raft only):\n%s", n, out)
	}
	if !strings.Contains(out, "port=raft") || !strings.Contains(out, "192.0.2.1:7000") || !strings.Contains(out, "AppendEntries") {
		t.Errorf("the warning does not name the raft port, its address and what anyone can do:\n%s", out)
	}
}

// TestAdminTokenMadeBeyondLoopback checks the admin defaults: beyond loopback without a token
// one is made in the data directory (0600), reused on the next start, and the log names the
// file but never the token; on loopback none is made and a warning says the API is open.
func TestAdminTokenMadeBeyondLoopback(t *testing.T) {
	dir := t.TempDir()
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	first := Config{AdminListen: "0.0.0.0:9090"}
	if err := first.secure(log, dir); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, admin.TokenFileName)
	st, err := os.Stat(path)
	if err != nil {
		t.Fatalf("no token file: %v", err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("token file mode %v, want 0600", st.Mode().Perm())
	}
	if len(first.AdminToken) < 32 {
		t.Errorf("token %d characters, want at least 32", len(first.AdminToken))
	}
	again := Config{AdminListen: "[::]:9090"}
	if err := again.secure(log, dir); err != nil {
		t.Fatal(err)
	}
	if again.AdminToken != first.AdminToken {
		t.Error("the second start made a new token instead of reusing the file's")
	}
	if strings.Contains(buf.String(), first.AdminToken) {
		t.Errorf("the log shows the token:\n%s", buf.String())
	}
	if !strings.Contains(buf.String(), path) {
		t.Errorf("the log does not name the token file %s:\n%s", path, buf.String())
	}
	given := Config{AdminListen: "0.0.0.0:9090", AdminToken: "given"}
	if err := given.secure(log, t.TempDir()); err != nil || given.AdminToken != "given" {
		t.Errorf("a given token: %q, %v", given.AdminToken, err)
	}
	buf.Reset()
	local := Config{AdminListen: "127.0.0.1:9090"}
	loDir := t.TempDir()
	if err := local.secure(log, loDir); err != nil {
		t.Fatal(err)
	}
	if local.AdminToken != "" {
		t.Error("a token was made for a loopback admin API")
	}
	if _, err := os.Stat(filepath.Join(loDir, admin.TokenFileName)); err == nil {
		t.Error("a token file was made for a loopback admin API")
	}
	if !strings.Contains(buf.String(), "level=WARN") {
		t.Errorf("no warning for an open loopback admin API:\n%s", buf.String())
	}
}
