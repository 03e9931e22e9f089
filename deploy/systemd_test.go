package deploy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// unitFile is a systemd unit: section -> key -> values (keys may repeat).
type unitFile map[string]map[string][]string

func readUnit(t *testing.T, path string) unitFile {
	t.Helper()
	u := unitFile{}
	section := ""
	var pending string
	for i, line := range strings.Split(readFile(t, path), "\n") {
		trimmed := strings.TrimSpace(line)
		if pending == "" && (trimmed == "" || trimmed[0] == '#' || trimmed[0] == ';') {
			continue
		}
		if strings.HasSuffix(trimmed, "\\") {
			pending += strings.TrimSuffix(trimmed, "\\") + " "
			continue
		}
		trimmed, pending = pending+trimmed, ""
		if strings.HasPrefix(trimmed, "[") && strings.HasSuffix(trimmed, "]") {
			section = trimmed[1 : len(trimmed)-1]
			u[section] = map[string][]string{}
			continue
		}
		k, v, ok := strings.Cut(trimmed, "=")
		if !ok || section == "" {
			t.Fatalf("%s:%d: not key=value in a section: %q", path, i+1, trimmed)
		}
		u[section][k] = append(u[section][k], v)
	}
	return u
}

func (u unitFile) one(t *testing.T, section, key string) string {
	t.Helper()
	if v := u[section][key]; len(v) == 1 {
		return v[0]
	}
	t.Errorf("[%s] %s: want exactly one, got %q", section, key, u[section][key])
	return ""
}

var spanPart = regexp.MustCompile(`^(\d+)(us|ms|s|sec|m|min|h|hr)?$`)

// parseTimeSpan reads a systemd time span ("90", "1min 30s").
func parseTimeSpan(t *testing.T, v string) time.Duration {
	t.Helper()
	var d time.Duration
	for _, part := range strings.Fields(v) {
		m := spanPart.FindStringSubmatch(part)
		if m == nil {
			t.Fatalf("time span %q", v)
		}
		n, _ := strconv.Atoi(m[1])
		unit := map[string]time.Duration{"": time.Second, "s": time.Second, "sec": time.Second, "us": time.Microsecond,
			"ms": time.Millisecond, "m": time.Minute, "min": time.Minute, "h": time.Hour, "hr": time.Hour}[m[2]]
		d += time.Duration(n) * unit
	}
	return d
}

// readEnvFile reads KEY=VALUE lines (comments and blank lines skipped).
func readEnvFile(t *testing.T, path string) map[string]string {
	t.Helper()
	env := map[string]string{}
	for i, line := range strings.Split(readFile(t, path), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s:%d: not KEY=VALUE", path, i+1)
		}
		env[k] = strings.Trim(v, `"'`)
	}
	return env
}

// systemdSpecs are the units' command lines: the replica with env.example, the sim worker.
func systemdSpecs(t *testing.T) (replica, worker execSpec, ru, wu unitFile) {
	t.Helper()
	ru = readUnit(t, "systemd/kvrouter-ha.service")
	wu = readUnit(t, "systemd/kvrouter-ha-sim-worker@.service")
	spec := func(u unitFile, name string, env map[string]string) execSpec {
		f := strings.Fields(u.one(t, "Service", "ExecStart"))
		if len(f) < 2 || f[0] != "/usr/local/bin/kvrouter-ha" {
			t.Fatalf("%s: ExecStart %v, want /usr/local/bin/kvrouter-ha <subcommand> ...", name, f)
		}
		return execSpec{source: name, sub: f[1], args: f[2:], env: env}
	}
	replica = spec(ru, "systemd/kvrouter-ha.service", readEnvFile(t, "systemd/env.example"))
	worker = spec(wu, "systemd/kvrouter-ha-sim-worker@.service", nil)
	return replica, worker, ru, wu
}

func TestSystemdUnitsMatchTheBinary(t *testing.T) {
	b := binary(t)
	r, w, ru, wu := systemdSpecs(t)
	if r.sub != "serve" || w.sub != "sim-worker" {
		t.Fatalf("subcommands %q and %q, want serve and sim-worker", r.sub, w.sub)
	}
	for _, s := range []execSpec{r, w} {
		if _, err := b.parse(s); err != nil {
			t.Error(err)
		}
	}
	checkNoInlineSecrets(t, b, r)
	if ef := strings.TrimPrefix(ru.one(t, "Service", "EnvironmentFile"), "-"); ef != "/etc/kvrouter-ha/env" {
		t.Errorf("kvrouter-ha.service: EnvironmentFile %q, want /etc/kvrouter-ha/env (env.example is its template)", ef)
	}
	for name, u := range map[string]unitFile{"kvrouter-ha.service": ru, "kvrouter-ha-sim-worker@.service": wu} {
		user := u["Service"]["User"]
		if u.one(t, "Service", "DynamicUser") != "yes" && (len(user) == 0 || user[0] == "root" || user[0] == "0") {
			t.Errorf("%s: runs as root; want DynamicUser=yes or a User", name)
		}
		for key, want := range map[string]string{"Restart": "on-failure", "KillSignal": "SIGTERM", "NoNewPrivileges": "yes", "ProtectSystem": "strict"} {
			if got := u.one(t, "Service", key); got != want {
				t.Errorf("%s: %s=%s, want %s", name, key, got, want)
			}
		}
	}
	if !strings.Contains(strings.Join(w.args, " "), "%i") {
		t.Error("kvrouter-ha-sim-worker@.service: the instance name (%i) is not used")
	}
	if got, want := b.value(t, r, "data-dir"), "/var/lib/"+ru.one(t, "Service", "StateDirectory"); got != want {
		t.Errorf("kvrouter-ha.service: --data-dir %s, want the StateDirectory %s", got, want)
	}
	if stop, drain := parseTimeSpan(t, ru.one(t, "Service", "TimeoutStopSec")), b.drain(t, r); stop <= drain {
		t.Errorf("kvrouter-ha.service: TimeoutStopSec %v is not above --shutdown-delay + --shutdown-timeout (%v)", stop, drain)
	}
	creds := map[string]bool{}
	for _, lc := range ru["Service"]["LoadCredential"] {
		name, _, _ := strings.Cut(lc, ":")
		creds[name] = true
	}
	for _, a := range r.args {
		if _, after, ok := strings.Cut(a, "%d/"); ok && !creds[after] {
			t.Errorf("kvrouter-ha.service: %s reads credential %s, which no LoadCredential provides", a, after)
		}
	}
}

// systemd-analyze verify, where it is installed, catches misspelt directives and bad values.
func TestSystemdAnalyzeVerify(t *testing.T) {
	tool, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed")
	}
	b := binary(t)
	dir := t.TempDir()
	for _, name := range []string{"kvrouter-ha.service", "kvrouter-ha-sim-worker@.service"} {
		unit := strings.ReplaceAll(readFile(t, "systemd/"+name), "/usr/local/bin/kvrouter-ha", b.path)
		if err := os.WriteFile(filepath.Join(dir, name), []byte(unit), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out, err := exec.Command(tool, "verify", filepath.Join(dir, "kvrouter-ha.service"), filepath.Join(dir, "kvrouter-ha-sim-worker@8001.service")).CombinedOutput()
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, "kvrouter-ha") {
			t.Errorf("systemd-analyze verify: %s", line)
		}
	}
	if err != nil {
		t.Logf("systemd-analyze verify: %v (environment, not the units: no line names them)\n%s", err, out)
	}
}
