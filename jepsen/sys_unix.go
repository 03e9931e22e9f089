//go:build unix

package jepsen

import (
	"syscall"
)

// Signals that pause and resume a process.
const (
	sigStop = syscall.SIGSTOP
	sigCont = syscall.SIGCONT
)
