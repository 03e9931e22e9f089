// The tests of deploy/ keep every file there true to the binary they deploy. Neither docker,
// kubectl, systemd nor nginx runs here: the files are read (YAML with the subset reader in
// yaml_test.go), their flags, ports, probes, volumes, secrets and drain timeouts compared with
// `kvrouter-ha serve --help` and with each other, and live_test.go starts replicas from their
// very command lines and checks the probe paths and the dashboard's metrics on them.
package deploy_test

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The binary is built once per test run, on first use.
var (
	buildOnce sync.Once
	buildDir  string
	built     *kvrBinary
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// kvrBinary is the built kvrouter-ha and the flags of its subcommands, read from --help.
type kvrBinary struct {
	path  string
	flags map[string]map[string]flagInfo // subcommand -> flag name -> info
}

// flagInfo is what --help says of one flag.
type flagInfo struct {
	isBool bool
	def    string // the default as --help prints it ("string" or "value" when empty)
}

// subcommands whose flags the deploy files may use.
var subcommands = []string{"serve", "sim-worker", "ctl"}

func binary(t *testing.T) *kvrBinary {
	t.Helper()
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "kvrouter-deploy-")
		if buildErr != nil {
			return
		}
		path := filepath.Join(buildDir, "kvrouter-ha")
		out, err := exec.Command("go", "build", "-o", path, "github.com/kvrouter-ha/kvrouter-ha/cmd/kvrouter-ha").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %w\n%s", err, out)
			return
		}
		b := &kvrBinary{path: path, flags: map[string]map[string]flagInfo{}}
		for _, sub := range subcommands {
			out, err := exec.Command(path, sub, "--help").CombinedOutput()
			if err != nil {
				buildErr = fmt.Errorf("%s --help: %w\n%s", sub, err, out)
				return
			}
			if b.flags[sub], buildErr = parseHelpFlags(string(out)); buildErr != nil {
				buildErr = fmt.Errorf("%s --help: %w", sub, buildErr)
				return
			}
		}
		built = b
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return built
}

var helpFlagLine = regexp.MustCompile(`^\s+-([a-z0-9][a-z0-9-]*)(?:=(\S+)|\s+(\S+))?`)

// parseHelpFlags reads the FLAGS section of ffcli's usage text.
func parseHelpFlags(help string) (map[string]flagInfo, error) {
	flags := map[string]flagInfo{}
	in := false
	for _, line := range strings.Split(help, "\n") {
		if strings.TrimSpace(line) == "FLAGS" {
			in = true
			continue
		}
		if !in || strings.TrimSpace(line) == "" {
			continue
		}
		m := helpFlagLine.FindStringSubmatch(line)
		if m == nil {
			if !strings.HasPrefix(line, " ") {
				in = false // the next section
			}
			continue
		}
		fi := flagInfo{def: m[3]}
		if m[2] != "" {
			fi = flagInfo{isBool: true, def: m[2]}
		}
		flags[m[1]] = fi
	}
	if len(flags) == 0 {
		return nil, fmt.Errorf("no flags in the help text:\n%s", help)
	}
	return flags, nil
}

