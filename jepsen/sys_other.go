//go:build unix && !linux

package jepsen

import "syscall"

// childAttr puts a child in its own process group, so a terminal's ^C reaches only the
// harness, which then stops its children by pid.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}

// newNetns is Linux only.
func newNetns(string, int) (network, error) {
	return nil, errNetnsUnsupported
}
