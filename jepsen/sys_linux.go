package jepsen

import "syscall"

// childAttr puts a child in its own process group, so a terminal's ^C reaches only the
// harness, which then stops its children by pid; and has the kernel kill the child should the
// harness die without doing so.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
