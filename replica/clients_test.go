package replica

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// clientsDir holds the Node tests of the official OpenAI and Anthropic clients.
const clientsDir = "../clients/node"

// nodeClients returns node, with the official clients installed from the lock file when they
// are missing. Without Node it skips the test, unless KVROUTER_REQUIRE_NODE is set (CI sets
// it), when it fails.
func nodeClients(t *testing.T, ctx context.Context) string {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		if os.Getenv("KVROUTER_REQUIRE_NODE") != "" {
			t.Fatal("node is not installed and KVROUTER_REQUIRE_NODE is set")
		}
		t.Skip("node is not installed")
	}
	if _, err := os.Stat(filepath.Join(clientsDir, "node_modules", "openai")); err != nil {
		npm := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund")
		npm.Dir = clientsDir
		if out, err := npm.CombinedOutput(); err != nil {
			t.Fatalf("npm ci in %s: %v\n%s", clientsDir, err, out)
		}
	}
	return node
}

// TestOfficialClientsSpeakResponsesAndMessages runs the official openai and
// @anthropic-ai/sdk npm clients (clients/node/apis.test.mjs) against a replica in front of
// simulated workers: Responses and Messages, streamed and not, count_tokens, embeddings,
// errors in each API's shape (a model no worker serves among them), models.list() and
// models.retrieve(), a session kept on one worker, a conversation chained by
// previous_response_id kept on the worker that stored it.
func TestOfficialClientsSpeakResponsesAndMessages(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	node := nodeClients(t, ctx)
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

// TestOfficialClientsRaiseATypedErrorWhenTheWorkerDiesMidStream: a streamed chat,
// completion, Responses and Messages answer whose worker's connection is cut after the first
// event ends, for the official openai and @anthropic-ai/sdk clients (clients/node/midstream.mjs),
// in a typed API error (openai's APIError with code upstream_broken, Anthropic's with type
// api_error), not a connection error. The script prints "first NAME WORKER" at each stream's
// first event, when the test cuts that worker, and "ok NAME ..." or "FAIL NAME ..." at its end.
func TestOfficialClientsRaiseATypedErrorWhenTheWorkerDiesMidStream(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	node := nodeClients(t, ctx)
	// 200 tokens at 50 ms: a stream lasts 10 s unless it is cut, far longer than the cut takes.
	// A worker whose stream broke is out of rotation: one per stream.
	fleet := startWorkers(t, 4, simConfig(50*time.Millisecond))
	rep := startTestReplica(t, fleet, nil)
	run := exec.CommandContext(ctx, node, "midstream.mjs")
	run.Dir = clientsDir
	run.Env = append(os.Environ(), "KVROUTER_URL=http://"+rep.Addr(), "KVROUTER_MODEL="+sim.DefaultModel, "KVROUTER_MAX_TOKENS=200")
	run.Stderr = io.Discard
	if testing.Verbose() {
		run.Stderr = os.Stderr
	}
	stdout, err := run.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := run.Start(); err != nil {
		t.Fatal(err)
	}
	var ok, lines []string
	for sc := bufio.NewScanner(stdout); sc.Scan(); {
		line := sc.Text()
		lines = append(lines, line)
		switch {
		case strings.HasPrefix(line, "first "):
			fields := strings.Fields(line)
			fleet.byID(t, fields[len(fields)-1]).cut()
		case strings.HasPrefix(line, "ok "):
			ok = append(ok, line)
		}
	}
	err = run.Wait()
	t.Logf("node midstream.mjs:\n%s", strings.Join(lines, "\n"))
	if err != nil || len(ok) != 4 {
		t.Fatalf("node midstream.mjs: %v; %d of 4 streams raised a typed error", err, len(ok))
	}
	waitRouterIdle(t, rep)
}