// envName is the environment variable that sets flag name (main.go: ff.WithEnvVarPrefix).
func envName(flag string) string {
	return "KVROUTER_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// flagOfEnv is the flag of sub that variable sets, if any.
func (b *kvrBinary) flagOfEnv(sub, variable string) (string, bool) {
	for name := range b.flags[sub] {
		if envName(name) == variable {
			return name, true
		}
	}
	return "", false
}

// execSpec is one way a deploy file runs the binary: a subcommand, its arguments after the
// subcommand, and the environment it gets.
type execSpec struct {
	source string
	sub    string
	args   []string
	env    map[string]string
}

// flagSetting is one flag as an argument list sets it.
type flagSetting struct{ name, value string }

// parse splits the spec's arguments into flags, checking each against the subcommand's.
func (b *kvrBinary) parse(s execSpec) ([]flagSetting, error) {
	known, ok := b.flags[s.sub]
	if !ok {
		return nil, fmt.Errorf("%s: unknown subcommand %q", s.source, s.sub)
	}
	var out []flagSetting
	for i := 0; i < len(s.args); i++ {
		a := s.args[i]
		if !strings.HasPrefix(a, "-") || a == "-" || a == "--" {
			return nil, fmt.Errorf("%s: stray argument %q (kvrouter-ha %s takes only flags)", s.source, a, s.sub)
		}
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		fi, ok := known[name]
		if !ok {
			return nil, fmt.Errorf("%s: kvrouter-ha %s has no flag --%s", s.source, s.sub, name)
		}
		if !hasVal {
			if fi.isBool {
				val = "true"
			} else if i+1 < len(s.args) {
				i++
				val = s.args[i]
			} else {
				return nil, fmt.Errorf("%s: --%s needs a value", s.source, name)
			}
		}
		out = append(out, flagSetting{name, val})
	}
	for variable := range s.env {
		if strings.HasPrefix(variable, "KVROUTER_") {
			if _, ok := b.flagOfEnv(s.sub, variable); !ok {
				return nil, fmt.Errorf("%s: %s names no flag of kvrouter-ha %s", s.source, variable, s.sub)
			}
		}
	}
	return out, nil
}

// setFlags is the set of flags the spec sets, in its arguments or its environment.
func (b *kvrBinary) setFlags(t *testing.T, s execSpec) map[string]bool {
	t.Helper()
	settings, err := b.parse(s)
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	for _, f := range settings {
		set[f.name] = true
	}
	for variable := range s.env {
		if name, ok := b.flagOfEnv(s.sub, variable); ok {
			set[name] = true
		}
	}
	return set
}

// value is the flag's effective value for the spec: the last setting in the arguments, else
// its environment variable, else the binary's default.
func (b *kvrBinary) value(t *testing.T, s execSpec, name string) string {
	t.Helper()
	settings, err := b.parse(s)
	if err != nil {
		t.Fatal(err)
	}
	v, found := "", false
	for _, f := range settings {
		if f.name == name {
			v, found = f.value, true
		}
	}
	if found {
		return v
	}
	if v, ok := s.env[envName(name)]; ok {
		return v
	}
	fi, ok := b.flags[s.sub][name]
	if !ok {
		t.Fatalf("%s: kvrouter-ha %s has no flag --%s", s.source, s.sub, name)
	}
	return fi.def
}

func (b *kvrBinary) duration(t *testing.T, s execSpec, name string) time.Duration {
	t.Helper()
	v := b.value(t, s, name)
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("%s: --%s %q: %v", s.source, name, v, err)
	}
	return d
}

// drain is how long a SIGTERM may take: the delay with /readyz failing, then the bounded wait
// for in-flight requests.
func (b *kvrBinary) drain(t *testing.T, s execSpec) time.Duration {
	t.Helper()
	return b.duration(t, s, "shutdown-delay") + b.duration(t, s, "shutdown-timeout")
}

func (b *kvrBinary) port(t *testing.T, s execSpec, name string) int {
	t.Helper()
	return portOf(t, s.source+" --"+name, b.value(t, s, name))
}

func portOf(t *testing.T, what, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s: %q is not host:port: %v", what, addr, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil || n <= 0 || n > 65535 {
		t.Fatalf("%s: bad port in %q", what, addr)
	}
	return n
}

func hostOf(t *testing.T, what, addr string) string {
	t.Helper()
	h, _, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s: %q is not host:port: %v", what, addr, err)
	}
	return h
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func readYAML(t *testing.T, path string) []any {
	t.Helper()
	docs, err := parseYAML(readFile(t, path))
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return docs
}

// Accessors over parsed YAML: a missing key or a wrong type gives the zero value, which the
// checks then report as a mismatch.
func ymap(v any, path ...string) map[string]any {
	for _, k := range path {
		m, _ := v.(map[string]any)
		v = m[k]
	}
	m, _ := v.(map[string]any)
	return m
}

func ylist(v any, path ...string) []any {
	if len(path) > 0 {
		v = ymap(v, path[:len(path)-1]...)[path[len(path)-1]]
	}
	l, _ := v.([]any)
	return l
}

