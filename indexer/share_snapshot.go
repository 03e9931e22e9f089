package indexer

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/bits"
)

// Snapshot format, version 1 (all integers little-endian or uvarint):
//
//	"KVIX" version(1) flags(1: bit 0 = ages present) tick unit in microseconds (uvarint)
//	workers (uvarint), then per worker:
//	  id length (uvarint, 1..MaxSnapshotIDLen), id bytes, dp rank (uvarint)
//	  n (uvarint), then n keys of 8 bytes,
//	  then, with ages, n ages in ticks: the first as a zigzag varint, each next as the
//	  zigzag varint of its difference from the previous (records are oldest first, so the
//	  differences are small and mostly zero)
//	total entries (uvarint), CRC-32C of everything before it (4 bytes)
//
// With a TTL or a cap (approximate mode) the entries are each worker's live recency
// records, oldest first, with their ages, so a loaded entry expires when it would have at
// the writer and the cap evicts in the writer's order. Without (precise mode) they come
// from a scan of the block table, whose key words keep 56 of a key's 64 bits: the keys are
// written with the 8 missing bits zero, which the table cannot tell from the full key (it
// compares and places keys by those 56 bits only).

const (
	snapshotMagic   = "KVIX"
	snapshotVersion = 1
	snapshotAges    = 1 << 0
	// MaxSnapshotIDLen bounds a worker id in a snapshot.
	MaxSnapshotIDLen = 1024
)

// ErrBadSnapshot marks a snapshot that does not decode: wrong magic or version, a length
// past the end, a count no input that short could hold, or a checksum that does not match.
var ErrBadSnapshot = errors.New("indexer: bad snapshot")

var snapshotCRC = crc32.MakeTable(crc32.Castagnoli)

// Snapshot is a decoded index snapshot, ready to load into an Index with Restore.
type Snapshot struct {
	workers []snapshotWorker
	entries int
}

type snapshotWorker struct {
	w    Worker
	keys []uint64
	ages []uint32 // ticks old at the writer, parallel to keys; nil without ages
}

// Len returns the number of (block, worker) entries in the snapshot.
func (s *Snapshot) Len() int { return s.entries }

// Workers returns the workers the snapshot holds entries of.
func (s *Snapshot) Workers() []Worker {
	out := make([]Worker, len(s.workers))
	for i, sw := range s.workers {
		out[i] = sw.w
	}
	return out
}

// WriteSnapshot writes every live entry of the index to w (see the format above). Writers
// and lookups go on meanwhile: each worker's entries are copied under that worker's lock
// (approximate mode) or each shard's under its lock (precise mode), so the snapshot is
// consistent per worker, not across workers, which is all a hint needs.
func (x *Index) WriteSnapshot(w io.Writer) error {
	sw := &snapshotWriter{bw: bufio.NewWriterSize(w, 64<<10)}
	var workers []snapshotWorker
	if x.recency {
		workers = x.snapshotQueues()
	} else {
		workers = x.snapshotTables()
	}
	flags := byte(0)
	if x.recency {
		flags |= snapshotAges
	}
	sw.bytes([]byte(snapshotMagic))
	sw.bytes([]byte{snapshotVersion, flags})
	sw.uvarint(uint64(tickUnit.Microseconds()))
	sw.uvarint(uint64(len(workers)))
	total := 0
	for _, wk := range workers {
		sw.uvarint(uint64(len(wk.w.ID)))
		sw.bytes([]byte(wk.w.ID))
		sw.uvarint(uint64(wk.w.DPRank))
		sw.uvarint(uint64(len(wk.keys)))
		var b [8]byte
		for _, k := range wk.keys {
			binary.LittleEndian.PutUint64(b[:], k)
			sw.bytes(b[:])
		}
		if flags&snapshotAges != 0 {
			prev := int64(0)
			for _, a := range wk.ages {
				sw.varint(int64(a) - prev)
				prev = int64(a)
			}
		}
		total += len(wk.keys)
	}
	sw.uvarint(uint64(total))
	var c [4]byte
	binary.LittleEndian.PutUint32(c[:], sw.crc)
	if sw.err == nil {
		_, sw.err = sw.bw.Write(c[:])
	}
	if sw.err == nil {
		sw.err = sw.bw.Flush()
	}
	if sw.err != nil {
		return fmt.Errorf("indexer: writing snapshot: %w", sw.err)
	}
	return nil
}

