package gossip

import (
	"bytes"
	"testing"
)

// FuzzParseFrame: no input crashes the frame parser; what it accepts re-encodes to the
// bytes it consumed, within the payload limit.
func FuzzParseFrame(f *testing.F) {
	f.Add(appendFrame(nil, KindLoad, "r1", []byte("payload")), 64)
	f.Add(appendFrame(appendFrame(nil, KindHealth, "r2", nil), KindDecisions, "r3", []byte{1, 2, 3}), 16)
	f.Add([]byte{wireVersion, 1, 200, 'x'}, 1024)
	f.Add([]byte{wireVersion, 1, 1, 'x', 0xff, 0xff, 0xff, 0xff}, 1<<20)
	f.Fuzz(func(t *testing.T, b []byte, maxPayload int) {
		if maxPayload < 0 {
			maxPayload = -maxPayload
		}
		fr, rest, err := parseFrame(b, maxPayload)
		if err != nil {
			if dropReason(err) == "" {
				t.Fatalf("error without a drop reason: %v", err)
			}
			return
		}
		if len(fr.payload) > maxPayload {
			t.Fatalf("payload of %d bytes passed a limit of %d", len(fr.payload), maxPayload)
		}
		if checkName(fr.from) != nil {
			t.Fatalf("accepted sender name %q", fr.from)
		}
		enc := appendFrame(nil, fr.kind, fr.from, fr.payload)
		if !bytes.Equal(enc, b[:len(b)-len(rest)]) {
			t.Fatalf("re-encoded frame %x differs from the consumed bytes %x", enc, b[:len(b)-len(rest)])
		}
	})
}

// FuzzDecodeMeta: no metadata crashes the decoder; what it accepts round-trips its fields.
func FuzzDecodeMeta(f *testing.F) {
	f.Add(Meta{ID: "r1", Version: "v1", PeerAddr: "127.0.0.1:7001", RaftAddr: "127.0.0.1:7000", ClusterID: "c"}.encode())
	f.Add([]byte{metaVersion, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMeta(b)
		if err != nil {
			return
		}
		again, err := decodeMeta(m.encode())
		if err != nil || again != m {
			t.Fatalf("%+v does not round-trip: %+v %v", m, again, err)
		}
	})
}
