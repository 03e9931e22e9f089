package proc

import "syscall"

// childAttr puts a child in its own process group, so a terminal's ^C reaches only the
// harness, which then stops its children by pid; and has the kernel kill the child should the
// harness die without doing so. (Pdeathsig follows the thread that started the child; the
// runtime ends a thread only when a goroutine locked to it exits, which Start's caller is not.)
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
