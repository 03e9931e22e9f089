package replica

import (
	"crypto/tls"
	"errors"
	"log/slog"
	"time"
)

// ExtProcTLSFiles are the endpoint picker port's certificate and key, and the CA its
// gateways' client certificates must verify against ("" : any gateway that reaches the
// port, over TLS).
type ExtProcTLSFiles struct {
	CertFile, KeyFile, ClientCAFile string
}

// load reads the files into the picker port's TLS config (nil: plaintext), naming the flag
// of a file that is missing or wrong.
func (f ExtProcTLSFiles) load(log *slog.Logger) (*tls.Config, error) {
	if (f.CertFile == "") != (f.KeyFile == "") {
		return nil, errors.New("--ext-proc-tls-cert-file and --ext-proc-tls-key-file go together: give both for TLS on the endpoint picker's port, or neither")
	}
	if f.CertFile == "" {
		if f.ClientCAFile != "" {
			return nil, errors.New("--ext-proc-tls-client-ca-file needs --ext-proc-tls-cert-file and --ext-proc-tls-key-file: client certificates are checked over TLS")
		}
		return nil, nil
	}
	pair, err := loadKeyPair("--ext-proc-tls-cert-file", f.CertFile, "--ext-proc-tls-key-file", f.KeyFile)
	if err != nil {
		return nil, err
	}
	// HTTP/2 is gRPC's: the credentials add h2 to NextProtos.
	cfg := &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	if f.ClientCAFile != "" {
		pool, err := loadCAFile("--ext-proc-tls-client-ca-file", f.ClientCAFile)
		if err != nil {
			return nil, err
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	if log != nil {
		log.Info("endpoint picker serves TLS", "cert", f.CertFile, "client_ca", f.ClientCAFile,
			"subject", pair.Leaf.Subject.String(), "not_after", pair.Leaf.NotAfter.Format(time.RFC3339))
	}
	return cfg, nil
}
