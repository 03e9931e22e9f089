package replica

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
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
// api_error), not a connection error.
func TestOfficialClientsRaiseATypedErrorWhenTheWorkerDiesMidStream(t *testing.T) {
	// A worker whose stream broke is out of rotation: one per stream.
	if ok := runCuttingWorkers(t, "midstream.mjs", 4, 200, nil); ok != 4 {
		t.Fatalf("%d of 4 streams raised a typed error", ok)
	}
}

// TestOfficialClientsReadAMovedStreamWhole: with --migration-limit 1, a streamed chat and
// completion whose worker's connection is cut after the first event go on at another worker,
// and the official openai client (clients/node/migrate.mjs) reads one stream, with one id,
// holding exactly the uninterrupted answer.
func TestOfficialClientsReadAMovedStreamWhole(t *testing.T) {
	// Each cut takes a worker out of rotation: two streams, each moving once.
	// 40 tokens: the script asks each once whole, then streamed.
	if ok := runCuttingWorkers(t, "migrate.mjs", 4, 40, func(c *Config) { c.Proxy.MigrationLimit = 1 }); ok != 2 {
		t.Fatalf("%d of 2 streams were read whole", ok)
	}
}

// runCuttingWorkers runs the Node script (in clientsDir) against a replica (tune adjusts its
// config) in front of n simulated workers, asking for maxTokens tokens per answer. The script prints "first NAME WORKER" at each
// stream's first event, when the worker's connections are cut, and "ok NAME ..." or
// "FAIL NAME ..." at its end; it returns the ok lines' count, failing the test if the script
// fails.
func runCuttingWorkers(t *testing.T, script string, n, maxTokens int, tune func(*Config)) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	node := nodeClients(t, ctx)
	// A token every 50 ms: a stream of 40 lasts 2 s unless it is cut, far longer than the
	// cut takes.
	fleet := startWorkers(t, n, simConfig(50*time.Millisecond))
	rep := startTestReplica(t, fleet, tune)
	run := exec.CommandContext(ctx, node, script)
	run.Dir = clientsDir
	run.Env = append(os.Environ(), "KVROUTER_URL=http://"+rep.Addr(), "KVROUTER_MODEL="+sim.DefaultModel, "KVROUTER_MAX_TOKENS="+strconv.Itoa(maxTokens))
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
	t.Logf("node %s:\n%s", script, strings.Join(lines, "\n"))
	if err != nil {
		t.Fatalf("node %s: %v", script, err)
	}
	waitRouterIdle(t, rep)
	return len(ok)
}