// snapshotQueues copies every worker's live, unexpired recency records, oldest first.
func (x *Index) snapshotQueues() []snapshotWorker {
	var out []snapshotWorker
	for _, st := range *x.byID.Load() {
		if st == nil {
			continue
		}
		st.mu.Lock()
		if st.removed.Load() || st.live == 0 {
			st.mu.Unlock()
			continue
		}
		now := x.tick()
		// The oldest records of a key with a pending count are the superseded ones, as in
		// popOldest; count them off a copy of pending.
		pending := make(map[uint64]uint32, len(st.pending))
		for k, c := range st.pending {
			pending[k] = c
		}
		sw := snapshotWorker{w: st.w, keys: make([]uint64, 0, st.live), ages: make([]uint32, 0, st.live)}
		for i := range st.queue.len() {
			key, t := st.queue.at(i)
			if c := pending[key]; c > 0 {
				pending[key] = c - 1
				continue
			}
			if x.ttlTicks > 0 && x.expired(t, now) {
				continue
			}
			sw.keys = append(sw.keys, key)
			sw.ages = append(sw.ages, uint32(max(int32(now-t), 0)))
		}
		st.mu.Unlock()
		if len(sw.keys) > 0 {
			out = append(out, sw)
		}
	}
	return out
}

// snapshotTables scans every shard's table for the entries of every worker.
func (x *Index) snapshotTables() []snapshotWorker {
	byID := *x.byID.Load()
	keys := make([][]uint64, len(byID))
	for i := range x.shards {
		sh := &x.shards[i]
		sh.mu.Lock()
		if t := sh.tab.Load(); t != nil {
			w := 1 + t.pages
			for j := 0; j+w <= len(t.a); j += w {
				k := t.a[j]
				if k == 0 {
					continue
				}
				key := uint64(i)<<(64-shardBits) | k&keyMask
				for p := range t.pages {
					for set := t.a[j+1+p]; set != 0; set &= set - 1 {
						id := p*pageBits + bits.TrailingZeros64(set)
						if id < len(keys) {
							keys[id] = append(keys[id], key)
						}
					}
				}
			}
		}
		sh.mu.Unlock()
	}
	var out []snapshotWorker
	for id, ks := range keys {
		if st := byID[id]; st != nil && len(ks) > 0 && !st.removed.Load() {
			out = append(out, snapshotWorker{w: st.w, keys: ks})
		}
	}
	return out
}

// ReadSnapshot decodes a whole snapshot from r and, only if all of it decodes, loads it
// (see Restore).
func (x *Index) ReadSnapshot(r io.Reader) error {
	b, err := io.ReadAll(r)
	if err != nil {
		return fmt.Errorf("indexer: reading snapshot: %w", err)
	}
	s, err := DecodeSnapshot(b)
	if err != nil {
		return err
	}
	x.Restore(s)
	return nil
}

// DecodeSnapshot decodes a snapshot written by WriteSnapshot; it never loads a part of one.
func DecodeSnapshot(b []byte) (*Snapshot, error) {
	if len(b) < len(snapshotMagic)+2+4 || string(b[:len(snapshotMagic)]) != snapshotMagic {
		return nil, fmt.Errorf("%w: no snapshot header", ErrBadSnapshot)
	}
	body, sum := b[:len(b)-4], binary.LittleEndian.Uint32(b[len(b)-4:])
	if got := crc32.Checksum(body, snapshotCRC); got != sum {
		return nil, fmt.Errorf("%w: checksum %08x, trailer says %08x", ErrBadSnapshot, got, sum)
	}
	d := snapshotReader{b: body[len(snapshotMagic):]}
	version, flags := d.byte(), d.byte()
	if d.err == nil && version != snapshotVersion {
		return nil, fmt.Errorf("%w: version %d, this build reads %d", ErrBadSnapshot, version, snapshotVersion)
	}
	unitMicros := d.uvarint()
	if d.err == nil && (unitMicros == 0 || unitMicros > 1<<32) {
		d.fail("tick unit of %d us", unitMicros)
	}
	nw := d.count(3) // a worker takes at least 3 bytes
	s := &Snapshot{}
	for range nw {
		idLen := d.uvarint()
		if d.err == nil && (idLen == 0 || idLen > MaxSnapshotIDLen) {
			d.fail("worker id of %d bytes", idLen)
		}
		id := d.take(int(idLen))
		rank := d.uvarint()
		if d.err == nil && rank > 1<<32-1 {
			d.fail("dp rank %d", rank)
		}
		n := d.count(8)
		raw := d.take(8 * n)
		if d.err != nil {
			break
		}
		sw := snapshotWorker{w: Worker{ID: string(id), DPRank: uint32(rank)}, keys: make([]uint64, n)}
		for i := range sw.keys {
			sw.keys[i] = binary.LittleEndian.Uint64(raw[8*i:])
		}
		if flags&snapshotAges != 0 {
			sw.ages = make([]uint32, n)
			age := int64(0)
			for i := range sw.ages {
				age += d.varint()
				if d.err == nil && (age < 0 || age > 1<<31) {
					d.fail("age of %d ticks", age)
				}
				// Ages go to this build's tick unit (the same unless the unit changed).
				sw.ages[i] = uint32(uint64(age) * unitMicros / uint64(tickUnit.Microseconds()))
			}
		}
		s.workers = append(s.workers, sw)
		s.entries += n
	}
	total := d.uvarint()
	if d.err == nil && total != uint64(s.entries) {
		d.fail("trailer counts %d entries, the body %d", total, s.entries)
	}
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d bytes after the trailer", len(d.b))
	}
	if d.err != nil {
		return nil, d.err
	}
	return s, nil
}

