package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/peterbourgon/ff/v3/ffcli"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// ctlClient speaks the admin API of one replica and prints what it answers.
type ctlClient struct {
	admin.Client
	json bool
	out  io.Writer
}

func (c *ctlClient) do(ctx context.Context, method, path string, body any) ([]byte, error) {
	return c.Do(ctx, method, path, body)
}

// show prints raw JSON with --json, else the table fn renders.
func (c *ctlClient) show(b []byte, v any, table func(w *tabwriter.Writer)) error {
	if c.json {
		_, err := c.out.Write(b)
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("admin API answer: %w", err)
	}
	tw := tabwriter.NewWriter(c.out, 0, 4, 2, ' ', 0)
	table(tw)
	return tw.Flush()
}

func ctlCommand(stdout, stderr io.Writer) *ffcli.Command {
	fs := flag.NewFlagSet("kvrouter-ha ctl", flag.ContinueOnError)
	c := &ctlClient{out: stdout, Client: admin.Client{HTTP: &http.Client{Timeout: 30 * time.Second}}}
	fs.StringVar(&c.Addr, "addr", "127.0.0.1:9090", "admin address of any replica")
	fs.StringVar(&c.Token, "token", "", "admin bearer token (or KVROUTER_TOKEN, or --token-file)")
	tokenFile := fs.String("token-file", "", "file holding the admin bearer token (a replica whose admin API listens beyond loopback without --admin-token-file made its own: <its --data-dir>/admin.token)")
	fs.BoolVar(&c.json, "json", false, "print the API's JSON instead of a table")
	setup := func() (err error) {
		c.Token, err = readSecret(c.Token, *tokenFile, "", "token")
		return err
	}
	sub := func(name, usage, help string, nargs int, fn func(ctx context.Context, args []string) error) *ffcli.Command {
		return &ffcli.Command{
			Name: name, ShortUsage: "kvrouter-ha ctl [flags] " + usage, ShortHelp: help,
			Exec: func(ctx context.Context, args []string) error {
				// A negative nargs asks for at least -nargs arguments.
				if len(args) != nargs && (nargs >= 0 || len(args) < -nargs) {
					return fmt.Errorf("usage: kvrouter-ha ctl %s", usage)
				}
				if err := setup(); err != nil {
					return err
				}
				return fn(ctx, args)
			},
		}
	}
	workers := &ffcli.Command{
		Name: "workers", ShortUsage: "kvrouter-ha ctl workers <list|add|drain|remove>", ShortHelp: "list, add, drain or remove workers",
		Subcommands: []*ffcli.Command{
			sub("list", "workers list", "list workers with health and bindings", 0, c.workersList),
			sub("add", "workers add <id> <url>", "add a worker to every replica", 2, func(ctx context.Context, a []string) error {
				_, err := c.do(ctx, http.MethodPost, "/admin/workers", routing.WorkerSpec{ID: a[0], URL: a[1]})
				if err == nil {
					fmt.Fprintf(c.out, "worker %s added\n", a[0])
				}
				return err
			}),
			sub("drain", "workers drain <id>", "stop new requests to a worker; its sessions move", 1, func(ctx context.Context, a []string) error {
				return c.printResult(ctx, http.MethodPost, "/admin/workers/"+url.PathEscape(a[0])+"/drain")
			}),
			sub("remove", "workers remove <id>", "remove a worker", 1, func(ctx context.Context, a []string) error {
				return c.printResult(ctx, http.MethodDelete, "/admin/workers/"+url.PathEscape(a[0]))
			}),
		},
		Exec: func(context.Context, []string) error { return flag.ErrHelp },
	}
	sessions := &ffcli.Command{
		Name: "sessions", ShortUsage: "kvrouter-ha ctl sessions <get|invalidate> <session>", ShortHelp: "read or invalidate a session's binding",
		Subcommands: []*ffcli.Command{
			sub("get", "sessions get <session>", "show a session's binding", 1, c.sessionGet),
			sub("invalidate", "sessions invalidate <session>", "drop a session's binding", 1, func(ctx context.Context, a []string) error {
				return c.printResult(ctx, http.MethodDelete, "/admin/sessions/"+url.PathEscape(a[0]))
			}),
		},
		Exec: func(context.Context, []string) error { return flag.ErrHelp },
	}
	clusterCmd := &ffcli.Command{
		Name: "cluster", ShortUsage: "kvrouter-ha ctl cluster <status|transfer-leadership|remove|snapshot>", ShortHelp: "cluster membership and Raft",
		Subcommands: []*ffcli.Command{
			sub("status", "cluster status", "members, leader, raft indexes", 0, c.clusterStatus),
			sub("transfer-leadership", "cluster transfer-leadership", "make another replica lead (ask the leader)", 0, func(ctx context.Context, _ []string) error {
				return c.printResult(ctx, http.MethodPost, "/admin/cluster/transfer-leadership")
			}),
			sub("remove", "cluster remove <replica-id>", "remove a replica from the Raft configuration", 1, func(ctx context.Context, a []string) error {
				return c.printResult(ctx, http.MethodDelete, "/admin/cluster/servers/"+url.PathEscape(a[0]))
			}),
			sub("snapshot", "cluster snapshot", "take a Raft snapshot on the replica asked", 0, func(ctx context.Context, _ []string) error {
				return c.printResult(ctx, http.MethodPost, "/admin/cluster/snapshot")
			}),
		},
		Exec: func(context.Context, []string) error { return flag.ErrHelp },
	}
	alias := &ffcli.Command{
		Name: "alias", ShortUsage: "kvrouter-ha ctl models alias <set|list|delete>", ShortHelp: "model aliases with weighted targets",
		Subcommands: []*ffcli.Command{
			sub("set", "models alias set <name> <model>=<weight>...", "set an alias on every replica (a weight change applies to new sessions)", -2, c.aliasSet),
			sub("list", "models alias list", "list aliases and their targets", 0, c.aliasList),
			sub("delete", "models alias delete <name>", "delete an alias", 1, func(ctx context.Context, a []string) error {
				return c.printResult(ctx, http.MethodDelete, "/admin/models/aliases/"+url.PathEscape(a[0]))
			}),
		},
		Exec: func(context.Context, []string) error { return flag.ErrHelp },
	}
	models := &ffcli.Command{
		Name: "models", ShortUsage: "kvrouter-ha ctl models alias <set|list|delete>", ShortHelp: "model aliases",
		Subcommands: []*ffcli.Command{alias},
		Exec:        func(context.Context, []string) error { return flag.ErrHelp },
	}
	cmd := &ffcli.Command{
		Name:        "ctl",
		ShortUsage:  "kvrouter-ha ctl [--addr host:port] [--token T] [--json] <workers|sessions|cluster|models> ...",
		ShortHelp:   "operate a running cluster through a replica's admin API",
		FlagSet:     fs,
		Subcommands: []*ffcli.Command{workers, sessions, clusterCmd, models},
		Exec:        func(context.Context, []string) error { return flag.ErrHelp },
	}
	for _, g := range cmd.Subcommands {
		g.FlagSet = flag.NewFlagSet(g.Name, flag.ContinueOnError)
		g.FlagSet.SetOutput(stderr)
		for _, s := range g.Subcommands {
			s.FlagSet = flag.NewFlagSet(s.Name, flag.ContinueOnError)
			s.FlagSet.SetOutput(stderr)
			for _, l := range s.Subcommands {
				l.FlagSet = flag.NewFlagSet(l.Name, flag.ContinueOnError)
				l.FlagSet.SetOutput(stderr)
			}
		}
	}
	return cmd
}

