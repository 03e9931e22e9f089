package benchreport

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// Machine is where a report was made.
type Machine struct {
	Hostname string `json:"hostname"`
	CPU      string `json:"cpu"`
	Cores    int    `json:"cores"`
	// GoVersion is the toolchain this binary was built with; GoCommand what `go version`
	// says (the go test benchmarks' toolchain), "" without one.
	GoVersion string    `json:"go_version"`
	GoCommand string    `json:"go_command,omitempty"`
	OS        string    `json:"os"`
	MemoryGiB float64   `json:"memory_gib"`
	Date      time.Time `json:"date"`
	// LoadStart and LoadEnd are /proc/loadavg's 1-minute load when the run began and ended:
	// the machine is shared, and this is the one sign of the neighbours a report can give.
	LoadStart string `json:"load_start"`
	LoadEnd   string `json:"load_end,omitempty"`
}

// thisMachine describes the machine now.
func thisMachine() Machine {
	m := Machine{Cores: runtime.NumCPU(), GoVersion: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH,
		Date: time.Now().UTC(), LoadStart: loadAverage()}
	m.Hostname, _ = os.Hostname()
	m.CPU = cpuModel()
	m.MemoryGiB = memoryGiB()
	if out, err := exec.Command("go", "version").Output(); err == nil {
		m.GoCommand = strings.TrimSpace(string(out))
	}
	return m
}

// Footer is the machine in one line, for the plots.
func (m Machine) Footer() string {
	return fmt.Sprintf("%s, %s, %d cores, %s, %s", m.Hostname, m.CPU, m.Cores, m.GoVersion, m.Date.Format("2006-01-02 15:04 MST"))
}

// cpuModel is /proc/cpuinfo's first model name ("unknown CPU" elsewhere).
func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU"
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}

// memoryGiB is /proc/meminfo's MemTotal in GiB (0 when unknown).
func memoryGiB() float64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		var kb float64
		if _, err := fmt.Sscanf(line, "MemTotal: %f kB", &kb); err == nil {
			return kb / (1 << 20)
		}
	}
	return 0
}

// cpuTimes is a reading of the machine's processor time and this process's, in clock ticks.
type cpuTimes struct {
	busy, total, steal, self uint64
	ok                       bool
}

// readCPU reads /proc/stat's first line and /proc/self/stat's times (children that were
// waited for included).
func readCPU() cpuTimes {
	var c cpuTimes
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return c
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return c
	}
	var v [8]uint64
	for i := range v {
		fmt.Sscan(f[i+1], &v[i])
	}
	// user nice system idle iowait irq softirq steal
	c.busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
	c.total = c.busy + v[3] + v[4]
	c.steal = v[7]
	t, err := proc.ReadCPUTicks("self")
	if err != nil {
		return c
	}
	c.self = t.User + t.System + t.ChildrenUser + t.ChildrenSystem
	c.ok = true
	return c
}

// Neighbours is how busy the rest of the machine was while something ran: the share of all
// its processor time that other processes used, and the share the hypervisor stole.
type Neighbours struct {
	OthersCPU float64 `json:"others_cpu"`
	Steal     float64 `json:"steal"`
	Load      string  `json:"load_end"`
}

// since is the neighbours' share between c and now.
func (c cpuTimes) since() Neighbours {
	n := Neighbours{Load: first(loadAverage())}
	now := readCPU()
	if !c.ok || !now.ok || now.total <= c.total {
		return n
	}
	total := float64(now.total - c.total)
	steal := float64(now.steal - c.steal)
	others := float64(now.busy-c.busy) - steal - float64(now.self-c.self)
	n.OthersCPU = max(0, others/total)
	n.Steal = steal / total
	return n
}

// Taken is the share of the machine's processor time this process did not get to use because
// others (processes here, or other virtual machines through steal) took it.
func (n Neighbours) Taken() float64 { return n.OthersCPU + n.Steal }

// String renders the neighbours for a caption.
func (n Neighbours) String() string {
	return fmt.Sprintf("others %.0f%% of the CPU, steal %.0f%%", 100*n.OthersCPU, 100*n.Steal)
}

// loadAverage is the 1, 5 and 15-minute load averages ("" when unknown).
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}
