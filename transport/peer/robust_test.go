package peer

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrouter-ha/kvrouter-ha/internal/testpki"
)

func TestGarbageOnThePortDoesNotHurtTheServer(t *testing.T) {
	h := &fakeHandler{}
	addr := serve(t, h, ServerOptions{HandshakeTimeout: 500 * time.Millisecond})
	noise := bytes.Repeat([]byte{0xde, 0xad, 0xbe, 0xef, 0x00, 0xff}, 16<<10)
	cases := []struct {
		name    string
		payload []byte
	}{
		{"binary noise", noise},
		{"http/1 request", []byte("GET /peerpb.Peer/Apply HTTP/1.1\r\nHost: x\r\n\r\n")},
		{"http/2 preface then junk frames", append([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), noise...)},
		// Too short to be judged: the handshake timeout must cut it.
		{"tls hello to a plaintext port, then silence", []byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if err := conn.SetDeadline(time.Now().Add(15 * time.Second)); err != nil {
				t.Fatal(err)
			}
			// The server may hang up before reading everything; a write error is fine.
			_, _ = conn.Write(tc.payload)
			// The server must close the connection (EOF or reset), not wait for more.
			_, err = io.Copy(io.Discard, conn)
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("server kept a garbage connection open: %v", err)
			}
		})
	}
	// A well-behaved client is served afterwards.
	c := dial(t, addr, ClientOptions{})
	if _, _, err := c.Apply(testCtx(t), []byte("ok")); err != nil {
		t.Fatalf("Apply after garbage: %v", err)
	}
	if n := h.appliedCount(); n != 1 {
		t.Fatalf("handler applied %d commands, want just the well-formed one", n)
	}
}

func TestOversizedMessagesAreRejected(t *testing.T) {
	cases := []struct {
		name      string
		serverMax int
		clientMax int
		size      int
	}{
		{"server default 4 MiB", 0, 8 << 20, 5 << 20},
		{"client default 4 MiB", 8 << 20, 0, 5 << 20},
		{"server limit", 1 << 10, 0, 2 << 10},
		{"client limit", 0, 1 << 10, 2 << 10},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := &fakeHandler{}
			c := dial(t, serve(t, h, ServerOptions{MaxMessageBytes: tc.serverMax}), ClientOptions{MaxMessageBytes: tc.clientMax})
			ctx := testCtx(t)
			_, _, err := c.Apply(ctx, make([]byte, tc.size))
			if status.Code(err) != codes.ResourceExhausted {
				t.Fatalf("err = %v, want ResourceExhausted", err)
			}
			if n := h.appliedCount(); n != 0 {
				t.Fatalf("an oversized command was applied")
			}
			if _, _, err := c.Apply(ctx, []byte("small")); err != nil {
				t.Fatalf("a normal call after the oversized one: %v", err)
			}
		})
	}
}

func TestMutualTLSRefusesClientsWithoutACertFromTheCA(t *testing.T) {
	ca, other := testpki.NewCA(t, "cluster CA"), testpki.NewCA(t, "other CA")
	replica := func(from *testpki.CA, name string) tls.Certificate {
		return from.Issue(name, testpki.ServerAndClient, "127.0.0.1")
	}
	serverTLS := &tls.Config{
		Certificates: []tls.Certificate{replica(ca, "replica-1")},
		ClientCAs:    ca.Pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS13,
	}
	h := &fakeHandler{}
	addr := serve(t, h, ServerOptions{TLS: serverTLS})

	good := testpki.ClientConfig(ca, replica(ca, "replica-2"))
	c := dial(t, addr, ClientOptions{TLS: good})
	if _, _, err := c.Apply(testCtx(t), []byte("with a cert")); err != nil {
		t.Fatalf("client with a CA cert: %v", err)
	}

	refused := []struct {
		name string
		tls  *tls.Config
	}{
		{"no client cert", testpki.ClientConfig(ca)},
		{"cert from another CA", testpki.ClientConfig(ca, replica(other, "intruder"))},
		{"does not trust the server", testpki.ClientConfig(other, replica(ca, "replica-3"))},
		{"plaintext", nil},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			p := NewPool(ClientOptions{TLS: tc.tls})
			defer p.Close()
			bad, err := p.Get(addr)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(testCtx(t), 5*time.Second)
			defer cancel()
			if _, _, err := bad.Apply(ctx, []byte("intruder")); err == nil {
				t.Fatal("call succeeded")
			}
		})
	}
	if n := h.appliedCount(); n != 1 {
		t.Fatalf("handler applied %d commands, want only the authenticated one", n)
	}
}