// Restore stores every entry of s, merging with what the index holds: an entry both have
// is kept, refreshed to the younger of the two ages. Entries older than this index's TTL
// are skipped, the cap applies as it does to Store, and without ages (a precise-mode
// snapshot) entries count as stored now. Workers are registered as needed.
func (x *Index) Restore(s *Snapshot) {
	for _, sw := range s.workers {
		x.restoreWorker(sw)
	}
}

// restoreWorker is Store for one worker's snapshot records: it pushes them in the
// snapshot's order (oldest first) with their own ages, so they expire and are evicted as
// they would have been at the writer. Within a run of records of one age, which one Store
// of the writer queued from the prompt's last block to its first, each block's hint is
// chained from the record before it, as Store chains them.
func (x *Index) restoreWorker(sw snapshotWorker) {
	if len(sw.keys) == 0 {
		return
	}
	st := x.writeWorker(sw.w, true)
	if st == nil {
		return
	}
	defer st.mu.Unlock()
	now := x.tick()
	added := 0
	var next link
	for i, h := range sw.keys {
		tick := now
		if sw.ages != nil {
			if x.ttlTicks > 0 && sw.ages[i] > x.ttlTicks {
				continue
			}
			// Modulo 2^32, like every tick: an age older than this index is fine.
			tick = now - sw.ages[i]
			if i == 0 || sw.ages[i] != sw.ages[i-1] {
				next = link{}
			}
		} else {
			next = link{} // table order: neighbours are unrelated blocks
		}
		var had bool
		had, next, _, _ = x.addBlock(st, normKey(h), tick, next)
		if !had {
			added++
		}
	}
	x.settleAdded(st, added)
	if x.ttlTicks > 0 {
		x.expireWorker(st, now)
	}
	x.compact(st)
}

// snapshotWriter writes through a buffer while keeping a CRC-32C; the first error sticks.
type snapshotWriter struct {
	bw  *bufio.Writer
	crc uint32
	err error
	tmp [binary.MaxVarintLen64]byte
}

func (w *snapshotWriter) bytes(b []byte) {
	if w.err != nil {
		return
	}
	w.crc = crc32.Update(w.crc, snapshotCRC, b)
	_, w.err = w.bw.Write(b)
}

func (w *snapshotWriter) uvarint(v uint64) { w.bytes(binary.AppendUvarint(w.tmp[:0], v)) }

func (w *snapshotWriter) varint(v int64) { w.bytes(binary.AppendVarint(w.tmp[:0], v)) }

// snapshotReader decodes from a byte slice; the first error sticks and later reads return
// zero values.
type snapshotReader struct {
	b   []byte
	err error
}

func (r *snapshotReader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: "+format, append([]any{ErrBadSnapshot}, args...)...)
	}
}

func (r *snapshotReader) byte() byte {
	if r.err != nil {
		return 0
	}
	if len(r.b) == 0 {
		r.fail("truncated")
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *snapshotReader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail("bad or truncated varint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *snapshotReader) varint() int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail("bad or truncated varint")
		return 0
	}
	r.b = r.b[n:]
	return v
}

// count reads a count of items of at least minBytes each, refusing one the bytes left
// cannot hold (so a forged count never sizes an allocation).
func (r *snapshotReader) count(minBytes int) int {
	v := r.uvarint()
	if r.err == nil && v > uint64(len(r.b)/minBytes) {
		r.fail("count %d with %d bytes left", v, len(r.b))
		return 0
	}
	return int(v)
}

func (r *snapshotReader) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n > len(r.b) {
		r.fail("%d bytes wanted, %d left", n, len(r.b))
		return nil
	}
	b := r.b[:n]
	r.b = r.b[n:]
	return b
}