// printResult runs a write and prints its JSON answer's fields as "key: value" lines.
func (c *ctlClient) printResult(ctx context.Context, method, path string) error {
	b, err := c.do(ctx, method, path, nil)
	if err != nil {
		return err
	}
	var m map[string]any
	return c.show(b, &m, func(w *tabwriter.Writer) {
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(w, "%s:\t%v\n", k, m[k])
		}
	})
}

func (c *ctlClient) workersList(ctx context.Context, _ []string) error {
	b, err := c.do(ctx, http.MethodGet, "/admin/workers", nil)
	if err != nil {
		return err
	}
	var ws []admin.WorkerView
	if err := c.show(b, &ws, func(w *tabwriter.Writer) {
		fmt.Fprintln(w, "ID\tURL\tSOURCE\tSTATE\tHEALTHY\tBINDINGS\tREASON")
		for _, x := range ws {
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%v\t%d\t%s\n", x.Spec.ID, x.Spec.URL, x.Source, x.State, x.Healthy, x.Bindings, x.Reason)
		}
	}); err != nil || c.json {
		// --json prints the workers array alone, as before: GET /admin/discovery is the
		// sources' JSON.
		return err
	}
	b, err = c.do(ctx, http.MethodGet, "/admin/discovery", nil)
	if err != nil {
		// A replica of an older release has no /admin/discovery: the table stands alone.
		return nil
	}
	var d admin.DiscoveryView
	if err := json.Unmarshal(b, &d); err != nil {
		return fmt.Errorf("admin API answer: %w", err)
	}
	for _, line := range discoveryLines(d) {
		fmt.Fprintln(c.out, line)
	}
	return nil
}

