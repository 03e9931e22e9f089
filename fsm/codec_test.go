package fsm

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"
)

// everyCommand has one of each command with every field set.
func everyCommand() []Command {
	return []Command{
		&Bind{Session: "s-1", Worker: "w-1", DPRank: 3, ExpectRevision: 42, TTL: 90 * time.Second, MaxBindings: 1000},
		&Bind{Session: "s 2", Worker: "w"},
		&Invalidate{Session: "s-1", Revision: 9},
		&Expire{Session: "s-1", Revision: 10},
		&InvalidateWorker{Worker: "w-1"},
		&Checkpoint{Entries: []Remaining{{Session: "a", Revision: 1, Remaining: time.Second}, {Session: "b", Revision: 2, Remaining: time.Millisecond}}},
		&Checkpoint{},
		&Checkpoint{Entries: []Remaining{{Session: "a", Revision: 1, Remaining: time.Second}}, Aged: 30 * time.Second},
		&AddWorker{ID: "w-1", Spec: []byte(`{"url":"http://10.0.0.1:8000"}`)},
		&AddWorker{ID: "w-2"},
		&DrainWorker{ID: "w-1"},
		&RemoveWorker{ID: "w-1"},
		&SetMember{Member: Member{ID: "r1", RaftAddr: "10.0.0.1:7000", PeerAddr: "10.0.0.1:7001"}},
		&RemoveMember{ID: "r1"},
		&Bind{Session: "s-3", Worker: "w-2", Model: "llama-v3"},
		&SetAlias{Alias: Alias{Name: "llama", Targets: []AliasTarget{{Model: "llama-v2", Weight: 90}, {Model: "llama-v3", Weight: 10}, {Model: "llama-v4"}}}},
		&DeleteAlias{Name: "llama"},
	}
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	for _, cmd := range everyCommand() {
		t.Run(fmt.Sprintf("%T", cmd), func(t *testing.T) {
			b, err := Encode(cmd)
			if err != nil {
				t.Fatal(err)
			}
			got, err := Decode(b)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, cmd) {
				t.Fatalf("round trip: %#v, want %#v", got, cmd)
			}
			// The ignore-if-unknown flag does not change a known command's meaning.
			flagged := append([]byte{b[0] | flagIgnorable}, b[1:]...)
			if got, err := Decode(flagged); err != nil || !reflect.DeepEqual(got, cmd) {
				t.Fatalf("flagged: %#v, %v", got, err)
			}
		})
	}
}

func TestDecodeRejectsBadInputClearly(t *testing.T) {
	valid, _ := Encode(&Bind{Session: "s", Worker: "w"})
	for _, tc := range []struct {
		name string
		in   []byte
		want error
		msg  string
	}{
		{"empty", nil, ErrMalformed, "empty entry"},
		{"unknown type", []byte{0x55}, ErrUnknownType, "0x55"},
		{"unknown ignorable type", []byte{0xd5}, ErrUnknownType, "ignore-if-unknown"},
		{"truncated body", valid[:len(valid)-1], ErrMalformed, "body"},
		{"missing session", mustMarshal(t, typeBind, &Bind{Worker: "w"}), ErrInvalid, "session key is empty"},
		{"session too long", mustMarshal(t, typeBind, &Bind{Session: strings.Repeat("s", 257), Worker: "w"}), ErrInvalid, "257 bytes, over 256"},
		{"non-printable session", mustMarshal(t, typeBind, &Bind{Session: "a\tb", Worker: "w"}), ErrInvalid, "non-printable byte 0x09"},
		{"non-ascii worker", mustMarshal(t, typeBind, &Bind{Session: "s", Worker: "wé"}), ErrInvalid, "non-printable"},
		{"negative ttl", mustMarshal(t, typeBind, &Bind{Session: "s", Worker: "w", TTL: -1}), ErrInvalid, "negative ttl"},
		{"invalid utf-8", []byte{typeInvalidate, 0x0a, 0x01, 0xff, 0x10, 0x01}, ErrMalformed, "body"},
		{"zero revision", mustMarshal(t, typeInvalidate, &Invalidate{Session: "s"}), ErrInvalid, "revision 0"},
		{"bad checkpoint entry", mustMarshal(t, typeCheckpoint, &Checkpoint{Entries: []Remaining{{Session: "a", Revision: 1, Remaining: time.Second}, {Session: "b", Revision: 1}}}), ErrInvalid, "entry 1: "},
		{"checkpoint aged backwards", mustMarshal(t, typeCheckpoint, &Checkpoint{Aged: -time.Second}), ErrInvalid, "must not be negative"},
		{"spec too large", mustMarshal(t, typeAddWorker, &AddWorker{ID: "w", Spec: make([]byte, MaxSpecLen+1)}), ErrInvalid, "spec of"},
		{"member without id", mustMarshal(t, typeSetMember, &SetMember{Member: Member{RaftAddr: "x:1"}}), ErrInvalid, "member id is empty"},
		{"wrong wire type reads as an unknown field", []byte{typeDrainWorker, 0x08, 0x01}, ErrInvalid, "worker id is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd, err := Decode(tc.in)
			if err == nil {
				t.Fatalf("decoded %#v", cmd)
			}
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("error %q, want %v containing %q", err, tc.want, tc.msg)
			}
		})
	}
}

