package system_test

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// plainHAProxyConfig is HAProxy round-robin to the workers with nothing else: the same
// global and default settings as deploy/haproxy-lua/haproxy.cfg, without the Lua action.
func plainHAProxyConfig(listen string, workers []string) string {
	var b strings.Builder
	b.WriteString(`global
    log stdout format raw local0 info
    tune.bufsize 1048576

defaults
    mode http
    log global
    option httplog
    option http-no-delay
    timeout connect 1s
    timeout client 10m
    timeout server 10m
    timeout http-request 10s
    timeout http-keep-alive 30s
`)
	b.WriteString(roundRobinProxies(listen, workers))
	return b.String()
}

// roundRobinProxies is the part of an HAProxy config after its settings: a frontend on
// listen balancing the workers round-robin, with X-Forwarded-For as the router sets it.
func roundRobinProxies(listen string, workers []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `
frontend rr
    bind %s
    default_backend workers

backend workers
    balance roundrobin
    option forwardfor
`, listen)
	for i, w := range workers {
		fmt.Fprintf(&b, "    server w%d %s\n", i, w)
	}
	return b.String()
}

// BenchmarkHAProxyLuaAddedLatency is what the decision service costs a request when HAProxy
// carries the bytes: the same request, to the same simulated worker (its own process, told
// to answer at once), by four paths taken in turn in blocks, one request at a time at a
// fixed rate (every 2 ms, each from idle):
//
//	direct   client -> worker
//	haproxy  client -> HAProxy, round-robin -> worker (no decision)
//	replica  client -> replica (parse, decide, proxy) -> worker
//	lua      client -> HAProxy + kvrouter.lua (POST /v1/reserve to the replica, the answer
//	         read, the release sent after the response) -> worker
//
// It reports each path's p50 and p90 and, the figures the comparison is for, how much more
// the Lua path takes at p50 and p90 than plain HAProxy and than the replica's own proxy. The
// replica is one `kvrouter-ha serve` (a one-node cluster) of the release build.
func BenchmarkHAProxyLuaAddedLatency(b *testing.B) {
	haproxy := haproxyWithLua(b)
	bin := releaseBinary(b)
	worker := loopbacktest.Addr(b)
	process(b, bin, "sim-worker", "--listen", worker, "--id", "w0", "--speedup", "1000000",
		"--log-level", "error")
	waitHTTP(b, "http://"+worker+"/health")
	router := loopbacktest.Addr(b)
	process(b, bin, "serve", "--listen", router, "--admin-listen", loopbacktest.Addr(b),
		"--raft-listen", loopbacktest.Addr(b), "--peer-listen", loopbacktest.Addr(b),
		"--gossip-listen", loopbacktest.Addr(b), "--data-dir", b.TempDir(),
		"--worker", "w0=http://"+worker, "--log-level", "error")
	waitHTTP(b, "http://"+router+"/readyz")
	// The Lua path: the deployment's file, its three replicas all this one, its four
	// workers all this one.
	lua := startLuaHAProxy(b, haproxy, []string{router, router, router}, []string{worker, worker, worker, worker}, "closed")
	// Plain HAProxy.
	plainListen := loopbacktest.Addr(b)
	cfg := filepath.Join(b.TempDir(), "plain.cfg")
	if err := os.WriteFile(cfg, []byte(plainHAProxyConfig(plainListen, []string{worker})), 0o644); err != nil {
		b.Fatal(err)
	}
	h := proc.HAProxy{Binary: haproxy, Config: cfg}
	if err := h.Check(b.Context()); err != nil {
		b.Fatal(err)
	}
	spec := h.Spec()
	spec.Name = "haproxy-plain"
	if err := newProcess(b, spec).Start(); err != nil {
		b.Fatal(err)
	}
	waitHTTP(b, "http://"+plainListen+"/health")

	paths := []struct{ name, base string }{
		{"direct", "http://" + worker},
		{"haproxy", "http://" + plainListen},
		{"replica", "http://" + router},
		{"lua", lua.base},
	}
	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "json", true: "sse"}[stream]
		b.Run(name, func(b *testing.B) {
			body := fmt.Sprintf(`{"model":"sim-model","stream":%v,"max_tokens":4,"prompt":"%s"}`, stream, strings.Repeat("word ", 200))
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
			defer client.CloseIdleConnections()
			one := func(base string) time.Duration {
				start := time.Now()
				resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					b.Fatalf("%s: %s", base, resp.Status)
				}
				return time.Since(start)
			}
			// Warm every path (connections, the router's first routing state, Lua).
			for range 200 {
				for _, p := range paths {
					one(p.base)
				}
			}
			const block = 4
			took := make([][]time.Duration, len(paths))
			next := time.Now()
			i := 0
			for b.Loop() {
				p := (i / block) % len(paths)
				first := i%block == 0
				i++
				if d := time.Until(next); d > 0 {
					time.Sleep(d)
				}
				next = time.Now().Add(2 * time.Millisecond)
				d := one(paths[p].base)
				if !first { // what ran just before a block's first request colours it
					took[p] = append(took[p], d)
				}
			}
			pct := map[string][2]time.Duration{}
			for k, p := range paths {
				if len(took[k]) < 10 {
					return
				}
				slices.Sort(took[k])
				s := took[k]
				pct[p.name] = [2]time.Duration{s[len(s)*50/100], s[len(s)*90/100]}
			}
			us := func(d time.Duration) float64 { return float64(d.Microseconds()) }
			for _, p := range paths {
				b.ReportMetric(us(pct[p.name][0]), p.name+"-p50-us")
				b.ReportMetric(us(pct[p.name][1]), p.name+"-p90-us")
			}
			for _, than := range []string{"haproxy", "replica"} {
				b.ReportMetric(us(pct["lua"][0]-pct[than][0]), "lua-over-"+than+"-p50-us")
				b.ReportMetric(us(pct["lua"][1]-pct[than][1]), "lua-over-"+than+"-p90-us")
			}
		})
	}
}