// discoveryLines says, one line a source, how the discovery sources are doing, from the looks
// of the replica that runs them (the leader; a follower asks it): whether the last look failed,
// since when and why, and the workers kept. Without the leader's looks it says why.
func discoveryLines(d admin.DiscoveryView) []string {
	clock := func(t time.Time) string { return t.UTC().Format("15:04:05") }
	from := ""
	if d.LooksFrom != "" && d.LooksFrom != d.Replica {
		from = " (the leader " + d.LooksFrom + "'s looks)"
	}
	var out []string
	for _, s := range d.Sources {
		kept := fmt.Sprintf("%d workers", s.Workers)
		if s.Gone > 0 {
			kept += fmt.Sprintf(" (and %d gone, draining)", s.Gone)
		}
		var line string
		switch {
		case d.LooksFrom == "" && d.LeaderID == "":
			line = fmt.Sprintf("not looked at on %s, which does not lead; no leader is known now; %s in the registry", d.Replica, kept)
		case d.LooksFrom == "":
			line = fmt.Sprintf("runs on the leader %s (peer %s), not on %s, which could not show its looks: %s; %s in the registry",
				d.LeaderID, d.LeaderPeerAddr, d.Replica, d.LeaderError, kept)
		case s.Failures > 0:
			last := "no good look yet in this term (its workers are left as they are)"
			if !s.LastGood.IsZero() {
				last = "last good look " + clock(s.LastGood)
			}
			line = fmt.Sprintf("FAILING since %s (%d looks): %s; %s; %s kept", clock(s.FailingSince), s.Failures, s.LastError, last, kept)
		case s.LastGood.IsZero():
			line = "no look yet; " + kept
		default:
			line = fmt.Sprintf("ok, last good look %s; %s", clock(s.LastGood), kept)
		}
		if s.SuspectDrains > 0 {
			line += fmt.Sprintf("; %d drains held as suspect", s.SuspectDrains)
		}
		out = append(out, "discovery "+s.Source+": "+line+from)
	}
	return out
}

func (c *ctlClient) sessionGet(ctx context.Context, a []string) error {
	b, err := c.do(ctx, http.MethodGet, "/admin/sessions/"+url.PathEscape(a[0]), nil)
	if err != nil {
		return err
	}
	var s admin.SessionView
	return c.show(b, &s, func(w *tabwriter.Writer) {
		fmt.Fprintln(w, "SESSION\tWORKER\tDP_RANK\tREVISION\tTTL")
		fmt.Fprintf(w, "%s\t%s\t%d\t%d\t%s\n", s.Session, s.Worker, s.DPRank, s.Revision, time.Duration(s.TTLMillis)*time.Millisecond)
	})
}

// aliasSet sets alias a[0] to the targets a[1:], each model=weight.
func (c *ctlClient) aliasSet(ctx context.Context, a []string) error {
	body := admin.AliasView{Name: a[0]}
	for _, arg := range a[1:] {
		model, w, ok := strings.Cut(arg, "=")
		if !ok {
			return fmt.Errorf("target %q: want model=weight", arg)
		}
		weight, err := strconv.ParseUint(w, 10, 32)
		if err != nil {
			return fmt.Errorf("target %q: weight: %w", arg, err)
		}
		body.Targets = append(body.Targets, admin.AliasTargetView{Model: model, Weight: uint32(weight)})
	}
	b, err := c.do(ctx, http.MethodPut, "/admin/models/aliases/"+url.PathEscape(a[0]), body)
	if err != nil {
		return err
	}
	var v admin.AliasView
	return c.show(b, &v, func(w *tabwriter.Writer) { aliasRows(w, []admin.AliasView{v}) })
}

func (c *ctlClient) aliasList(ctx context.Context, _ []string) error {
	b, err := c.do(ctx, http.MethodGet, "/admin/models/aliases", nil)
	if err != nil {
		return err
	}
	var vs []admin.AliasView
	return c.show(b, &vs, func(w *tabwriter.Writer) { aliasRows(w, vs) })
}

func aliasRows(w *tabwriter.Writer, vs []admin.AliasView) {
	fmt.Fprintln(w, "ALIAS\tTARGET\tWEIGHT")
	for _, v := range vs {
		for _, t := range v.Targets {
			fmt.Fprintf(w, "%s\t%s\t%d\n", v.Name, t.Model, t.Weight)
		}
	}
}

func (c *ctlClient) clusterStatus(ctx context.Context, _ []string) error {
	b, err := c.do(ctx, http.MethodGet, "/admin/cluster", nil)
	if err != nil {
		return err
	}
	var v admin.ClusterView
	return c.show(b, &v, func(w *tabwriter.Writer) {
		fmt.Fprintf(w, "replica:\t%s (%s)\n", v.Self.ID, v.Self.State)
		fmt.Fprintf(w, "leader:\t%s\n", orNone(v.Self.LeaderID))
		fmt.Fprintf(w, "cluster id:\t%s\n", orNone(v.Self.ClusterID))
		fmt.Fprintf(w, "term / commit index:\t%d / %d\n", v.Self.Term, v.Self.CommitIndex)
		// Two applied indexes that differ by design: Raft's counts every log entry (its own
		// no-op and barrier entries too), the state machine's only commands and membership
		// changes it was handed (self.applied_index in --json).
		fmt.Fprintf(w, "applied index (Raft log):\t%s\n", orNone(v.Raft["applied_index"]))
		fmt.Fprintf(w, "applied index (state machine):\t%d\n", v.Self.AppliedIndex)
		fmt.Fprintf(w, "bindings:\t%d\n\n", v.Bindings)
		fmt.Fprintln(w, "ID\tRAFT\tPEER\tSUFFRAGE\tLEADER")
		for _, s := range v.Servers {
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%v\n", s.ID, s.RaftAddr, s.PeerAddr, s.Suffrage, s.Leader)
		}
	})
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}