func TestEncodeRefusesInvalidCommands(t *testing.T) {
	for _, cmd := range []Command{
		nil,
		&Bind{Session: "", Worker: "w"},
		&Expire{Session: "s"},
		&Checkpoint{Entries: make([]Remaining, MaxCheckpointEntries+1)},
		&RemoveWorker{},
	} {
		if _, err := Encode(cmd); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Encode(%#v): %v, want ErrInvalid", cmd, err)
		}
	}
}

func TestResultRoundTrip(t *testing.T) {
	for _, r := range []*Result{
		{Status: Created, Found: true, Binding: Binding{Session: "s", Worker: "w", DPRank: 2, Revision: 7, TTL: time.Minute, Remaining: time.Second}},
		{Status: Conflict},
		{Status: OK, Count: 12345},
		{Status: Invalid, Err: fmt.Errorf("entry 4: %w", fmt.Errorf("decode: %w: session key is empty", ErrInvalid))},
		{Status: Invalid, Err: fmt.Errorf("entry 5: %w: empty command", ErrMalformed)},
		{Status: Ignored},
	} {
		b, err := EncodeResult(r)
		if err != nil {
			t.Fatal(err)
		}
		got, err := DecodeResult(b)
		if err != nil {
			t.Fatal(err)
		}
		if got.Status != r.Status || got.Binding != r.Binding || got.Found != r.Found || got.Count != r.Count {
			t.Fatalf("round trip %+v, want %+v", got, r)
		}
		if (got.Err == nil) != (r.Err == nil) {
			t.Fatalf("err %v, want %v", got.Err, r.Err)
		}
		if r.Err != nil {
			if got.Err.Error() != r.Err.Error() {
				t.Fatalf("message %q, want %q", got.Err, r.Err)
			}
			for _, s := range []error{ErrInvalid, ErrMalformed} {
				if errors.Is(got.Err, s) != errors.Is(r.Err, s) {
					t.Fatalf("errors.Is(%v) differs after the trip", s)
				}
			}
		}
	}
	for _, bad := range [][]byte{{0x08, 0x00}, {0x08, 0x63}, {0xff}} {
		if _, err := DecodeResult(bad); !errors.Is(err, ErrMalformed) {
			t.Fatalf("DecodeResult(%x): %v", bad, err)
		}
	}
	if _, err := EncodeResult(nil); err == nil {
		t.Fatal("nil result encoded")
	}
}

func FuzzDecode(f *testing.F) {
	for _, cmd := range everyCommand() {
		b, err := Encode(cmd)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0x85, 0x0a})
	f.Fuzz(func(t *testing.T, in []byte) {
		cmd, err := Decode(in)
		if err != nil {
			if cmd != nil {
				t.Fatalf("error %v with a command", err)
			}
			return
		}
		b, err := Encode(cmd)
		if err != nil {
			t.Fatalf("decoded %#v does not re-encode: %v", cmd, err)
		}
		again, err := Decode(b)
		if err != nil {
			t.Fatalf("re-encoded %#v does not decode: %v", cmd, err)
		}
		if !reflect.DeepEqual(again, cmd) {
			t.Fatalf("round trip %#v, want %#v", again, cmd)
		}
		// Apply on a fresh FSM must not panic on anything Decode accepts.
		f := New(Options{OnChange: func(Change) {}})
		if r := f.applyCommand(1, in); r == nil || r.Status == Invalid {
			t.Fatalf("apply of a decodable entry: %+v", r)
		}
	})
}

func FuzzRestore(f *testing.F) {
	n := populated(f, 5)
	f.Add(persist(f, n.f))
	f.Add([]byte(snapMagic))
	if v1, err := os.ReadFile("testdata/snapshot-v1.bin"); err == nil {
		f.Add(v1) // the format before aliases
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		r := New(Options{})
		if err := restore(r, in); err != nil {
			if r.Len() != 0 || r.AppliedIndex() != 0 {
				t.Fatalf("failed restore changed the state: %v", err)
			}
			return
		}
		// Whatever restores must snapshot again to an equal state.
		r2 := New(Options{})
		if err := restore(r2, persist(t, r)); err != nil {
			t.Fatal(err)
		}
		requireEqual(t, dumpOf(r2), dumpOf(r))
	})
}
