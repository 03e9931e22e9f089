package kvevents

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/zmtptest"
)

// deadlineConn records the read deadlines set on it.
type deadlineConn struct {
	net.Conn
	deadlines []time.Time
}

func (c *deadlineConn) SetReadDeadline(t time.Time) error {
	c.deadlines = append(c.deadlines, t)
	return nil
}

func (c *deadlineConn) RemoteAddr() net.Addr { return &net.TCPAddr{} }

func (c *deadlineConn) Close() error { return nil }

func TestGuardFollowsFramingAcrossReads(t *testing.T) {
	var stream []byte
	stream = append(stream, zmtptest.Greeting()...)
	for _, size := range []uint64{0, 5, 255, 256, 70000} {
		stream = append(stream, zmtptest.Header(zmtptest.Command, size)...)
		stream = append(stream, make([]byte, size)...)
	}
	okLen := len(stream)
	stream = append(stream, zmtptest.Header(0, maxFrame+1)...)
	for _, chunk := range []int{1, 3, 7, 64, 4096, len(stream)} {
		dc := &deadlineConn{}
		g := newGuardConnTimeout(dc, nil, time.Hour)
		var err error
		at := 0
		for at < len(stream) && err == nil {
			end := min(at+chunk, len(stream))
			err = g.follow(stream[at:end])
			if err != nil && end <= okLen {
				t.Fatalf("chunk %d: error inside the valid part at %d: %v", chunk, end, err)
			}
			at = end
		}
		if !errors.Is(err, ErrTooLarge) {
			t.Fatalf("chunk %d: oversized frame gave %v", chunk, err)
		}
		// The handshake deadline was set once and lifted after the first frame.
		if len(dc.deadlines) != 2 || dc.deadlines[0].IsZero() || !dc.deadlines[1].IsZero() {
			t.Fatalf("chunk %d: read deadlines %v, want one set then lifted", chunk, dc.deadlines)
		}
	}
}

func TestGuardFailsASilentHandshake(t *testing.T) {
	a, b := net.Pipe()
	defer func() { _ = b.Close() }()
	g := newGuardConnTimeout(a, nil, 20*time.Millisecond)
	_, err := g.Read(make([]byte, 64))
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("silent peer gave %v, want a timeout", err)
	}
	// The guard closed the connection, which zmq4 would not have.
	if _, err := b.Write([]byte{1}); err == nil {
		t.Fatal("the connection is still open")
	}
}

// TestHugeFrameDoesNotCrashTheSubscriber sends a bound subscriber a valid greeting and then a
// frame header announcing 2^62 bytes, which zmq4 alone would try to allocate (and panic on).
func TestHugeFrameDoesNotCrashTheSubscriber(t *testing.T) {
	sink := newSink()
	sub := startSub(t, Config{Endpoint: "tcp://127.0.0.1:0", Mode: Bind, Topics: map[string]indexer.Worker{"t": w0}, Sink: sink})
	poll.Holds(t, 15*time.Second, "the bind", func() bool { return sub.Addr() != nil })
	c, err := net.Dial("tcp", sub.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	if _, err := c.Write(append(zmtptest.Greeting(), zmtptest.Header(zmtptest.Command, 1<<62)...)); err != nil {
		t.Fatal(err)
	}
	// The subscriber drops that connection...
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("connection not closed by the subscriber: %v", err)
	}
	// ...and goes on serving real publishers.
	pub := startPub(t, PublisherConfig{Endpoint: tcp(sub.Addr()), Topic: "t"})
	poll.Holds(t, 15*time.Second, "the publisher connected", pub.hasSubscriber)
	var e engine
	publish(t, pub, e.stored(promptN(0)))
	poll.Holds(t, 15*time.Second, "the prompt", func() bool { return matched(sink.Index, w0, promptN(0), "") == 2 })
}

func TestGuardedRewritesOnlyTCP(t *testing.T) {
	for in, want := range map[string]string{
		"tcp://127.0.0.1:5557": guardScheme + "://127.0.0.1:5557",
		"ipc:///tmp/kv":        "ipc:///tmp/kv",
	} {
		if got := guarded(in); got != want {
			t.Errorf("guarded(%q) = %q, want %q", in, got, want)
		}
	}
	if !bytes.HasPrefix(zmtptest.Greeting(), []byte{0xff}) {
		t.Fatal("greeting fixture broken")
	}
}
