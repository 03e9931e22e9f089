package main

import (
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestReadmeThreeReplicaSnippetRunsBesideTheLoneReplica holds the README's three-replica
// snippet to what makes it work as written after the lone `serve` before it: ports and data
// directories of its own (none of the lone replica's defaults), the gossip key made before
// the replicas read it, chat-42 sent to this cluster and every ctl call aimed at its admin
// ports (else `ctl sessions get chat-42` asks the lone replica, or 404s).
func TestReadmeThreeReplicaSnippetRunsBesideTheLoneReplica(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var block string
	for _, m := range regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllStringSubmatch(string(readme), -1) {
		if strings.Contains(m[1], "for i in 0 1 2") {
			block = strings.ReplaceAll(m[1], "\\\n", " ")
		}
	}
	if block == "" {
		t.Fatal("README.md has no sh block with the three-replica loop (for i in 0 1 2)")
	}
	lines := strings.Split(block, "\n")
	serveAt := slices.IndexFunc(lines, func(l string) bool { return strings.Contains(l, " serve ") })
	if serveAt < 0 {
		t.Fatalf("no serve line in the three-replica block:\n%s", block)
	}
	defaults := serveCommand(io.Discard, io.Discard).FlagSet
	lone := map[string]bool{defaults.Lookup("data-dir").DefValue: true}
	addressFlags := []string{"listen", "admin-listen", "raft-listen", "peer-listen", "gossip-listen"}
	for _, name := range addressFlags {
		lone[defaults.Lookup(name).DefValue] = true
	}
	taken := map[string]string{} // value -> replica and flag
	admins, clients := map[string]bool{}, map[string]bool{}
	var keyFile string
	for i := range 3 {
		args := strings.Fields(strings.ReplaceAll(lines[serveAt], "$i", strconv.Itoa(i)))
		flags := map[string]string{}
		for j := 0; j+1 < len(args); j++ {
			if name, ok := strings.CutPrefix(args[j], "--"); ok {
				flags[name] = args[j+1]
			}
		}
		for _, name := range append(addressFlags, "data-dir") {
			v := flags[name]
			switch {
			case v == "":
				t.Errorf("replica %d: --%s not set: it would take the lone replica's %s", i, name, defaults.Lookup(name).DefValue)
			case lone[v]:
				t.Errorf("replica %d: --%s %s is the lone replica's", i, name, v)
			case taken[v] != "":
				t.Errorf("replica %d: --%s %s is also %s", i, name, v, taken[v])
			}
			taken[v] = "replica " + strconv.Itoa(i) + "'s --" + name
		}
		admins[flags["admin-listen"]], clients[flags["listen"]] = true, true
		keyFile = flags["gossip-key-file"]
	}
	if keyFile == "" {
		t.Fatal("the replicas read no --gossip-key-file")
	}
	if made := slices.IndexFunc(lines, func(l string) bool { return strings.Contains(l, "> "+keyFile) }); made < 0 || made > serveAt {
		t.Errorf("%s is not made before the replicas that read it:\n%s", keyFile, block)
	}
	sent, asked := -1, -1
	for n, l := range lines {
		if strings.Contains(l, "X-Session-ID: chat-42") {
			for c := range clients {
				if strings.Contains(l, c+"/") {
					sent = n
				}
			}
			if sent != n {
				t.Errorf("chat-42 is sent to none of the cluster's client ports %v: %s", clients, l)
			}
		}
		if f := strings.Fields(l); slices.IndexFunc(f, func(s string) bool { return s == "ctl" }) >= 0 {
			addr := ""
			if i := slices.IndexFunc(f, func(s string) bool { return s == "--addr" }); i >= 0 && i+1 < len(f) {
				addr = f[i+1]
			}
			if !admins[addr] {
				t.Errorf("a ctl call aimed at %q, none of the cluster's admin ports %v: %s", addr, admins, l)
			}
			if strings.Contains(l, "sessions get chat-42") {
				asked = n
			}
		}
	}
	if asked < 0 || sent < 0 || sent > asked {
		t.Errorf("the block must send chat-42 to the cluster before `ctl sessions get chat-42` (sent at line %d, asked at %d)", sent, asked)
	}
}
