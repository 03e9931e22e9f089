package fsm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"maps"
	"math"
	"slices"

	"github.com/hashicorp/raft"
)

// Snapshot stream, format version 2 (integers little-endian unless "uvarint"):
//
//	header   magic "KVRHAFSM", version u32, applied index u64, binding count u64
//	names    uvarint n, n × (uvarint len, bytes)        interned worker ids
//	workers  uvarint n, n × (id, draining byte, spec)   strings/bytes as uvarint len + bytes
//	members  uvarint n, n × (id, raft addr, peer addr)
//	aliases  uvarint n, n × (name, uvarint k, k × (model, uvarint weight))     (v2)
//	models   uvarint n, n × (uvarint len, bytes)        interned binding models (v2)
//	bindings per binding: uvarint session len (>0), session, uvarint name index,
//	         uvarint dp rank, uvarint revision, uvarint ttl ns, uvarint remaining ns,
//	         uvarint model index + 1 (0: none; v2); then uvarint 0
//	trailer  binding count u64, CRC-32C u32 of every byte before it
//
// Version 1 (before aliases: no aliases or models sections, no model field) still restores.
//
// Restore reads and checks the whole stream into new structures before it touches the
// FSM, so a truncated or corrupt snapshot leaves the state as it was.

const (
	snapMagic   = "KVRHAFSM"
	snapVersion = 2
	// snapVersionNoModels is the format before aliases, still read.
	snapVersionNoModels = 1

	// Sanity bounds on counts read from a snapshot (before its CRC can be checked).
	maxSnapNames   = 1 << 24
	maxSnapWorkers = 1 << 20
	maxSnapMembers = 1 << 16
	// maxPresize bounds the capacity Restore reserves from the header's count.
	maxPresize = 1 << 22

	snapBufSize = 256 << 10
)

// ErrSnapshot is wrapped by every error about a snapshot stream's content.
var ErrSnapshot = errors.New("bad snapshot")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// snapshot is a frozen version of the state: Snapshot copied pointers only, and the
// applier clones any shard it writes afterwards, so nothing here changes until Release.
type snapshot struct {
	st     *state
	names  []string
	models []string
	reg    *registry
	index  uint64
	count  uint64
}

// Snapshot freezes the current state in O(shards): it copies pointers and bumps the
// generation, so Apply clones a shard on its first write after this call.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.amu.Lock()
	defer f.amu.Unlock()
	s := &snapshot{st: f.st.Load(), names: f.intern.names, models: f.models.names, reg: f.reg.Load(),
		index: f.applied.Load(), count: uint64(f.count.Load())}
	f.gen++
	return s, nil
}

// Persist streams the frozen state to sink, cancelling the sink on any error.
func (s *snapshot) Persist(sink raft.SnapshotSink) error {
	if err := s.write(sink); err != nil {
		_ = sink.Cancel()
		return fmt.Errorf("fsm: persist snapshot: %w", err)
	}
	if err := sink.Close(); err != nil {
		return fmt.Errorf("fsm: persist snapshot: close sink: %w", err)
	}
	return nil
}

// Release drops the frozen state.
func (s *snapshot) Release() { *s = snapshot{} }

