// Package loopbacktest is loopback.Addr for tests, which fail at once when no address can
// be had. It is for tests only: it imports testing, which the binary must not.
package loopbacktest

import (
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
)

// Addr returns a loopback host:port that was free a moment ago, for a server the test must
// name before it binds; see loopback.Addr for why it is not 127.0.0.1.
func Addr(t testing.TB) string {
	t.Helper()
	a, err := loopback.Addr()
	if err != nil {
		t.Fatal(err)
	}
	return a
}
