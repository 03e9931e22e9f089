package proc

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// ClockTicks is USER_HZ, the unit of /proc/PID/stat's times: 100 on every Linux this runs on.
const ClockTicks = 100

// CPUTicks is a process's processor time, in clock ticks: its own (all threads) and that of
// the children it waited for.
type CPUTicks struct {
	User, System, ChildrenUser, ChildrenSystem uint64
}

// Own is the process's own user and system time, in seconds.
func (t CPUTicks) Own() float64 { return float64(t.User+t.System) / ClockTicks }

// ReadCPUTicks reads /proc/PID/stat's times of the process pid ("self" for this one).
func ReadCPUTicks(pid string) (CPUTicks, error) {
	b, err := os.ReadFile("/proc/" + pid + "/stat")
	if err != nil {
		return CPUTicks{}, err
	}
	// The command, in parentheses, may hold spaces: the fields after it start past the last
	// ')', state first, so utime (field 14) is the 12th of them.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return CPUTicks{}, fmt.Errorf("/proc/%s/stat: no command", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 15 {
		return CPUTicks{}, fmt.Errorf("/proc/%s/stat: %d fields after the command", pid, len(f))
	}
	var v [4]uint64
	for j := range v {
		if v[j], err = strconv.ParseUint(f[11+j], 10, 64); err != nil {
			return CPUTicks{}, fmt.Errorf("/proc/%s/stat: %w", pid, err)
		}
	}
	return CPUTicks{User: v[0], System: v[1], ChildrenUser: v[2], ChildrenSystem: v[3]}, nil
}
