package benchreport

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// GoBenchResult is one benchmark over its go test -count runs: each metric's values, median,
// lowest and highest.
type GoBenchResult struct {
	Pkg     string               `json:"pkg"`
	Name    string               `json:"name"`
	Runs    int                  `json:"runs"`
	Metrics map[string]GoMetrics `json:"metrics"`
	// Order is the metrics in the order go test printed them.
	Order []string `json:"order"`
}

// GoMetrics is one metric over the runs.
type GoMetrics struct {
	Values []float64 `json:"values"`
	Median float64   `json:"median"`
	Min    float64   `json:"min"`
	Max    float64   `json:"max"`
}

// GoBenches are the go test benchmarks' results, or why there are none.
type GoBenches struct {
	Skipped string          `json:"skipped,omitempty"`
	Runs    []GoBenchRun    `json:"runs"`
	Results []GoBenchResult `json:"results"`
}

// GoBenchRun is one go test invocation.
type GoBenchRun struct {
	GoBench
	Command string  `json:"command"`
	Seconds float64 `json:"seconds"`
	Error   string  `json:"error,omitempty"`
}

// runGoBenches runs cfg.GoBenches in cfg.RepoDir, each one's output appended to logPath.
func runGoBenches(ctx context.Context, cfg Config, logPath string, progress func(string, ...any)) GoBenches {
	var g GoBenches
	dir := cfg.RepoDir
	if dir == "" {
		dir = "."
	}
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		g.Skipped = fmt.Sprintf("no go.mod in %s: the source tree is needed to run the repository's benchmarks", dir)
		return g
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		g.Skipped = "no go command on PATH"
		return g
	}
	logf, err := os.Create(logPath)
	if err != nil {
		g.Skipped = err.Error()
		return g
	}
	defer logf.Close()
	for _, b := range cfg.GoBenches {
		if ctx.Err() != nil {
			break
		}
		args := []string{"test", "-run", "^$", "-bench", b.Pattern, "-benchtime", b.Benchtime, "-count", strconv.Itoa(max(1, b.Count)), b.Pkg}
		run := GoBenchRun{GoBench: b, Command: "go " + shellJoin(args)}
		progress("%s", run.Command)
		cmd := exec.CommandContext(ctx, goBin, args...)
		cmd.Dir = dir
		pr, pw := io.Pipe()
		cmd.Stdout, cmd.Stderr = pw, pw
		start := time.Now()
		if err := cmd.Start(); err != nil {
			run.Error = err.Error()
			g.Runs = append(g.Runs, run)
			continue
		}
		parsed := make(chan []benchLine, 1)
		go func() { parsed <- parseBench(io.TeeReader(pr, logf)) }()
		err := cmd.Wait()
		pw.Close()
		lines := <-parsed
		run.Seconds = time.Now().Sub(start).Seconds()
		if err != nil {
			run.Error = err.Error()
		}
		g.Runs = append(g.Runs, run)
		g.Results = append(g.Results, aggregate(b.Pkg, lines)...)
	}
	return g
}

// benchLine is one result line of go test -bench.
type benchLine struct {
	name    string
	metrics [][2]string // value, unit
}

// parseBench reads go test -bench output and returns its result lines.
func parseBench(r io.Reader) []benchLine {
	var out []benchLine
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		// BenchmarkName-2  <iterations>  <value> <unit>  <value> <unit> ...
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") || len(f)%2 != 0 {
			continue
		}
		if _, err := strconv.ParseInt(f[1], 10, 64); err != nil {
			continue
		}
		l := benchLine{name: trimProcs(f[0])}
		for i := 2; i+1 < len(f); i += 2 {
			l.metrics = append(l.metrics, [2]string{f[i], f[i+1]})
		}
		out = append(out, l)
	}
	return out
}

// trimProcs drops the -GOMAXPROCS suffix of a benchmark's name.
func trimProcs(name string) string {
	if i := strings.LastIndexByte(name, '-'); i > 0 {
		if _, err := strconv.Atoi(name[i+1:]); err == nil {
			return name[:i]
		}
	}
	return name
}

// aggregate groups result lines by benchmark and metric.
func aggregate(pkg string, lines []benchLine) []GoBenchResult {
	var out []GoBenchResult
	index := map[string]int{}
	for _, l := range lines {
		i, ok := index[l.name]
		if !ok {
			i = len(out)
			index[l.name] = i
			out = append(out, GoBenchResult{Pkg: pkg, Name: l.name, Metrics: map[string]GoMetrics{}})
		}
		r := &out[i]
		r.Runs++
		for _, m := range l.metrics {
			v, err := strconv.ParseFloat(m[0], 64)
			if err != nil {
				continue
			}
			gm, seen := r.Metrics[m[1]]
			if !seen {
				r.Order = append(r.Order, m[1])
			}
			gm.Values = append(gm.Values, v)
			r.Metrics[m[1]] = gm
		}
	}
	for i := range out {
		for unit, gm := range out[i].Metrics {
			gm.Median = median(gm.Values)
			gm.Min, gm.Max = slices.Min(gm.Values), slices.Max(gm.Values)
			out[i].Metrics[unit] = gm
		}
	}
	return out
}

// shellJoin quotes what a shell would split or expand.
func shellJoin(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " ^$|()*?[]'\"\\") {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		} else {
			q[i] = a
		}
	}
	return strings.Join(q, " ")
}
