package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/testpki"
)

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
	peerCert, peerKey := ca.IssueReplicaFiles("r0", raftAddr, peerAddr)
	const token = "admin-token-that-must-not-leak"
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A 32-byte gossip key, which must not appear in the log either.
	const gossipKey = "a3Zyb3V0ZXItaGEgZ29zc2lwIHRlc3Qga2V5IDAwMzI="
	t.Setenv("KVROUTER_GOSSIP_KEY", gossipKey)
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
	var out, errOut bytes.Buffer // written by the serve goroutine's logger, read once it returned
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, &out, &errOut) }()
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool}}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 2 * time.Second}
	poll.Until(t, 15*time.Second, func() error {
		select {
		case err := <-done:
			t.Fatalf("serve stopped: %v\n%s", err, errOut.String())
		default:
		}
		resp, err := hc.Get("https://" + listen + "/readyz")
		if err != nil {
			return err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/readyz: %s", resp.Status)
		}
		return nil
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("serve returned %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve did not stop")
	}
	logged := out.String() + errOut.String()
	if !strings.Contains(logged, "mutual TLS") || !strings.Contains(logged, "https://") {
		t.Errorf("the log does not say TLS is on:\n%s", logged)
	}
	secrets := map[string]string{"admin token": token, "gossip key": gossipKey}
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
