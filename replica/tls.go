package replica

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"
)

// TLSFiles are a replica's certificates: one for the client port, and a certificate, key
// and CA for mutual TLS between replicas on the peer and Raft ports. Files are read once at
// start (a new certificate takes a restart, which a rolling restart gives without downtime);
// errors name the flag each file comes from.
type TLSFiles struct {
	CertFile, KeyFile                     string
	PeerCertFile, PeerKeyFile, PeerCAFile string

	client *tls.Config // nil: the client port is plain HTTP
	peer   *tls.Config // nil: replicas talk plaintext
}

// load reads and checks the certificate files, so that a mistake stops the start with a
// message naming the flag instead of surfacing as refused connections later. It returns
// c with the configs filled. Key material is never logged, only file names and validity.
func (c TLSFiles) load(log *slog.Logger) (TLSFiles, error) {
	if (c.CertFile == "") != (c.KeyFile == "") {
		return c, errors.New("--tls-cert-file and --tls-key-file go together: give both for TLS on the client port, or neither")
	}
	set := 0
	for _, f := range []string{c.PeerCertFile, c.PeerKeyFile, c.PeerCAFile} {
		if f != "" {
			set++
		}
	}
	if set != 0 && set != 3 {
		return c, errors.New("--peer-tls-cert-file, --peer-tls-key-file and --peer-tls-ca-file go together: give all three for mutual TLS between replicas, or none")
	}
	if c.CertFile != "" {
		pair, err := loadKeyPair("--tls-cert-file", c.CertFile, "--tls-key-file", c.KeyFile)
		if err != nil {
			return c, err
		}
		c.client = &tls.Config{
			Certificates: []tls.Certificate{pair},
			MinVersion:   tls.VersionTLS12,
			// HTTP/1.1 only, as on the plain port: the same streaming and disconnect
			// behaviour whichever way a client comes in.
			NextProtos: []string{"http/1.1"},
		}
		if log != nil {
			log.Info("client port serves TLS", "cert", c.CertFile, "subject", pair.Leaf.Subject.String(), "not_after", pair.Leaf.NotAfter.Format(time.RFC3339))
		}
	}
	if set == 3 {
		pair, err := loadKeyPair("--peer-tls-cert-file", c.PeerCertFile, "--peer-tls-key-file", c.PeerKeyFile)
		if err != nil {
			return c, err
		}
		pool, err := loadCAFile("--peer-tls-ca-file", c.PeerCAFile)
		if err != nil {
			return c, err
		}
		if err := checkPeerCert(pair, pool, c.PeerCertFile, c.PeerCAFile); err != nil {
			return c, err
		}
		c.peer = &tls.Config{
			Certificates: []tls.Certificate{pair},
			RootCAs:      pool,
			ClientCAs:    pool,
			ClientAuth:   tls.RequireAndVerifyClientCert,
			MinVersion:   tls.VersionTLS13,
		}
		if log != nil {
			log.Info("replicas use mutual TLS on the peer and Raft ports", "cert", c.PeerCertFile, "ca", c.PeerCAFile,
				"subject", pair.Leaf.Subject.String(), "not_after", pair.Leaf.NotAfter.Format(time.RFC3339))
		}
	}
	return c, nil
}

// loadKeyPair reads a certificate and its key, naming the flags in any error.
func loadKeyPair(certFlag, certFile, keyFlag, keyFile string) (tls.Certificate, error) {
	for _, f := range [][2]string{{certFlag, certFile}, {keyFlag, keyFile}} {
		if _, err := os.Stat(f[1]); err != nil {
			return tls.Certificate{}, fmt.Errorf("%s: %w", f[0], err)
		}
	}
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		// The error says what is wrong (no PEM, a key that does not match) without the key.
		return tls.Certificate{}, fmt.Errorf("%s %s with %s %s: %w", certFlag, certFile, keyFlag, keyFile, err)
	}
	if pair.Leaf == nil {
		if pair.Leaf, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return tls.Certificate{}, fmt.Errorf("%s %s: %w", certFlag, certFile, err)
		}
	}
	return pair, nil
}

// loadCAFile reads PEM CA certificates; a file with none, or with one that does not
// parse, is an error (x509.CertPool.AppendCertsFromPEM would skip it silently).
func loadCAFile(flag, path string) (*x509.CertPool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", flag, err)
	}
	pool := x509.NewCertPool()
	n := 0
	for rest := b; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%s %s: certificate %d: %w", flag, path, n+1, err)
		}
		pool.AddCert(cert)
		n++
	}
	if n == 0 {
		return nil, fmt.Errorf("%s %s: no PEM certificate in it", flag, path)
	}
	return pool, nil
}

// checkPeerCert fails when this replica's own certificate would be refused by the others:
// not from the CA, expired, or not allowed both as a server and as a client certificate.
func checkPeerCert(pair tls.Certificate, pool *x509.CertPool, certFile, caFile string) error {
	inter := x509.NewCertPool()
	for _, der := range pair.Certificate[1:] {
		if c, err := x509.ParseCertificate(der); err == nil {
			inter.AddCert(c)
		}
	}
	for _, use := range []struct {
		eku  x509.ExtKeyUsage
		name string
	}{{x509.ExtKeyUsageServerAuth, "serverAuth"}, {x509.ExtKeyUsageClientAuth, "clientAuth"}} {
		_, err := pair.Leaf.Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{use.eku}})
		if err != nil {
			var inv x509.CertificateInvalidError
			if errors.As(err, &inv) && inv.Reason == x509.IncompatibleUsage {
				return fmt.Errorf("--peer-tls-cert-file %s: replicas use it as server and client certificate, it lacks %s: %w", certFile, use.name, err)
			}
			return fmt.Errorf("--peer-tls-cert-file %s does not verify against --peer-tls-ca-file %s, so the other replicas would refuse it: %w", certFile, caFile, err)
		}
	}
	return nil
}

// clientListener wraps the client port's listener in TLS when configured.
func (c TLSFiles) clientListener(ln net.Listener) net.Listener {
	if c.client == nil {
		return ln
	}
	return tls.NewListener(ln, c.client.Clone())
}

// Scheme is the client port's URL scheme: https with a certificate, else http.
func (c TLSFiles) Scheme() string {
	if c.CertFile != "" {
		return "https"
	}
	return "http"
}

// peerConfig is a copy of the mutual TLS config, for one side of the peer gRPC or Raft port
// (nil: plaintext). One config serves server and client: it names the CA as both roots and
// client CAs, and dialers take ServerName from the dialled host.
func (c TLSFiles) peerConfig() *tls.Config {
	if c.peer == nil {
		return nil
	}
	return c.peer.Clone()
}
