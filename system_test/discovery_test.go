package system_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/internal/dnstest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// discoveryFlags are the discovery tunings of these tests: a look every 200 ms, a drain of
// 2 s, a suspect drop held 4 s.
func discoveryFlags(source string, extra ...string) []string {
	return append([]string{"--discovery", source, "--discovery-interval", "200ms",
		"--discovery-drain-for", "2s", "--discovery-suspect-for", "4s"}, extra...)
}

// writeSpecs replaces the workers file at path with the workers of fl named by ids, by
// renaming a complete file over it (as the file source asks).
func writeSpecs(t *testing.T, path string, fl *fleet, ids ...string) {
	t.Helper()
	type spec struct {
		ID  string `json:"id"`
		URL string `json:"url"`
	}
	var specs []spec
	for _, id := range ids {
		specs = append(specs, spec{id, fl.urls[slices.Index(fl.ids, id)]})
	}
	b, err := json.Marshal(specs)
	if err != nil {
		t.Fatal(err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// routable is the ids of the workers replica r routes new sessions to (listed, not drained,
// ready), sorted, and the ids it lists at all.
func routable(ctx context.Context, r *replica) (route, listed []string, err error) {
	var ws []admin.WorkerView
	if err := proc.Get(ctx, httpClient, "http://"+r.Admin+"/admin/workers", &ws); err != nil {
		return nil, nil, err
	}
	for _, w := range ws {
		listed = append(listed, w.Spec.ID)
		if !w.Drained && !w.NotReady {
			route = append(route, w.Spec.ID)
		}
	}
	slices.Sort(route)
	slices.Sort(listed)
	return route, listed, nil
}

// waitFleet polls every replica of rs until each lists exactly want, none drained, and
// returns how long the slowest took.
func waitFleet(t *testing.T, rs []*replica, want []string, within time.Duration) time.Duration {
	t.Helper()
	want = slices.Sorted(slices.Values(want))
	start := time.Now()
	eventually(t, within, func() error {
		for _, r := range rs {
			route, listed, err := routable(t.Context(), r)
			if err != nil {
				return err
			}
			if !slices.Equal(route, want) || !slices.Equal(listed, want) {
				return fmt.Errorf("%s routes to %v and lists %v, want %v", r.ID, route, listed, want)
			}
		}
		return nil
	})
	return time.Since(start)
}

// holdsFleet checks, for the window, that every replica of rs keeps routing to exactly want.
func holdsFleet(t *testing.T, rs []*replica, want []string, window time.Duration) {
	t.Helper()
	want = slices.Sorted(slices.Values(want))
	pace := time.NewTicker(100 * time.Millisecond)
	defer pace.Stop()
	for end, n := time.Now().Add(window), 0; time.Now().Before(end) && n < 200; n++ {
		for _, r := range rs {
			route, _, err := routable(t.Context(), r)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(route, want) {
				t.Fatalf("%s routes to %v while the source failed, want the last known %v", r.ID, route, want)
			}
		}
		<-pace.C
	}
}

func mustChat(t *testing.T, r *replica, session, prompt string) answer {
	t.Helper()
	a, err := chat(t.Context(), r, session, prompt)
	if err != nil || a.status != http.StatusOK {
		t.Fatalf("%s via %s: %+v, %v", session, r.ID, a, err)
	}
	return a
}

// mostBound is the worker holding the most of the sessions.
func mostBound(bound map[string]answer) string {
	count := map[string]int{}
	best := ""
	for _, b := range bound {
		count[b.worker]++
		if best == "" || count[b.worker] > count[best] || (count[b.worker] == count[best] && b.worker < best) {
			best = b.worker
		}
	}
	return best
}

// checkMovedOnce sends two more requests for every session (on different replicas) and
// checks: a session bound to a gone worker moved once (a new worker that is not gone, a
// higher revision, the same on the next request); every other session kept its worker and
// revision. It returns how many moved.
func checkMovedOnce(t *testing.T, c *cluster, bound map[string]answer, gone ...string) int {
	t.Helper()
	moved := 0
	i := 0
	for s, b := range bound {
		i++
		first := mustChat(t, c.replicas[i%len(c.replicas)], s, "turn 2 of "+s)
		second := mustChat(t, c.replicas[(i+1)%len(c.replicas)], s, "turn 3 of "+s)
		if second.worker != first.worker || second.revision != first.revision {
			t.Errorf("session %s moved twice: %s@%d, then %s@%d", s, first.worker, first.revision, second.worker, second.revision)
		}
		if slices.Contains(gone, b.worker) {
			moved++
			if slices.Contains(gone, first.worker) || first.revision <= b.revision {
				t.Errorf("session %s on gone worker %s@%d is now on %s@%d: want a kept worker, a higher revision", s, b.worker, b.revision, first.worker, first.revision)
			}
			continue
		}
		if first.worker != b.worker || first.revision != b.revision {
			t.Errorf("session %s on kept worker %s@%d moved to %s@%d", s, b.worker, b.revision, first.worker, first.revision)
		}
	}
	return moved
}

func TestFileDiscoveryAddsAndRemovesWorkersOnEveryReplicaAndMovesOnlyTheGoneWorkersSessions(t *testing.T) {
	fl := startFleet(t, 5)
	path := filepath.Join(t.TempDir(), "fleet.json")
	writeSpecs(t, path, fl, "w0", "w1", "w2", "w3")
	c := startClusterOf(t, binary, 3, nil, discoveryFlags("file:"+path)...)
	took := waitFleet(t, c.replicas, []string{"w0", "w1", "w2", "w3"}, 30*time.Second)
	t.Logf("4 discovered workers on every replica %s after the cluster was ready", took.Round(time.Millisecond))

	bound := bindSessions(t, c, sessionNames("file", 40))
	writeSpecs(t, path, fl, "w0", "w1", "w2", "w3", "w4")
	took = waitFleet(t, c.replicas, []string{"w0", "w1", "w2", "w3", "w4"}, 20*time.Second)
	t.Logf("an added entry on every replica within %s", took.Round(time.Millisecond))
	if a := mustChat(t, c.replicas[1], "", "to anyone"); a.worker == "" {
		t.Fatalf("no worker answered: %+v", a)
	}

	gone := mostBound(bound)
	var kept []string
	for _, id := range []string{"w0", "w1", "w2", "w3", "w4"} {
		if id != gone {
			kept = append(kept, id)
		}
	}
	writeSpecs(t, path, fl, kept...)
	// Drained first (no new sessions), then removed after the drain period.
	eventually(t, 20*time.Second, func() error {
		for _, r := range c.replicas {
			route, _, err := routable(t.Context(), r)
			if err != nil {
				return err
			}
			if slices.Contains(route, gone) {
				return fmt.Errorf("%s still routes to %s", r.ID, gone)
			}
		}
		return nil
	})
	took = waitFleet(t, c.replicas, kept, 20*time.Second)
	t.Logf("a removed entry drained and gone from every replica within %s", took.Round(time.Millisecond))
	moved := checkMovedOnce(t, c, bound, gone)
	if moved == 0 {
		t.Fatalf("no session was bound to %s: the test proves nothing", gone)
	}
	t.Logf("%d of %d sessions were on %s and moved once; the rest kept their worker and revision", moved, len(bound), gone)

	// A half-written file (not renamed into place) is a failed look: the set stays, past the
	// suspect and drain periods, and the leader counts it.
	if err := os.WriteFile(path, []byte(`[{"id":"w0","url":`), 0o600); err != nil {
		t.Fatal(err)
	}
	holdsFleet(t, c.replicas, kept, 8*time.Second)
	failed, err := metricValue(t.Context(), c.leader(), `kvrouter_discovery_errors_total{source="file"}`)
	if err != nil || failed == 0 {
		t.Fatalf("the leader's kvrouter_discovery_errors_total{source=\"file\"}: %v, %v; want failed looks counted", failed, err)
	}
	t.Logf("an invalid file kept %d workers on every replica for 8 s; the leader counted %v failed looks", len(kept), failed)
}

// ctlWorkersList runs the binary's `ctl workers list` against r's admin API.
func ctlWorkersList(t *testing.T, r *replica) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, "ctl", "--addr", r.Admin, "workers", "list")
	cmd.Env = cleanEnv()
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func TestCtlWorkersListOnEveryReplicaSaysAFailingFileSourceKeepsItsWorkersUntilFixed(t *testing.T) {
	fl := startFleet(t, 2)
	path := filepath.Join(t.TempDir(), "fleet.json")
	writeSpecs(t, path, fl, "w0", "w1")
	source := "file:" + path
	c := startClusterOf(t, binary, 3, nil, discoveryFlags(source)...)
	waitFleet(t, c.replicas, []string{"w0", "w1"}, 30*time.Second)
	// says polls ctl workers list on every replica until each says want of the source, with
	// w0 and w1 listed and routable, and returns what each said.
	says := func(want *regexp.Regexp) map[string]string {
		t.Helper()
		got := map[string]string{}
		eventually(t, 30*time.Second, func() error {
			for _, r := range c.replicas {
				out, err := ctlWorkersList(t, r)
				if err != nil {
					return fmt.Errorf("%s: %v\n%s", r.ID, err, out)
				}
				for _, id := range []string{"w0", "w1"} {
					if !regexp.MustCompile(`(?m)^` + id + `\s+\S+\s+discovery:\S+\s+active\s`).MatchString(out) {
						return fmt.Errorf("%s does not list %s as an active discovered worker:\n%s", r.ID, id, out)
					}
				}
				if !want.MatchString(out) {
					return fmt.Errorf("%s does not say %s:\n%s", r.ID, want, out)
				}
				got[r.ID] = out
			}
			return nil
		})
		return got
	}
	// line matches the source's line saying state: the leader's own looks, or a follower's
	// copy of them, fetched from the leader over the peer port (which counts them here).
	line := func(state string) *regexp.Regexp {
		return regexp.MustCompile(`(?m)^discovery ` + regexp.QuoteMeta(source) + `: ` + state + `( \(the leader \S+'s looks\))?$`)
	}
	followers := regexp.MustCompile(`\(the leader \S+'s looks\)$`)
	// check holds every replica's output to state, and at least two (the followers) to the
	// leader's looks.
	check := func(outs map[string]string, state string) {
		t.Helper()
		copies := 0
		for id, out := range outs {
			m := line(state).FindStringSubmatch(out)
			if m == nil {
				t.Errorf("%s does not say %s:\n%s", id, state, out)
				continue
			}
			if followers.MatchString(m[0]) {
				copies++
			}
		}
		if copies < 2 {
			t.Errorf("%d replicas showed the leader's looks, want the two followers:\n%v", copies, outs)
		}
	}
	check(says(regexp.MustCompile(`ok, last good look`)), `ok, last good look \d\d:\d\d:\d\d; 2 workers`)

	// A half-written file: every replica says the source fails, with the leader's error and
	// the workers kept, while the drain and suspect periods pass; the workers stay routable.
	if err := os.WriteFile(path, []byte(`[{"id":"w0","url":`), 0o600); err != nil {
		t.Fatal(err)
	}
	failing := `FAILING since \d\d:\d\d:\d\d \(\d+ looks\): discovery file .*: invalid worker spec: unexpected EOF; last good look \d\d:\d\d:\d\d; 2 workers kept`
	says(regexp.MustCompile(`FAILING since`))
	holdsFleet(t, c.replicas, []string{"w0", "w1"}, 6*time.Second)
	outs := says(regexp.MustCompile(`FAILING since .* \((2[0-9]|[3-9][0-9]|\d{3,}) looks\)`))
	check(outs, failing)
	for id, out := range outs {
		t.Logf("%s: ctl workers list on a failing source:\n%s", id, out)
	}

	// Fixed: every replica says so.
	writeSpecs(t, path, fl, "w0", "w1")
	outs = says(regexp.MustCompile(`ok, last good look`))
	check(outs, `ok, last good look \d\d:\d\d:\d\d; 2 workers`)
}

// discoveryLines counts, over the logs of rs (a killed leader's included), the registry
// changes discovery proposed, by action and worker.
func discoveryLines(rs []*replica) map[string]int {
	n := map[string]int{}
	for _, r := range rs {
		for _, line := range strings.Split(r.log(), "\n") {
			if !strings.Contains(line, "discovery changed the worker registry") {
				continue
			}
			n[field(line, "action")+" "+field(line, "worker")]++
		}
	}
	return n
}

// field is the value of key=value in a text log line.
func field(line, key string) string {
	_, rest, ok := strings.Cut(line, " "+key+"=")
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, " ")
	return v
}

func TestLeaderKilledInTheMiddleOfAScaleDownMovesEachSessionOnceAndAddsNoWorkerTwice(t *testing.T) {
	fl := startFleet(t, 6)
	all := []string{"w0", "w1", "w2", "w3", "w4", "w5"}
	path := filepath.Join(t.TempDir(), "fleet.json")
	writeSpecs(t, path, fl, all...)
	// A drain period long enough that the kill lands between the drains and the removals.
	c := startClusterOf(t, binary, 3, nil, "--discovery", "file:"+path, "--discovery-interval", "200ms",
		"--discovery-drain-for", "4s", "--discovery-suspect-for", "4s")
	waitFleet(t, c.replicas, all, 30*time.Second)
	bound := bindSessions(t, c, sessionNames("kill", 60))

	leader := c.leader()
	follower := c.others(leader)[0]
	gone, kept := all[3:], all[:3]
	writeSpecs(t, path, fl, kept...)
	// The scale-down has started (a follower sees a gone worker drained): kill the leader.
	eventually(t, 20*time.Second, func() error {
		route, _, err := routable(t.Context(), follower)
		if err != nil {
			return err
		}
		for _, g := range gone {
			if !slices.Contains(route, g) {
				return nil
			}
		}
		return fmt.Errorf("%s still routes to %v", follower.ID, route)
	})
	route, listed, _ := routable(t.Context(), follower)
	c.kill(leader)
	t.Logf("killed leader %s with the scale-down under way: a follower routed to %v of %v", leader.ID, route, listed)
	survivors := c.others(leader)
	c.leaderAmong(survivors)
	took := waitFleet(t, survivors, kept, 30*time.Second)
	t.Logf("the new leader finished the scale-down %s after the kill", took.Round(time.Millisecond))

	// Sessions through the survivors only.
	c.replicas = survivors
	moved := checkMovedOnce(t, c, bound, gone...)
	if moved == 0 {
		t.Fatal("no session was bound to a gone worker: the test proves nothing")
	}
	lines := discoveryLines(append(survivors, leader))
	for _, id := range all {
		if n := lines["add "+id]; n != 1 {
			t.Errorf("worker %s added %d times, want once", id, n)
		}
	}
	for _, id := range gone {
		if n := lines["drain "+id]; n > 1 {
			t.Errorf("worker %s drained %d times, want once", id, n)
		}
	}
	t.Logf("%d sessions moved once; discovery's proposals across both terms: %v", moved, lines)
}

// startFleetOnPort serves one simulated worker on each host at one port (a DNS name's
// A records share the port), trying a few ports.
func startFleetOnPort(t *testing.T, hosts ...string) (port int, urls []string) {
	t.Helper()
	for try := 0; try < 20; try++ {
		l0, err := net.Listen("tcp", net.JoinHostPort(hosts[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		port = l0.Addr().(*net.TCPAddr).Port
		ls := []net.Listener{l0}
		for _, h := range hosts[1:] {
			l, err := net.Listen("tcp", net.JoinHostPort(h, strconv.Itoa(port)))
			if err != nil {
				break
			}
			ls = append(ls, l)
		}
		if len(ls) < len(hosts) {
			for _, l := range ls {
				l.Close()
			}
			continue
		}
		for i, l := range ls {
			w, err := sim.New(sim.Config{ID: fmt.Sprintf("d%d", i)})
			if err != nil {
				t.Fatal(err)
			}
			srv := &http.Server{Handler: w.Handler()}
			go srv.Serve(l)
			t.Cleanup(func() { srv.Close() })
			urls = append(urls, "http://"+l.Addr().String())
		}
		return port, urls
	}
	t.Fatal("no port free on every host")
	return 0, nil
}

func TestDNSDiscoveryFollowsRecordsOnEveryReplicaAndKeepsTheSetWhenTheServerStopsAnswering(t *testing.T) {
	hosts := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}
	port, _ := startFleetOnPort(t, hosts...)
	dns, err := dnstest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dns.Close() })
	addrs := func(hs ...string) (out []netip.Addr) {
		for _, h := range hs {
			out = append(out, netip.MustParseAddr(h))
		}
		return out
	}
	ids := func(hs ...string) (out []string) {
		for _, h := range hs {
			out = append(out, net.JoinHostPort(h, strconv.Itoa(port)))
		}
		return out
	}
	dns.SetAddrs("vllm.fleet.test", addrs(hosts[:3]...)...)
	c := startClusterOf(t, binary, 3, nil, discoveryFlags(fmt.Sprintf("dns:vllm.fleet.test.:%d", port), "--discovery-dns-server", dns.Addr())...)
	took := waitFleet(t, c.replicas, ids(hosts[:3]...), 30*time.Second)
	t.Logf("3 A records on every replica %s after the cluster was ready", took.Round(time.Millisecond))
	bound := bindSessions(t, c, sessionNames("dns", 30))

	dns.SetAddrs("vllm.fleet.test", addrs(hosts...)...)
	took = waitFleet(t, c.replicas, ids(hosts...), 20*time.Second)
	t.Logf("an added record on every replica within %s", took.Round(time.Millisecond))

	gone := mostBound(bound)
	var keptHosts []string
	for _, h := range hosts {
		if ids(h)[0] != gone {
			keptHosts = append(keptHosts, h)
		}
	}
	dns.SetAddrs("vllm.fleet.test", addrs(keptHosts...)...)
	took = waitFleet(t, c.replicas, ids(keptHosts...), 20*time.Second)
	t.Logf("a removed record drained and gone from every replica within %s", took.Round(time.Millisecond))
	moved := checkMovedOnce(t, c, bound, gone)
	if moved == 0 {
		t.Fatalf("no session was bound to %s: the test proves nothing", gone)
	}

	// The server stops answering: the set stays, for longer than a look's timeout (5 s) and the
	// suspect and drain periods together.
	dns.SetMode(dnstest.Silent)
	asked := dns.Questions()
	holdsFleet(t, c.replicas, ids(keptHosts...), 15*time.Second)
	if dns.Questions() == asked {
		t.Fatal("the leader asked the silent server nothing: the test proves nothing")
	}
	failed, err := metricValue(t.Context(), c.leader(), `kvrouter_discovery_errors_total{source="dns"}`)
	if err != nil || failed == 0 {
		t.Fatalf("the leader's kvrouter_discovery_errors_total{source=\"dns\"}: %v, %v; want failed looks counted", failed, err)
	}
	t.Logf("%d sessions moved once; the silent server kept %d workers on every replica", moved, len(keptHosts))
	// It answers again: the set follows it.
	dns.SetMode(dnstest.Answer)
	dns.SetAddrs("vllm.fleet.test", addrs(hosts...)...)
	waitFleet(t, c.replicas, ids(hosts...), 20*time.Second)
}
