package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/zmtptest"
)

// feed passes stream through a guard's framing as zmq4 would read it (never further than the
// guard's want), split further into pieces of at most chunk bytes; it returns the bytes the
// guard let through and its error.
func feed(g *guardConn, stream []byte, chunk int) ([]byte, error) {
	at := 0
	for at < len(stream) {
		n := min(len(stream)-at, max(chunk, 1))
		if w := g.want(); w > 0 && uint64(n) > w {
			n = int(w)
		}
		if err := g.follow(stream[at : at+n]); err != nil {
			return stream[:at], err
		}
		at += n
	}
	return stream, nil
}

// handshake is a greeting and a READY command, as a publisher opens a connection.
func handshake() []byte { return append(zmtptest.Greeting(), zmtptest.Ready("PUB")...) }

// frames appends frames of the given sizes as one message (MORE on all but the last).
func frames(b []byte, flags byte, sizes ...uint64) []byte {
	for i, size := range sizes {
		f := flags
		if i < len(sizes)-1 {
			f |= zmtptest.More
		}
		b = append(b, zmtptest.Header(f, size)...)
		b = append(b, make([]byte, size)...)
	}
	return b
}

func TestGuardBoundsWholeMessages(t *testing.T) {
	const mib = 1 << 20
	many := make([]uint64, maxFrames+1)
	cases := []struct {
		name   string
		stream []byte
		want   error
	}{
		{"vLLM's message at its limit", frames(handshake(), 0, 8, 8, MaxPayload), nil},
		{"frames of a message add up past the limit", frames(handshake(), 0, 40*mib, 40*mib), errMessageTooLarge},
		{"a message of too many frames", frames(handshake(), 0, many...), errTooManyFrames},
		{"a message under MORE that never ends still counts", frames(handshake(), zmtptest.More, 30*mib, 30*mib, 30*mib), errMessageTooLarge},
		{"a large handshake", frames(zmtptest.Greeting(), zmtptest.Command, maxCommand+1), errMessageTooLarge},
		{"a handshake spread over frames", frames(zmtptest.Greeting(), zmtptest.Command, maxCommand/2, maxCommand/2+1), errMessageTooLarge},
		{"one frame over the limit", append(handshake(), zmtptest.Header(0, maxFrame+1)...), errFrameTooLarge},
		{"messages one after another", frames(frames(frames(handshake(), 0, 8, 8, 60*mib), 0, 8, 8, 60*mib), 0, 8), nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for _, chunk := range []int{1, 7, 4096, len(c.stream)} {
				_, err := feed(newGuardConnTimeout(&deadlineConn{}, nil, time.Hour), c.stream, chunk)
				if !errors.Is(err, c.want) {
					t.Fatalf("chunk %d: %v, want %v", chunk, err, c.want)
				}
			}
		})
	}
}

// FuzzGuardFraming feeds any byte stream through the guard's framing in any chunks and checks
// that what it lets through holds no frame, message or handshake over its bound.
func FuzzGuardFraming(f *testing.F) {
	f.Add(frames(handshake(), 0, 3, 8, 300), uint16(5))
	f.Add(frames(handshake(), zmtptest.More, 1, 2, 3), uint16(1))
	f.Add(append(handshake(), 0x03, 0, 0, 0, 0, 0x10, 0, 0, 0), uint16(2))
	f.Add(append(zmtptest.Greeting(), 0x07, 0xff), uint16(64))
	f.Fuzz(func(t *testing.T, stream []byte, chunk uint16) {
		g := newGuardConnTimeout(&deadlineConn{}, nil, time.Hour)
		passed, err := feed(g, stream, int(chunk))
		if err == nil && len(passed) != len(stream) {
			t.Fatalf("no error but %d of %d bytes passed", len(passed), len(stream))
		}
		if err != nil && !errors.Is(err, ErrTooLarge) {
			t.Fatalf("unexpected error %v", err)
		}
		checkFraming(t, passed)
	})
}

