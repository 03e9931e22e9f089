package system_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// The tests here run the real HAProxy with deploy/haproxy-lua/haproxy.cfg and its Lua action
// (kvrouter.lua) in front of simulated workers: the decision comes from a replica's POST
// /v1/reserve, the bytes go from HAProxy straight to the worker, and the reservation is
// released on the replica that made it once the response is over.

// haproxyLuaConfig is the deployment's HAProxy-with-Lua configuration, relative to this
// package; it loads kvrouter.lua from its own directory.
var haproxyLuaConfig = filepath.Join("..", "deploy", "haproxy-lua", "haproxy.cfg")

// luaWorkers is how many workers deploy/haproxy-lua/haproxy.cfg names (KVR_WORKER0..3).
const luaWorkers = 4

// haproxyBinary is haproxy on PATH, else Debian's /usr/sbin/haproxy (not on a user's PATH).
func haproxyBinary() string {
	if bin, err := exec.LookPath("haproxy"); err == nil {
		return bin
	}
	return "/usr/sbin/haproxy"
}

// haproxyWithLua returns an HAProxy binary built with Lua, or skips the test.
func haproxyWithLua(t testing.TB) string {
	t.Helper()
	bin := haproxyBinary()
	out, err := exec.Command(bin, "-vv").CombinedOutput()
	if err != nil {
		t.Skipf("no HAProxy (%s -vv: %v): these tests run the real HAProxy with its Lua action (apt-get install haproxy)", bin, err)
	}
	if !strings.Contains(string(out), "Built with Lua") {
		t.Skipf("%s is built without Lua: deploy/haproxy-lua needs an HAProxy built with USE_LUA", bin)
	}
	return bin
}

// luaProxy is an HAProxy running deploy/haproxy-lua/haproxy.cfg.
type luaProxy struct {
	base string // http://listen
	log  string // its output
}

// startLuaHAProxy validates deploy/haproxy-lua/haproxy.cfg with these addresses (replicas in
// the order the Lua action tries them, workers as host:port) and runs it in the foreground
// until the test ends. fail is KVR_FAIL: "open" or "closed".
func startLuaHAProxy(t testing.TB, bin string, replicas, workers []string, fail string) *luaProxy {
	t.Helper()
	if len(replicas) != proc.DeployReplicas || len(workers) != luaWorkers {
		t.Fatalf("deploy/haproxy-lua/haproxy.cfg names %d replicas and %d workers, not %d and %d",
			proc.DeployReplicas, luaWorkers, len(replicas), len(workers))
	}
	listen := loopbacktest.Addr(t)
	env := []string{"KVR_LISTEN=" + listen, "KVR_FAIL=" + fail}
	for i, r := range replicas {
		env = append(env, fmt.Sprintf("KVR_REPLICA%d=%s", i, r))
	}
	for i, w := range workers {
		env = append(env, fmt.Sprintf("KVR_WORKER%d=%s", i, w))
	}
	h := proc.HAProxy{Binary: bin, Config: haproxyLuaConfig, Env: env}
	if err := h.Check(t.Context()); err != nil {
		t.Fatal(err)
	}
	spec := h.Spec()
	spec.Name = "haproxy-lua"
	spec.LogPath = filepath.Join(t.TempDir(), "haproxy-lua.log")
	if err := newProcess(t, spec).Start(); err != nil {
		t.Fatal(err)
	}
	p := &luaProxy{base: "http://" + listen, log: spec.LogPath}
	// Requests without a decision go round-robin to the workers: /health answers once
	// HAProxy listens.
	if err := proc.WaitReady(t.Context(), httpClient, p.base+"/health", 30*time.Second); err != nil {
		t.Fatalf("haproxy with Lua: %v\n%s", err, logTail(spec.LogPath, 4000))
	}
	return p
}

