package replica

import (
	"context"
	"crypto/tls"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrouter-ha/kvrouter-ha/internal/envoytest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/testpki"
)

// TestPickerPortTakesOnlyGatewaysWithACertificateFromItsCA: with a certificate, a key and a
// client CA, the picker's port answers a gateway presenting a certificate from that CA, and
// refuses one without a certificate, one with a certificate from another CA, and plaintext.
func TestPickerPortTakesOnlyGatewaysWithACertificateFromItsCA(t *testing.T) {
	ca := testpki.NewCA(t, "gateway CA")
	other := testpki.NewCA(t, "another CA")
	cert, key := ca.IssueFiles("picker", testpki.ServerOnly, "127.0.0.1")
	fleet := startWorkers(t, 1, simConfig(0))
	rep := startTestReplica(t, fleet, func(c *Config) {
		c.ExtProcListen = "127.0.0.1:0"
		c.ExtProcTLS = ExtProcTLSFiles{CertFile: cert, KeyFile: key, ClientCAFile: ca.CAFile}
	})
	for _, tc := range []struct {
		name  string
		dial  func() (*envoytest.Gateway, error)
		serve bool
	}{
		{"a gateway certificate from the CA", func() (*envoytest.Gateway, error) {
			return envoytest.DialTLS(rep.ExtProcAddr(), testpki.ClientConfig(ca, ca.Issue("gateway", testpki.ServerAndClient)))
		}, true},
		{"no certificate", func() (*envoytest.Gateway, error) {
			return envoytest.DialTLS(rep.ExtProcAddr(), testpki.ClientConfig(ca))
		}, false},
		{"a certificate from another CA", func() (*envoytest.Gateway, error) {
			return envoytest.DialTLS(rep.ExtProcAddr(), testpki.ClientConfig(ca, other.Issue("gateway", testpki.ServerAndClient)))
		}, false},
		{"plaintext", func() (*envoytest.Gateway, error) { return envoytest.Dial(rep.ExtProcAddr()) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gw, err := tc.dial()
			if err != nil {
				t.Fatal(err)
			}
			defer gw.Close()
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			st, err := gw.Health(ctx, "liveness")
			if tc.serve != (err == nil && st == healthpb.HealthCheckResponse_SERVING) {
				t.Fatalf("health %v, %v; want served: %v", st, err, tc.serve)
			}
		})
	}
}

// TestPickerTLSFlagsGoTogether: a certificate without its key, or a client CA without a
// certificate, stops the start with the flags named.
func TestPickerTLSFlagsGoTogether(t *testing.T) {
	for _, f := range []ExtProcTLSFiles{{CertFile: "c.pem"}, {KeyFile: "k.pem"}, {ClientCAFile: "ca.pem"}} {
		if _, err := f.load(nil); err == nil {
			t.Errorf("%+v: loaded", f)
		}
	}
	if cfg, err := (ExtProcTLSFiles{}).load(nil); cfg != (*tls.Config)(nil) || err != nil {
		t.Errorf("no files: %v, %v; want plaintext", cfg, err)
	}
}
