package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/peterbourgon/ff/v3/ffcli"
)

// update rewrites docs/configuration.md from the flag sets instead of comparing with it.
var update = flag.Bool("update", false, "rewrite docs/configuration.md from the flag sets")

// configurationDocPath is the generated configuration reference, relative to this package.
const configurationDocPath = "../../docs/configuration.md"

// regenerateHint is what a stale reference tells the developer to run.
const regenerateHint = "go test ./cmd/kvrouter-ha/ -run TestConfigurationReference -update"

// TestConfigurationReference keeps docs/configuration.md equal to what the subcommands'
// flag sets say, so a flag added, removed, renamed or re-defaulted without regenerating the
// reference fails here rather than drifting in the docs.
func TestConfigurationReference(t *testing.T) {
	want, err := configurationReference()
	if err != nil {
		t.Fatal(err)
	}
	if *update {
		if err := os.MkdirAll(filepath.Dir(configurationDocPath), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(configurationDocPath, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", configurationDocPath)
		return
	}
	got, err := os.ReadFile(configurationDocPath)
	if err != nil {
		t.Fatalf("%v; generate it with `%s`", err, regenerateHint)
	}
	if string(got) != want {
		t.Fatalf("docs/configuration.md does not match the flags (%s); regenerate it with `%s`",
			firstDifference(string(got), want), regenerateHint)
	}
}

// TestEveryFlagIsReadFromItsDocumentedEnvironmentVariable backs the reference's
// environment column: for every flag whose type refuses garbage, it sets the variable the
// reference names to garbage and runs the real command line, which must fail parsing that
// very variable (so the variable is read, under that name, for that subcommand).
func TestEveryFlagIsReadFromItsDocumentedEnvironmentVariable(t *testing.T) {
	const garbage = "not-a-value"
	// stopArgs make each command's Exec fail before it starts anything, so that if a
	// variable were not read (the bug this test looks for) the command still does no harm.
	stopArgs := map[string][]string{
		"serve":      {"--log-level=bogus"},
		"sim-worker": {"--log-level=bogus"},
		"replay":     {}, // neither --target nor --workers
		"demo":       {"--modes=bogus"},
		"ctl":        {}, // no subcommand: help
		"jepsen":     {"--log-level=bogus"},
	}
	checked := 0
	for _, c := range documentedCommands() {
		name := c.cmd.Name
		args, ok := stopArgs[name]
		if !ok {
			t.Fatalf("no stopArgs for %s: add arguments that make it fail before it starts anything", name)
		}
		args = append([]string{name}, args...)
		if err := run(context.Background(), args, io.Discard, io.Discard); err == nil {
			t.Fatalf("kvrouter-ha %v succeeded; its stopArgs must make it fail", args)
		}
		c.cmd.FlagSet.VisitAll(func(f *flag.Flag) {
			// c.cmd is a throwaway copy (run builds its own commands), so trying the
			// garbage on its value here only tells whether this flag's type refuses it.
			if f.Value.Set(garbage) == nil {
				return // a string-like flag takes anything: nothing to observe
			}
			env := flagEnvVar(f.Name)
			checked++
			t.Run(name+"/"+f.Name, func(t *testing.T) {
				t.Setenv(env, garbage)
				err := run(context.Background(), args, io.Discard, io.Discard)
				if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%q", env)) {
					t.Fatalf("kvrouter-ha %v with %s=%s: got %v, want a parse error naming %s", args, env, garbage, err, env)
				}
			})
		})
	}
	if checked < 50 {
		t.Fatalf("only %d flags could be probed; the check proves little", checked)
	}
}

// TestConfigurationReferenceGroupsOnlyRealFlags fails when a group in the reference names a
// flag the command does not have (a flag renamed or removed), which the generator would
// otherwise skip silently.
func TestConfigurationReferenceGroupsOnlyRealFlags(t *testing.T) {
	for _, c := range documentedCommands() {
		for _, g := range c.groups {
			for _, name := range g.flags {
				if c.cmd.FlagSet.Lookup(name) == nil {
					t.Errorf("%s: group %q lists --%s, which the command does not define (fix documentedCommands in docs_test.go)", c.cmd.Name, g.title, name)
				}
			}
		}
	}
}

// docCommand is one subcommand's section of the reference.
type docCommand struct {
	cmd   *ffcli.Command
	intro string
	// groups order the flags into tables; flags in no group land in a last "Other" table.
	// Nil: one table of every flag.
	groups []docGroup
}

// docGroup is one table of a subcommand's flags.
type docGroup struct {
	title, intro string
	flags        []string
}

// documentedCommands is every subcommand the reference covers, with serve's flags grouped.
func documentedCommands() []docCommand {
	d := io.Discard
	return []docCommand{
		{
			cmd:   serveCommand(d, d),
			intro: "A lone `serve` is a one-node Raft cluster; three or more started with `--join` (and `--bootstrap-expect` for a new cluster) form a highly available one.",
			groups: []docGroup{
				{"Client and proxy", "The OpenAI port clients and the load balancer talk to, the admin port, and how requests are passed to workers.",
					[]string{"listen", "admin-listen", "replica-id", "max-body-bytes", "connect-timeout", "first-byte-timeout", "idle-timeout"}},
				{"Workers and routing", "Which workers there are and how one is chosen for a request; sessions and their bindings.",
					[]string{"worker", "workers-file", "policy", "prefill-weight", "temperature", "busy-decode-fraction", "busy-prefill-tokens",
						"queue-size", "queue-wait", "max-retries", "session-ttl", "max-sessions", "session-headers"}},
				{"Prefill/decode disaggregation", "With workers of role prefill: when a request's prefill goes to a prefill worker and its decode to a decode worker.",
					[]string{"disagg", "disagg-min-uncached-tokens", "disagg-max-prefill-queue-tokens"}},
				{"Gateways and balancers", "For whatever carries the bytes instead of the replicas: a Kubernetes gateway asking the endpoint picker (ext_proc), or a balancer reserving decisions (POST /v1/reserve).",
					[]string{"ext-proc-listen", "ext-proc-target-ports", "reservation-ttl", "max-reservations"}},
				{"Engine metrics", "Each replica scrapes every worker's Prometheus endpoint and counts the load its engine reports beyond this cluster's requests (other clients, the engine's queue).",
					[]string{"engine-metrics-interval", "engine-metrics-timeout", "engine-metrics-path", "engine-metrics-max-bytes",
						"engine-metrics-stale-after", "engine-metrics-request-tokens"}},
				{"Index", "What the router believes each worker has cached: learned from its own decisions (approximate: a prompt when it is dispatched, and again with its generated blocks when the worker has answered) and, for workers that publish them, from vLLM KV events (precise).",
					[]string{"block-size", "approx-ttl", "approx-max-blocks", "kv-events-bind", "kv-events-publisher-hosts", "kv-events-topic-pattern", "overlay-ttl", "tokenizer"}},
				{"Cluster and Raft", "The Raft node that keeps session bindings: addresses, forming and joining a cluster, read consistency, timeouts and snapshots.",
					[]string{"data-dir", "raft-listen", "raft-advertise", "peer-listen", "peer-advertise", "bootstrap-expect", "join",
						"consistency", "stale-bound", "bind-wait", "raft-heartbeat-timeout", "raft-election-timeout", "raft-leader-lease-timeout",
						"raft-commit-timeout", "checkpoint-interval", "snapshot-interval", "snapshot-threshold", "snapshot-retain",
						"raft-trailing-logs", "raft-log-compact-min-bytes",
						"worker-grace", "touch-flush"}},
				{"Gossip", "Membership (which replicas are Raft voters), merged worker health, routing decisions, load and index snapshots shared between replicas over memberlist. Gossip is a hint: losing it makes routing slightly worse, never changes a binding.",
					[]string{"no-gossip", "gossip-listen", "gossip-advertise", "gossip-join", "gossip-join-wait", "gossip-max-bytes-per-second",
						"min-quorum", "cleanup-interval", "load-share-interval", "decision-flush-interval", "health-gossip-interval",
						"index-snapshot-discovery", "index-snapshot-max-bytes"}},
				{"TLS and secrets", "Safe by default: a replica whose Raft, peer or gossip listen or advertise address reaches beyond loopback (anything but 127.0.0.0/8, ::1 and localhost; 0.0.0.0, :: and host names count as beyond) refuses to start without peer mutual TLS (the three `--peer-tls-*` files) and a gossip key, unless `--insecure-open-cluster` accepts an open cluster, which then warns at every start, port by port. An admin API beyond loopback without a token makes one at first start in `<data-dir>/admin.token` (0600), reuses it later and requires it; on loopback it stays open, with a warning at every start. Certificate files are read at start (a new certificate takes a restart), and a bad one stops the start with a message naming the flag. Secrets are never logged; give them through the `-file` flags or the environment, since flags show in `ps`.",
					[]string{"tls-cert-file", "tls-key-file", "peer-tls-cert-file", "peer-tls-key-file", "peer-tls-ca-file",
						"gossip-key", "gossip-key-file", "admin-token", "admin-token-file", "insecure-open-cluster"}},
				{"Worker health", "Each replica probes every worker; with gossip the replicas' views are merged (see `cluster/hints/health.go`).",
					[]string{"health-interval", "health-timeout", "health-fail-threshold", "health-rise-threshold"}},
				{"Shutdown", "On SIGTERM or SIGINT: `/readyz` fails at once, the port keeps serving for `--shutdown-delay`, leadership moves to a follower if this replica leads, then in-flight requests get `--shutdown-timeout` to finish. A second signal cuts the delay short.",
					[]string{"shutdown-delay", "shutdown-timeout"}},
				{"Logging", "Logs are text (`log/slog`) on stderr.",
					[]string{"log-level"}},
			},
		},
		{cmd: simWorkerCommand(d), intro: "For demos and tests: the OpenAI API with simulated prefill and decode timing, injected faults, and optional vLLM-format KV events over ZMQ."},
		{cmd: replayCommand(d, d), intro: "Give `--target` (a router) or `--workers` (round-robin straight at the workers, a baseline without a router); the summary gives hit rate, TTFT percentiles and load imbalance."},
		{cmd: demoCommand(d, d), intro: "`make demo` runs the `ha` scenario; `make demo-scale` runs `scale` (the fleet grows and shrinks through `--discovery file:PATH`); `compare` runs side-by-side comparisons in one process."},
		{cmd: ctlCommand(d, d), intro: "Subcommands: `workers list|add|drain|remove`, `sessions get|invalidate`, `cluster status|transfer-leadership|remove|snapshot`; the flags go before them (`kvrouter-ha ctl --addr 127.0.0.1:9090 cluster status`). The token: `--token-file` (a replica that made its own keeps it in `<data-dir>/admin.token`), `--token`, or `KVROUTER_TOKEN`."},
		{cmd: jepsenCommand(d, d), intro: "A test harness, not an operations tool (`make jepsen`)."},
	}
}

// configurationReference renders docs/configuration.md from the subcommands' flag sets.
func configurationReference() (string, error) {
	host, _ := os.Hostname()
	var b strings.Builder
	b.WriteString("<!-- Generated from the flag sets in cmd/kvrouter-ha by `" + regenerateHint + "`; edit the flags (or docs_test.go), not this file. -->\n\n")
	b.WriteString("# Configuration reference\n\n")
	b.WriteString("Every flag of every subcommand, generated from the flag sets and checked against them by\n")
	b.WriteString("`go test ./cmd/kvrouter-ha/` (`TestConfigurationReference`). `kvrouter-ha <subcommand> --help`\n")
	b.WriteString("prints the flags too.\n\n")
	b.WriteString("Every flag can also come from the environment: `--foo-bar` is `KVROUTER_FOO_BAR` (upper case, `-`\n")
	b.WriteString("becomes `_`). A flag on the command line wins over the environment, which wins over the default;\n")
	b.WriteString("an empty variable counts as unset. A repeatable flag takes one value from its variable: for\n")
	b.WriteString("`--worker`, a comma-separated list (`KVROUTER_WORKER=w0=http://10.0.0.1:8000,w1=http://10.0.0.2:8000`).\n")
	b.WriteString("Durations are Go durations (`500ms`, `30s`, `5m`).\n\n")
	b.WriteString("Contents:")
	cmds := documentedCommands()
	for i, c := range cmds {
		sep := ","
		if i == len(cmds)-1 {
			sep = "."
		}
		fmt.Fprintf(&b, " [`%s`](#%s)%s", c.cmd.Name, c.cmd.Name, sep)
	}
	b.WriteString("\n")
	for _, c := range cmds {
		fmt.Fprintf(&b, "\n## %s\n\n", c.cmd.Name)
		fmt.Fprintf(&b, "`%s`\n\n%s %s\n", c.cmd.ShortUsage, upperFirst(c.cmd.ShortHelp)+".", c.intro)
		var all []*flag.Flag
		c.cmd.FlagSet.VisitAll(func(f *flag.Flag) { all = append(all, f) })
		if c.groups == nil {
			b.WriteString("\n")
			writeFlagTable(&b, all, host)
			continue
		}
		placed := map[string]bool{}
		for _, g := range c.groups {
			var fs []*flag.Flag
			for _, name := range g.flags {
				f := c.cmd.FlagSet.Lookup(name)
				if f == nil {
					return "", fmt.Errorf("%s: group %q lists --%s, which the command does not define", c.cmd.Name, g.title, name)
				}
				if placed[name] {
					return "", fmt.Errorf("%s: --%s is in two groups", c.cmd.Name, name)
				}
				placed[name] = true
				fs = append(fs, f)
			}
			fmt.Fprintf(&b, "\n### %s\n\n%s\n\n", g.title, g.intro)
			writeFlagTable(&b, fs, host)
		}
		var rest []*flag.Flag
		for _, f := range all {
			if !placed[f.Name] {
				rest = append(rest, f)
			}
		}
		if len(rest) > 0 {
			b.WriteString("\n### Other\n\nFlags not yet sorted into a group above (add them to a group in `documentedCommands`, `cmd/kvrouter-ha/docs_test.go`).\n\n")
			writeFlagTable(&b, rest, host)
		}
	}
	return b.String(), nil
}

// writeFlagTable writes one Markdown table of flags: name and value type, environment
// variable, default and the flag's own usage text.
func writeFlagTable(b *strings.Builder, fs []*flag.Flag, host string) {
	b.WriteString("| flag | environment | default | meaning |\n| --- | --- | --- | --- |\n")
	for _, f := range fs {
		typ, usage := flag.UnquoteUsage(f)
		name := "--" + f.Name
		if typ != "" {
			name += " " + typ
		}
		def := "`" + mdCell(f.DefValue) + "`"
		switch {
		case f.Name == "replica-id" && f.DefValue == host:
			// The machine's own name would make the reference differ between machines.
			def = "the host name"
		case f.DefValue == "":
			def = "none"
		}
		fmt.Fprintf(b, "| `%s` | `%s` | %s | %s |\n", name, flagEnvVar(f.Name), def, mdCell(usage))
	}
}

// flagEnvVar is the environment variable ff reads for a flag (ff.WithEnvVarPrefix(envPrefix)).
func flagEnvVar(name string) string {
	return envPrefix + "_" + strings.NewReplacer("-", "_", ".", "_", "/", "_").Replace(strings.ToUpper(name))
}

// mdCell escapes what would break a Markdown table cell or turn into emphasis or HTML.
func mdCell(s string) string {
	return strings.NewReplacer("\\", "\\\\", "|", "\\|", "*", "\\*", "<", "&lt;", ">", "&gt;", "\n", " ").Replace(s)
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// firstDifference names the first line where the file and the generated text part, so a
// stale reference says what changed.
func firstDifference(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := range max(len(g), len(w)) {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl {
			return fmt.Sprintf("line %d is %q, the flags say %q", i+1, gl, wl)
		}
	}
	return "they differ"
}

// TestFlagEnvVarMatchesTheDocumentedRule pins the naming rule the README and the reference
// state, including for names with several dashes.
func TestFlagEnvVarMatchesTheDocumentedRule(t *testing.T) {
	for name, want := range map[string]string{
		"session-ttl":                 "KVROUTER_SESSION_TTL",
		"peer-tls-ca-file":            "KVROUTER_PEER_TLS_CA_FILE",
		"gossip-max-bytes-per-second": "KVROUTER_GOSSIP_MAX_BYTES_PER_SECOND",
	} {
		if got := flagEnvVar(name); got != want {
			t.Errorf("flagEnvVar(%q) = %q, want %q", name, got, want)
		}
	}
}
