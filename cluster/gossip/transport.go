package gossip

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/vmihailenco/msgpack/v5"
)

// memberlist's message types that the stream guard looks at (part of its wire protocol).
const (
	mlPushPull = 6
	mlUser     = 8
	mlCompress = 9
)

const (
	// maxPushNodes bounds the node count a push/pull header may claim.
	maxPushNodes = 1 << 16
	// maxStreamBytes bounds what one inbound stream may deliver.
	maxStreamBytes = 2*maxStateBytes + 1<<20
	// maxHeaderPeek bounds how far the guard reads to decode a header.
	maxHeaderPeek = 256
)

// transport wraps memberlist's UDP+TCP transport to count every byte and, when traffic is
// not encrypted, to check the sizes a stream header claims before memberlist allocates
// them: memberlist trusts them, and a 30-byte stream claiming 2^40 nodes would make it
// allocate until the process dies. With a key, only holders of the key can speak, and
// memberlist checks the encrypted length itself.
type transport struct {
	inner   *memberlist.NetTransport
	stats   *counters
	guard   bool
	packets chan *memberlist.Packet
	streams chan net.Conn
	done    chan struct{}
	wg      sync.WaitGroup
	once    sync.Once
}

var _ memberlist.NodeAwareTransport = (*transport)(nil)