func ystr(v any, path ...string) string {
	if len(path) > 0 {
		v = ymap(v, path[:len(path)-1]...)[path[len(path)-1]]
	}
	s, _ := v.(string)
	return s
}

func yint(t *testing.T, what string, v any, path ...string) int {
	t.Helper()
	s := ystr(v, path...)
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("%s: %s is %q, want an integer", what, strings.Join(path, "."), s)
	}
	return n
}

func strList(v []any) []string {
	out := make([]string, 0, len(v))
	for _, x := range v {
		s, _ := x.(string)
		out = append(out, s)
	}
	return out
}

// ---- docker-compose.yml

// compose is docker-compose.yml read into what the checks need.
type compose struct {
	doc      map[string]any
	services map[string]map[string]any
	replicas []execSpec // serve services, by service name order
	workers  []execSpec // sim-worker services
}

func readCompose(t *testing.T) compose {
	t.Helper()
	docs := readYAML(t, "docker-compose.yml")
	if len(docs) != 1 {
		t.Fatalf("docker-compose.yml: %d documents, want 1", len(docs))
	}
	c := compose{doc: ymap(docs[0]), services: map[string]map[string]any{}}
	var names []string
	for name, v := range ymap(docs[0], "services") {
		c.services[name] = ymap(v)
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		svc := c.services[name]
		if !strings.HasPrefix(ystr(svc, "image"), "kvrouter-ha") {
			continue
		}
		cmd := strList(ylist(svc, "command"))
		if len(cmd) == 0 {
			t.Fatalf("docker-compose.yml: service %s: command must be a list starting with the subcommand", name)
		}
		env := map[string]string{}
		for k, v := range ymap(svc, "environment") {
			env[k], _ = v.(string)
		}
		s := execSpec{source: "docker-compose.yml service " + name, sub: cmd[0], args: cmd[1:], env: env}
		switch s.sub {
		case "serve":
			c.replicas = append(c.replicas, s)
		case "sim-worker":
			c.workers = append(c.workers, s)
		default:
			t.Fatalf("%s: unexpected subcommand %q", s.source, s.sub)
		}
	}
	return c
}

func serviceName(s execSpec) string { return s.source[strings.LastIndexByte(s.source, ' ')+1:] }

