package kvevents

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// zmq4 allocates each incoming frame at the size its header announces, up to 2^63 bytes, and
// buffers whole messages (all their frames) per connection, in a channel of ten, and in
// whatever its reader holds, before Recv hands one up. The guard transport is plain TCP whose
// connections watch the incoming ZMTP stream, frame by frame, before zmq4 sees a byte:
//
//   - a frame over maxFrame, a message (its frames with MORE, 0x01, and the last) over
//     maxMessage or of more than maxFrames frames, and a handshake message over maxCommand
//     fail the connection, which zmq4 then drops like any broken one;
//   - on a subscriber's socket (an admission in the socket's context), each message reserves
//     maxMessage bytes of the socket's budget at its first header byte and gives back what it
//     did not use when it ends; the subscriber gives back the rest once it has handled the
//     message. A connection that would pass the budget waits before zmq4 allocates anything, so
//     the bytes of messages in flight, across every connection, stay under the budget;
//   - a bound socket admits only connections from its workers' addresses, at most maxConns at
//     once, and fails a connection whose message names, in its topic, a worker whose address is
//     not the connection's (admission.go).
//
// Until the handshake's message is in, reads have a deadline: zmq4's handshake has none, and a
// peer that connects and says nothing would otherwise hold a dial, or a bound socket's accept
// loop, for ever. Every tcp:// endpoint of this package goes through the guard.

// guardScheme is the transport name the guard is registered under; guarded rewrites tcp://
// endpoints to it.
const guardScheme = "kvevents-tcp"

const (
	// maxFrame is the largest ZMTP frame accepted: a payload at its limit, with room to spare.
	maxFrame = MaxPayload + 1<<20
	// maxMessage bounds the frames of one message together: vLLM's is [topic, 8-byte
	// sequence, payload], the payload at most MaxPayload.
	maxMessage = maxFrame
	// maxFrames bounds the frames of one message (replay answers have up to five).
	maxFrames = 16
	// maxCommand bounds the handshake's message (READY and its metadata).
	maxCommand = 64 << 10
	// zmtpGreeting is the length of the ZMTP 3 greeting, before the first frame.
	zmtpGreeting = 64
	// flagMore and flagLong are the ZMTP frame flags the guard reads.
	flagMore, flagLong = 0x01, 0x02
)

func init() {
	// zmq4 has no per-socket transport option, only this process-wide registry; registering
	// once here, under a name of our own, leaves every other user of zmq4 untouched. What is
	// per socket (an admission) travels in the socket's context, which zmq4 hands to Listen
	// and Dial.
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
	return newGuardConn(c, admissionOf(ctx)), nil
}

func (g guardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := g.inner.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return guardListener{Listener: l, adm: admissionOf(ctx)}, nil
}

func (g guardTransport) Addr(ep string) (string, error) { return g.inner.Addr(ep) }

type guardListener struct {
	net.Listener
	adm *admission // nil: every connection, no budget
}

// Accept returns the next connection the admission lets in; it closes the others.
func (l guardListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.adm == nil {
			return newGuardConn(c, nil), nil
		}
		if reason, err := l.adm.admit(c.RemoteAddr()); err != nil {
			_ = c.Close()
			l.adm.refuse(reason, c.RemoteAddr(), err)
			continue
		}
		g := newGuardConn(c, l.adm)
		g.counted = true
		// zmq4 forgets, without closing it, a connection whose handshake failed: one that
		// has not been read since its handshake by then is closed.
		time.AfterFunc(2*handshakeTimeout, func() {
			if !g.served.Load() {
				_ = g.Close()
			}
		})
		return g, nil
	}
}

// guardConn follows the ZMTP framing of what it reads: the greeting, then frames of a flags
// byte (0x02: an 8-byte size follows, else a 1-byte size) and a body. It only looks; the bytes
// reach zmq4 unchanged. It reads no further than the end of the current greeting, header or
// body, so that a message's end is the end of a Read.
type guardConn struct {
	net.Conn
	adm     *admission
	counted bool // holds one of adm's connection slots

	skip    uint64  // bytes of greeting or body still to pass over
	inFrame bool    // skip is a frame body (not the greeting)
	last    bool    // the frame in skip ends its message
	hdr     [9]byte // the frame header read so far
	hdrLen  int
	msgSize uint64 // bytes announced by the frames of the current message so far
	frames  int    // frames of the current message so far
	cmd     bool   // the current message is a command
	topic   []byte // the first frame of the current message, while it is in (bound sockets)
	held    int64  // budget held by the current message
	shaking bool   // the handshake's message is not in yet
	timeout time.Duration
	// msgTimeout bounds how long a message, once begun, may take to be whole while it holds
	// the budget.
	msgTimeout time.Duration

	mu     sync.Mutex // err, closed
	err    error
	served atomic.Bool // read after the handshake
	closed chan struct{}
	once   sync.Once
}

