package proc

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
)

// ReadRSS is the resident set size, in bytes, of the process pid ("self" for this one), from
// /proc/PID/status's VmRSS.
func ReadRSS(pid string) (int64, error) {
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		rest, ok := bytes.CutPrefix(sc.Bytes(), []byte("VmRSS:"))
		if !ok {
			continue
		}
		// "VmRSS:     12345 kB"
		f := bytes.Fields(rest)
		if len(f) != 2 || string(f[1]) != "kB" {
			return 0, fmt.Errorf("/proc/%s/status: VmRSS %q", pid, rest)
		}
		kb, err := strconv.ParseInt(string(f[0]), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/%s/status: VmRSS: %w", pid, err)
		}
		return kb << 10, nil
	}
	return 0, fmt.Errorf("/proc/%s/status: no VmRSS", pid)
}
