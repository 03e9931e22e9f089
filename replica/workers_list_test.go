package replica

import (
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

func TestWorkersListSaysWhereEachWorkerCameFromAndWhatStateItIsIn(t *testing.T) {
	fleet := startWorkers(t, 2, simConfig(0))
	path := filepath.Join(t.TempDir(), "fleet.json")
	d0 := routing.WorkerSpec{ID: "d0", URL: "http://127.0.0.1:9"}
	d1 := routing.WorkerSpec{ID: "d1", URL: "http://127.0.0.1:10"}
	writeFleetFile(t, path, d0, d1)
	rep := startTestReplica(t, fleet, func(c *Config) {
		c.WorkersFromFile = map[string]bool{fleet[1].spec.ID: true}
		// A gone worker drains for a minute: long enough to be seen as gone.
		c.Discovery = DiscoveryConfig{Sources: []string{"file:" + path}, Interval: 50 * time.Millisecond,
			DrainFor: time.Minute, SuspectFor: 50 * time.Millisecond}
	})
	addWorker(t, rep, routing.WorkerSpec{ID: "a0", URL: "http://127.0.0.1:11"})
	waitInRegistry(t, rep, "d1", true)
	waitInRegistry(t, rep, "a0", true)
	if status, body := adminDo(t, rep, http.MethodPost, "/admin/workers/a0/drain", ""); status >= 300 {
		t.Fatalf("drain a0: %d %s", status, body)
	}
	writeFleetFile(t, path, d0) // d1 is gone
	discovered := "discovery:file:" + path
	want := map[string][2]string{
		fleet[0].spec.ID: {admin.SourceFlags, admin.StateActive},
		fleet[1].spec.ID: {admin.SourceFile, admin.StateActive},
		"a0":             {admin.SourceAdmin, admin.StateDraining},
		"d0":             {discovered, admin.StateActive},
		"d1":             {discovered, admin.StateGone},
	}
	eventually(t, "every worker's source and state", func() (bool, string) {
		status, body := adminDo(t, rep, http.MethodGet, "/admin/workers", "")
		if status != http.StatusOK {
			return false, fmt.Sprintf("%d %s", status, body)
		}
		var ws []admin.WorkerView
		if err := json.Unmarshal(body, &ws); err != nil {
			return false, err.Error()
		}
		got := map[string][2]string{}
		for _, w := range ws {
			got[w.Spec.ID] = [2]string{w.Source, w.State}
		}
		return fmt.Sprint(got) == fmt.Sprint(want), fmt.Sprintf("got %v, want %v", got, want)
	})
}