const (
	// handshakeTimeout bounds the ZMTP greeting and handshake of one connection.
	handshakeTimeout = 5 * time.Second
	// messageTimeout bounds how long one message may take from its first byte to its last
	// where it holds a budget: a peer that begins messages and stalls must not hold the budget
	// for ever.
	messageTimeout = 30 * time.Second
)

func newGuardConn(c net.Conn, adm *admission) *guardConn {
	return newGuardConnTimeout(c, adm, handshakeTimeout)
}

func newGuardConnTimeout(c net.Conn, adm *admission, timeout time.Duration) *guardConn {
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	return &guardConn{Conn: c, adm: adm, skip: zmtpGreeting, shaking: true, timeout: timeout, msgTimeout: messageTimeout,
		closed: make(chan struct{})}
}

// Close closes the connection and gives back what it holds: its slot and the budget of a
// message not yet whole.
func (c *guardConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		close(c.closed)
		if c.adm != nil {
			c.mu.Lock()
			c.adm.budget.release(c.held)
			c.held = 0
			c.mu.Unlock()
			if c.counted {
				c.adm.conns.Add(-1)
			}
		}
	})
	return err
}

func (c *guardConn) Read(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return 0, c.err
	}
	if !c.shaking {
		c.served.Store(true)
	}
	if want := c.want(); want > 0 && uint64(len(p)) > want {
		p = p[:want]
	}
	n, err := c.Conn.Read(p)
	ferr := c.follow(p[:n])
	if ne := net.Error(nil); ferr == nil && errors.As(err, &ne) && ne.Timeout() {
		switch {
		case c.shaking:
			ferr = fmt.Errorf("kvevents: no ZMTP handshake from %s within %v: %w", c.RemoteAddr(), c.timeout, err)
		case c.held > 0:
			ferr = fmt.Errorf("kvevents: message from %s not whole within %v: %w", c.RemoteAddr(), c.msgTimeout, errSlowMessage)
		}
	}
	if ferr != nil {
		// zmq4 does not close a connection whose handshake failed; this does.
		c.err = ferr
		if c.adm != nil {
			c.adm.refuse(reasonOf(ferr), c.RemoteAddr(), ferr)
		}
		c.mu.Unlock()
		_ = c.Close()
		c.mu.Lock()
		return 0, ferr
	}
	return n, err
}

// want is how many bytes may be read before the framing needs a look: the rest of the
// greeting, header or body (0: any).
func (c *guardConn) want() uint64 {
	switch {
	case c.skip > 0:
		return c.skip
	case c.hdrLen == 0:
		return 2
	case c.hdr[0]&flagLong != 0:
		return uint64(9 - c.hdrLen)
	default:
		return uint64(2 - c.hdrLen)
	}
}

// Errors of the guard, by what the peer did (each wraps ErrTooLarge or errRefused).
var (
	errFrameTooLarge   = fmt.Errorf("frame too large: %w", ErrTooLarge)
	errMessageTooLarge = fmt.Errorf("message too large: %w", ErrTooLarge)
	errTooManyFrames   = fmt.Errorf("too many frames in one message: %w", ErrTooLarge)
	errRefused         = errors.New("refused")
	errWrongWorker     = fmt.Errorf("topic of a worker at another address: %w", errRefused)
	errSlowMessage     = errors.New("message too slow")
)