// luaWorkerAddrs strips the scheme of the fleet's URLs.
func luaWorkerAddrs(fl *fleet) []string {
	var out []string
	for _, u := range fl.urls {
		out = append(out, strings.TrimPrefix(u, "http://"))
	}
	return out
}

// luaAnswer is what one request through HAProxy got.
type luaAnswer struct {
	status     int
	servedBy   string // X-Worker-ID: the simulated worker that really answered
	decided    string // X-Kvrouter-Worker: the decision's worker
	replica    string // X-Kvrouter-Replica: the replica that decided
	revision   string // X-Kvrouter-Binding-Revision
	fallback   string // X-Kvrouter-Fallback: no decision, round-robin
	retryAfter string
	cached     int // usage.prompt_tokens_details.cached_tokens
	body       string
}

// luaPost sends one non-streaming request (body, JSON) to base+path, with a session key
// unless empty.
func luaPost(ctx context.Context, base, path, session, body string) (luaAnswer, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, strings.NewReader(body))
	if err != nil {
		return luaAnswer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if session != "" {
		req.Header.Set("X-Session-ID", session)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return luaAnswer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return luaAnswer{}, fmt.Errorf("read answer: %w", err)
	}
	a := luaAnswer{status: resp.StatusCode, servedBy: resp.Header.Get("X-Worker-ID"),
		decided: resp.Header.Get("X-Kvrouter-Worker"), replica: resp.Header.Get("X-Kvrouter-Replica"),
		revision: resp.Header.Get("X-Kvrouter-Binding-Revision"), fallback: resp.Header.Get("X-Kvrouter-Fallback"),
		retryAfter: resp.Header.Get("Retry-After"), body: string(b)}
	var u struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(b, &u) == nil {
		a.cached = u.Usage.Details.Cached
	}
	return a, nil
}

func luaCompletionBody(prompt string, maxTokens int) string {
	return fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":%d}`, sim.DefaultModel, prompt, maxTokens)
}

func luaChatBody(prompt string, maxTokens int) string {
	return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":%d}`, sim.DefaultModel, prompt, maxTokens)
}

// luaScrape reads a replica's /metrics (admin port) as "name{labels}" -> value.
func luaScrape(ctx context.Context, admin string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+admin+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/metrics: %s", admin, resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[line[:i]] = v
		}
	}
	return out, sc.Err()
}

// luaSum adds the series of metric name whose labels contain every one of labels
// (`key="value"`).
func luaSum(m map[string]float64, name string, labels ...string) float64 {
	var sum float64
	for k, v := range m {
		if !strings.HasPrefix(k, name+"{") && k != name {
			continue
		}
		all := true
		for _, l := range labels {
			all = all && strings.Contains(k, l)
		}
		if all {
			sum += v
		}
	}
	return sum
}

// luaCounts is what the replicas' metrics say of the traffic: requests their proxy
// served on the chat and completion paths, and reservations by event.
type luaCounts struct {
	proxied, reserved, released, expired float64
}

func luaCountReplicas(ctx context.Context, rs []*replica) (luaCounts, error) {
	var c luaCounts
	for _, r := range rs {
		m, err := luaScrape(ctx, r.Admin)
		if err != nil {
			return c, err
		}
		c.proxied += luaSum(m, "kvrouter_requests_total", `endpoint="chat"`) + luaSum(m, "kvrouter_requests_total", `endpoint="completions"`)
		c.reserved += luaSum(m, "kvrouter_reservations_total", `event="reserved"`)
		c.released += luaSum(m, "kvrouter_reservations_total", `event="released"`)
		c.expired += luaSum(m, "kvrouter_reservations_total", `event="expired"`)
	}
	return c, nil
}

// luaServedByFleet totals the requests the simulated workers ran to their end.
func luaServedByFleet(ctx context.Context, fl *fleet) (uint64, error) {
	var n uint64
	for _, u := range fl.urls {
		var st struct {
			Stats sim.Stats `json:"stats"`
		}
		if err := proc.Get(ctx, httpClient, u+"/sim/stats", &st); err != nil {
			return 0, err
		}
		n += st.Stats.Served
	}
	return n, nil
}