func (s *snapshot) write(w io.Writer) error {
	if s.st == nil {
		return errors.New("snapshot already released")
	}
	e := &snapWriter{w: w, buf: make([]byte, 0, snapBufSize)}
	// Without aliases or binding models the state is written in format 1, which a replica of
	// the release before aliases restores: a rolling upgrade can ship snapshots both ways
	// until aliases are first used.
	withModels := len(s.reg.aliases) > 0 || len(s.models) > 0
	version := uint32(snapVersionNoModels)
	if withModels {
		version = snapVersion
	}
	e.buf = append(e.buf, snapMagic...)
	e.buf = binary.LittleEndian.AppendUint32(e.buf, version)
	e.buf = binary.LittleEndian.AppendUint64(e.buf, s.index)
	e.buf = binary.LittleEndian.AppendUint64(e.buf, s.count)

	e.uvarint(uint64(len(s.names)))
	for _, n := range s.names {
		e.str(n)
	}
	workers := sortedKeys(s.reg.workers)
	e.uvarint(uint64(len(workers)))
	for _, id := range workers {
		wk := s.reg.workers[id]
		e.str(wk.ID)
		var d byte
		if wk.Draining {
			d = 1
		}
		e.reserve(1)
		e.buf = append(e.buf, d)
		e.bytes(wk.Spec)
	}
	members := sortedKeys(s.reg.members)
	e.uvarint(uint64(len(members)))
	for _, id := range members {
		m := s.reg.members[id]
		e.str(m.ID)
		e.str(m.RaftAddr)
		e.str(m.PeerAddr)
	}
	if withModels {
		aliases := sortedKeys(s.reg.aliases)
		e.uvarint(uint64(len(aliases)))
		for _, name := range aliases {
			a := s.reg.aliases[name]
			e.str(a.Name)
			e.uvarint(uint64(len(a.Targets)))
			for _, t := range a.Targets {
				e.str(t.Model)
				e.uvarint(uint64(t.Weight))
			}
		}
		e.uvarint(uint64(len(s.models)))
		for _, m := range s.models {
			e.str(m)
		}
	}

	var n uint64
	for _, sh := range s.st.shards {
		for i := range sh.slots {
			sl := &sh.slots[i]
			e.reserve(7*binary.MaxVarintLen64 + int(sl.keyLen))
			e.buf = binary.AppendUvarint(e.buf, uint64(sl.keyLen))
			e.buf = append(e.buf, sh.key(i)...)
			e.buf = binary.AppendUvarint(e.buf, uint64(sl.worker))
			e.buf = binary.AppendUvarint(e.buf, uint64(sl.dpRank))
			e.buf = binary.AppendUvarint(e.buf, sl.revision)
			e.buf = binary.AppendUvarint(e.buf, uint64(sl.ttl))
			e.buf = binary.AppendUvarint(e.buf, uint64(sl.remaining))
			if withModels {
				e.buf = binary.AppendUvarint(e.buf, uint64(sl.model))
			}
			n++
		}
		if e.err != nil {
			return e.err
		}
	}
	if n != s.count {
		return fmt.Errorf("frozen state holds %d bindings, counted %d", n, s.count)
	}
	e.uvarint(0)
	e.reserve(12)
	e.buf = binary.LittleEndian.AppendUint64(e.buf, n)
	e.crc = crc32.Update(e.crc, castagnoli, e.buf)
	e.buf = binary.LittleEndian.AppendUint32(e.buf, e.crc)
	if e.err == nil {
		_, e.err = w.Write(e.buf)
	}
	return e.err
}

// snapWriter buffers the stream and keeps a running CRC of what it wrote.
type snapWriter struct {
	w   io.Writer
	buf []byte
	crc uint32
	err error
}

// reserve makes room for n more bytes (n at most the buffer's capacity).
func (e *snapWriter) reserve(n int) {
	if len(e.buf)+n <= cap(e.buf) {
		return
	}
	if e.err == nil {
		e.crc = crc32.Update(e.crc, castagnoli, e.buf)
		_, e.err = e.w.Write(e.buf)
	}
	e.buf = e.buf[:0]
}

func (e *snapWriter) uvarint(v uint64) {
	e.reserve(binary.MaxVarintLen64)
	e.buf = binary.AppendUvarint(e.buf, v)
}

func (e *snapWriter) bytes(b []byte) {
	e.reserve(binary.MaxVarintLen64 + len(b))
	e.buf = binary.AppendUvarint(e.buf, uint64(len(b)))
	e.buf = append(e.buf, b...)
}

func (e *snapWriter) str(s string) {
	e.reserve(binary.MaxVarintLen64 + len(s))
	e.buf = binary.AppendUvarint(e.buf, uint64(len(s)))
	e.buf = append(e.buf, s...)
}