// follow advances the framing state over b: it fails on a frame, message or handshake over
// its bound, reserves a message's budget at its first header byte and checks its topic once
// its first frame is in.
func (c *guardConn) follow(b []byte) error {
	for {
		if c.skip > 0 {
			k := min(c.skip, uint64(len(b)))
			if c.topic != nil && c.inFrame && c.frames == 1 {
				c.topic = append(c.topic, b[:k]...)
			}
			c.skip -= k
			b = b[k:]
			if c.skip > 0 {
				return nil
			}
		}
		if c.inFrame {
			c.inFrame = false
			if err := c.frameDone(); err != nil {
				return err
			}
		}
		if len(b) == 0 {
			return nil
		}
		if c.hdrLen == 0 && c.frames == 0 && !c.shaking && c.adm != nil && c.held == 0 {
			// A message begins: reserve before zmq4 sees its header.
			if err := c.adm.budget.acquire(c.closed, maxMessage); err != nil {
				return err
			}
			c.held = maxMessage
			_ = c.Conn.SetReadDeadline(time.Now().Add(c.msgTimeout))
		}
		c.hdr[c.hdrLen] = b[0]
		c.hdrLen++
		b = b[1:]
		want := 2
		if c.hdr[0]&flagLong != 0 {
			want = 9
		}
		if c.hdrLen < want {
			continue
		}
		var size uint64
		for _, x := range c.hdr[1:want] {
			size = size<<8 | uint64(x)
		}
		flags := c.hdr[0]
		c.hdrLen = 0
		if err := c.frameStart(flags, size); err != nil {
			return err
		}
		c.skip, c.inFrame = size, true
	}
}

// frameStart checks a frame header against the bounds of the frame and of its message.
func (c *guardConn) frameStart(flags byte, size uint64) error {
	if size > maxFrame {
		return fmt.Errorf("kvevents: ZMTP frame of %d bytes from %s (limit %d): %w", size, c.RemoteAddr(), maxFrame, errFrameTooLarge)
	}
	if c.frames == 0 {
		c.cmd = flags&0x04 != 0
		if c.adm != nil && c.adm.topics != nil && !c.cmd && !c.shaking {
			c.topic = make([]byte, 0, min(size, maxTopic))
		}
	}
	c.frames++
	c.msgSize += size
	limit := uint64(maxMessage)
	if c.shaking {
		limit = maxCommand
	}
	if c.msgSize > limit {
		return fmt.Errorf("kvevents: ZMTP message of %d bytes or more from %s (limit %d): %w", c.msgSize, c.RemoteAddr(), limit, errMessageTooLarge)
	}
	if c.frames > maxFrames {
		return fmt.Errorf("kvevents: ZMTP message of more than %d frames from %s: %w", maxFrames, c.RemoteAddr(), errTooManyFrames)
	}
	if c.topic != nil && c.frames == 1 && size > maxTopic {
		return fmt.Errorf("kvevents: topic of %d bytes from %s (limit %d): %w", size, c.RemoteAddr(), maxTopic, errWrongWorker)
	}
	c.last = flags&flagMore == 0
	return nil
}

// frameDone runs once a frame's body is in: it checks the topic after the first frame, and
// ends the message (and the handshake) after the last.
func (c *guardConn) frameDone() error {
	if c.topic != nil && c.frames == 1 {
		topic := c.topic
		c.topic = nil
		if err := c.adm.checkTopic(c.RemoteAddr(), string(topic)); err != nil {
			return err
		}
	}
	if !c.last {
		return nil
	}
	if c.shaking {
		c.shaking = false
		_ = c.Conn.SetReadDeadline(time.Time{})
	} else if c.adm != nil {
		// The message is whole: zmq4 hands it up, and the subscriber gives back its size
		// once it has handled it. What the message did not use goes back now.
		c.adm.budget.release(c.held - int64(c.msgSize))
		c.held = 0
		_ = c.Conn.SetReadDeadline(time.Time{})
	}
	c.msgSize, c.frames, c.cmd = 0, 0, false
	return nil
}

// budget is the bytes a socket's messages in flight may hold, from their first header byte in
// the guard until the subscriber has handled them.
type budget struct {
	mu   sync.Mutex
	free int64
	wake chan struct{} // closed (and replaced) when bytes come back
}

func newBudget(n int64) *budget { return &budget{free: n, wake: make(chan struct{})} }

// acquire takes n bytes, waiting until they are free or done is closed.
func (b *budget) acquire(done <-chan struct{}, n int64) error {
	for {
		b.mu.Lock()
		if b.free >= n {
			b.free -= n
			b.mu.Unlock()
			return nil
		}
		wake := b.wake
		b.mu.Unlock()
		select {
		case <-wake:
		case <-done:
			return net.ErrClosed
		}
	}
}

// release gives back n bytes (n <= 0 does nothing).
func (b *budget) release(n int64) {
	if b == nil || n <= 0 {
		return
	}
	b.mu.Lock()
	b.free += n
	close(b.wake)
	b.wake = make(chan struct{})
	b.mu.Unlock()
}
