package system_test

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loadgen"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// BenchmarkThroughputVsHAProxy is the router's saturation throughput against the physical
// anchor: HAProxy doing round-robin over the same two backends, driven by the same closed-loop
// load generator in the same run. The backends are an HAProxy answering a static completion
// (`http-request return`), so they are never what limits either path; one `kvrouter-ha serve`
// (the release build, default flags but its addresses and its data directory, so its own
// HTTP/1.1 server, --http-server fast) has them as its two workers (and another, router-net,
// the same on --http-server net: Go's server, the default before 2026-12-04), and a second HAProxy
// balances them round-robin with no other work (no log line per request, X-Forwarded-For as
// the router sets it); and, as the Go anchor, httputil.ReverseProxy
// round-robin over them (testdata/goproxy: Go's HTTP server and client with no routing work),
// and the floor for Go (testdata/gofloor: a goroutine per connection relaying whole messages,
// no HTTP library).
// The load generator is 32 keep-alive
// connections in this process, each sending its next request as soon as its answer is in, over a
// minimal HTTP/1.1 client (net/http's client costs several times what it measures). Rounds
// alternate router, HAProxy, router, ... (three of each by default); each reports requests per
// second, and the router's and HAProxy's CPU seconds per request from /proc/PID/stat.
//
//	json  POST /v1/completions, a short text prompt, a 200 JSON answer of about 300 bytes
//	sse   POST /v1/chat/completions with stream true, an SSE answer of three events
//
// Everything shares this machine's cores, the load generator included: the CPU figures tell
// how much each part took. Knobs, from the environment:
//
//	KVROUTER_TP_ROUND     measured length of a round (4s; each round warms up first, 300ms or wrk's 1s)
//	KVROUTER_TP_ROUNDS    rounds of each contender (3)
//	KVROUTER_TP_CONNS     connections (32)
//	KVROUTER_TP_PIN=split pin the proxy under test (router or HAProxy) to CPU 1, and the load
//	                      generator and the backends to CPU 0 (taskset)
//	KVROUTER_TP_ONLY      the optional contenders that run, comma-separated, of router-net,
//	                      go-revproxy and go-floor (all; "none" for none): the router and
//	                      HAProxy always run, and every KVROUTER_TP_BASELINE
//	KVROUTER_TP_BASELINE  other kvrouter-ha binaries, [name=]path, comma-separated: more
//	                      contenders in the same alternation (a before/after comparison in
//	                      one run; "baseline" when unnamed)
//	KVROUTER_TP_LOAD=wrk  drive the rounds with wrk (2 threads, the same connections, a Lua
//	                      script that POSTs the same request) instead of the in-process
//	                      generator, as a new user would measure it; wrk's CPU is then the
//	                      load generator's column
//	KVROUTER_TP_PPROF     a directory: the router is built with -tags kvrouter_pprof and its
//	                      CPU profile (all router rounds) and allocations (the delta over them)
//	                      are written there (cpu-json.pprof, allocs-json.pprof, ...)
//
// Run it once (each call takes its rounds whatever b.N is):
//
//	go test ./system_test -run '^$' -bench ThroughputVsHAProxy -benchtime 1x
func BenchmarkThroughputVsHAProxy(b *testing.B) {
	haproxy := haproxyBinary()
	if _, err := os.Stat(haproxy); err != nil {
		b.Skip("haproxy is not installed")
	}
	knobs := throughputKnobs(b)
	pprofDir := os.Getenv("KVROUTER_TP_PPROF")
	bin := releaseBinary(b)
	if pprofDir != "" {
		bin = releaseBuild(b, "kvrouter_pprof")
	}
	if knobs.pin {
		// The load generator's threads, and every thread they start, on CPU 0.
		if out, err := exec.Command("taskset", "-a", "-cp", "0", strconv.Itoa(os.Getpid())).CombinedOutput(); err != nil {
			b.Fatalf("taskset: %v: %s", err, out)
		}
	}
	on := func(cpu string) []string {
		if !knobs.pin {
			return nil
		}
		return []string{"taskset", "-c", cpu}
	}

	dir := b.TempDir()
	backends := []string{loopbacktest.Addr(b), loopbacktest.Addr(b)}
	backend := startTPHAProxy(b, haproxy, "backends", backendsConfig(b, dir, backends), on("0"))
	for _, a := range backends {
		waitHTTP(b, "http://"+a+"/health")
	}
	lbAddr := loopbacktest.Addr(b)
	lb := startTPHAProxy(b, haproxy, "haproxy-rr", roundRobinConfig(lbAddr, backends), on("1"))
	waitHTTP(b, "http://"+lbAddr+"/health")

	type contender struct {
		name  string
		addr  string
		pid   int
		pprof string // the pprof listener, when profiled
	}
	router := func(name, bin string, extra ...string) contender {
		addr := loopbacktest.Addr(b)
		args := []string{"serve", "--listen", addr, "--admin-listen", loopbacktest.Addr(b),
			"--raft-listen", loopbacktest.Addr(b), "--peer-listen", loopbacktest.Addr(b),
			"--gossip-listen", loopbacktest.Addr(b), "--data-dir", b.TempDir(),
			"--worker", "w0=http://" + backends[0], "--worker", "w1=http://" + backends[1]}
		args = append(args, extra...)
		spec := proc.Spec{Name: name, Argv: append([]string{bin}, args...), Wrap: on("1")}
		pprof := ""
		if pprofDir != "" {
			// Every router is profiled whose binary serves pprof (built with the tag).
			pprof = loopbacktest.Addr(b)
			spec.Env = []string{"KVROUTER_PPROF_LISTEN=" + pprof}
		}
		p := newProcess(b, spec)
		if err := p.Start(); err != nil {
			b.Fatal(err)
		}
		waitHTTP(b, "http://"+addr+"/readyz")
		if pprof != "" && !servesPprof(pprof) {
			b.Logf("%s: %s does not serve pprof (not built with -tags kvrouter_pprof): not profiled", name, bin)
			pprof = ""
		}
		return contender{name: name, addr: addr, pid: p.PID(), pprof: pprof}
	}
	// The router on each client-port server (--http-server): net/http's, and its own
	// (router-fast), in the same alternation.
	contenders := []contender{router("router", bin, "--http-server", "fast"), {name: "haproxy", addr: lbAddr, pid: lb.PID()}}
	if knobs.runs("router-net") {
		contenders = append(contenders, router("router-net", bin, "--http-server", "net"))
	}
	// The Go anchors, each built from testdata and run over the same backends: go-revproxy,
	// httputil.ReverseProxy round-robin (what Go's HTTP server and client cost on this path
	// before any routing work), and go-floor, a goroutine per connection relaying whole
	// messages with blocking reads and writes and nothing else (what Go and the kernel cost
	// before any HTTP library or routing work).
	for _, a := range []struct{ name, dir string }{{"go-revproxy", "goproxy"}, {"go-floor", "gofloor"}} {
		if !knobs.runs(a.name) {
			continue
		}
		addr := loopbacktest.Addr(b)
		bin := filepath.Join(b.TempDir(), a.dir)
		if out, err := exec.Command("go", "build", "-o", bin, "./testdata/"+a.dir).CombinedOutput(); err != nil {
			b.Fatalf("build %s: %v\n%s", a.dir, err, out)
		}
		argv := []string{bin, "-listen", addr, "-backend", backends[0], "-backend", backends[1]}
		p := newProcess(b, proc.Spec{Name: a.dir, Argv: argv, Wrap: on("1")})
		if err := p.Start(); err != nil {
			b.Fatal(err)
		}
		waitHTTP(b, "http://"+addr+"/readyz")
		contenders = append(contenders, contender{name: a.name, addr: addr, pid: p.PID()})
	}
	for _, base := range baselines() {
		contenders = append(contenders, router(base[0], base[1]))
	}
	b.Logf("%d connections, rounds of %s, pinned: %v, load generator %s; backends pid %d", knobs.conns, knobs.round, knobs.pin, knobs.load, backend.PID())

	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "json", true: "sse"}[stream]
		b.Run(name, func(b *testing.B) {
			req := loadgen.Request("tp-model", stream)
			// Each contender answers once, whole, before the rounds.
			for _, c := range contenders {
				if _, err := driveRound(c.addr, req, 1, 0, 0, 1, nil); err != nil {
					b.Fatalf("%s: %v", c.name, err)
				}
			}
			var profs []*routerProfile
			for _, c := range contenders {
				if c.pprof != "" {
					profs = append(profs, startRouterProfile(b, c.pprof, pprofDir, name+"-"+c.name,
						time.Duration(knobs.rounds*len(contenders))*(knobs.warmup()+knobs.round)))
				}
			}
			results := map[string][]roundResult{}
			for round := range knobs.rounds {
				for _, c := range contenders {
					pids := []int{c.pid, backend.PID(), os.Getpid()}
					var res roundResult
					var err error
					if knobs.load == "wrk" {
						res, err = wrkRound(b, c.addr, stream, knobs.conns, knobs.warmup(), knobs.round, pids[:2], on("0"))
					} else {
						res, err = driveRound(c.addr, req, knobs.conns, knobs.warmup(), knobs.round, 1<<30, pids)
					}
					if err != nil {
						b.Fatalf("%s, round %d: %v", c.name, round+1, err)
					}
					results[c.name] = append(results[c.name], res)
					// To stdout, as it comes: a benchmark's log keeps only its first ten lines.
					fmt.Printf("%s round %d %-8s %8.0f req/s  %6.1f us CPU/req (backends %5.1f, load generator %5.1f)\n",
						name, round+1, c.name, res.rate(), res.cpuPerReq(0), res.cpuPerReq(1), res.cpuPerReq(2))
				}
			}
			for _, p := range profs {
				p.finish(b)
			}
			ratios := func(of string) []float64 {
				var out []float64
				for i, r := range results[of] {
					out = append(out, r.rate()/results["haproxy"][i].rate())
				}
				return out
			}
			rates := func(of string) []float64 { return mapRounds(results[of], roundResult.rate) }
			cpu := func(of string) []float64 {
				return mapRounds(results[of], func(r roundResult) float64 { return r.cpuPerReq(0) })
			}
			rr := ratios("router")
			b.Logf("router/haproxy per round %s, median %.2fx", fmtRatios(rr), median(rr))
			b.ReportMetric(median(rates("router")), "router-req/s")
			b.ReportMetric(median(rates("haproxy")), "haproxy-req/s")
			b.ReportMetric(median(rr), "ratio-median")
			b.ReportMetric(median(cpu("router")), "router-cpu-us/req")
			b.ReportMetric(median(cpu("haproxy")), "haproxy-cpu-us/req")
			// Every other contender: its ratio and CPU per request.
			var others []string
			for _, c := range contenders[2:] {
				others = append(others, c.name)
			}
			for _, name := range others {
				r := ratios(name)
				b.Logf("%s/haproxy per round %s, median %.2fx", name, fmtRatios(r), median(r))
				b.ReportMetric(median(r), name+"-ratio-median")
				b.ReportMetric(median(cpu(name)), name+"-cpu-us/req")
			}
		})
	}
}