// checkFraming parses what the guard let through, independently of it, and fails on anything
// over a bound; the last frame may be cut short.
func checkFraming(t *testing.T, b []byte) {
	if len(b) <= zmtpGreeting {
		return
	}
	b = b[zmtpGreeting:]
	shaking := true
	var size uint64
	n := 0
	for len(b) >= 2 {
		flags, hdr := b[0], 2
		fsize := uint64(b[1])
		if flags&flagLong != 0 {
			if len(b) < 9 {
				return
			}
			fsize, hdr = binary.BigEndian.Uint64(b[1:9]), 9
		}
		limit := uint64(maxMessage)
		if shaking {
			limit = maxCommand
		}
		size += fsize
		n++
		if fsize > maxFrame || size > limit || n > maxFrames {
			t.Fatalf("let through frame %d of %d bytes, message of %d bytes (limit %d)", n, fsize, size, limit)
		}
		b = b[hdr:]
		if uint64(len(b)) < fsize {
			return
		}
		b = b[fsize:]
		if flags&flagMore == 0 {
			shaking, size, n = false, 0, 0
		}
	}
}

func TestBudgetHoldsMessagesInFlight(t *testing.T) {
	adm := &admission{budget: newBudget(maxMessage + 100), maxConns: 10}
	a := newGuardConnTimeout(&deadlineConn{}, adm, time.Hour)
	b := newGuardConnTimeout(&deadlineConn{}, adm, time.Hour)
	close(b.closed) // b gives up at once where it would wait
	msg := frames(handshake(), 0, 8, 8, 1000)
	if _, err := feed(a, msg, len(msg)); err != nil {
		t.Fatal(err)
	}
	// a's message is whole: it holds its size, not the reservation.
	if got := adm.budget.free; got != maxMessage+100-1016 {
		t.Fatalf("free %d after a whole message of 1016 bytes", got)
	}
	// b's message needs a reservation of maxMessage, which is not free until the subscriber
	// has handled a's.
	if _, err := feed(b, msg, len(msg)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("a message past the budget went through: %v", err)
	}
	adm.budget.release(1016) // a's message handled
	b2 := newGuardConnTimeout(&deadlineConn{}, adm, time.Hour)
	if _, err := feed(b2, msg, len(msg)); err != nil {
		t.Fatalf("budget free again, but: %v", err)
	}
	adm.budget.release(1016) // b2's message handled
	// A message cut short holds its reservation, and gives it back when its connection
	// closes.
	c := newGuardConnTimeout(&deadlineConn{}, adm, time.Hour)
	half := frames(handshake(), zmtptest.More, 8)
	if _, err := feed(c, half, len(half)); err != nil {
		t.Fatal(err)
	}
	if got := adm.budget.free; got != 100 {
		t.Fatalf("free %d while a message is in progress, want 100", got)
	}
	_ = c.Close()
	if got := adm.budget.free; got != maxMessage+100 {
		t.Fatalf("free %d after the cut message's connection closed", got)
	}
}

func TestWorkerHostsResolveAndCache(t *testing.T) {
	lookups := 0
	now := time.Unix(1000, 0)
	h := newWorkerHosts(map[string][]string{"w0": {"10.0.0.5"}, "w1": {"node-b"}, "w2": {"::ffff:10.0.0.9"}})
	h.now = func() time.Time { return now }
	answer := []netip.Addr{netip.MustParseAddr("10.0.0.7")}
	h.lookup = func(context.Context, string) ([]netip.Addr, error) {
		lookups++
		if answer == nil {
			return nil, errors.New("no answer")
		}
		return answer, nil
	}
	ctx := context.Background()
	ip := netip.MustParseAddr
	cases := []struct {
		id   string
		ip   string
		want bool
	}{
		{"w0", "10.0.0.5", true},
		{"w0", "10.0.0.7", false},
		{"w1", "10.0.0.7", true},
		{"w1", "10.0.0.5", false},
		{"w2", "10.0.0.9", true},
		{"w3", "10.0.0.5", false},
	}
	for _, c := range cases {
		if got := h.of(ctx, c.id, ip(c.ip)); got != c.want {
			t.Errorf("of(%s, %s) = %v, want %v", c.id, c.ip, got, c.want)
		}
	}
	if lookups != 1 {
		t.Fatalf("%d lookups of one name within its time", lookups)
	}
	if h.any(ctx, ip("10.0.0.8")) || !h.any(ctx, ip("10.0.0.7")) {
		t.Fatal("any() wrong")
	}
	now = now.Add(resolveEvery)
	answer = nil // a failed lookup keeps the last answer
	if !h.of(ctx, "w1", ip("10.0.0.7")) || lookups != 2 {
		t.Fatalf("after expiry: lookups %d", lookups)
	}
}

