package discovery

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

// maxFileBytes bounds the file a File source reads (a fleet of specs, not a data set).
const maxFileBytes = 8 << 20

// File is a source that reads a JSON array of worker specs (the --workers-file shape) and
// reads it again when it changes, as Prometheus' file_sd does. Write the file by renaming a
// complete one over it: a half-written file is invalid JSON, a failed look that keeps the
// last set.
type File struct {
	path string
	// sum and specs are the last good read (a look runs on one goroutine at a time).
	sum   [sha256.Size]byte
	specs []routing.WorkerSpec
}

// NewFile is a File source over path.
func NewFile(path string) *File { return &File{path: path} }

// Name is "file:PATH".
func (f *File) Name() string { return "file:" + f.path }

// Kind is "file".
func (f *File) Kind() string { return "file" }

// Lookup reads the file; unchanged contents are not parsed again.
func (f *File) Lookup(context.Context) ([]routing.WorkerSpec, error) {
	st, err := os.Stat(f.path)
	if err != nil {
		return nil, fmt.Errorf("discovery file: %w", err)
	}
	if st.Size() > maxFileBytes {
		return nil, fmt.Errorf("discovery file %s: %d bytes, over %d", f.path, st.Size(), maxFileBytes)
	}
	b, err := os.ReadFile(f.path)
	if err != nil {
		return nil, fmt.Errorf("discovery file: %w", err)
	}
	sum := sha256.Sum256(b)
	if f.specs != nil && sum == f.sum {
		return f.specs, nil
	}
	specs, err := workers.ParseSpecs(b)
	if err != nil {
		return nil, fmt.Errorf("discovery file %s: %w", f.path, err)
	}
	if specs == nil {
		specs = []routing.WorkerSpec{}
	}
	f.sum, f.specs = sum, specs
	return specs, nil
}
