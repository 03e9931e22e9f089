package kvevents

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// zmq4 allocates each incoming frame at the size its header announces, up to 2^63 bytes, so a
// peer that completes the ZMTP greeting and then announces a huge frame crashes the process
// (a makeslice panic in a library goroutine, or the OOM killer). The guard transport is plain
// TCP whose connections watch the incoming ZMTP stream and fail a read when a frame header
// announces more than maxFrame bytes: zmq4 then drops that connection like any broken one.
// Every tcp:// endpoint of this package goes through it.

// guardScheme is the transport name the guard is registered under; guarded rewrites tcp://
// endpoints to it.
const guardScheme = "kvevents-tcp"

// maxFrame is the largest ZMTP frame accepted: a payload at its limit, with room to spare.
const maxFrame = MaxPayload + 1<<20

// zmtpGreeting is the length of the ZMTP 3 greeting, before the first frame.
const zmtpGreeting = 64

func init() {
	// zmq4 has no per-socket transport option, only this process-wide registry; registering
	// once here, under a name of our own, leaves every other user of zmq4 untouched.
	if err := zmq4.RegisterTransport(guardScheme, guardTransport{inner: transport.New("tcp")}); err != nil {
		panic(fmt.Sprintf("kvevents: register the guard transport: %v", err))
	}
}

// guarded returns the endpoint this package dials or binds for ep.
func guarded(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return guardScheme + "://" + rest
	}
	return ep
}

type guardTransport struct{ inner transport.Transport }

func (g guardTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := g.inner.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newGuardConn(c), nil
}

func (g guardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := g.inner.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return guardListener{l}, nil
}

func (g guardTransport) Addr(ep string) (string, error) { return g.inner.Addr(ep) }

type guardListener struct{ net.Listener }

func (l guardListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newGuardConn(c), nil
}

// guardConn follows the ZMTP framing of what it reads: the greeting, then frames of a flags
// byte (0x02: an 8-byte size follows, else a 1-byte size) and a body. It only looks; the bytes
// reach zmq4 unchanged. Until the first frame (the handshake's READY) is in, reads have a
// deadline: zmq4's handshake has none, and a peer that connects and says nothing would
// otherwise hold a dial, or a bound socket's accept loop, for ever.
type guardConn struct {
	net.Conn
	skip    uint64  // bytes of greeting or body still to pass over
	inFrame bool    // skip is a frame body (not the greeting)
	hdr     [9]byte // the frame header read so far
	hdrLen  int
	shaking bool // the handshake's first frame is not in yet
	err     error
	timeout time.Duration // for the error message
}

// handshakeTimeout bounds the ZMTP greeting and handshake of one connection.
const handshakeTimeout = 5 * time.Second

func newGuardConn(c net.Conn) *guardConn { return newGuardConnTimeout(c, handshakeTimeout) }

func newGuardConnTimeout(c net.Conn, timeout time.Duration) *guardConn {
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	return &guardConn{Conn: c, skip: zmtpGreeting, shaking: true, timeout: timeout}
}

func (c *guardConn) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.Conn.Read(p)
	ferr := c.follow(p[:n])
	if ferr == nil && err != nil && c.shaking {
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			ferr = fmt.Errorf("kvevents: no ZMTP handshake from %s within %v: %w", c.RemoteAddr(), c.timeout, err)
		}
	}
	if ferr != nil {
		// zmq4 does not close a connection whose handshake failed; this does.
		c.err = ferr
		_ = c.Conn.Close()
		return 0, ferr
	}
	return n, err
}

// follow advances the framing state over b and fails on an oversized frame.
func (c *guardConn) follow(b []byte) error {
	for {
		if c.skip > 0 {
			k := min(c.skip, uint64(len(b)))
			c.skip -= k
			b = b[k:]
			if c.skip > 0 {
				return nil
			}
		}
		if c.inFrame {
			c.inFrame = false
			if c.shaking {
				c.shaking = false
				_ = c.Conn.SetReadDeadline(time.Time{})
			}
		}
		if len(b) == 0 {
			return nil
		}
		c.hdr[c.hdrLen] = b[0]
		c.hdrLen++
		b = b[1:]
		want := 2
		if c.hdr[0]&0x02 != 0 {
			want = 9
		}
		if c.hdrLen < want {
			continue
		}
		var size uint64
		for _, x := range c.hdr[1:want] {
			size = size<<8 | uint64(x)
		}
		c.hdrLen = 0
		if size > maxFrame {
			return fmt.Errorf("kvevents: ZMTP frame of %d bytes from %s (limit %d): %w", size, c.RemoteAddr(), maxFrame, ErrTooLarge)
		}
		c.skip, c.inFrame = size, true
	}
}