func TestPublisherHosts(t *testing.T) {
	cases := []struct {
		url, ep string
		want    []string
	}{
		{"http://10.0.0.5:8000", "", []string{"10.0.0.5"}},
		{"http://node-a:8000", "tcp://10.0.0.6:5557", []string{"node-a", "10.0.0.6"}},
		{"http://[::1]:8000", "tcp://*:5557", []string{"::1"}},
		{"http://10.0.0.5:8000", "tcp://10.0.0.5:5557", []string{"10.0.0.5"}},
		{"http://10.0.0.5:8000", "tcp://0.0.0.0:5557", []string{"10.0.0.5"}},
		{"::", "ipc:///tmp/x", nil},
	}
	for _, c := range cases {
		got := PublisherHosts(c.url, c.ep)
		if !slices.Equal(got, c.want) {
			t.Errorf("PublisherHosts(%q, %q) = %q, want %q", c.url, c.ep, got, c.want)
		}
	}
}

// sendBatch sends one vLLM message [topic, seq, payload] of events over c.
func sendBatch(t *testing.T, c *zmtptest.Conn, topic string, seq uint64, evs ...Event) error {
	t.Helper()
	payload, err := Encode(Batch{Events: evs}, false)
	if err != nil {
		t.Fatal(err)
	}
	return c.Send([]byte(topic), binary.BigEndian.AppendUint64(nil, seq), payload)
}

// closedByPeer reports whether the peer closed c within a bound (an end of file, or a reset
// where it closed with our bytes unread).
func closedByPeer(c net.Conn) bool {
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	_, err := io.Copy(io.Discard, c)
	return err == nil || errors.Is(err, syscall.ECONNRESET)
}

func TestBoundSocketTakesAWorkersEventsOnlyFromItsHost(t *testing.T) {
	w1 := indexer.Worker{ID: "w1"}
	sink := newSink()
	sub := startSub(t, Config{Endpoint: "tcp://127.0.0.1:0", Mode: Bind, Sink: sink,
		Topics: map[string]indexer.Worker{"t0": w0, "t1": w1},
		Hosts:  map[string][]string{"w0": {"127.0.0.2"}, "w1": {"127.0.0.3"}}})
	poll.Holds(t, 15*time.Second, "the bind", func() bool { return sub.Addr() != nil })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	addr := sub.Addr().String()

	// w0's own host: applied.
	honest, err := zmtptest.Dial(ctx, "127.0.0.2", addr, "PUB")
	if err != nil {
		t.Fatal(err)
	}
	defer honest.Close()
	var e engine
	if err := sendBatch(t, honest, "t0", 5, e.stored(promptN(0))); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 15*time.Second, "w0's prompt", func() bool { return matched(sink.Index, w0, promptN(0), "") == 2 })

	// No worker's address: closed at accept, so no handshake.
	if c, err := zmtptest.Dial(ctx, "127.0.0.9", addr, "PUB"); err == nil {
		_ = c.Close()
		t.Fatal("a publisher from 127.0.0.9 completed its handshake")
	}

	// w1's host under w0's topic: a forged restart (seq 0) would purge w0; the connection is
	// failed instead and nothing changes.
	other, err := zmtptest.Dial(ctx, "127.0.0.3", addr, "PUB")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	_ = sendBatch(t, other, "t0", 0, Event{Kind: indexer.Cleared})
	if !closedByPeer(other) {
		t.Fatal("a message under another worker's topic left its connection open")
	}
	poll.Holds(t, 15*time.Second, "the refusals counted", func() bool {
		return value(t, sub.m.refused.WithLabelValues(reasonNotAWorker)) >= 1 && value(t, sub.m.refused.WithLabelValues(reasonWrongWorker)) == 1
	})
	// The next honest message still applies, so the forged one came before it had it been taken.
	if err := sendBatch(t, honest, "t0", 6, e.stored(promptN(1))); err != nil {
		t.Fatal(err)
	}
	poll.Holds(t, 15*time.Second, "w0's second prompt", func() bool { return matched(sink.Index, w0, promptN(1), "") == 2 })
	if got := sink.purged(); len(got) != 0 || matched(sink.Index, w0, promptN(0), "") != 2 {
		t.Fatalf("w0 purged (%v) or its first prompt lost by a forged message", got)
	}
	if got := value(t, sub.m.restarts); got != 0 {
		t.Fatalf("restarts %v", got)
	}
}