// luaPrefix is a prompt prefix of about 400 tokens, distinct for each seed.
func luaPrefix(seed int) string {
	var b strings.Builder
	for i := range 400 {
		fmt.Fprintf(&b, "doc%d-word%d ", seed, i)
	}
	return b.String()
}

// TestHAProxyLuaPlacesByPrefixAndSessionWithNoByteThroughReplicas runs three replicas, four
// simulated workers and HAProxy with the Lua action in front of them. Requests that share a
// long prefix (no session) land on the worker that holds it, and it reports the prefix
// cached; a session's turns all land on its worker; every request is served by the worker
// the decision named (the worker's own X-Worker-ID against the decision's
// X-Kvrouter-Worker). The replicas' proxy serves none of them (kvrouter_requests_total for
// chat and completions stays 0) while each request took one reservation, and every
// reservation is released. A client error of the router comes back as the router wrote it.
func TestHAProxyLuaPlacesByPrefixAndSessionWithNoByteThroughReplicas(t *testing.T) {
	bin := haproxyWithLua(t)
	fl := startFleet(t, luaWorkers)
	c := startCluster(t, 3, fl)
	var order []string
	for _, r := range c.replicas {
		order = append(order, r.Client)
	}
	// Closed: a request the decision service fails gets a 503 here instead of a guess.
	hp := startLuaHAProxy(t, bin, order, luaWorkerAddrs(fl), "closed")
	ctx := t.Context()
	sent := 0
	// check(what)(luaPost(...)) fails the test unless the request was served by the worker
	// its decision named.
	check := func(what string) func(luaAnswer, error) luaAnswer {
		return func(a luaAnswer, err error) luaAnswer {
			t.Helper()
			if err != nil || a.status != http.StatusOK {
				t.Fatalf("%s: %+v %v\nhaproxy log:\n%s", what, a, err, logTail(hp.log, 3000))
			}
			if a.servedBy == "" || a.servedBy != a.decided {
				t.Fatalf("%s: served by %q, the decision named %q", what, a.servedBy, a.decided)
			}
			sent++
			return a
		}
	}

	// settled waits until every reservation made so far is released. The release leaves
	// HAProxy as the response ends, so a client's next request can reach a replica just
	// before it and find the worker still loaded with the request before; placement is
	// checked on a settled load.
	settled := func() {
		t.Helper()
		poll.Until(t, 10*time.Second, func() error {
			n, err := luaCountReplicas(ctx, c.replicas)
			if err == nil && n.released != n.reserved {
				err = fmt.Errorf("%v of %v reservations released", n.released, n.reserved)
			}
			return err
		})
	}

	// KV-aware placement: each prefix's later requests go where its first one went, and
	// find it cached there.
	placed := map[string]int{}
	for p := range 4 {
		prefix := luaPrefix(p)
		settled()
		first := check(fmt.Sprintf("prefix %d, first request", p))(luaPost(ctx, hp.base, "/v1/completions", "", luaCompletionBody(prefix+"first question", 4)))
		placed[first.servedBy]++
		for i := range 3 {
			settled()
			a := check(fmt.Sprintf("prefix %d, request %d", p, i+2))(luaPost(ctx, hp.base, "/v1/completions", "",
				luaCompletionBody(prefix+fmt.Sprintf("follow-up %d", i), 4)))
			if a.servedBy != first.servedBy {
				t.Fatalf("prefix %d, request %d went to %s; its first request went to %s", p, i+2, a.servedBy, first.servedBy)
			}
			if a.cached < 300 {
				t.Fatalf("prefix %d, request %d: %s reports %d cached tokens, want the ~400-token prefix", p, i+2, a.servedBy, a.cached)
			}
		}
	}
	t.Logf("prefixes by worker: %v", placed)

	// Session affinity: every turn of a session on one worker, one revision.
	for _, s := range sessionNames("lua", 6) {
		var first luaAnswer
		for turn := range 4 {
			a := check(fmt.Sprintf("%s turn %d", s, turn))(luaPost(ctx, hp.base, "/v1/chat/completions", s, luaChatBody(fmt.Sprintf("turn %d of %s", turn, s), 4)))
			if a.revision == "" {
				t.Fatalf("%s turn %d: no binding revision in %+v", s, turn, a)
			}
			if turn == 0 {
				first = a
			} else if a.servedBy != first.servedBy || a.revision != first.revision {
				t.Fatalf("%s turn %d: %s rev %s; the first turn bound %s rev %s", s, turn, a.servedBy, a.revision, first.servedBy, first.revision)
			}
		}
		// A streamed turn: HAProxy carries the stream too.
		if err := streamVia(ctx, httpClient, hp.base, s, 8); err != nil {
			t.Fatalf("%s streamed: %v", s, err)
		}
		sent++
	}

	// The router's own client error comes back as it is, and takes no reservation.
	bad := `{"model":"sim-model","messages":`
	got, err := luaPost(ctx, hp.base, "/v1/chat/completions", "", bad)
	want, err2 := luaPost(ctx, "http://"+c.replicas[0].Client, "/v1/reserve", "", bad)
	if err != nil || err2 != nil || got.status != http.StatusBadRequest || got.status != want.status || got.body != want.body {
		t.Fatalf("malformed body through haproxy: %d %q (%v); the decision service answers %d %q (%v)", got.status, got.body, err, want.status, want.body, err2)
	}

	// No byte through the replicas, every request one reservation, each released.
	served, err := luaServedByFleet(ctx, fl)
	if err != nil || served != uint64(sent) {
		t.Fatalf("the workers served %d requests (%v), %d were sent", served, err, sent)
	}
	var last luaCounts
	poll.Until(t, 30*time.Second, func() error {
		n, err := luaCountReplicas(ctx, c.replicas)
		if err != nil {
			return err
		}
		if n.proxied != 0 {
			t.Fatalf("the replicas proxied %v chat or completion requests; HAProxy should have carried them all", n.proxied)
		}
		if n.reserved != float64(sent) {
			t.Fatalf("%v reservations for %d requests", n.reserved, sent)
		}
		last = n
		if n.released != n.reserved {
			return fmt.Errorf("%v of %v reservations released", n.released, n.reserved)
		}
		return nil
	})
	if last.expired != 0 {
		t.Fatalf("%v reservations expired", last.expired)
	}
	t.Logf("%d requests through HAProxy: %v reservations, all released; 0 through the replicas' proxy", sent, last.reserved)
}

