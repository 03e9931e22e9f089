package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.etcd.io/bbolt"
)

// DefaultCompactMinBytes is the least free space in raft.db worth a compaction.
const DefaultCompactMinBytes = 16 << 20

// compactSuffix names the fresh copy a compaction writes beside raft.db before it renames it
// over raft.db; one left by a crash is removed when the store opens.
const compactSuffix = ".compact"

// errStoreClosed answers every call after Close (or after a compaction that could not reopen
// the file, which the log says loudly).
var errStoreClosed = errors.New("raft log store is closed")

// logStore is raft.db: raft-boltdb's store (the log and the stable store in one bbolt file,
// fsync on every write) behind a lock that lets it be swapped for a compacted copy. bbolt
// never gives freed pages back to the file system: after a burst of sessions the log's
// entries are deleted by a snapshot, yet the file keeps its peak size for good. So after
// Raft deletes a range (a snapshot compacted the log) the store checks how much of the file
// is free, and past both thresholds writes a fresh copy, fsyncs it and renames it over
// raft.db while Raft's calls wait on the lock (compact).
type logStore struct {
	path     string
	minBytes int64
	log      *slog.Logger

	mu   sync.RWMutex
	bolt *raftboltdb.BoltStore // nil once closed

	kick chan struct{}
	stop context.CancelFunc
	wg   sync.WaitGroup

	compactions, reclaimed atomic.Uint64
	// free is bbolt's free bytes when last read: what Stats reports while a compaction
	// holds the lock, so a metrics scrape never waits for one.
	free atomic.Int64
}

// logStore is both of Raft's stores over one file (raft-boltdb is not a MonotonicLogStore,
// so neither is it).
var (
	_ raft.LogStore    = (*logStore)(nil)
	_ raft.StableStore = (*logStore)(nil)
)

// LogStoreStats are a raft.db's compaction counters and its size now.
type LogStoreStats struct {
	// Compactions is how many times raft.db was rewritten; Reclaimed the bytes it shrank by in all.
	Compactions, Reclaimed uint64
	// FileBytes is raft.db's size now; FreeBytes how much of it bbolt holds free.
	FileBytes, FreeBytes int64
}

// openLogStore opens (or creates) raft.db at path, after removing a copy a crashed
// compaction left, and compacts it at once when it is already mostly free (a file an
// earlier version let grow). minBytes is the least free space worth a compaction.
func openLogStore(path string, minBytes int64, log *slog.Logger) (*logStore, error) {
	if err := os.Remove(path + compactSuffix); err == nil {
		log.Warn("removed a raft log copy an interrupted compaction left", "path", path+compactSuffix)
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove an interrupted compaction's copy: %w", err)
	}
	bolt, err := openBolt(path)
	if err != nil {
		return nil, err
	}
	ctx, stop := context.WithCancel(context.Background())
	s := &logStore{path: path, minBytes: minBytes, log: log, bolt: bolt, kick: make(chan struct{}, 1), stop: stop}
	if s.needsCompaction() {
		if err := s.compact(); err != nil {
			s.log.Warn("compacting the raft log at start failed", "err", err)
		}
	}
	s.wg.Add(1)
	go s.compactor(ctx)
	return s, nil
}

func openBolt(path string) (*raftboltdb.BoltStore, error) {
	return raftboltdb.New(raftboltdb.Options{Path: path, BoltOptions: &bbolt.Options{Timeout: time.Second}})
}

// compactor compacts raft.db when a deletion left it mostly free.
func (s *logStore) compactor(ctx context.Context) {
	defer s.wg.Done()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.kick:
		}
		if !s.needsCompaction() {
			continue
		}
		if err := s.compact(); err != nil {
			s.log.Error("compacting the raft log failed", "path", s.path, "err", err)
		}
	}
}

// needsCompaction reports whether at least minBytes and at least half of raft.db are free.
func (s *logStore) needsCompaction() bool {
	st := s.Stats()
	return st.FreeBytes >= s.minBytes && 2*st.FreeBytes >= st.FileBytes
}

// Stats reports the compaction counters and raft.db's size now.
func (s *logStore) Stats() LogStoreStats {
	st := LogStoreStats{Compactions: s.compactions.Load(), Reclaimed: s.reclaimed.Load()}
	if s.mu.TryRLock() {
		if s.bolt != nil {
			s.free.Store(int64(s.bolt.Stats().FreeAlloc))
		}
		s.mu.RUnlock()
	}
	st.FreeBytes = s.free.Load()
	if fi, err := os.Stat(s.path); err == nil {
		st.FileBytes = fi.Size()
	}
	return st
}

