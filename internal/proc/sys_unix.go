//go:build unix

package proc

import "syscall"

// Pause and Resume are SIGSTOP and SIGCONT.
const (
	canPause = true
	sigStop  = syscall.SIGSTOP
	sigCont  = syscall.SIGCONT
)
