package main

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// lockedBuffer is a bytes.Buffer a command writes while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func TestSimWorkerLogsItsStartOnce(t *testing.T) {
	cases := []struct {
		name string
		args []string
	}{
		{name: "one engine", args: nil},
		{name: "data-parallel ranks behind one front", args: []string{"--dp-size", "2"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			var logs lockedBuffer
			done := make(chan error, 1)
			args := append([]string{"sim-worker", "--listen", "127.0.0.1:0", "--log-level", "info"}, tc.args...)
			go func() { done <- run(ctx, args, &logs, &logs) }()
			poll.Until(t, 10*time.Second, func() error {
				if !strings.Contains(logs.String(), "serving") {
					return errors.New("no serving line yet")
				}
				return nil
			})
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("sim-worker: %v\n%s", err, logs.String())
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("sim-worker did not stop within 30 s of its context ending\n%s", logs.String())
			}
			if n := strings.Count(logs.String(), "serving"); n != 1 {
				t.Fatalf("sim-worker logged %d serving lines, want one:\n%s", n, logs.String())
			}
		})
	}
}
