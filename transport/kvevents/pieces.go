package kvevents

import "fmt"

// A piece of a batch is flushed once it holds this many events, block hashes or token ids
// (whichever comes first), so what DecodePieces holds at once stays bounded however many
// events the payload carries: about 16 MiB of events, 2 MiB of hashes and 16 MiB of tokens,
// plus one event at its own limits.
const (
	pieceEvents = MaxEvents
	pieceHashes = 1 << 18
	pieceTokens = 1 << 22
)

// pieceFull says whether the piece decoded so far is to be handed on before the next event.
func (d *Decoder) pieceFull() bool {
	return len(d.events) >= d.pieceEvents || len(d.hashes) >= pieceHashes || len(d.tokens) >= pieceTokens
}

// DecodePieces decodes one payload as Decode does, without Decode's limit on the events of a
// batch, and hands its events to fn in order, in pieces: each a Batch with the payload's TS
// and data-parallel rank and at most MaxEvents events (and about 2^18 hashes and 2^22 token
// ids, or one event larger than that), valid only until fn returns. The whole payload is
// checked before fn is first called, so a payload that fails to decode reaches fn not at all
// (the error is Decode's), and fn sees the rank, which a map batch may give after its events.
// A payload that fits in one piece is decoded once; a longer one twice, the first time to
// check it and learn its rank, keeping one piece at a time. An error from fn stops the decode
// and is returned as it is.
func (d *Decoder) DecodePieces(payload []byte, fn func(Batch) error) error {
	d.emit, d.emitted = func([]Event) error { return nil }, 0 // the first pass checks only
	defer func() { d.emit = nil }()
	b, err := d.Decode(payload)
	if err != nil {
		return err
	}
	if d.emitted == 0 {
		return fn(b) // one piece: decoded once
	}
	head := b
	var fnErr error
	d.emit = func(evs []Event) error {
		head.Events = evs
		fnErr = fn(head)
		return fnErr
	}
	if b, err = d.Decode(payload); err != nil {
		if fnErr != nil {
			return fnErr
		}
		// The same bytes decoded a moment ago: only a bug gets here.
		return fmt.Errorf("%w: second pass: %w", ErrMalformed, err)
	}
	return fn(b)
}

// flush hands the events decoded so far to emit and starts the next piece in the same buffers.
func (d *Decoder) flush() error {
	d.emitted++
	if err := d.emit(d.events[:len(d.events):len(d.events)]); err != nil {
		return err
	}
	d.events = d.events[:0]
	d.hashes = d.hashes[:0]
	d.tokens = d.tokens[:0]
	d.extras = d.extras[:0]
	return nil
}
