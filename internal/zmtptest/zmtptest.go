// Package zmtptest speaks just enough ZMTP 3.0 (the NULL mechanism) over a raw TCP
// connection to play a publisher, honest or hostile, in tests: the greeting, the READY
// handshake, and then frames of any flags and sizes, from a chosen local address.
package zmtptest

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"time"
)

// Frame flags.
const (
	More    = 0x01
	Long    = 0x02
	Command = 0x04
)

// Conn is a ZMTP connection that has completed its handshake.
type Conn struct{ net.Conn }

// Greeting is a ZMTP 3.0 greeting for the NULL mechanism, as a client sends it.
func Greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:], "NULL")
	return g
}

// Header is a frame header announcing size bytes.
func Header(flags byte, size uint64) []byte {
	if size > 255 {
		return binary.BigEndian.AppendUint64([]byte{flags | Long}, size)
	}
	return []byte{flags, byte(size)}
}

// Ready is the READY command of a socket of the given type (PUB, SUB, DEALER...).
func Ready(socketType string) []byte {
	body := append([]byte{5}, "READY"...)
	body = append(body, byte(len("Socket-Type")))
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, uint32(len(socketType)))
	body = append(body, socketType...)
	return append(Header(Command, uint64(len(body))), body...)
}

// Dial connects from local (an IP address; "" lets the system choose) to addr and completes
// the handshake as a socketType socket, within ctx.
func Dial(ctx context.Context, local, addr, socketType string) (*Conn, error) {
	d := net.Dialer{}
	if local != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
	}
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	c := &Conn{nc}
	if dl, ok := ctx.Deadline(); ok {
		_ = nc.SetDeadline(dl)
	}
	if err := c.handshake(socketType); err != nil {
		_ = nc.Close()
		return nil, err
	}
	_ = nc.SetDeadline(time.Time{})
	return c, nil
}

func (c *Conn) handshake(socketType string) error {
	if _, err := c.Write(append(Greeting(), Ready(socketType)...)); err != nil {
		return fmt.Errorf("zmtptest: send greeting: %w", err)
	}
	peer := make([]byte, 64)
	if _, err := io.ReadFull(c, peer); err != nil {
		return fmt.Errorf("zmtptest: read greeting: %w", err)
	}
	if _, err := c.ReadFrame(); err != nil {
		return fmt.Errorf("zmtptest: read READY: %w", err)
	}
	return nil
}

// ReadFrame reads one frame and returns its body (at most 1 MiB).
func (c *Conn) ReadFrame() ([]byte, error) {
	var h [9]byte
	if _, err := io.ReadFull(c, h[:2]); err != nil {
		return nil, err
	}
	size := uint64(h[1])
	if h[0]&Long != 0 {
		if _, err := io.ReadFull(c, h[2:]); err != nil {
			return nil, err
		}
		size = binary.BigEndian.Uint64(h[1:])
	}
	if size > 1<<20 {
		return nil, fmt.Errorf("zmtptest: frame of %d bytes", size)
	}
	body := make([]byte, size)
	_, err := io.ReadFull(c, body)
	return body, err
}

// Send sends one message of the given frames.
func (c *Conn) Send(frames ...[]byte) error {
	var b []byte
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = More
		}
		b = append(b, Header(flags, uint64(len(f)))...)
		b = append(b, f...)
	}
	_, err := c.Write(b)
	return err
}
