//go:build !linux

package jepsen

// newNetns is Linux only.
func newNetns(string, int) (network, error) {
	return nil, errNetnsUnsupported
}