// image is a fully read and checked snapshot, not yet installed.
type image struct {
	st     *state
	intern *interner
	models *interner
	reg    *registry
	index  uint64
	count  uint64
}

// Restore replaces the whole state with the snapshot in rc, and closes rc. The stream is
// read and verified completely (lengths, limits, duplicates, count and CRC) before
// anything is replaced: on error the FSM is unchanged. Afterwards OnChange gets one
// Change of Kind Reset.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	f.amu.Lock()
	defer f.amu.Unlock()
	img, err := readImage(rc, f.gen)
	if err != nil {
		return fmt.Errorf("fsm: restore: %w", err)
	}
	f.intern, f.models = img.intern, img.models
	f.reg.Store(img.reg)
	f.st.Store(img.st)
	f.count.Store(int64(img.count))
	f.applied.Store(img.index)
	f.note(Change{Kind: Reset, Reason: Restored, Index: img.index})
	f.emit()
	if f.opts.OnApplied != nil {
		f.opts.OnApplied(img.index)
	}
	return nil
}

func readImage(r io.Reader, gen uint64) (*image, error) {
	d := &snapReader{r: r, buf: make([]byte, snapBufSize)}
	hdr, err := d.next(len(snapMagic)+4+8+8, "header")
	if err != nil {
		return nil, err
	}
	if string(hdr[:len(snapMagic)]) != snapMagic {
		return nil, fmt.Errorf("%w: not an fsm snapshot (magic %q)", ErrSnapshot, hdr[:len(snapMagic)])
	}
	version := binary.LittleEndian.Uint32(hdr[8:])
	if version != snapVersion && version != snapVersionNoModels {
		return nil, fmt.Errorf("%w: format version %d, this code reads %d and %d", ErrSnapshot, version, snapVersionNoModels, snapVersion)
	}
	img := &image{index: binary.LittleEndian.Uint64(hdr[12:]), count: binary.LittleEndian.Uint64(hdr[20:])}

	// Worker names: the snapshot's indexes map to ids of a fresh interner, built in place
	// because nothing can see it yet.
	names, err := readNames(d, "worker", ValidWorker)
	if err != nil {
		return nil, err
	}
	in := newInterner()
	remap := make([]int32, len(names))
	for i := range remap {
		remap[i] = -1
	}

	img.reg = newRegistry()
	nWorkers, err := d.count("worker count", maxSnapWorkers)
	if err != nil {
		return nil, err
	}
	for i := range nWorkers {
		what := fmt.Sprintf("worker %d", i)
		b, err := d.lenBytes(what+" id", MaxKeyLen)
		if err != nil {
			return nil, err
		}
		w := Worker{ID: string(b)}
		if err := ValidWorker(w.ID); err != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrSnapshot, what, err)
		}
		flag, err := d.next(1, what+" draining flag")
		if err != nil {
			return nil, err
		}
		if flag[0] > 1 {
			return nil, fmt.Errorf("%w: %s: draining flag %d", ErrSnapshot, what, flag[0])
		}
		w.Draining = flag[0] == 1
		spec, err := d.lenBytes(what+" spec", MaxSpecLen)
		if err != nil {
			return nil, err
		}
		if len(spec) > 0 {
			w.Spec = append([]byte(nil), spec...)
		}
		if _, dup := img.reg.workers[w.ID]; dup {
			return nil, fmt.Errorf("%w: worker %q listed twice", ErrSnapshot, w.ID)
		}
		img.reg.workers[w.ID] = w
	}
	nMembers, err := d.count("member count", maxSnapMembers)
	if err != nil {
		return nil, err
	}
	for i := range nMembers {
		var fields [3]string
		for j, what := range [3]string{"id", "raft address", "peer address"} {
			b, err := d.lenBytes(fmt.Sprintf("member %d %s", i, what), MaxKeyLen)
			if err != nil {
				return nil, err
			}
			fields[j] = string(b)
		}
		m := Member{ID: fields[0], RaftAddr: fields[1], PeerAddr: fields[2]}
		if err := (&SetMember{Member: m}).validate(); err != nil {
			return nil, fmt.Errorf("%w: member %d: %w", ErrSnapshot, i, err)
		}
		if _, dup := img.reg.members[m.ID]; dup {
			return nil, fmt.Errorf("%w: member %q listed twice", ErrSnapshot, m.ID)
		}
		img.reg.members[m.ID] = m
	}
	var models []string
	if version >= snapVersion {
		if err := readAliases(d, img.reg); err != nil {
			return nil, err
		}
		if models, err = readNames(d, "model", ValidModel); err != nil {
			return nil, err
		}
	}
	mc := &modelCodes{names: models, remap: make([]int32, len(models)), in: newInterner(), withField: version >= snapVersion}
	for i := range mc.remap {
		mc.remap[i] = -1
	}

	img.st = newState(gen)
	if per := min(img.count, maxPresize) / numShards; per > 0 {
		tbl := minTable
		for tbl*3 < int(per)*4+4 {
			tbl *= 2
		}
		for _, sh := range img.st.shards {
			sh.slots = make([]slot, 0, per+per/8)
			sh.arena = make([]byte, 0, int(per)*40)
			sh.table = make([]uint64, tbl)
		}
	}
	var n uint64
	for ; ; n++ {
		done, err := readBinding(d, img, names, remap, in, mc)
		if err != nil {
			return nil, fmt.Errorf("binding %d: %w", n, err)
		}
		if done {
			break
		}
	}
	tr, err := d.next(8, "trailer count")
	if err != nil {
		return nil, err
	}
	trCount := binary.LittleEndian.Uint64(tr)
	sum := d.sum()
	crcb, err := d.next(4, "trailer checksum")
	if err != nil {
		return nil, err
	}
	if got := binary.LittleEndian.Uint32(crcb); got != sum {
		return nil, fmt.Errorf("%w: checksum mismatch (stored %08x, computed %08x): the snapshot is corrupt", ErrSnapshot, got, sum)
	}
	if trCount != n || img.count != n {
		return nil, fmt.Errorf("%w: %d bindings read, header says %d, trailer %d", ErrSnapshot, n, img.count, trCount)
	}
	if extra, err := d.atEOF(); err != nil {
		return nil, err
	} else if !extra {
		return nil, fmt.Errorf("%w: bytes after the trailer at offset %d", ErrSnapshot, d.offset())
	}
	// Every shard resolves ids with the final table.
	for _, sh := range img.st.shards {
		sh.names, sh.models = in.names, mc.in.names
	}
	img.intern, img.models = in, mc.in
	return img, nil
}

