//go:build !unix

package jepsen

import "syscall"

// Pausing a process is a Unix signal; elsewhere a stop fault fails and is reported.
const (
	sigStop = syscall.Signal(0x13)
	sigCont = syscall.Signal(0x12)
)

func childAttr() *syscall.SysProcAttr { return nil }

// newNetns is Linux only.
func newNetns(string, int) (network, error) {
	return nil, errNetnsUnsupported
}