// TestHAProxyLuaLeaderKillMovesNoSession binds sessions through HAProxy with the Raft leader
// first in the Lua action's order of replicas (so it made every decision), kills the leader
// with SIGKILL, and sends each session again through HAProxy: the action moves on to a
// surviving replica and every session lands on the worker it was bound to, at the same
// revision.
func TestHAProxyLuaLeaderKillMovesNoSession(t *testing.T) {
	bin := haproxyWithLua(t)
	fl := startFleet(t, luaWorkers)
	c := startCluster(t, 3, fl)
	leader := c.leader()
	order := []string{leader.Client}
	for _, r := range c.others(leader) {
		order = append(order, r.Client)
	}
	hp := startLuaHAProxy(t, bin, order, luaWorkerAddrs(fl), "closed")
	ctx := t.Context()
	sessions := sessionNames("kept", 12)
	bound := map[string]luaAnswer{}
	workers := map[string]bool{}
	for _, s := range sessions {
		a, err := luaPost(ctx, hp.base, "/v1/chat/completions", s, luaChatBody("first turn of "+s, 4))
		if err != nil || a.status != http.StatusOK || a.servedBy == "" || a.servedBy != a.decided || a.revision == "" {
			t.Fatalf("binding %s through haproxy: %+v %v", s, a, err)
		}
		if a.replica != leader.ID {
			t.Fatalf("%s was decided by %s; the leader %s is first in the order", s, a.replica, leader.ID)
		}
		bound[s] = a
		workers[a.servedBy] = true
	}
	t.Logf("%d sessions bound over workers %v, decided by the leader %s", len(sessions), slices.Sorted(maps.Keys(workers)), leader.ID)

	c.kill(leader)
	survivors := map[string]bool{}
	for _, s := range sessions {
		a, err := luaPost(ctx, hp.base, "/v1/chat/completions", s, luaChatBody("after the leader died, "+s, 4))
		if err != nil || a.status != http.StatusOK {
			t.Fatalf("%s after killing the leader %s: %+v %v\nhaproxy log:\n%s", s, leader.ID, a, err, logTail(hp.log, 3000))
		}
		if a.servedBy != bound[s].servedBy || a.servedBy != a.decided || a.revision != bound[s].revision {
			t.Fatalf("%s after killing the leader: served by %s (decided %s) rev %s; bound to %s rev %s",
				s, a.servedBy, a.decided, a.revision, bound[s].servedBy, bound[s].revision)
		}
		if a.replica == leader.ID {
			t.Fatalf("%s decided by the killed replica %s", s, a.replica)
		}
		survivors[a.replica] = true
	}
	t.Logf("after the SIGKILL of %s every session stayed on its worker; decided by %v", leader.ID, slices.Sorted(maps.Keys(survivors)))

	// The survivors release what they reserved.
	poll.Until(t, 30*time.Second, func() error {
		n, err := luaCountReplicas(ctx, c.others(leader))
		if err != nil {
			return err
		}
		if n.reserved != float64(len(sessions)) || n.released != n.reserved || n.proxied != 0 {
			return fmt.Errorf("survivors: %+v, want %d reserved and released, 0 proxied", n, len(sessions))
		}
		return nil
	})
}

