// Package testpki makes throwaway certificate authorities and certificates for tests. It is
// for tests only: keys are generated on the spot, files go to the test's temporary
// directory, and every failure fails the test that made the CA.
//
// It lives outside a _test.go file because test files cannot be imported across packages,
// and the TLS tests of the cluster, the peer transport, the binary and the deploy files all
// need the same kind of certificates: ECDSA P-256, IP SANs for loopback addresses, a DNS
// SAN naming the replica's id (IssueReplicaFiles: the cluster checks that a certificate
// names the replica it speaks for), and a second CA to play a replica from another cluster.
package testpki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Usage says what a leaf certificate may be used for.
type Usage int

const (
	// ServerAndClient is a replica's certificate: it serves its peers and dials them, so
	// mutual TLS needs both.
	ServerAndClient Usage = iota
	// ServerOnly is a plain server's certificate, which a peer must refuse to present as a
	// client.
	ServerOnly
)

func (u Usage) extKeyUsages() []x509.ExtKeyUsage {
	if u == ServerOnly {
		return []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	}
	return []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
}

// validity is generous on both sides so that neither clock skew nor a slow test run near
// an edge makes a certificate fail for a reason the test is not about.
const validity = 24 * time.Hour

// CA is a throwaway certificate authority. Its methods fail the test that made it, so they
// belong on that test's goroutine.
type CA struct {
	// Cert is the CA's certificate; Pool trusts it and nothing else.
	Cert *x509.Certificate
	Pool *x509.CertPool
	// CAFile is Cert as a PEM file, for code that reads its trust from disk.
	CAFile string

	t   testing.TB
	key *ecdsa.PrivateKey
	dir string
}

// NewCA makes a CA named name, with its PEM file in a fresh temporary directory of t.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("testpki: CA key: %v", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(t), Subject: pkix.Name{CommonName: name},
		NotBefore: now.Add(-validity), NotAfter: now.Add(validity),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatalf("testpki: CA certificate: %v", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatalf("testpki: CA certificate: %v", err)
	}
	ca := &CA{Cert: cert, Pool: x509.NewCertPool(), t: t, key: key, dir: t.TempDir()}
	ca.Pool.AddCert(cert)
	ca.CAFile = ca.write(name+"-ca.pem", "CERTIFICATE", der)
	return ca
}

// Issue signs a leaf certificate named name for hosts: each is a host or host:port, an IP
// becomes an IP SAN and anything else a DNS SAN. The result carries its parsed Leaf.
func (ca *CA) Issue(name string, u Usage, hosts ...string) tls.Certificate {
	ca.t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		ca.t.Fatalf("testpki: key for %s: %v", name, err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(ca.t), Subject: pkix.Name{CommonName: name},
		NotBefore: now.Add(-validity), NotAfter: now.Add(validity),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: u.extKeyUsages(),
	}
	for _, h := range hosts {
		if host, _, err := net.SplitHostPort(h); err == nil {
			h = host
		}
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		ca.t.Fatalf("testpki: certificate for %s: %v", name, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		ca.t.Fatalf("testpki: certificate for %s: %v", name, err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
}

// IssueFiles is Issue written as PEM files (the certificate, and the key as PKCS #8) in the
// CA's directory, named after name; issuing the same name twice replaces the files.
func (ca *CA) IssueFiles(name string, u Usage, hosts ...string) (certFile, keyFile string) {
	ca.t.Helper()
	c := ca.Issue(name, u, hosts...)
	kder, err := x509.MarshalPKCS8PrivateKey(c.PrivateKey)
	if err != nil {
		ca.t.Fatalf("testpki: key for %s: %v", name, err)
	}
	return ca.write(name+".pem", "CERTIFICATE", c.Certificate[0]), ca.write(name+"-key.pem", "PRIVATE KEY", kder)
}

// IssueReplicaFiles is a replica's certificate as the cluster checks it: server and client
// auth, a DNS SAN naming the replica's id, and SANs for the addresses (host:port) it
// advertises, written as IssueFiles writes them.
func (ca *CA) IssueReplicaFiles(id string, addrs ...string) (certFile, keyFile string) {
	ca.t.Helper()
	return ca.IssueFiles(id, ServerAndClient, append([]string{id}, addrs...)...)
}

func (ca *CA) write(name, typ string, der []byte) string {
	ca.t.Helper()
	path := filepath.Join(ca.dir, strings.ReplaceAll(name, " ", "-"))
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		ca.t.Fatalf("testpki: %v", err)
	}
	return path
}

// MutualConfig presents leaf and trusts trust's CA both ways (as the servers' and the
// clients' authority), at TLS 1.3. It leaves ClientAuth alone: whether client certificates
// are required is for the code under test to decide, and a test must see it do so.
func MutualConfig(leaf tls.Certificate, trust *CA) *tls.Config {
	return &tls.Config{
		Certificates: []tls.Certificate{leaf},
		RootCAs:      trust.Pool, ClientCAs: trust.Pool, MinVersion: tls.VersionTLS13,
	}
}

// ClientConfig trusts trust's CA for servers and presents certs (none for a client without
// a certificate), at TLS 1.3.
func ClientConfig(trust *CA, certs ...tls.Certificate) *tls.Config {
	return &tls.Config{RootCAs: trust.Pool, Certificates: certs, MinVersion: tls.VersionTLS13}
}

// serial is a random serial number, so that no two certificates of a CA share one however
// fast they are issued.
func serial(t testing.TB) *big.Int {
	t.Helper()
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		t.Fatalf("testpki: serial: %v", err)
	}
	return n
}