// snapReader is a buffered reader that keeps a CRC of the bytes consumed so far.
type snapReader struct {
	r        io.Reader
	buf      []byte
	pos, end int
	crc      uint32 // over bytes consumed before buf[0]
	consumed int64  // bytes discarded before buf[0]
	eof      bool
}

func (d *snapReader) offset() int64 { return d.consumed + int64(d.pos) }

// sum is the CRC of every byte consumed so far.
func (d *snapReader) sum() uint32 { return crc32.Update(d.crc, castagnoli, d.buf[:d.pos]) }

// fill tries to have n unread bytes buffered; fewer only at the end of the stream.
func (d *snapReader) fill(n int) error {
	if d.end-d.pos >= n {
		return nil
	}
	if d.pos > 0 {
		d.crc = crc32.Update(d.crc, castagnoli, d.buf[:d.pos])
		d.consumed += int64(d.pos)
		d.end = copy(d.buf, d.buf[d.pos:d.end])
		d.pos = 0
	}
	for d.end < n && !d.eof {
		m, err := d.r.Read(d.buf[d.end:])
		d.end += m
		if errors.Is(err, io.EOF) {
			d.eof = true
		} else if err != nil {
			return fmt.Errorf("reading snapshot at offset %d: %w", d.offset(), err)
		}
	}
	return nil
}

