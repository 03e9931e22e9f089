package deploy_test

import (
	"fmt"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// haproxy-lua/ is HAProxy carrying the bytes with kvrouter.lua asking the decision service;
// system_test/haproxy_lua_test.go runs it for real. Here: HAProxy accepts the file as it is,
// with no warning, in both fail modes; the Lua and the configuration name the same things;
// its timeout is above the replicas' own wait; and it never sends to the admin port.

const (
	luaConfig = "haproxy-lua/haproxy.cfg"
	luaScript = "haproxy-lua/kvrouter.lua"
)

// luaHAProxy returns an HAProxy built with Lua, or skips.
func luaHAProxy(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		bin = "/usr/sbin/haproxy"
	}
	out, err := exec.Command(bin, "-vv").CombinedOutput()
	if err != nil {
		t.Skipf("no HAProxy to check %s with (%v); apt-get install haproxy", luaConfig, err)
	}
	if !strings.Contains(string(out), "Built with Lua") {
		t.Skipf("%s is built without Lua: %s cannot be checked", bin, luaConfig)
	}
	return bin
}

func TestHAProxyLuaConfigIsValid(t *testing.T) {
	bin := luaHAProxy(t)
	for _, fail := range []string{"open", "closed"} {
		// -dW: zero-warning mode, a warning fails the check. The Lua file's body runs at
		// the check, so a Lua error fails it too.
		cmd := exec.Command(bin, "-dW", "-c", "-f", luaConfig)
		cmd.Env = append(cmd.Environ(), "KVR_FAIL="+fail)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("KVR_FAIL=%s haproxy -dW -c -f %s: %v\n%s", fail, luaConfig, err, out)
		}
		if strings.Contains(string(out), "kvrouter.lua") {
			t.Fatalf("KVR_FAIL=%s: kvrouter.lua complained at load:\n%s", fail, out)
		}
	}
	// A broken setting stops HAProxy at start, not on the first request.
	for env, says := range map[string]string{
		"KVR_FAIL=maybe":            "KVR_FAIL must be open or closed",
		"KVR_DECISION_TIMEOUT=soon": "KVR_DECISION_TIMEOUT must be a positive number",
	} {
		cmd := exec.Command(bin, "-c", "-f", luaConfig)
		cmd.Env = append(cmd.Environ(), env)
		if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), says) {
			t.Errorf("%s: haproxy -c: %v, want it refused saying %q:\n%s", env, err, says, out)
		}
	}
}

// TestHAProxyLuaConfigAndScriptAgree: every setting the Lua reads has its default in the
// configuration (presetenv) and is documented there; the backend, action and filter the
// Lua names are those the configuration uses; the variables the configuration reads are
// set by the Lua.
func TestHAProxyLuaConfigAndScriptAgree(t *testing.T) {
	cfg, lua := readFile(t, luaConfig), readFile(t, luaScript)
	uncommented := func(s, comment string) string {
		var b strings.Builder
		for _, line := range strings.Split(s, "\n") {
			line, _, _ = strings.Cut(line, comment)
			b.WriteString(line + "\n")
		}
		return b.String()
	}
	cfgCode, luaCode := uncommented(cfg, "#"), uncommented(lua, "--")

	for _, m := range regexp.MustCompile(`os\.getenv\("([A-Z_]+)"\)`).FindAllStringSubmatch(luaCode, -1) {
		if !regexp.MustCompile(`(?m)^\s*presetenv ` + m[1] + ` \S+$`).MatchString(cfgCode) {
			t.Errorf("kvrouter.lua reads %s; haproxy.cfg gives it no default (presetenv)", m[1])
		}
		if !strings.Contains(cfg, "#   "+m[1]) {
			t.Errorf("haproxy.cfg's header does not document %s", m[1])
		}
	}
	named := func(re, s string) []string {
		var out []string
		for _, m := range regexp.MustCompile(re).FindAllStringSubmatch(s, -1) {
			out = append(out, m[1])
		}
		return out
	}
	if backends := named(`(?m)^backend (\S+)`, cfgCode); !slices.Contains(backends, named(`local REPLICAS = "(\w+)"`, luaCode)[0]) {
		t.Errorf("kvrouter.lua reads backend %v; haproxy.cfg has %v", named(`local REPLICAS = "(\w+)"`, luaCode), backends)
	}
	for _, a := range named(`lua\.(\w+)`, cfgCode) {
		if !strings.Contains(luaCode, `core.register_action("`+a+`"`) && !strings.Contains(luaCode, `core.register_filter("`+a+`"`) {
			t.Errorf("haproxy.cfg uses lua.%s, which kvrouter.lua does not register", a)
		}
	}
	for _, v := range named(`var\((txn\.\w+)\)`, cfgCode) {
		if !strings.Contains(luaCode, `set_var("`+v+`"`) {
			t.Errorf("haproxy.cfg reads %s, which kvrouter.lua never sets", v)
		}
	}
	// Servers in file order are the order the Lua tries them: r0, r1, r2.
	if got := named(`(?m)^\s*server (r\d) "\$\{KVR_REPLICA\d`, cfgCode); !slices.Equal(got, []string{"r0", "r1", "r2"}) {
		t.Errorf("haproxy.cfg's replicas are %v, want r0 r1 r2 from KVR_REPLICA0..2", got)
	}
}

// TestHAProxyLuaWaitsLongerThanTheReplicas: a new session's reservation may wait for a leader
// up to the replicas' --bind-wait; the Lua's decision timeout must let it.
func TestHAProxyLuaWaitsLongerThanTheReplicas(t *testing.T) {
	b := binary(t)
	m := regexp.MustCompile(`(?m)^\s*presetenv KVR_DECISION_TIMEOUT (\d+(?:\.\d+)?)$`).FindStringSubmatch(readFile(t, luaConfig))
	if m == nil {
		t.Fatal("haproxy.cfg sets no default KVR_DECISION_TIMEOUT")
	}
	secs, _ := strconv.ParseFloat(m[1], 64)
	bindWait, err := time.ParseDuration(b.flags["serve"]["bind-wait"].def)
	if err != nil {
		t.Fatal(err)
	}
	if time.Duration(secs*float64(time.Second)) <= bindWait {
		t.Errorf("KVR_DECISION_TIMEOUT %ss is not above the replicas' --bind-wait %v", m[1], bindWait)
	}
}

func TestHAProxyLuaKeepsTheAdminPortPrivate(t *testing.T) {
	b := binary(t)
	ports := []string{fmt.Sprintf(":%d", b.port(t, readCompose(t).replicas[0], "admin-listen"))}
	if def := b.flags["serve"]["admin-listen"].def; def != "" {
		ports = append(ports, def[strings.LastIndexByte(def, ':'):])
	}
	for i, line := range strings.Split(readFile(t, luaConfig), "\n") {
		line, _, _ = strings.Cut(line, "#")
		for _, p := range ports {
			if strings.Contains(line, p+`"`) || strings.Contains(line, p+" ") || strings.HasSuffix(strings.TrimSpace(line), p) {
				t.Errorf("%s:%d: %q reaches the admin port", luaConfig, i+1, strings.TrimSpace(line))
			}
		}
	}
}