// baselines are KVROUTER_TP_BASELINE's contenders, as name and path.
func baselines() [][2]string {
	var out [][2]string
	for _, v := range strings.Split(os.Getenv("KVROUTER_TP_BASELINE"), ",") {
		if v = strings.TrimSpace(v); v == "" {
			continue
		}
		name, path, ok := strings.Cut(v, "=")
		if !ok {
			name, path = "baseline", v
		}
		out = append(out, [2]string{name, path})
	}
	return out
}

type tpKnobs struct {
	round  time.Duration
	rounds int
	conns  int
	pin    bool
	load   string // "wrk", or "" for the in-process generator
	// only names the optional contenders that run (nil: all).
	only []string
}

// runs reports whether the optional contender name runs.
func (k tpKnobs) runs(name string) bool { return k.only == nil || slices.Contains(k.only, name) }

// warmup is how long each round warms up before it counts: wrk's durations are whole seconds.
func (k tpKnobs) warmup() time.Duration {
	if k.load == "wrk" {
		return time.Second
	}
	return 300 * time.Millisecond
}

func throughputKnobs(b *testing.B) tpKnobs {
	k := tpKnobs{round: 4 * time.Second, rounds: 3, conns: 32}
	if v := os.Getenv("KVROUTER_TP_ROUND"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			b.Fatalf("KVROUTER_TP_ROUND=%q: not a duration", v)
		}
		k.round = d
	}
	for _, kv := range []struct {
		name string
		dst  *int
	}{{"KVROUTER_TP_ROUNDS", &k.rounds}, {"KVROUTER_TP_CONNS", &k.conns}} {
		if v := os.Getenv(kv.name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				b.Fatalf("%s=%q: not a positive number", kv.name, v)
			}
			*kv.dst = n
		}
	}
	switch v := os.Getenv("KVROUTER_TP_LOAD"); v {
	case "", "wrk":
		k.load = v
	default:
		b.Fatalf("KVROUTER_TP_LOAD=%q: only wrk", v)
	}
	if k.load == "wrk" {
		if _, err := exec.LookPath("wrk"); err != nil {
			b.Skip("KVROUTER_TP_LOAD=wrk, and wrk is not installed")
		}
	}
	if v := os.Getenv("KVROUTER_TP_ONLY"); v != "" {
		k.only = strings.Split(v, ",")
	}
	switch v := os.Getenv("KVROUTER_TP_PIN"); v {
	case "":
	case "split":
		k.pin = true
	default:
		b.Fatalf("KVROUTER_TP_PIN=%q: only split", v)
	}
	return k
}

