package testpki

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestIssueSetsSANsAndUsagesThatVerify(t *testing.T) {
	ca, other := NewCA(t, "test CA"), NewCA(t, "other CA")
	c := ca.Issue("replica", ServerAndClient, "127.0.0.1:7000", "127.1.2.3", "localhost")
	leaf := c.Leaf
	if leaf == nil {
		t.Fatal("Issue returned no parsed leaf")
	}
	var ips []string
	for _, ip := range leaf.IPAddresses {
		ips = append(ips, ip.String())
	}
	if !slices.Equal(ips, []string{"127.0.0.1", "127.1.2.3"}) || !slices.Equal(leaf.DNSNames, []string{"localhost"}) {
		t.Fatalf("SANs: IPs %v, DNS %v; want the port dropped and the name as DNS", ips, leaf.DNSNames)
	}
	for _, u := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: ca.Pool, KeyUsages: []x509.ExtKeyUsage{u}}); err != nil {
			t.Errorf("usage %v against its own CA: %v", u, err)
		}
	}
	if err := leaf.VerifyHostname("127.1.2.3"); err != nil {
		t.Errorf("hostname: %v", err)
	}
	var unknown x509.UnknownAuthorityError
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: other.Pool}); !errors.As(err, &unknown) {
		t.Errorf("against another CA: %v, want an unknown authority", err)
	}

	server := ca.Issue("server", ServerOnly, "127.0.0.1").Leaf
	if _, err := server.Verify(x509.VerifyOptions{Roots: ca.Pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Errorf("server-only certificate as a server: %v", err)
	}
	if _, err := server.Verify(x509.VerifyOptions{Roots: ca.Pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err == nil {
		t.Error("a server-only certificate verifies as a client")
	}
}

func TestFilesLoadAsWhatTheyHold(t *testing.T) {
	ca := NewCA(t, "file CA")
	certFile, keyFile := ca.IssueFiles("file leaf", ServerAndClient, "127.0.0.1")
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatalf("the written certificate and key do not load as a pair: %v", err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	if leaf.Subject.CommonName != "file leaf" || strings.Contains(certFile, " ") {
		t.Errorf("leaf %q in %s", leaf.Subject.CommonName, certFile)
	}
	pemCA, err := os.ReadFile(ca.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemCA) {
		t.Fatalf("%s holds no PEM certificate", ca.CAFile)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool}); err != nil {
		t.Errorf("the leaf does not verify against the CA file: %v", err)
	}
	if fi, err := os.Stat(keyFile); err != nil || fi.Mode().Perm()&0o077 != 0 {
		t.Errorf("key file %v, mode %v: want it private to the owner", err, fi.Mode())
	}
}

// handshake runs one TLS handshake over loopback TCP (a pipe without buffers would deadlock
// when both sides write an alert at once) and returns the server's and client's errors.
func handshake(t *testing.T, server, client *tls.Config) (serverErr, clientErr error) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	deadline := time.Now().Add(10 * time.Second)
	done := make(chan error, 1)
	go func() {
		conn, err := l.Accept()
		if err != nil {
			done <- err
			return
		}
		defer conn.Close() // the client's read below ends here if the server accepted it
		_ = conn.SetDeadline(deadline)
		done <- tls.Server(conn, server).Handshake()
	}()
	raw, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	_ = raw.SetDeadline(deadline)
	c := tls.Client(raw, client)
	clientErr = c.Handshake()
	if clientErr == nil {
		// In TLS 1.3 the client is done before the server has checked its certificate: a
		// read shows whether the server then refused it (an alert) or just closed (EOF).
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
			clientErr = err
		}
	}
	return <-done, clientErr
}

func TestConfigsHandshakeOnlyWithinTheCA(t *testing.T) {
	ca, other := NewCA(t, "cluster CA"), NewCA(t, "other CA")
	server := MutualConfig(ca.Issue("server", ServerAndClient, "127.0.0.1"), ca)
	if server.ClientAuth != tls.NoClientCert {
		t.Fatalf("MutualConfig set ClientAuth %v; that is the code under test's to set", server.ClientAuth)
	}
	server.ClientAuth = tls.RequireAndVerifyClientCert
	withName := func(c *tls.Config) *tls.Config { c.ServerName = "127.0.0.1"; return c }

	if serr, cerr := handshake(t, server, withName(MutualConfig(ca.Issue("client", ServerAndClient), ca))); serr != nil || cerr != nil {
		t.Fatalf("mutual TLS within one CA: server %v, client %v", serr, cerr)
	}
	if serr, cerr := handshake(t, server, withName(ClientConfig(ca, ca.Issue("client", ServerAndClient)))); serr != nil || cerr != nil {
		t.Fatalf("ClientConfig with a certificate: server %v, client %v", serr, cerr)
	}
	if serr, _ := handshake(t, server, withName(ClientConfig(ca))); serr == nil {
		t.Error("the server accepted a client without a certificate")
	}
	if serr, _ := handshake(t, server, withName(ClientConfig(ca, other.Issue("intruder", ServerAndClient)))); serr == nil {
		t.Error("the server accepted a client certificate from another CA")
	}
	if _, cerr := handshake(t, server, withName(ClientConfig(other, ca.Issue("client", ServerAndClient)))); cerr == nil {
		t.Error("a client that trusts another CA accepted the server")
	}
}
