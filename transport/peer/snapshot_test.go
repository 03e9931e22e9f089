package peer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrouter-ha/kvrouter-ha/transport/peer/peerpb"
)

// snapSource writes data, or part of it and then fails or panics.
type snapSource struct {
	data    []byte
	cutAt   int // >0: write this much, then fail with err
	err     error
	panicAt int // >0: write this much, then panic
}

func (s *snapSource) WriteIndexSnapshot(_ context.Context, w io.Writer) error {
	switch {
	case s.panicAt > 0:
		if _, err := w.Write(s.data[:s.panicAt]); err != nil {
			return err
		}
		panic("snapshot source exploded")
	case s.cutAt > 0:
		if _, err := w.Write(s.data[:s.cutAt]); err != nil {
			return err
		}
		return s.err
	case s.err != nil:
		return s.err
	}
	// Odd write sizes cross chunk boundaries in every way.
	for p := s.data; len(p) > 0; {
		k := min(len(p), 70_001)
		if _, err := w.Write(p[:k]); err != nil {
			return err
		}
		p = p[k:]
	}
	return nil
}

func randomBytes(n int) []byte {
	r := rand.New(rand.NewPCG(1, 2))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func TestIndexSnapshotArrivesWholeAcrossChunks(t *testing.T) {
	for _, n := range []int{0, 1, snapshotChunkBytes, 3*snapshotChunkBytes + 17} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			data := randomBytes(n)
			addr := serve(t, &fakeHandler{}, ServerOptions{Snapshots: &snapSource{data: data}})
			got, err := dial(t, addr, ClientOptions{}).IndexSnapshot(testCtx(t), "r2", 0)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("got %d bytes, want the %d sent", len(got), len(data))
			}
		})
	}
}

func TestIndexSnapshotRefusals(t *testing.T) {
	data := randomBytes(2*snapshotChunkBytes + 5)
	tests := []struct {
		name    string
		src     SnapshotSource
		max     int64
		want    error
		code    codes.Code
		another bool // ErrSnapshotBroken: the caller should try elsewhere
	}{
		{name: "no source", src: nil, code: codes.Unimplemented},
		{name: "cold peer", src: &snapSource{err: fmt.Errorf("loading: %w", ErrNotWarm)}, want: ErrNotWarm},
		{name: "source fails mid-way", src: &snapSource{data: data, cutAt: snapshotChunkBytes + 3, err: errBoom}, want: ErrSnapshotBroken},
		{name: "source panics mid-way", src: &snapSource{data: data, panicAt: snapshotChunkBytes + 3}, want: ErrSnapshotBroken},
		{name: "over the bound", src: &snapSource{data: data}, max: snapshotChunkBytes, want: ErrSnapshotBroken},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			opts := ServerOptions{}
			if tc.src != nil {
				opts.Snapshots = tc.src
			}
			addr := serve(t, &fakeHandler{}, opts)
			got, err := dial(t, addr, ClientOptions{}).IndexSnapshot(testCtx(t), "r2", tc.max)
			if err == nil {
				t.Fatalf("got %d bytes and no error", len(got))
			}
			if got != nil {
				t.Errorf("a refused snapshot returned %d bytes", len(got))
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want %v", err, tc.want)
			}
			if tc.code != codes.OK && status.Code(err) != tc.code {
				t.Errorf("code = %s, want %s (%v)", status.Code(err), tc.code, err)
			}
		})
	}
}

// forgedPeer answers IndexSnapshot with a scripted stream, to test what a client does with
// streams no honest server sends.
type forgedPeer struct {
	peerpb.UnimplementedPeerServer
	msgs []*peerpb.IndexSnapshotChunk
}

func (f *forgedPeer) IndexSnapshot(_ *peerpb.IndexSnapshotRequest, s peerpb.Peer_IndexSnapshotServer) error {
	for _, m := range f.msgs {
		if err := s.Send(m); err != nil {
			return err
		}
	}
	return nil
}

func serveForged(t *testing.T, msgs []*peerpb.IndexSnapshotChunk) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	peerpb.RegisterPeerServer(gs, &forgedPeer{msgs: msgs})
	go gs.Serve(l)
	t.Cleanup(gs.Stop)
	return l.Addr().String()
}

func TestIndexSnapshotRejectsForgedStreams(t *testing.T) {
	a, b := []byte("hello "), []byte("world")
	crc := crc32.Update(crc32.Update(0, crcTable, a), crcTable, b)
	good := func(chunks, n uint64, c uint32) *peerpb.IndexSnapshotChunk {
		return &peerpb.IndexSnapshotChunk{Seq: 2, Trailer: &peerpb.IndexSnapshotTrailer{Chunks: chunks, Bytes: n, Crc32C: c}}
	}
	tests := []struct {
		name string
		msgs []*peerpb.IndexSnapshotChunk
	}{
		{"ends without a trailer", []*peerpb.IndexSnapshotChunk{{Seq: 0, Data: a}, {Seq: 1, Data: b}}},
		{"chunk skipped", []*peerpb.IndexSnapshotChunk{{Seq: 0, Data: a}, {Seq: 2, Data: b}, good(2, 11, crc)}},
		{"wrong crc", []*peerpb.IndexSnapshotChunk{{Seq: 0, Data: a}, {Seq: 1, Data: b}, good(2, 11, crc^1)}},
		{"wrong length", []*peerpb.IndexSnapshotChunk{{Seq: 0, Data: a}, {Seq: 1, Data: b}, good(2, 12, crc)}},
		{"wrong count", []*peerpb.IndexSnapshotChunk{{Seq: 0, Data: a}, {Seq: 1, Data: b}, good(3, 11, crc)}},
		{"trailer with data", []*peerpb.IndexSnapshotChunk{{Seq: 0, Data: a}, {Seq: 1, Data: b, Trailer: &peerpb.IndexSnapshotTrailer{Chunks: 1, Bytes: 6}}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			addr := serveForged(t, tc.msgs)
			got, err := dial(t, addr, ClientOptions{}).IndexSnapshot(testCtx(t), "r2", 0)
			if !errors.Is(err, ErrSnapshotBroken) || got != nil {
				t.Fatalf("got %q, %v; want nothing and ErrSnapshotBroken", got, err)
			}
		})
	}
	t.Run("the honest version passes", func(t *testing.T) {
		addr := serveForged(t, []*peerpb.IndexSnapshotChunk{{Seq: 0, Data: a}, {Seq: 1, Data: b}, good(2, 11, crc)})
		got, err := dial(t, addr, ClientOptions{}).IndexSnapshot(testCtx(t), "r2", 0)
		if err != nil || string(got) != "hello world" {
			t.Fatalf("got %q, %v", got, err)
		}
	})
}

func BenchmarkIndexSnapshot16MiB(b *testing.B) {
	data := randomBytes(16 << 20)
	addr := serve(b, &fakeHandler{}, ServerOptions{Snapshots: &snapSource{data: data}})
	c := dial(b, addr, ClientOptions{})
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		if _, err := c.IndexSnapshot(context.Background(), "bench", 0); err != nil {
			b.Fatal(err)
		}
	}
}
