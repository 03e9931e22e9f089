package proc

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Memory is a process's resident memory, in bytes: now (VmRSS) and at its peak (VmHWM).
type Memory struct {
	RSS, PeakRSS uint64
}

// ReadMemory reads /proc/PID/status's resident set sizes of the process pid ("self" for this
// one).
func ReadMemory(pid string) (Memory, error) {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return Memory{}, err
	}
	var m Memory
	found := 0
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		var dst *uint64
		switch {
		case !ok:
			continue
		case name == "VmRSS":
			dst = &m.RSS
		case name == "VmHWM":
			dst = &m.PeakRSS
		default:
			continue
		}
		f := strings.Fields(rest) // "123456 kB"
		if len(f) != 2 || f[1] != "kB" {
			return Memory{}, fmt.Errorf("/proc/%s/status: %s: %q", pid, name, rest)
		}
		kb, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return Memory{}, fmt.Errorf("/proc/%s/status: %s: %w", pid, name, err)
		}
		*dst = kb << 10
		found++
	}
	if found != 2 {
		return Memory{}, fmt.Errorf("/proc/%s/status: VmRSS or VmHWM missing", pid)
	}
	return m, nil
}
