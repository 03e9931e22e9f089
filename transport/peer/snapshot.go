package peer

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"runtime/debug"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrouter-ha/kvrouter-ha/transport/peer/peerpb"
)

// DefaultMaxSnapshotBytes bounds an index snapshot a Client accepts when the caller passes
// no bound: about 25 million index entries, far beyond one fleet's KV caches.
const DefaultMaxSnapshotBytes = 512 << 20

// snapshotChunkBytes is the data per stream message: big enough that the per-message cost
// is negligible, far below the message bound so the trailer and framing always fit.
const snapshotChunkBytes = 256 << 10

// ErrNotWarm marks a replica that cannot serve an index snapshot yet because its own index
// is still being loaded. It crosses the wire as FailedPrecondition (without a NotLeader
// detail); the asking replica tries another peer.
var ErrNotWarm = errors.New("peer index is not warm yet")

// ErrSnapshotBroken marks an index snapshot stream that ended early, was out of sequence,
// over the size bound, or did not match its trailer. Nothing of it may be used; another
// peer (or a retry) may succeed.
var ErrSnapshotBroken = errors.New("index snapshot stream broken")

// crcTable is CRC-32C, which the processor computes in hardware.
var crcTable = crc32.MakeTable(crc32.Castagnoli)

// SnapshotSource writes this replica's index snapshot for the IndexSnapshot call. The
// bytes are opaque to this package. An error wrapping ErrNotWarm (this replica's index is
// still loading) or ErrUnavailable reaches the caller as such; what was written before an
// error is discarded by the caller, which never sees a trailer.
type SnapshotSource interface {
	WriteIndexSnapshot(ctx context.Context, w io.Writer) error
}

// IndexSnapshot serves one snapshot stream: the source's bytes in chunks, then the trailer.
func (s *service) IndexSnapshot(req *peerpb.IndexSnapshotRequest, stream peerpb.Peer_IndexSnapshotServer) (err error) {
	if s.snap == nil {
		return status.Error(codes.Unimplemented, "this replica serves no index snapshots")
	}
	defer func() {
		if r := recover(); r != nil {
			s.log.Error("index snapshot source panicked", "panic", r, "stack", string(debug.Stack()))
			err = status.Errorf(codes.Internal, "snapshot source panicked: %v", r)
		}
	}()
	cw := &chunkWriter{send: stream.Send, buf: make([]byte, 0, min(snapshotChunkBytes, s.limit/2))}
	if err := s.snap.WriteIndexSnapshot(stream.Context(), cw); err != nil {
		if !errors.Is(err, ErrNotWarm) {
			s.log.Warn("index snapshot failed", "to", req.GetReplicaId(), "after_bytes", cw.n, "err", err)
		}
		return toStatus(err)
	}
	if err := cw.flush(); err != nil {
		return err
	}
	s.log.Debug("index snapshot sent", "to", req.GetReplicaId(), "bytes", cw.n, "chunks", cw.seq)
	return stream.Send(&peerpb.IndexSnapshotChunk{Seq: cw.seq, Trailer: &peerpb.IndexSnapshotTrailer{
		Chunks: cw.seq, Bytes: cw.n, Crc32C: cw.crc,
	}})
}

// chunkWriter cuts what the source writes into numbered stream messages and keeps the
// running length and CRC for the trailer.
type chunkWriter struct {
	send func(*peerpb.IndexSnapshotChunk) error
	buf  []byte
	seq  uint64
	n    uint64
	crc  uint32
}

func (c *chunkWriter) Write(p []byte) (int, error) {
	written := 0
	for len(p) > 0 {
		k := min(len(p), cap(c.buf)-len(c.buf))
		c.buf = append(c.buf, p[:k]...)
		p = p[k:]
		written += k
		if len(c.buf) == cap(c.buf) {
			if err := c.flush(); err != nil {
				return written, err
			}
		}
	}
	return written, nil
}

// flush sends the buffered bytes as one chunk; the stream copies them before Send returns,
// so the buffer is reused.
func (c *chunkWriter) flush() error {
	if len(c.buf) == 0 {
		return nil
	}
	if err := c.send(&peerpb.IndexSnapshotChunk{Seq: c.seq, Data: c.buf}); err != nil {
		return fmt.Errorf("sending snapshot chunk %d: %w", c.seq, err)
	}
	c.crc = crc32.Update(c.crc, crcTable, c.buf)
	c.n += uint64(len(c.buf))
	c.seq++
	c.buf = c.buf[:0]
	return nil
}

// IndexSnapshot fetches the replica's index snapshot whole. It checks that the chunks come
// in sequence, that the total stays within maxBytes (0: DefaultMaxSnapshotBytes), and that
// the data matches the trailer (chunk count, length, CRC-32C). self names the asking
// replica in the peer's logs. A stream that breaks or fails a check is an error wrapping
// ErrSnapshotBroken; a peer still loading its own index answers an error wrapping
// ErrNotWarm. Either way no byte of a partial stream is returned.
func (c *Client) IndexSnapshot(ctx context.Context, self string, maxBytes int64) ([]byte, error) {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxSnapshotBytes
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends the stream on every early return
	stream, err := c.rpc.IndexSnapshot(ctx, &peerpb.IndexSnapshotRequest{ReplicaId: self})
	if err != nil {
		return nil, fromStatus(c.addr, "IndexSnapshot", err)
	}
	var (
		data []byte
		seq  uint64
		crc  uint32
	)
	for {
		m, err := stream.Recv()
		if err == io.EOF {
			return nil, fmt.Errorf("%w: %s: ended after %d chunks (%d bytes) without a trailer", ErrSnapshotBroken, c.addr, seq, len(data))
		}
		if err != nil {
			cerr := fromStatus(c.addr, "IndexSnapshot", err)
			if seq == 0 && (errors.Is(cerr, ErrNotWarm) || status.Code(cerr) == codes.Unimplemented) {
				return nil, cerr
			}
			return nil, fmt.Errorf("%w after %d chunks (%d bytes): %w", ErrSnapshotBroken, seq, len(data), cerr)
		}
		if m.GetSeq() != seq {
			return nil, fmt.Errorf("%w: %s: chunk %d where %d was due", ErrSnapshotBroken, c.addr, m.GetSeq(), seq)
		}
		if t := m.GetTrailer(); t != nil {
			if len(m.GetData()) != 0 {
				return nil, fmt.Errorf("%w: %s: trailer with data", ErrSnapshotBroken, c.addr)
			}
			if t.GetChunks() != seq || t.GetBytes() != uint64(len(data)) || t.GetCrc32C() != crc {
				return nil, fmt.Errorf("%w: %s: got %d chunks, %d bytes, crc %08x; trailer says %d, %d, %08x",
					ErrSnapshotBroken, c.addr, seq, len(data), crc, t.GetChunks(), t.GetBytes(), t.GetCrc32C())
			}
			return data, nil
		}
		d := m.GetData()
		if int64(len(data))+int64(len(d)) > maxBytes {
			return nil, fmt.Errorf("%w: %s: over the bound of %d bytes", ErrSnapshotBroken, c.addr, maxBytes)
		}
		data = append(data, d...)
		crc = crc32.Update(crc, crcTable, d)
		seq++
	}
}