func TestForwarderReconnectsToARestartedLeader(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	first := NewServer(&fakeHandler{}, ServerOptions{})
	go first.Serve(l)

	v := newLeaderView()
	v.set(addr)
	f := fastForwarder(t, v)
	ctx := testCtx(t)
	if _, _, err := f.Forward(ctx, []byte("before")); err != nil {
		t.Fatal(err)
	}
	first.Stop() // the leader's process dies; its pooled connection breaks

	// The same address comes back (a restarted replica).
	l2, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("cannot rebind %s: %v", addr, err)
	}
	h := &fakeHandler{}
	second := NewServer(h, ServerOptions{})
	go second.Serve(l2)
	t.Cleanup(second.Stop)

	if _, _, err := f.Forward(ctx, []byte("after")); err != nil {
		t.Fatalf("Forward after the leader restarted: %v", err)
	}
	if n := h.appliedCount(); n != 1 {
		t.Fatalf("restarted leader applied %d, want 1", n)
	}
}

func TestMemberOnlyCallsNeedACertificateTheMemberCheckAdmits(t *testing.T) {
	ca := testpki.NewCA(t, "cluster CA")
	serverTLS := testpki.MutualConfig(ca.Issue("replica-1", testpki.ServerAndClient, "127.0.0.1"), ca)
	serverTLS.ClientAuth = tls.RequireAndVerifyClientCert
	h := &fakeHandler{}
	// The check admits the certificate of CN replica-2 only, as the cluster admits only
	// certificates that name a configured replica.
	member := func(ctx context.Context) error {
		if c := ClientCertificate(ctx); c == nil || c.Subject.CommonName != "replica-2" {
			return errors.New("not a member")
		}
		return nil
	}
	addr := serve(t, h, ServerOptions{TLS: serverTLS, Member: member})
	ctx := testCtx(t)

	good := dial(t, addr, ClientOptions{TLS: testpki.ClientConfig(ca, ca.Issue("replica-2", testpki.ServerAndClient, "127.0.0.1"))})
	if _, _, err := good.Apply(ctx, []byte("from a member")); err != nil {
		t.Fatalf("a member's Apply: %v", err)
	}
	stranger := dial(t, addr, ClientOptions{TLS: testpki.ClientConfig(ca, ca.Issue("intruder", testpki.ServerAndClient, "127.0.0.1"))})
	for _, tc := range []struct {
		call string
		err  error
	}{
		{"Apply", func() error { _, _, err := stranger.Apply(ctx, []byte("forged")); return err }()},
		{"ReadIndex", func() error { _, err := stranger.ReadIndex(ctx); return err }()},
		{"Touch", stranger.Touch(ctx, []Touch{{Session: "s", Revision: 1}})},
		{"Leave", stranger.Leave(ctx, "replica-1")},
		{"IndexSnapshot", func() error { _, err := stranger.IndexSnapshot(ctx, "intruder", 0); return err }()},
	} {
		if !errors.Is(tc.err, ErrPermission) {
			t.Errorf("%s from a non-member: %v, want PermissionDenied", tc.call, tc.err)
		}
	}
	// Status and Join stay open to any certificate of the CA: a joiner asks before it is
	// a member, and the handler checks that a join names its caller.
	if _, err := stranger.Status(ctx); err != nil {
		t.Errorf("Status from a certificate of the CA: %v", err)
	}
	if err := stranger.Join(ctx, JoinRequest{ID: "intruder", RaftAddr: "127.0.0.1:1"}); err != nil {
		t.Errorf("Join reached the handler's own check: %v", err)
	}
	if n := h.appliedCount(); n != 1 {
		t.Fatalf("handler applied %d commands, want only the member's", n)
	}
}