// The backends' answers: a short completion, and a short chat stream with its usage.
const (
	tpJSONAnswer = `{"id":"cmpl-tp","object":"text_completion","created":1700000000,"model":"tp-model",` +
		`"choices":[{"index":0,"text":" Hello there, how can I help?","logprobs":null,"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":48,"completion_tokens":8,"total_tokens":56,"prompt_tokens_details":{"cached_tokens":32}}}`
	tpSSEAnswer = `data: {"id":"chatcmpl-tp","object":"chat.completion.chunk","created":1700000000,"model":"tp-model","choices":[{"index":0,"delta":{"role":"assistant","content":"Hello"},"finish_reason":null}]}` + "\n\n" +
		`data: {"id":"chatcmpl-tp","object":"chat.completion.chunk","created":1700000000,"model":"tp-model","choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":48,"completion_tokens":2,"total_tokens":50,"prompt_tokens_details":{"cached_tokens":32}}}` + "\n\n" +
		"data: [DONE]\n\n"
)

// backendsConfig is one HAProxy answering every request at each of addrs with a static
// answer: SSE for chat completions, JSON otherwise.
func backendsConfig(b *testing.B, dir string, addrs []string) string {
	jsonFile, sseFile := filepath.Join(dir, "answer.json"), filepath.Join(dir, "answer.sse")
	if err := os.WriteFile(jsonFile, []byte(tpJSONAnswer), 0o644); err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(sseFile, []byte(tpSSEAnswer), 0o644); err != nil {
		b.Fatal(err)
	}
	var sb strings.Builder
	sb.WriteString(`global
    maxconn 4000

defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    timeout http-request 10s
    timeout http-keep-alive 30s
`)
	for i, a := range addrs {
		fmt.Fprintf(&sb, `
frontend backend%d
    bind %s
    http-request return status 200 content-type text/event-stream file %s if { path /v1/chat/completions }
    http-request return status 200 content-type application/json file %s
`, i, a, sseFile, jsonFile)
	}
	return sb.String()
}

