package layout

import (
	"bufio"
	"bytes"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/kvrouter-ha/kvrouter-ha/"

// allowed lists, for the packages with a rule, the module's packages they may import
// directly ("internal/..." always allowed, except where a rule says "only").
var allowed = map[string][]string{
	"indexer":            {},
	"fsm":                {"fsm/fsmpb"},
	"routing":            {"indexer"},
	"cluster/gossip":     {},
	"cluster/hints":      {"cluster/gossip", "indexer", "routing", "transport/peer"},
	"cluster":            {"cluster/gossip", "fsm", "indexer", "routing", "transport/peer"},
	"transport/kvevents": {"indexer"},
	"transport/openai":   {"indexer", "routing"},
	// The endpoint picker holds decisions through the OpenAI front: one code for both paths.
	"transport/extproc": {"indexer", "routing", "transport/openai"},
	"transport/peer":    {"transport/peer/peerpb"},
	// The client port's HTTP/1.1 server knows handlers only as http.Handler.
	"transport/h1": {},
	"workers":      {"fsm", "routing"},
	// Discovery writes the worker registry through the cluster's interface, not its package.
	"discovery": {"fsm", "routing", "workers"},
	"admin":     {"cluster", "fsm", "routing", "transport/peer", "workers"},
	"sim":       {"indexer", "transport/kvevents"},
	// The fault harness and the process harness know the router only by its wire.
	"jepsen":        {"internal/loopback", "internal/proc"},
	"internal/proc": {"internal/loopback"},

	// The engine metrics scraper hands routing plain numbers (routing.EngineReport).
	"transport/enginemetrics": {"indexer", "routing"},

	// The bench report measures the parts through their public APIs and the demo; nothing
	// imports it but the command.
	"benchreport": {"cluster/hints", "demo", "indexer", "replica", "routing", "sim", "sim/replay", "sim/trace", "transport/openai", "transport/peer"},
}

// raftUsers are the only packages that may import hashicorp/raft itself.
var raftUsers = []string{"cluster", "fsm"}

func TestImportsGoOnlyTheAllowedWays(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", module+"...").Output()
	if err != nil {
		t.Skipf("go list: %v", err)
	}
	seen := 0
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		pkg := strings.TrimPrefix(f[0], module)
		rule, ruled := allowed[pkg]
		if ruled {
			seen++
		}
		for _, imp := range f[1:] {
			if imp == "github.com/hashicorp/raft" && !slices.Contains(raftUsers, pkg) {
				t.Errorf("%s imports hashicorp/raft: only %v may", pkg, raftUsers)
			}
			own, ok := strings.CutPrefix(imp, module)
			if !ok || !ruled {
				continue
			}
			if !slices.Contains(rule, own) && !(strings.HasPrefix(own, "internal/") && len(rule) > 0) {
				t.Errorf("%s imports %s; it may import only %v", pkg, own, rule)
			}
		}
	}
	if seen != len(allowed) {
		t.Errorf("found %d of the %d packages the rules name: a rule names a package that moved", seen, len(allowed))
	}
}