// compact rewrites raft.db with only what it holds, under the store's lock. Each step
// leaves a usable raft.db: until the rename it is the old file, untouched (closed cleanly);
// the copy is complete and fsynced before it is renamed over it, and the directory is
// fsynced after. A copy left by a crash is removed at the next open.
func (s *logStore) compact() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bolt == nil {
		return errStoreClosed
	}
	start := time.Now()
	before, err := fileSize(s.path)
	if err != nil {
		return err
	}
	if err := s.bolt.Close(); err != nil {
		return fmt.Errorf("close raft.db: %w", err)
	}
	s.bolt = nil
	copyErr := writeCompactCopy(s.path, s.path+compactSuffix)
	if copyErr == nil {
		copyErr = replaceFile(s.path+compactSuffix, s.path)
	}
	if copyErr != nil {
		_ = os.Remove(s.path + compactSuffix)
	}
	// Reopen whichever file is raft.db now: the old one if anything failed.
	bolt, err := openBolt(s.path)
	if err != nil {
		return fmt.Errorf("reopen raft.db after compaction (the store refuses every call now): %w", errors.Join(copyErr, err))
	}
	s.bolt = bolt
	if copyErr != nil {
		return fmt.Errorf("compact raft.db (the old file is kept): %w", copyErr)
	}
	after, err := fileSize(s.path)
	if err != nil {
		return err
	}
	s.free.Store(int64(bolt.Stats().FreeAlloc))
	s.compactions.Add(1)
	if before > after {
		s.reclaimed.Add(uint64(before - after))
	}
	s.log.Info("raft log compacted", "path", s.path, "bytes_before", before, "bytes_after", after,
		"took", time.Since(start).Round(time.Millisecond))
	return nil
}

// writeCompactCopy writes a compacted copy of the bbolt file src to dst, fsynced.
func writeCompactCopy(src, dst string) error {
	_ = os.Remove(dst)
	from, err := bbolt.Open(src, 0o600, &bbolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		return fmt.Errorf("open raft.db to copy: %w", err)
	}
	defer from.Close()
	to, err := bbolt.Open(dst, 0o600, &bbolt.Options{Timeout: time.Second})
	if err != nil {
		return fmt.Errorf("create the compacted copy: %w", err)
	}
	if err := bbolt.Compact(to, from, 64<<20); err != nil {
		_ = to.Close()
		return fmt.Errorf("copy raft.db: %w", err)
	}
	if err := to.Sync(); err != nil {
		_ = to.Close()
		return fmt.Errorf("fsync the compacted copy: %w", err)
	}
	if err := to.Close(); err != nil {
		return fmt.Errorf("close the compacted copy: %w", err)
	}
	return nil
}

// replaceFile renames from over to and fsyncs their directory, so the rename survives a crash.
func replaceFile(from, to string) error {
	if err := os.Rename(from, to); err != nil {
		return fmt.Errorf("rename the compacted copy over raft.db: %w", err)
	}
	dir, err := os.Open(filepath.Dir(to))
	if err != nil {
		return fmt.Errorf("open the data directory to fsync it: %w", err)
	}
	defer dir.Close()
	if err := dir.Sync(); err != nil {
		return fmt.Errorf("fsync the data directory: %w", err)
	}
	return nil
}

func fileSize(path string) (int64, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, fmt.Errorf("raft.db size: %w", err)
	}
	return fi.Size(), nil
}

// Close stops the compactor and closes raft.db.
func (s *logStore) Close() error {
	s.stop()
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bolt == nil {
		return nil
	}
	err := s.bolt.Close()
	s.bolt = nil
	return err
}

// with runs f on the open store under the read lock.
func (s *logStore) with(f func(b *raftboltdb.BoltStore) error) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.bolt == nil {
		return errStoreClosed
	}
	return f(s.bolt)
}

// FirstIndex implements raft.LogStore.
func (s *logStore) FirstIndex() (i uint64, err error) {
	err = s.with(func(b *raftboltdb.BoltStore) error { i, err = b.FirstIndex(); return err })
	return i, err
}

// LastIndex implements raft.LogStore.
func (s *logStore) LastIndex() (i uint64, err error) {
	err = s.with(func(b *raftboltdb.BoltStore) error { i, err = b.LastIndex(); return err })
	return i, err
}

// GetLog implements raft.LogStore.
func (s *logStore) GetLog(index uint64, l *raft.Log) error {
	return s.with(func(b *raftboltdb.BoltStore) error { return b.GetLog(index, l) })
}

// StoreLog implements raft.LogStore.
func (s *logStore) StoreLog(l *raft.Log) error {
	return s.with(func(b *raftboltdb.BoltStore) error { return b.StoreLog(l) })
}

// StoreLogs implements raft.LogStore.
func (s *logStore) StoreLogs(logs []*raft.Log) error {
	return s.with(func(b *raftboltdb.BoltStore) error { return b.StoreLogs(logs) })
}

// DeleteRange implements raft.LogStore; a deletion that left raft.db mostly free wakes the
// compactor.
func (s *logStore) DeleteRange(lo, hi uint64) error {
	if err := s.with(func(b *raftboltdb.BoltStore) error { return b.DeleteRange(lo, hi) }); err != nil {
		return err
	}
	select {
	case s.kick <- struct{}{}:
	default: // one pending kick stands for any number
	}
	return nil
}

// Set implements raft.StableStore.
func (s *logStore) Set(k, v []byte) error {
	return s.with(func(b *raftboltdb.BoltStore) error { return b.Set(k, v) })
}

// Get implements raft.StableStore.
func (s *logStore) Get(k []byte) (v []byte, err error) {
	err = s.with(func(b *raftboltdb.BoltStore) error { v, err = b.Get(k); return err })
	return v, err
}

// SetUint64 implements raft.StableStore.
func (s *logStore) SetUint64(k []byte, v uint64) error {
	return s.with(func(b *raftboltdb.BoltStore) error { return b.SetUint64(k, v) })
}

// GetUint64 implements raft.StableStore.
func (s *logStore) GetUint64(k []byte) (v uint64, err error) {
	err = s.with(func(b *raftboltdb.BoltStore) error { v, err = b.GetUint64(k); return err })
	return v, err
}