// roundRobinConfig is HAProxy round-robin over the backends, as a user would set it up, with
// no log line per request.
func roundRobinConfig(listen string, backends []string) string {
	var sb strings.Builder
	sb.WriteString(`global
    maxconn 4000

defaults
    mode http
    option http-no-delay
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    timeout http-request 10s
    timeout http-keep-alive 30s
`)
	sb.WriteString(roundRobinProxies(listen, backends))
	return sb.String()
}

// startTPHAProxy checks and starts an HAProxy with cfg.
func startTPHAProxy(b *testing.B, bin, name, cfg string, wrap []string) *proc.Process {
	path := filepath.Join(b.TempDir(), name+".cfg")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		b.Fatal(err)
	}
	h := proc.HAProxy{Binary: bin, Config: path}
	if err := h.Check(b.Context()); err != nil {
		b.Fatal(err)
	}
	spec := h.Spec()
	spec.Name, spec.Wrap = name, wrap
	p := newProcess(b, spec)
	if err := p.Start(); err != nil {
		b.Fatal(err)
	}
	return p
}

// roundResult is one round of one contender.
type roundResult struct {
	requests int64
	seconds  float64
	cpu      []float64 // CPU seconds of each process watched, over the round
}

func (r roundResult) rate() float64 { return float64(r.requests) / r.seconds }