// newTransport binds host:port on TCP and UDP (port 0 picks one, retried because the UDP
// port may be taken after TCP picked it).
func newTransport(host string, port int, logger *log.Logger, stats *counters, guard bool) (*transport, error) {
	var (
		inner *memberlist.NetTransport
		err   error
	)
	tries := 1
	if port == 0 {
		tries = 10
	}
	for range tries {
		inner, err = memberlist.NewNetTransport(&memberlist.NetTransportConfig{BindAddrs: []string{host}, BindPort: port, Logger: logger})
		if err == nil {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("gossip: bind %s: %w", net.JoinHostPort(host, fmt.Sprint(port)), err)
	}
	t := &transport{
		inner: inner, stats: stats, guard: guard,
		packets: make(chan *memberlist.Packet), streams: make(chan net.Conn), done: make(chan struct{}),
	}
	t.wg.Add(2)
	go t.forwardPackets()
	go t.forwardStreams()
	return t, nil
}

func (t *transport) port() int { return t.inner.GetAutoBindPort() }

func (t *transport) forwardPackets() {
	defer t.wg.Done()
	for {
		select {
		case p := <-t.inner.PacketCh():
			t.stats.bytesIn.Add(uint64(len(p.Buf)))
			select {
			case t.packets <- p:
			case <-t.done:
				return
			}
		case <-t.done:
			return
		}
	}
}

func (t *transport) forwardStreams() {
	defer t.wg.Done()
	for {
		select {
		case c := <-t.inner.StreamCh():
			select {
			case t.streams <- t.wrap(c):
			case <-t.done:
				_ = c.Close()
				return
			}
		case <-t.done:
			return
		}
	}
}

// FinalAdvertiseAddr implements memberlist.Transport.
func (t *transport) FinalAdvertiseAddr(ip string, port int) (net.IP, int, error) {
	return t.inner.FinalAdvertiseAddr(ip, port)
}

// WriteTo implements memberlist.Transport.
func (t *transport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress implements memberlist.NodeAwareTransport.
func (t *transport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	ts, err := t.inner.WriteToAddress(b, a)
	if err == nil {
		t.stats.bytesOut.Add(uint64(len(b)))
	}
	return ts, err
}

// PacketCh implements memberlist.Transport.
func (t *transport) PacketCh() <-chan *memberlist.Packet { return t.packets }

// DialTimeout implements memberlist.Transport.
func (t *transport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return t.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout implements memberlist.NodeAwareTransport.
func (t *transport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	c, err := t.inner.DialAddressTimeout(a, timeout)
	if err != nil {
		return nil, err
	}
	return t.wrap(c), nil
}

// StreamCh implements memberlist.Transport.
func (t *transport) StreamCh() <-chan net.Conn { return t.streams }

// Shutdown implements memberlist.Transport.
func (t *transport) Shutdown() error {
	var err error
	t.once.Do(func() {
		close(t.done)
		t.wg.Wait()
		// The inner listeners may be blocked handing over a packet or a connection; keep
		// taking them until the inner transport has stopped, or its Shutdown never returns.
		stop := make(chan struct{})
		drained := make(chan struct{})
		go func() {
			defer close(drained)
			for {
				select {
				case <-t.inner.PacketCh():
				case c := <-t.inner.StreamCh():
					_ = c.Close()
				case <-stop:
					return
				}
			}
		}()
		err = t.inner.Shutdown()
		close(stop)
		<-drained
	})
	return err
}

func (t *transport) wrap(c net.Conn) net.Conn {
	mc := &meteredConn{Conn: c, t: t, limit: maxStreamBytes}
	mc.br = bufio.NewReaderSize(countingReader{mc}, 4096)
	return mc
}

// countingReader counts the bytes read from the socket.
type countingReader struct{ c *meteredConn }

func (r countingReader) Read(p []byte) (int, error) {
	if r.c.limit <= 0 {
		return 0, errors.New("gossip stream longer than allowed")
	}
	if int64(len(p)) > r.c.limit {
		p = p[:r.c.limit]
	}
	n, err := r.c.Conn.Read(p)
	r.c.limit -= int64(n)
	r.c.t.stats.bytesIn.Add(uint64(n))
	return n, err
}

// meteredConn counts a stream's bytes and checks its first message header once.
type meteredConn struct {
	net.Conn
	t       *transport
	br      *bufio.Reader
	limit   int64
	checked bool
	failed  error
}

func (c *meteredConn) Read(p []byte) (int, error) {
	if !c.checked {
		c.checked = true
		if c.t.guard {
			if reason, err := checkStreamHeader(c.br); err != nil {
				c.t.stats.drop(reason)
				c.failed = err
			}
		}
	}
	if c.failed != nil {
		return 0, c.failed
	}
	return c.br.Read(p)
}

func (c *meteredConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.t.stats.bytesOut.Add(uint64(n))
	return n, err
}

// streamHeader is the union of memberlist's push/pull and user message headers (msgpack
// maps keyed by Go field name).
type streamHeader struct {
	Nodes        int64 `msgpack:"Nodes"`
	UserStateLen int64 `msgpack:"UserStateLen"`
	UserMsgLen   int64 `msgpack:"UserMsgLen"`
}

// checkStreamHeader peeks at an unencrypted stream's first message and refuses one whose
// header claims an impossible size, or a compressed one (we never send compressed streams
// in the clear, and memberlist decompresses without a bound). It returns the drop reason.
func checkStreamHeader(br *bufio.Reader) (string, error) {
	first, err := br.Peek(1)
	if err != nil {
		return "", nil // memberlist sees the same error on its own read
	}
	switch first[0] {
	case mlCompress:
		return DropDecode, errors.New("gossip: compressed plaintext stream refused")
	case mlPushPull, mlUser:
	default:
		return "", nil
	}
	var h streamHeader
	for {
		// Decode from everything buffered so far; if the header is still incomplete, wait
		// for at least one more byte (under memberlist's connection deadline).
		n := max(br.Buffered(), 2)
		buf, err := br.Peek(n)
		if err != nil {
			return "", nil // the stream ended early; memberlist will report it
		}
		h = streamHeader{}
		derr := msgpack.NewDecoder(bytes.NewReader(buf[1:])).Decode(&h)
		if derr == nil {
			break
		}
		if !errors.Is(derr, io.EOF) && !errors.Is(derr, io.ErrUnexpectedEOF) || n >= maxHeaderPeek {
			return DropDecode, fmt.Errorf("gossip: undecodable stream header: %w", derr)
		}
		if _, err := br.Peek(n + 1); err != nil {
			return "", nil
		}
	}
	if h.Nodes < 0 || h.Nodes > maxPushNodes {
		return DropSize, fmt.Errorf("gossip: push/pull header claims %d nodes", h.Nodes)
	}
	if h.UserStateLen < 0 || h.UserStateLen > maxStateBytes {
		return DropSize, fmt.Errorf("gossip: push/pull header claims %d bytes of state", h.UserStateLen)
	}
	if h.UserMsgLen < 0 || h.UserMsgLen > MaxReliablePayload+int64(frameHeaderLen(MaxNameLen)) {
		return DropSize, fmt.Errorf("gossip: user message header claims %d bytes", h.UserMsgLen)
	}
	return "", nil
}
