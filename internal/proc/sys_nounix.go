//go:build !unix

package proc

import "syscall"

// Pausing a process is a Unix signal; elsewhere Pause and Resume fail.
const (
	canPause = false
	sigStop  = syscall.Signal(0x13)
	sigCont  = syscall.Signal(0x12)
)

// childAttr has nothing to set outside Unix.
func childAttr() *syscall.SysProcAttr { return nil }