// cpuPerReq is process i's CPU microseconds per request.
func (r roundResult) cpuPerReq(i int) float64 { return r.cpu[i] * 1e6 / float64(r.requests) }

// driveRound runs conns closed-loop connections against addr, sending req: warm-up first, then
// it counts answers for dur or until limit answers, whichever comes first, with the CPU time of
// the processes pids took meanwhile. Any answer but a whole 200 fails the round.
func driveRound(addr string, req []byte, conns int, warm, dur time.Duration, limit int64, pids []int) (roundResult, error) {
	var (
		counting atomic.Bool
		stop     atomic.Bool
		counted  atomic.Int64
		enough   = make(chan struct{})
		once     sync.Once
		wg       sync.WaitGroup
		errMu    sync.Mutex
		firstErr error
	)
	fail := func(err error) {
		errMu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		errMu.Unlock()
		stop.Store(true)
		once.Do(func() { close(enough) })
	}
	if dur == 0 {
		counting.Store(true)
	}
	for range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lc, err := loadgen.Dial(addr)
			if err != nil {
				fail(err)
				return
			}
			defer lc.Close()
			for !stop.Load() {
				if err := lc.Do(req); err != nil {
					fail(err)
					return
				}
				if counting.Load() && counted.Add(1) >= limit {
					once.Do(func() { close(enough) })
					return
				}
			}
		}()
	}
	var res roundResult
	time.Sleep(warm)
	before := cpuTimes(pids)
	start := time.Now()
	counting.Store(true)
	if dur > 0 {
		timer := time.NewTimer(dur)
		select {
		case <-timer.C:
		case <-enough:
		}
		timer.Stop()
	} else {
		<-enough
	}
	res.requests = counted.Load()
	res.seconds = time.Since(start).Seconds()
	after := cpuTimes(pids)
	stop.Store(true)
	wg.Wait()
	for i := range pids {
		res.cpu = append(res.cpu, after[i]-before[i])
	}
	if firstErr != nil {
		return res, firstErr
	}
	if res.requests == 0 {
		return res, errors.New("no answer")
	}
	return res, nil
}

// wrkRound is one round driven by wrk: two threads, conns connections, a warm run and then
// one of dur, each in whole seconds, POSTing loadgen.Request's body. res.cpu is the CPU of pids over the
// measured run, then wrk's own. Any answer but a 2xx, or a socket error, fails the round.
func wrkRound(b *testing.B, addr string, stream bool, conns int, warm, dur time.Duration, pids []int, wrap []string) (roundResult, error) {
	req := loadgen.Request("tp-model", stream)
	head, body, _ := strings.Cut(string(req), "\r\n\r\n")
	path := strings.Fields(head)[1]
	script := filepath.Join(b.TempDir(), "post.lua")
	lua := fmt.Sprintf("wrk.method = \"POST\"\nwrk.body = %q\nwrk.headers[\"Content-Type\"] = \"application/json\"\n", body)
	if err := os.WriteFile(script, []byte(lua), 0o644); err != nil {
		return roundResult{}, err
	}
	run := func(d time.Duration) (string, float64, error) {
		argv := append(append([]string(nil), wrap...), "wrk", "-t2", "-c"+strconv.Itoa(conns), "-d"+strconv.Itoa(max(1, int(d.Round(time.Second)/time.Second)))+"s",
			"--timeout", "5s", "-s", script, "http://"+addr+path)
		cmd := exec.Command(argv[0], argv[1:]...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return "", 0, fmt.Errorf("wrk: %w: %s", err, out)
		}
		st := cmd.ProcessState
		return string(out), (st.UserTime() + st.SystemTime()).Seconds(), nil
	}
	if _, _, err := run(warm); err != nil {
		return roundResult{}, err
	}
	before := cpuTimes(pids)
	out, wrkCPU, err := run(dur)
	if err != nil {
		return roundResult{}, err
	}
	after := cpuTimes(pids)
	var res roundResult
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) >= 5 && f[1] == "requests" && f[2] == "in":
			res.requests, _ = strconv.ParseInt(f[0], 10, 64)
			d, derr := time.ParseDuration(strings.TrimSuffix(f[3], ","))
			if derr != nil {
				return res, fmt.Errorf("wrk's duration %q: %w", f[3], derr)
			}
			res.seconds = d.Seconds()
		case strings.HasPrefix(strings.TrimSpace(line), "Non-2xx"), strings.HasPrefix(strings.TrimSpace(line), "Socket errors"):
			return res, fmt.Errorf("wrk: %s", strings.TrimSpace(line))
		}
	}
	if res.requests == 0 || res.seconds == 0 {
		return res, fmt.Errorf("no requests in wrk's output:\n%s", out)
	}
	for i := range pids {
		res.cpu = append(res.cpu, after[i]-before[i])
	}
	res.cpu = append(res.cpu, wrkCPU)
	return res, nil
}