func TestComposeMatchesTheBinary(t *testing.T) {
	b := binary(t)
	c := readCompose(t)
	if len(c.replicas) != 3 {
		t.Fatalf("docker-compose.yml: %d replica services, want 3", len(c.replicas))
	}
	var wantJoin []string
	for _, r := range c.replicas {
		wantJoin = append(wantJoin, fmt.Sprintf("%s:%d", serviceName(r), b.port(t, r, "peer-listen")))
	}
	sort.Strings(wantJoin)
	topVolumes := ymap(c.doc, "volumes")
	topSecrets := ymap(c.doc, "secrets")
	seenVolumes := map[string]string{}
	for _, r := range append(append([]execSpec{}, c.replicas...), c.workers...) {
		svc := c.services[serviceName(r)]
		if _, err := b.parse(r); err != nil {
			t.Error(err)
			continue
		}
		// The image is built from this repository's Dockerfile by every service that uses
		// it, so `up` never tries to pull kvrouter-ha:local from a registry.
		ctx, df := ystr(svc, "build", "context"), ystr(svc, "build", "dockerfile")
		if _, err := os.Stat(filepath.Join(ctx, df)); ctx == "" || err != nil {
			t.Errorf("%s: build %q / %q is not deploy/Dockerfile (%v)", r.source, ctx, df, err)
		}
	}
	for _, r := range c.replicas {
		name := serviceName(r)
		svc := c.services[name]
		if got := b.value(t, r, "replica-id"); got != name {
			t.Errorf("%s: --replica-id %q, want the service name", r.source, got)
		}
		if got := b.value(t, r, "bootstrap-expect"); got != strconv.Itoa(len(c.replicas)) {
			t.Errorf("%s: --bootstrap-expect %s, want %d", r.source, got, len(c.replicas))
		}
		join := strings.Split(b.value(t, r, "join"), ",")
		sort.Strings(join)
		if strings.Join(join, ",") != strings.Join(wantJoin, ",") {
			t.Errorf("%s: --join %v, want every replica's peer address %v", r.source, join, wantJoin)
		}
		for _, kind := range []string{"raft", "peer", "gossip"} {
			want := fmt.Sprintf("%s:%d", name, b.port(t, r, kind+"-listen"))
			if got := b.value(t, r, kind+"-advertise"); got != want {
				t.Errorf("%s: --%s-advertise %q, want %q", r.source, kind, got, want)
			}
		}
		if ports := ylist(svc, "ports"); len(ports) != 0 {
			t.Errorf("%s: publishes %v; only the load balancer should be reachable from the host", r.source, ports)
		}
		// Its own named volume at --data-dir.
		dataDir := b.value(t, r, "data-dir")
		vol := ""
		for _, m := range strList(ylist(svc, "volumes")) {
			if src, dst, _ := strings.Cut(m, ":"); strings.TrimSuffix(dst, ":ro") == dataDir {
				vol = src
			}
		}
		if _, declared := topVolumes[vol]; vol == "" || !declared {
			t.Errorf("%s: no named volume declared at --data-dir %s", r.source, dataDir)
		} else if other, dup := seenVolumes[vol]; dup {
			t.Errorf("%s: shares volume %s with %s", r.source, vol, other)
		}
		seenVolumes[vol] = name
		// Secrets and the workers file come from files that exist or that the README makes.
		for _, f := range []string{"gossip-key-file", "admin-token-file", "peer-tls-ca-file", "peer-tls-cert-file", "peer-tls-key-file"} {
			p := b.value(t, r, f)
			secret, ok := strings.CutPrefix(p, "/run/secrets/")
			if !ok || !contains(strList(ylist(svc, "secrets")), secret) || ystr(topSecrets, secret, "file") == "" {
				t.Errorf("%s: --%s %s is not a secret the service mounts", r.source, f, p)
			}
		}
		wf := b.value(t, r, "workers-file")
		if src := composeMountSource(svc, wf); src == "" {
			t.Errorf("%s: --workers-file %s is not mounted", r.source, wf)
		} else if _, err := os.Stat(src); err != nil {
			t.Errorf("%s: --workers-file is mounted from %s: %v", r.source, src, err)
		}
		stop, err := time.ParseDuration(ystr(svc, "stop_grace_period"))
		if drain := b.drain(t, r); err != nil || stop <= drain {
			t.Errorf("%s: stop_grace_period %q must exceed --shutdown-delay + --shutdown-timeout (%v), or docker kills a draining replica",
				r.source, ystr(svc, "stop_grace_period"), drain)
		}
	}
	checkComposeWorkersFile(t, b, c)
	checkComposeHAProxy(t, b, c)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// composeMountSource is the host path a service mounts at path ("" if none).
func composeMountSource(svc map[string]any, path string) string {
	for _, m := range strList(ylist(svc, "volumes")) {
		parts := strings.Split(m, ":")
		if len(parts) >= 2 && parts[1] == path && strings.HasPrefix(parts[0], ".") {
			return parts[0]
		}
	}
	return ""
}

// checkComposeWorkersFile holds workers.json to the sim-worker services: the same ids, their
// client and KV event ports.
func checkComposeWorkersFile(t *testing.T, b *kvrBinary, c compose) {
	var specs []struct {
		ID       string `json:"id"`
		URL      string `json:"url"`
		KVEvents string `json:"kv_events"`
	}
	if err := json.Unmarshal([]byte(readFile(t, "workers.json")), &specs); err != nil {
		t.Fatalf("workers.json: %v", err)
	}
	byID := map[string]int{}
	for i, s := range specs {
		byID[s.ID] = i
	}
	if len(specs) != len(c.workers) {
		t.Errorf("workers.json lists %d workers, docker-compose.yml runs %d", len(specs), len(c.workers))
	}
	for _, w := range c.workers {
		name := serviceName(w)
		id := b.value(t, w, "id")
		i, ok := byID[id]
		if !ok {
			t.Errorf("%s: worker id %s is not in workers.json", w.source, id)
			continue
		}
		if want := fmt.Sprintf("http://%s:%d", name, b.port(t, w, "listen")); specs[i].URL != want {
			t.Errorf("workers.json %s: url %q, want %q", id, specs[i].URL, want)
		}
		ep := b.value(t, w, "kv-events-endpoint")
		if ep == "" {
			continue
		}
		if want := fmt.Sprintf("tcp://%s:%d", name, portOf(t, w.source, strings.TrimPrefix(ep, "tcp://"))); specs[i].KVEvents != want {
			t.Errorf("workers.json %s: kv_events %q, want %q (the worker publishes on %s)", id, specs[i].KVEvents, want, ep)
		}
	}
}

// checkComposeHAProxy: HAProxy is the only published service, it mounts deploy/haproxy.cfg,
// and the addresses it gets are the replicas' client ports (never the admin port).
func checkComposeHAProxy(t *testing.T, b *kvrBinary, c compose) {
	lb := c.services["haproxy"]
	if lb == nil {
		t.Fatal("docker-compose.yml: no haproxy service")
	}
	if src := composeMountSource(lb, "/usr/local/etc/haproxy/haproxy.cfg"); src != "./haproxy.cfg" {
		t.Errorf("haproxy service: mounts %q as its configuration, want ./haproxy.cfg", src)
	}
	env := map[string]string{}
	for k, v := range ymap(lb, "environment") {
		env[k], _ = v.(string)
	}
	var got, want []string
	for k, v := range env {
		if strings.HasPrefix(k, "KVR_REPLICA") {
			got = append(got, v)
		}
	}
	for _, r := range c.replicas {
		want = append(want, fmt.Sprintf("%s:%d", serviceName(r), b.port(t, r, "listen")))
		if admin := b.port(t, r, "admin-listen"); contains(got, fmt.Sprintf("%s:%d", serviceName(r), admin)) {
			t.Errorf("haproxy service: routes to %s's admin port %d", serviceName(r), admin)
		}
	}
	sort.Strings(got)
	sort.Strings(want)
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("haproxy service: KVR_REPLICA* = %v, want the replicas' client addresses %v", got, want)
	}
	published := strList(ylist(lb, "ports"))
	listenPort := portOf(t, "haproxy KVR_LISTEN", env["KVR_LISTEN"])
	if len(published) != 1 || !strings.HasSuffix(published[0], fmt.Sprintf(":%d", listenPort)) {
		t.Errorf("haproxy service: publishes %v, want one port mapped to KVR_LISTEN's %d", published, listenPort)
	}
	// The variable names are the ones deploy/haproxy.cfg reads (when that file is there).
	cfg, err := os.ReadFile("haproxy.cfg")
	if os.IsNotExist(err) {
		t.Log("haproxy.cfg not there yet: its variable names are not compared")
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	refs := map[string]bool{}
	for _, m := range regexp.MustCompile(`\$\{?(KVR_[A-Z0-9_]+)`).FindAllStringSubmatch(string(cfg), -1) {
		refs[m[1]] = true
	}
	for v := range refs {
		if _, ok := env[v]; !ok {
			t.Errorf("haproxy.cfg reads %s, which the compose haproxy service does not set", v)
		}
	}
	for v := range env {
		if strings.HasPrefix(v, "KVR_") && !refs[v] {
			t.Errorf("the compose haproxy service sets %s, which haproxy.cfg does not read", v)
		}
	}
}

// ---- the load balancer configurations

var nginxTime = regexp.MustCompile(`^(\d+)(ms|s|m|h)?$`)

func parseNginxTime(t *testing.T, v string) time.Duration {
	t.Helper()
	m := nginxTime.FindStringSubmatch(v)
	if m == nil {
		t.Fatalf("nginx.conf: time %q", v)
	}
	n, _ := strconv.Atoi(m[1])
	unit := map[string]time.Duration{"": time.Second, "s": time.Second, "ms": time.Millisecond, "m": time.Minute, "h": time.Hour}[m[2]]
	return time.Duration(n) * unit
}

func TestNginxMatchesTheReplicas(t *testing.T) {
	b := binary(t)
	c := readCompose(t)
	// Directives without comments, "name args..." per statement.
	var directives [][]string
	upstream, inUpstream := map[string][]string{}, false
	for _, line := range strings.Split(readFile(t, "nginx.conf"), "\n") {
		line, _, _ = strings.Cut(line, "#")
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "upstream ") {
			inUpstream = true
			continue
		}
		if line == "}" {
			inUpstream = false
			continue
		}
		line = strings.TrimSuffix(line, ";")
		if line == "" || strings.HasSuffix(line, "{") {
			continue
		}
		f := strings.Fields(line)
		directives = append(directives, f)
		if inUpstream && f[0] == "server" {
			upstream[f[1]] = f[2:]
		}
	}
	get := func(name string) []string {
		for _, d := range directives {
			if d[0] == name {
				return d[1:]
			}
		}
		t.Errorf("nginx.conf: no %s", name)
		return []string{""}
	}
	var want []string
	for _, r := range c.replicas {
		want = append(want, fmt.Sprintf("%s:%d", serviceName(r), b.port(t, r, "listen")))
	}
	var got []string
	for server, params := range upstream {
		got = append(got, server)
		p := strings.Join(params, " ")
		if !strings.Contains(p, "max_fails=") || !strings.Contains(p, "fail_timeout=") {
			t.Errorf("nginx.conf: server %s has no passive health check (max_fails, fail_timeout)", server)
		}
	}
	sort.Strings(got)
	sort.Strings(want)
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("nginx.conf: upstream servers %v, want the replicas' client addresses %v", got, want)
	}
	for _, d := range directives {
		for _, r := range c.replicas {
			if admin := fmt.Sprintf(":%d", b.port(t, r, "admin-listen")); strings.Contains(strings.Join(d, " "), admin) {
				t.Errorf("nginx.conf: %v reaches the admin port", d)
			}
		}
	}
	if nu := strings.Join(get("proxy_next_upstream"), " "); !strings.Contains(nu, "error") || !strings.Contains(nu, "timeout") || strings.Contains(nu, "non_idempotent") {
		t.Errorf("nginx.conf: proxy_next_upstream %q: want error and timeout, and never a resent POST", nu)
	}
	for name, want := range map[string]string{"proxy_buffering": "off", "proxy_http_version": "1.1", "proxy_pass": "http://kvrouter"} {
		if got := strings.Join(get(name), " "); got != want {
			t.Errorf("nginx.conf: %s %s, want %s", name, got, want)
		}
	}
	if len(get("keepalive")) != 1 {
		t.Error("nginx.conf: no upstream keepalive")
	}
	// The replicas, not nginx, decide when a worker is too slow.
	r0 := c.replicas[0]
	read := parseNginxTime(t, get("proxy_read_timeout")[0])
	for _, f := range []string{"first-byte-timeout", "idle-timeout"} {
		if d := b.duration(t, r0, f); read <= d {
			t.Errorf("nginx.conf: proxy_read_timeout %v is not above the replicas' --%s %v", read, f, d)
		}
	}
	size := get("client_max_body_size")[0]
	mb, err := strconv.Atoi(strings.TrimSuffix(size, "m"))
	maxBody, _ := strconv.Atoi(b.value(t, r0, "max-body-bytes"))
	if err != nil || int64(mb)<<20 < int64(maxBody) {
		t.Errorf("nginx.conf: client_max_body_size %s is below the replicas' --max-body-bytes %d", size, maxBody)
	}
}