func (d *snapReader) truncated(what string) error {
	return fmt.Errorf("%w: truncated at offset %d while reading %s: %w", ErrSnapshot, d.offset(), what, io.ErrUnexpectedEOF)
}

// next consumes n bytes (n at most the buffer size); the slice is valid until the next call.
func (d *snapReader) next(n int, what string) ([]byte, error) {
	if err := d.fill(n); err != nil {
		return nil, err
	}
	if d.end-d.pos < n {
		return nil, d.truncated(what)
	}
	b := d.buf[d.pos : d.pos+n]
	d.pos += n
	return b, nil
}

func (d *snapReader) uvarint(what string) (uint64, error) {
	if err := d.fill(binary.MaxVarintLen64); err != nil {
		return 0, err
	}
	v, n := binary.Uvarint(d.buf[d.pos:d.end])
	if n == 0 {
		return 0, d.truncated(what)
	}
	if n < 0 {
		return 0, fmt.Errorf("%w: %s at offset %d overflows 64 bits", ErrSnapshot, what, d.offset())
	}
	d.pos += n
	return v, nil
}

func (d *snapReader) count(what string, limit uint64) (uint64, error) {
	v, err := d.uvarint(what)
	if err != nil {
		return 0, err
	}
	if v > limit {
		return 0, fmt.Errorf("%w: %s %d over the limit %d", ErrSnapshot, what, v, limit)
	}
	return v, nil
}

func (d *snapReader) lenBytes(what string, limit int) ([]byte, error) {
	n, err := d.uvarint(what + " length")
	if err != nil {
		return nil, err
	}
	if n > uint64(limit) {
		return nil, fmt.Errorf("%w: %s of %d bytes, over %d", ErrSnapshot, what, n, limit)
	}
	return d.next(int(n), what)
}

// atEOF reports whether the stream has no bytes left.
func (d *snapReader) atEOF() (bool, error) {
	if err := d.fill(1); err != nil {
		return false, err
	}
	return d.end == d.pos, nil
}

// readBinding reads one binding into img, or the end marker (done).
func readBinding(d *snapReader, img *image, names []string, remap []int32, in *interner, mc *modelCodes) (done bool, err error) {
	klen, err := d.uvarint("session length")
	if err != nil {
		return false, err
	}
	if klen == 0 {
		return true, nil
	}
	if klen > MaxKeyLen {
		return false, fmt.Errorf("%w: session length %d over %d", ErrSnapshot, klen, MaxKeyLen)
	}
	key, err := d.next(int(klen), "session")
	if err != nil {
		return false, err
	}
	for _, c := range key {
		if c < 0x20 || c > 0x7e {
			return false, fmt.Errorf("%w: session %q has a non-printable byte", ErrSnapshot, key)
		}
	}
	h := hashBytes(key)
	sh := img.st.shards[shardOf(h)]
	if _, i := sh.findBytes(key, h); i >= 0 {
		return false, fmt.Errorf("%w: session %q listed twice", ErrSnapshot, key)
	}
	// key points into the reader's buffer: insert copies it before the next read moves it.
	insert(sh, key, h, slot{})
	var v [5]uint64
	for j := range v {
		if v[j], err = d.uvarint("binding field"); err != nil {
			return false, err
		}
	}
	idx, rank, rev, ttl, rem := v[0], v[1], v[2], v[3], v[4]
	if idx >= uint64(len(names)) {
		return false, fmt.Errorf("%w: worker index %d outside a table of %d", ErrSnapshot, idx, len(names))
	}
	if rank > math.MaxUint32 || ttl > math.MaxInt64 || rem > math.MaxInt64 {
		return false, fmt.Errorf("%w: dp rank, ttl or remaining out of range", ErrSnapshot)
	}
	if rev == 0 || rev > img.index {
		return false, fmt.Errorf("%w: revision %d outside 1..%d (the snapshot's index)", ErrSnapshot, rev, img.index)
	}
	id := remap[idx]
	if id < 0 {
		// A table may spell one name under two indexes (a freed id's stale entry).
		if cur, ok := in.ids[names[idx]]; ok {
			id = int32(cur)
		} else {
			id = int32(len(in.names))
			in.names = append(in.names, names[idx])
			in.refs = append(in.refs, 0)
			in.ids[names[idx]] = uint32(id)
		}
		remap[idx] = id
	}
	in.refs[id]++
	last := &sh.slots[len(sh.slots)-1]
	last.worker, last.dpRank, last.revision = uint32(id), uint32(rank), rev
	last.ttl, last.remaining = int64(ttl), int64(rem)
	if mc.withField {
		code, err := d.uvarint("binding model")
		if err != nil {
			return false, err
		}
		if last.model, err = mc.code(code); err != nil {
			return false, err
		}
	}
	return false, nil
}