// cpuTimes are the CPU seconds (user and system, all threads) each process has used; 0 for
// one that is gone.
func cpuTimes(pids []int) []float64 {
	out := make([]float64, len(pids))
	for i, pid := range pids {
		if t, err := proc.ReadCPUTicks(strconv.Itoa(pid)); err == nil {
			out[i] = t.Own()
		}
	}
	return out
}

func mapRounds(rs []roundResult, f func(roundResult) float64) []float64 {
	out := make([]float64, len(rs))
	for i, r := range rs {
		out[i] = f(r)
	}
	return out
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func fmtRatios(v []float64) string {
	parts := make([]string, len(v))
	for i, r := range v {
		parts[i] = fmt.Sprintf("%.2fx", r)
	}
	return strings.Join(parts, " ")
}

// routerProfile takes the router's CPU profile over its rounds and its allocations' delta,
// through the pprof listener of a kvrouter_pprof build. The CPU profile runs across every
// round; in the other contenders' rounds the router idles, and adds few samples.
type routerProfile struct {
	addr, dir, name                        string
	allocsBefore, mutexBefore, blockBefore []byte
	cpu                                    chan []byte
	seconds                                int
}

// startRouterProfile starts a CPU profile of length span (every round of every contender).
func startRouterProfile(b *testing.B, addr, dir, name string, span time.Duration) *routerProfile {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	p := &routerProfile{addr: addr, dir: dir, name: name, cpu: make(chan []byte, 1)}
	p.allocsBefore = pprofGet(b, "http://"+addr+"/debug/pprof/allocs")
	p.mutexBefore = pprofGet(b, "http://"+addr+"/debug/pprof/mutex")
	p.blockBefore = pprofGet(b, "http://"+addr+"/debug/pprof/block")
	p.seconds = int(span.Seconds()) + 1
	go func() {
		resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, p.seconds))
		if err != nil {
			p.cpu <- nil
			return
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		p.cpu <- body
	}()
	return p
}

func (p *routerProfile) finish(b *testing.B) {
	allocs := pprofGet(b, "http://"+p.addr+"/debug/pprof/allocs")
	mutex := pprofGet(b, "http://"+p.addr+"/debug/pprof/mutex")
	block := pprofGet(b, "http://"+p.addr+"/debug/pprof/block")
	cpu := <-p.cpu
	for name, data := range map[string][]byte{"allocs-before": p.allocsBefore, "allocs": allocs, "cpu": cpu,
		"mutex-before": p.mutexBefore, "mutex": mutex, "block-before": p.blockBefore, "block": block} {
		path := filepath.Join(p.dir, name+"-"+p.name+".pprof")
		if err := os.WriteFile(path, data, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	at := func(kind string) string { return filepath.Join(p.dir, kind+"-"+p.name+".pprof") }
	b.Logf("profiles in %s: go tool pprof -top %s; go tool pprof -sample_index=alloc_space -base %s -top %s "+
		"(mutex and block profiles: the same -base with mutex-before/mutex and block-before/block)",
		p.dir, at("cpu"), at("allocs-before"), at("allocs"))
}

// servesPprof reports whether addr answers pprof's index, polling while the listener, which
// the router starts beside its own, comes up.
func servesPprof(addr string) bool {
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/debug/pprof/")
		if err == nil {
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func pprofGet(b *testing.B, url string) []byte {
	resp, err := http.Get(url)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		b.Fatalf("%s: %v %s", url, err, resp.Status)
	}
	return body
}