// fakeDecisionService is a decision service played by the test: each POST /v1/reserve gets what
// answer says; every call is recorded.
type fakeDecisionService struct {
	name string
	addr string
	mu   sync.Mutex
	// answer writes the reply to a POST /v1/reserve.
	answer   func(w http.ResponseWriter, r *http.Request, body []byte)
	reserves []fakeReserveCall
	releases []string // "id?query" of each DELETE /v1/reservations/{id}
}

type fakeReserveCall struct {
	body   string
	header http.Header
}

func startFakeDecisionService(t *testing.T, name string) *fakeDecisionService {
	t.Helper()
	f := &fakeDecisionService{name: name}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("POST /v1/reserve", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.reserves = append(f.reserves, fakeReserveCall{body: string(b), header: r.Header.Clone()})
		answer := f.answer
		f.mu.Unlock()
		answer(w, r, b)
	})
	mux.HandleFunc("DELETE /v1/reservations/{id}", func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.releases = append(f.releases, r.PathValue("id")+"?"+r.URL.RawQuery)
		f.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	})
	s := httptest.NewServer(mux) // on 127.0.0.1
	t.Cleanup(s.Close)
	f.addr = strings.TrimPrefix(s.URL, "http://")
	f.set(func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		http.Error(w, "unset", http.StatusInternalServerError)
	})
	return f
}

func (f *fakeDecisionService) set(answer func(w http.ResponseWriter, r *http.Request, body []byte)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.answer = answer
}

func (f *fakeDecisionService) calls() (reserves []fakeReserveCall, releases []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.reserves), slices.Clone(f.releases)
}

// answerWith answers with a status, a content type, a body and header pairs.
func answerWith(code int, contentType, body string, header ...string) func(http.ResponseWriter, *http.Request, []byte) {
	return func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		w.Header().Set("Content-Type", contentType)
		w.WriteHeader(code)
		io.WriteString(w, body)
	}
}

