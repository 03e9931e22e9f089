package openai

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestHopByHopHeadersAreKnownInAnyCase(t *testing.T) {
	tests := []struct {
		name        string
		hop, onward bool
	}{
		{"Connection", true, false},
		{"connection", true, false},
		{"TRANSFER-ENCODING", true, false},
		{"te", true, false},
		{"Proxy-Authorization", true, false},
		{"keep-alive", true, false},
		{"Content-Type", false, true},
		{"content-type", false, true},
		{"X-Custom", false, true},
		{"Host", false, false},
		{"accept-encoding", false, false},
		{"X-Forwarded-For", false, false},
		{headerDPRank, false, false},
	}
	for _, tt := range tests {
		if got := isHop(tt.name); got != tt.hop {
			t.Errorf("isHop(%q) = %v, want %v", tt.name, got, tt.hop)
		}
		if got := forwardable(tt.name); got != tt.onward {
			t.Errorf("forwardable(%q) = %v, want %v", tt.name, got, tt.onward)
		}
	}
}

// deadlineCounter counts the read deadlines set on a connection.
type deadlineCounter struct {
	net.Conn
	reads int
	last  time.Time
}

func (d *deadlineCounter) SetReadDeadline(t time.Time) error {
	d.reads++
	d.last = t
	return d.Conn.SetReadDeadline(t)
}

func TestUpstreamReaderMovesTheIdleDeadlineOnlyWhenDue(t *testing.T) {
	a, b := net.Pipe()
	t.Cleanup(func() { _ = a.Close(); _ = b.Close() })
	conn := &deadlineCounter{Conn: a}
	body := &upBody{src: io.NopCloser(strings.NewReader(strings.Repeat("x", 100))),
		conn: &upConn{conn: conn, budget: -1}, stop: func() bool { return true }}
	const idle = time.Hour
	firstBy := time.Now().Add(time.Minute)
	rd := newUpstreamReader(body, firstBy, idle)
	buf := make([]byte, 10)
	read := func() {
		t.Helper()
		if _, err := rd.read(buf); err != nil {
			t.Fatalf("read: %v", err)
		}
	}

	// roundTrip has set the first-byte deadline already.
	read()
	if conn.reads != 0 {
		t.Fatalf("%d deadline updates before the first bytes, want 0", conn.reads)
	}
	// The first bytes arm the idle deadline, further out than the timeout.
	before := time.Now()
	read()
	if conn.reads != 1 || conn.last.Before(before.Add(idle)) {
		t.Fatalf("%d updates, deadline %v: want 1, at least %v away", conn.reads, conn.last.Sub(before), idle)
	}
	// Reads close together leave it.
	for range 5 {
		read()
	}
	if conn.reads != 1 {
		t.Fatalf("%d deadline updates for reads close together, want 1", conn.reads)
	}
	// Once it is no longer a whole timeout away, the next read moves it.
	rd.deadline = time.Now()
	before = time.Now()
	read()
	if conn.reads != 2 || conn.last.Before(before.Add(idle)) {
		t.Fatalf("%d updates, deadline %v: want 2, at least %v away", conn.reads, conn.last.Sub(before), idle)
	}
}

func TestContentLengthRelaysTheWorkersStringWhenItSaysTheSame(t *testing.T) {
	tests := []struct {
		name   string
		worker []string
		n      int
		want   string
		reused bool
	}{
		{"the worker's length", []string{"1234"}, 1234, "1234", true},
		{"a rewritten body", []string{"1234"}, 99999, "99999", false},
		{"a leading zero", []string{"01234"}, 1234, "1234", false},
		{"no length", nil, 1234, "1234", false},
		{"two lengths", []string{"1234", "1234"}, 1234, "1234", false},
		{"empty body", []string{"0"}, 0, "0", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			if tt.worker != nil {
				h["Content-Length"] = tt.worker
			}
			if got := lengthValue(h, tt.n); got != tt.want {
				t.Fatalf("lengthValue = %q, want %q", got, tt.want)
			}
			allocs := testing.AllocsPerRun(100, func() { _ = lengthValue(h, tt.n) })
			if tt.reused && allocs != 0 {
				t.Errorf("lengthValue allocates %.0f times; the worker's string says the same", allocs)
			}
		})
	}
}
