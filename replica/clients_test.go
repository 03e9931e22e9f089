package replica

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// clientsDir holds the Node tests of the official OpenAI and Anthropic clients.
const clientsDir = "../clients/node"

// TestOfficialClientsSpeakResponsesAndMessages runs the official openai and
// @anthropic-ai/sdk npm clients (clients/node/apis.test.mjs) against a replica in front of
// simulated workers: Responses and Messages, streamed and not, count_tokens, embeddings,
// errors in each API's shape (a model no worker serves among them), models.list() and
// models.retrieve(), a session kept on one worker, a conversation chained by
// previous_response_id kept on the worker that stored it. It installs the packages from
// the lock file when they are missing. Without Node it skips, unless KVROUTER_REQUIRE_NODE
// is set (CI sets it), when it fails.
func TestOfficialClientsSpeakResponsesAndMessages(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		if os.Getenv("KVROUTER_REQUIRE_NODE") != "" {
			t.Fatal("node is not installed and KVROUTER_REQUIRE_NODE is set")
		}
		t.Skip("node is not installed")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	if _, err := os.Stat(filepath.Join(clientsDir, "node_modules", "openai")); err != nil {
		npm := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund")
		npm.Dir = clientsDir
		if out, err := npm.CombinedOutput(); err != nil {
			t.Fatalf("npm ci in %s: %v\n%s", clientsDir, err, out)
		}
	}
	fleet := startWorkers(t, 3, simConfig(0))
	rep := startTestReplica(t, fleet, nil)
	run := exec.CommandContext(ctx, node, "--test", "apis.test.mjs")
	run.Dir = clientsDir
	run.Env = append(os.Environ(), "KVROUTER_URL=http://"+rep.Addr(), "KVROUTER_MODEL="+sim.DefaultModel)
	out, err := run.CombinedOutput()
	if err != nil {
		t.Fatalf("node --test: %v\n%s", err, out)
	}
	t.Logf("%s", out)
	waitRouterIdle(t, rep)
}