// TestHAProxyLuaTriesReplicasInOrderAndReleasesWhereReserved plays the decision service with
// fakes behind a dead first replica, to drive the Lua action through what a real cluster
// rarely shows: a refused connection, a 5xx and an answer that is not JSON move it on to the
// next replica; the decision's top-level fields are read right through nested objects and
// escaped strings; the release goes to the replica that reserved, completed with the
// answer's output tokens when the worker answered 2xx and not completed otherwise; the
// router's 400 and 429 come back to the client as they are; a worker URL HAProxy cannot send
// to gets a 502 and its reservation released. Then, every replica failing, the request fails
// open (round-robin over the workers) or closed (an OpenAI-shaped 503) as KVR_FAIL says.
func TestHAProxyLuaTriesReplicasInOrderAndReleasesWhereReserved(t *testing.T) {
	bin := haproxyWithLua(t)
	fl := startFleet(t, luaWorkers)
	a, b := startFakeDecisionService(t, "a"), startFakeDecisionService(t, "b")
	dead := loopbacktest.Addr(t) // nothing listens there
	order := []string{dead, a.addr, b.addr}
	closed := startLuaHAProxy(t, bin, order, luaWorkerAddrs(fl), "closed")
	ctx := t.Context()

	decision := func(worker int, id string) func(http.ResponseWriter, *http.Request, []byte) {
		return answerWith(http.StatusOK, "application/json", fmt.Sprintf(
			`{"worker":%q,"dp_rank":0,"url":%q,"overlap_blocks":2,"prompt_blocks":3,"binding_revision":0,"bound":false,`+
				`"disaggregation":"never","reservation":%q,"replica":"fake","expires_in_s":600}`, fl.ids[worker], fl.urls[worker], id))
	}
	// waitRelease waits for f's releases to be exactly want.
	waitRelease := func(f *fakeDecisionService, want ...string) {
		t.Helper()
		poll.Until(t, 10*time.Second, func() error {
			_, rel := f.calls()
			if !slices.Equal(rel, want) {
				return fmt.Errorf("releases on %s: %q, want %q", f.name, rel, want)
			}
			return nil
		})
	}

	// 1. Refused, 500, then a decision: served where b said, released on b, completed with
	// the answer's 4 tokens. b got the body and the headers (the session key among them) as
	// the client sent them.
	a.set(answerWith(http.StatusInternalServerError, "text/plain", "boom"))
	b.set(decision(2, "R1"))
	body := luaChatBody("hello", 4)
	got, err := luaPost(ctx, closed.base, "/v1/chat/completions", "sess-1", body)
	if err != nil || got.status != http.StatusOK || got.servedBy != fl.ids[2] || got.replica != "fake" || got.revision != "" {
		t.Fatalf("after a refused replica and a 500: %+v %v, want 200 from %s", got, err, fl.ids[2])
	}
	waitRelease(b, "R1?completed=true&output_tokens=4")
	if res, _ := b.calls(); len(res) != 1 || res[0].body != body || !slices.Equal(res[0].header.Values("X-Session-ID"), []string{"sess-1"}) ||
		res[0].header.Get("User-Agent") == "" {
		t.Fatalf("b was asked %+v, want the client's body and headers", res)
	}
	if res, rel := a.calls(); len(res) != 1 || len(rel) != 0 {
		t.Fatalf("a: %d reserves and releases %q, want 1 reserve and no release", len(res), rel)
	}

	// 2. An answer that is not JSON counts as a failed replica.
	a.set(answerWith(http.StatusOK, "text/html", "<html>a proxy's page, not a decision</html>"))
	b.set(decision(1, "R2"))
	got, err = luaPost(ctx, closed.base, "/v1/completions", "", luaCompletionBody("hi", 4))
	if err != nil || got.status != http.StatusOK || got.servedBy != fl.ids[1] {
		t.Fatalf("after an answer that is not JSON: %+v %v, want 200 from %s", got, err, fl.ids[1])
	}
	waitRelease(b, "R1?completed=true&output_tokens=4", "R2?completed=true&output_tokens=4")

	// A chunked request body reaches the decision service whole too.
	b.set(decision(0, "R2b"))
	chunked := luaCompletionBody("sent in chunks", 4)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, closed.base+"/v1/completions", io.MultiReader(strings.NewReader(chunked)))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Worker-ID") != fl.ids[0] {
		t.Fatalf("a chunked request: %s from %q, want 200 from %s", resp.Status, resp.Header.Get("X-Worker-ID"), fl.ids[0])
	}
	if res, _ := b.calls(); res[len(res)-1].body != chunked {
		t.Fatalf("the decision service got %q of a chunked body, want %q", res[len(res)-1].body, chunked)
	}
	waitRelease(b, "R1?completed=true&output_tokens=4", "R2?completed=true&output_tokens=4", "R2b?completed=true&output_tokens=4")

	// 3. The top-level fields, not those of a nested object or inside a string.
	a.set(answerWith(http.StatusOK, "application/json", fmt.Sprintf(
		`{"prefill":{"worker":%q,"url":%q,"reservation":"NESTED"},"session":"x\",\"url\":\"http://10.9.9.9:1\",\"q\":\"\u00e9\\\\",`+
			` "worker" : %q , "url":"%s/", "reservation":"R3", "replica":"fake-a", "binding_revision":7, "tags":[{"a":"]"}], "expires_in_s":600}`,
		fl.ids[0], fl.urls[0], fl.ids[3], fl.urls[3])))
	got, err = luaPost(ctx, closed.base, "/v1/chat/completions", "sess-3", luaChatBody("nested", 4))
	if err != nil || got.status != http.StatusOK || got.servedBy != fl.ids[3] || got.replica != "fake-a" || got.revision != "7" {
		t.Fatalf("a decision with nested fields: %+v %v, want 200 from %s, replica fake-a, revision 7", got, err, fl.ids[3])
	}
	waitRelease(a, "R3?completed=true&output_tokens=4")

	// 4. The worker answers an error (an unknown model): released, not completed.
	a.set(decision(0, "R4"))
	got, err = luaPost(ctx, closed.base, "/v1/chat/completions", "", `{"model":"no-such-model","messages":[{"role":"user","content":"x"}]}`)
	if err != nil || got.status != http.StatusNotFound || got.servedBy != fl.ids[0] {
		t.Fatalf("a worker's 404: %+v %v", got, err)
	}
	waitRelease(a, "R3?completed=true&output_tokens=4", "R4?")

	// A worker that cannot be reached: an OpenAI-shaped 503 from HAProxy, released, not
	// completed.
	a.set(answerWith(http.StatusOK, "application/json", fmt.Sprintf(
		`{"worker":"gone","dp_rank":0,"url":"http://%s","reservation":"R4b","replica":"fake"}`, dead)))
	got, err = luaPost(ctx, closed.base, "/v1/chat/completions", "", luaChatBody("x", 4))
	if err != nil || got.status != http.StatusServiceUnavailable || !strings.Contains(got.body, `"code":"worker_unreachable"`) {
		t.Fatalf("an unreachable worker: %+v %v, want 503 worker_unreachable", got, err)
	}
	waitRelease(a, "R3?completed=true&output_tokens=4", "R4?", "R4b?")

	// 5. The router's client errors come back as they are; nobody else is asked.
	const badBody = `{"error":{"message":"messages must be an array","type":"invalid_request_error","param":"messages"}}` + "\n"
	a.set(answerWith(http.StatusBadRequest, "application/json", badBody))
	b.set(decision(1, "NEVER"))
	got, err = luaPost(ctx, closed.base, "/v1/chat/completions", "", `{"messages":1}`)
	if err != nil || got.status != http.StatusBadRequest || got.body != badBody || got.servedBy != "" {
		t.Fatalf("the router's 400: %+v %v, want it as it is", got, err)
	}
	a.set(answerWith(http.StatusTooManyRequests, "application/json", `{"error":{"message":"full","type":"service_unavailable_error"}}`, "Retry-After", "1"))
	got, err = luaPost(ctx, closed.base, "/v1/chat/completions", "", luaChatBody("x", 4))
	if err != nil || got.status != http.StatusTooManyRequests || got.retryAfter != "1" || !strings.Contains(got.body, `"full"`) {
		t.Fatalf("the router's 429: %+v %v, want it as it is, with Retry-After", got, err)
	}
	if res, _ := b.calls(); len(res) != 3 {
		t.Fatalf("b was asked %d times; after a's client errors it should not have been", len(res))
	}

	// 6. A worker URL by host name cannot be sent to with set-dst: 502, and released.
	a.set(answerWith(http.StatusOK, "application/json",
		`{"worker":"named","dp_rank":0,"url":"http://localhost:8000","reservation":"R6","replica":"fake"}`))
	got, err = luaPost(ctx, closed.base, "/v1/chat/completions", "", luaChatBody("x", 4))
	if err != nil || got.status != http.StatusBadGateway || !strings.Contains(got.body, `"code":"worker_url_unusable"`) {
		t.Fatalf("a worker URL by name: %+v %v, want 502 worker_url_unusable", got, err)
	}
	waitRelease(a, "R3?completed=true&output_tokens=4", "R4?", "R4b?", "R6?")

	// 7. Every replica failing: closed answers 503 in the OpenAI shape ...
	a.set(answerWith(http.StatusServiceUnavailable, "application/json", `{"error":{"message":"no worker"}}`))
	b.set(answerWith(http.StatusInternalServerError, "text/plain", "down"))
	got, err = luaPost(ctx, closed.base, "/v1/chat/completions", "", luaChatBody("x", 4))
	var e struct {
		Error struct{ Message, Type, Code string } `json:"error"`
	}
	if err != nil || got.status != http.StatusServiceUnavailable || json.Unmarshal([]byte(got.body), &e) != nil ||
		e.Error.Code != "decision_service_unavailable" || e.Error.Type != "service_unavailable_error" || got.servedBy != "" {
		t.Fatalf("fail closed: %+v %v, want an OpenAI-shaped 503 decision_service_unavailable", got, err)
	}
	// ... and open sends the requests round-robin to the workers.
	open := startLuaHAProxy(t, bin, order, luaWorkerAddrs(fl), "open")
	seen := map[string]int{}
	for i := range 2 * luaWorkers {
		got, err = luaPost(ctx, open.base, "/v1/chat/completions", "", luaChatBody(fmt.Sprintf("open %d", i), 4))
		if err != nil || got.status != http.StatusOK || got.fallback != "round-robin" || got.decided != "" {
			t.Fatalf("fail open: %+v %v, want 200 round-robin", got, err)
		}
		seen[got.servedBy]++
	}
	if len(seen) != luaWorkers {
		t.Fatalf("failing open served by %v; round-robin should reach all %d workers", seen, luaWorkers)
	}
	// Failing open, HAProxy refuses what the router would have: a client's kv_transfer_params.
	got, err = luaPost(ctx, open.base, "/v1/chat/completions", "", `{"model":"sim-model","messages":[{"role":"user","content":"x"}],`+
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.1"}}`)
	if err != nil || got.status != http.StatusBadRequest || got.servedBy != "" || !strings.Contains(got.body, `"param":"kv_transfer_params"`) {
		t.Fatalf("kv_transfer_params failing open: %+v %v, want a 400 from HAProxy", got, err)
	}
}