// modelCodes maps a snapshot's model indexes (plus one) to a fresh model interner's.
type modelCodes struct {
	names     []string
	remap     []int32
	in        *interner
	withField bool
}

func (mc *modelCodes) code(v uint64) (uint16, error) {
	if v == 0 {
		return 0, nil
	}
	if v > uint64(len(mc.names)) {
		return 0, fmt.Errorf("%w: model index %d outside a table of %d", ErrSnapshot, v-1, len(mc.names))
	}
	idx := v - 1
	id := mc.remap[idx]
	if id < 0 {
		if cur, ok := mc.in.ids[mc.names[idx]]; ok {
			id = int32(cur)
		} else {
			if len(mc.in.names) >= MaxBoundModels {
				return 0, fmt.Errorf("%w: over %d distinct binding models", ErrSnapshot, MaxBoundModels)
			}
			id = int32(len(mc.in.names))
			mc.in.names = append(mc.in.names, mc.names[idx])
			mc.in.refs = append(mc.in.refs, 0)
			mc.in.ids[mc.names[idx]] = uint32(id)
		}
		mc.remap[idx] = id
	}
	mc.in.refs[id]++
	return uint16(id + 1), nil
}

// readNames reads a name table: uvarint n, n × name, each checked by valid.
func readNames(d *snapReader, what string, valid func(string) error) ([]string, error) {
	n, err := d.count(what+" table size", maxSnapNames)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, min(n, 1024))
	for i := range n {
		b, err := d.lenBytes(what+" name", MaxKeyLen)
		if err != nil {
			return nil, fmt.Errorf("%s %d: %w", what, i, err)
		}
		if err := valid(string(b)); err != nil {
			return nil, fmt.Errorf("%w: %s %d: %w", ErrSnapshot, what, i, err)
		}
		out = append(out, string(b))
	}
	return out, nil
}

// readAliases reads the aliases section into reg.
func readAliases(d *snapReader, reg *registry) error {
	n, err := d.count("alias count", MaxAliases)
	if err != nil {
		return err
	}
	for i := range n {
		b, err := d.lenBytes(fmt.Sprintf("alias %d name", i), MaxKeyLen)
		if err != nil {
			return err
		}
		a := Alias{Name: string(b)}
		k, err := d.count("alias target count", MaxAliasTargets)
		if err != nil {
			return err
		}
		for j := range k {
			b, err := d.lenBytes(fmt.Sprintf("alias %q target %d", a.Name, j), MaxKeyLen)
			if err != nil {
				return err
			}
			w, err := d.count("alias weight", MaxAliasWeight)
			if err != nil {
				return err
			}
			a.Targets = append(a.Targets, AliasTarget{Model: string(b), Weight: uint32(w)})
		}
		if err := ValidAlias(a); err != nil {
			return fmt.Errorf("%w: alias %d: %w", ErrSnapshot, i, err)
		}
		if _, dup := reg.aliases[a.Name]; dup {
			return fmt.Errorf("%w: alias %q listed twice", ErrSnapshot, a.Name)
		}
		reg.aliases[a.Name] = a
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	return slices.Sorted(maps.Keys(m))
}
