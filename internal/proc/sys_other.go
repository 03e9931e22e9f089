//go:build unix && !linux

package proc

import "syscall"

// childAttr puts a child in its own process group, so a terminal's ^C reaches only the
// harness, which then stops its children by pid.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