func TestBoundSocketCapsPublisherConnections(t *testing.T) {
	sub := startSub(t, Config{Endpoint: "tcp://127.0.0.1:0", Mode: Bind, Sink: newSink(),
		Topics: map[string]indexer.Worker{"t0": w0}, MaxPublishers: 2})
	poll.Holds(t, 15*time.Second, "the bind", func() bool { return sub.Addr() != nil })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	addr := sub.Addr().String()
	var open []*zmtptest.Conn
	defer func() {
		for _, c := range open {
			_ = c.Close()
		}
	}()
	for range 2 {
		c, err := zmtptest.Dial(ctx, "", addr, "PUB")
		if err != nil {
			t.Fatal(err)
		}
		open = append(open, c)
	}
	if c, err := zmtptest.Dial(ctx, "", addr, "PUB"); err == nil {
		_ = c.Close()
		t.Fatal("a third publisher got in past a limit of two")
	}
	// The dial fails when the replica closes the connection; the count may come a moment later.
	poll.Holds(t, 15*time.Second, "the refusal counted", func() bool {
		return value(t, sub.m.refused.WithLabelValues(reasonTooMany)) == 1
	})
	// A slot comes back when its publisher leaves.
	_ = open[0].Close()
	poll.Until(t, 15*time.Second, func() error {
		c, err := zmtptest.Dial(ctx, "", addr, "PUB")
		if err == nil {
			open = append(open, c)
		}
		return err
	})
}

func TestBoundSocketClosesAConnectionZMQForgot(t *testing.T) {
	sub := startSub(t, Config{Endpoint: "tcp://127.0.0.1:0", Mode: Bind, Sink: newSink(),
		Topics: map[string]indexer.Worker{"t0": w0}, MaxPublishers: 1})
	poll.Holds(t, 15*time.Second, "the bind", func() bool { return sub.Addr() != nil })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A REQ socket is no match for a SUB: zmq4 drops it after the handshake without closing
	// it, and without the guard it would hold the only slot for ever.
	c, err := zmtptest.Dial(ctx, "", sub.Addr().String(), "REQ")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !closedByPeer(c) {
		t.Fatal("the forgotten connection is still open")
	}
	poll.Until(t, 15*time.Second, func() error {
		p, err := zmtptest.Dial(ctx, "", sub.Addr().String(), "PUB")
		if err == nil {
			_ = p.Close()
		}
		return err
	})
}

func TestAStalledMessageGivesBackItsBudget(t *testing.T) {
	m, _ := NewMetrics(nil)
	adm := &admission{budget: newBudget(maxMessage), maxConns: 10, m: m, log: testLogger(t),
		logged: map[string]time.Time{}, pending: map[string]int{}}
	a, b := net.Pipe()
	defer b.Close()
	g := newGuardConnTimeout(a, adm, time.Hour)
	g.msgTimeout = 50 * time.Millisecond
	// A handshake, then a message begun (a topic under MORE) that never goes on.
	go func() { _, _ = b.Write(frames(handshake(), zmtptest.More, 8)) }()
	buf := make([]byte, 4096)
	var err error
	for range 100 {
		if _, err = g.Read(buf); err != nil {
			break
		}
	}
	if !errors.Is(err, errSlowMessage) {
		t.Fatalf("a stalled message gave %v", err)
	}
	if got := adm.budget.free; got != maxMessage {
		t.Fatalf("budget free %d after the stalled connection failed, want %d", got, maxMessage)
	}
	if got := value(t, m.refused.WithLabelValues(reasonSlow)); got != 1 {
		t.Fatalf("counted %v slow messages", got)
	}
}