// HAProxy's configuration is another engineer's, run for real by its own test; here only the
// promise that it never sends clients to the admin port.
func TestHAProxyKeepsTheAdminPortPrivate(t *testing.T) {
	cfg, err := os.ReadFile("haproxy.cfg")
	if os.IsNotExist(err) {
		t.Skip("deploy/haproxy.cfg is not there yet")
	}
	if err != nil {
		t.Fatal(err)
	}
	b := binary(t)
	admin := fmt.Sprintf(":%d", b.port(t, readCompose(t).replicas[0], "admin-listen"))
	for i, line := range strings.Split(string(cfg), "\n") {
		line, _, _ = strings.Cut(line, "#")
		if strings.Contains(line, admin) {
			t.Errorf("haproxy.cfg:%d: %q reaches the admin port", i+1, strings.TrimSpace(line))
		}
	}
}

// ---- Dockerfile

func TestDockerfileMatchesTheModule(t *testing.T) {
	b := binary(t)
	// Instructions with continuation lines joined, comments dropped.
	var instr [][2]string
	var cont string
	for _, line := range strings.Split(readFile(t, "Dockerfile"), "\n") {
		trimmed := strings.TrimSpace(line)
		if cont == "" && (trimmed == "" || strings.HasPrefix(trimmed, "#")) {
			continue
		}
		if strings.HasSuffix(trimmed, "\\") {
			cont += strings.TrimSuffix(trimmed, "\\") + " "
			continue
		}
		full := cont + trimmed
		cont = ""
		op, rest, _ := strings.Cut(full, " ")
		instr = append(instr, [2]string{strings.ToUpper(op), strings.TrimSpace(rest)})
	}
	goVersion := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindStringSubmatch(readFile(t, "../go.mod"))
	if goVersion == nil {
		t.Fatal("go.mod: no go directive")
	}
	var froms []string
	var entrypoint, user, volume, dataDir, binDest string
	exposed := map[string]bool{}
	for _, in := range instr {
		op, rest := in[0], in[1]
		switch op {
		case "FROM":
			froms = append(froms, rest)
			user = ""
		case "RUN":
			if strings.Contains(rest, "go build") {
				for _, want := range []string{"CGO_ENABLED=0", "-trimpath", "./cmd/kvrouter-ha", "-o /out/kvrouter-ha"} {
					if !strings.Contains(rest, want) {
						t.Errorf("Dockerfile: the go build step lacks %s", want)
					}
				}
			}
		case "COPY":
			if f := strings.Fields(rest); len(f) >= 2 && f[len(f)-2] == "/out/kvrouter-ha" {
				binDest = f[len(f)-1]
			}
		case "ENV":
			for _, kv := range strings.Fields(rest) {
				k, v, _ := strings.Cut(kv, "=")
				if !strings.HasPrefix(k, "KVROUTER_") {
					continue
				}
				f, ok := b.flagOfEnv("serve", k)
				if !ok {
					t.Errorf("Dockerfile: ENV %s names no flag of kvrouter-ha serve", k)
				}
				if f == "data-dir" {
					dataDir = v
				}
			}
		case "VOLUME":
			volume = rest
		case "USER":
			user = rest
		case "EXPOSE":
			for _, p := range strings.Fields(rest) {
				if !strings.Contains(p, "/") {
					p += "/tcp"
				}
				exposed[p] = true
			}
		case "ENTRYPOINT":
			var ep []string
			if err := json.Unmarshal([]byte(rest), &ep); err != nil {
				t.Errorf("Dockerfile: ENTRYPOINT %s is not the exec (JSON) form: %v", rest, err)
			}
			entrypoint = strings.Join(ep, " ")
		}
	}
	if len(froms) < 2 || froms[0] != "golang:"+goVersion[1]+" AS build" {
		t.Errorf("Dockerfile: stages %q, want a golang:%s build stage first (go.mod says go %s)", froms, goVersion[1], goVersion[1])
	}
	final := froms[len(froms)-1]
	if !strings.HasPrefix(final, "gcr.io/distroless/static") && final != "scratch" {
		t.Errorf("Dockerfile: final image %s, want distroless static or scratch", final)
	}
	if u, _, _ := strings.Cut(user, ":"); u == "" || u == "0" || u == "root" {
		t.Errorf("Dockerfile: the final stage runs as %q; want a numeric non-root USER (Kubernetes runAsNonRoot needs the number)", user)
	} else if _, err := strconv.Atoi(u); err != nil {
		t.Errorf("Dockerfile: USER %s is not numeric; Kubernetes cannot verify runAsNonRoot", user)
	}
	if binDest == "" || entrypoint != binDest {
		t.Errorf("Dockerfile: ENTRYPOINT %q is not the copied binary %q", entrypoint, binDest)
	}
	if dataDir == "" || volume != dataDir {
		t.Errorf("Dockerfile: VOLUME %q, want the data directory KVROUTER_DATA_DIR=%q", volume, dataDir)
	}
	// The ports the replicas listen on in compose: client, peer, Raft, gossip over TCP and UDP.
	r := readCompose(t).replicas[0]
	want := map[string]bool{}
	for _, f := range []string{"listen", "peer-listen", "raft-listen", "gossip-listen"} {
		want[fmt.Sprintf("%d/tcp", b.port(t, r, f))] = true
	}
	want[fmt.Sprintf("%d/udp", b.port(t, r, "gossip-listen"))] = true
	if fmt.Sprint(exposed) != fmt.Sprint(want) {
		t.Errorf("Dockerfile: EXPOSE %v, want %v (and never the admin port)", keys(exposed), keys(want))
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// ---- every file: no flag or variable that the binary does not have

// foreignFlags are other tools' flags that the files' comments show in commands.
var foreignFlags = map[string]string{
	"build":            "docker compose up",
	"from":             "Dockerfile COPY",
	"chown":            "Dockerfile COPY",
	"from-literal":     "kubectl create secret",
	"from-file":        "kubectl create secret",
	"kv-events-config": "vllm serve",
	"now":              "systemctl enable",
}

func TestEveryFlagMentionedExists(t *testing.T) {
	b := binary(t)
	flagToken := regexp.MustCompile(`(?:^|[\s"'(\[,=` + "`" + `])--([a-z][a-z0-9-]*[a-z0-9])`)
	envToken := regexp.MustCompile(`\bKVROUTER_[A-Z0-9_]+`)
	var files []string
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		// haproxy.cfg is checked by its own author's tests; Go files are the tests.
		if !d.IsDir() && !strings.HasSuffix(path, ".go") && path != "haproxy.cfg" && !strings.HasPrefix(path, "secrets/") {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range files {
		for i, line := range strings.Split(readFile(t, path), "\n") {
			for _, m := range flagToken.FindAllStringSubmatch(line, -1) {
				name := m[1]
				if _, ok := foreignFlags[name]; ok {
					continue
				}
				found := name == "help"
				for _, sub := range subcommands {
					_, ok := b.flags[sub][name]
					found = found || ok
				}
				if !found {
					t.Errorf("%s:%d: --%s is no flag of kvrouter-ha %v", path, i+1, name, subcommands)
				}
			}
			for _, v := range envToken.FindAllString(line, -1) {
				found := false
				for _, sub := range subcommands {
					_, ok := b.flagOfEnv(sub, v)
					found = found || ok
				}
				if !found {
					t.Errorf("%s:%d: %s is no flag's variable", path, i+1, v)
				}
			}
		}
	}
	if len(files) < 10 {
		t.Fatalf("only %d files under deploy/: %v", len(files), files)
	}
}

// secretFlags must never be given on a command line or in a manifest's environment, where ps,
// docker inspect and kubectl describe show them: the files' variants exist for that.
var secretFlags = []string{"gossip-key", "admin-token"}

func checkNoInlineSecrets(t *testing.T, b *kvrBinary, s execSpec) {
	t.Helper()
	settings, err := b.parse(s)
	if err != nil {
		t.Error(err)
		return
	}
	for _, f := range settings {
		if contains(secretFlags, f.name) {
			t.Errorf("%s: --%s on the command line; use --%s-file", s.source, f.name, f.name)
		}
	}
	for _, name := range secretFlags {
		if _, ok := s.env[envName(name)]; ok {
			t.Errorf("%s: %s in the environment; use --%s-file", s.source, envName(name), name)
		}
	}
}
