package replica

import (
	"fmt"
	"testing"
	"time"
)

// TestLoneReplicaExportsRaftMetricsOnTheAdminListener: a lone replica is a one-node Raft
// cluster, so once it has elected itself its admin /metrics says it leads, alone, and a
// session's first request shows up as a binding and an applied entry.
func TestLoneReplicaExportsRaftMetricsOnTheAdminListener(t *testing.T) {
	fleet := startWorkers(t, 1, simConfig(time.Millisecond))
	rep := startTestReplica(t, fleet, nil)
	c := newRouterClient(t, rep)

	var applied float64
	eventually(t, "the lone replica's /metrics to report it leads", func() (bool, string) {
		m := c.scrapeMetrics()
		applied = m["kvrouter_raft_applied_index"]
		want := map[string]float64{
			`kvrouter_raft_state{state="leader"}`:    1,
			`kvrouter_raft_state{state="follower"}`:  0,
			`kvrouter_raft_state{state="candidate"}`: 0,
			`kvrouter_raft_state{state="shutdown"}`:  0,
			"kvrouter_raft_voters":                   1,
			"kvrouter_raft_servers":                  1,
			"kvrouter_raft_last_contact_seconds":     0,
			"kvrouter_raft_leader_changes_total":     1,
		}
		for name, v := range want {
			if got, ok := m[name]; !ok || got != v {
				return false, fmt.Sprintf("%s = %v (present %v), want %v", name, got, ok, v)
			}
		}
		if m["kvrouter_raft_term"] < 1 || applied < 1 {
			return false, fmt.Sprintf("term %v, applied index %v: want both at least 1", m["kvrouter_raft_term"], applied)
		}
		return true, ""
	})

	c.complete(promptTokens(1, 64), 2, hdr("X-Session-ID", "raft-metrics")).mustOK(t)
	eventually(t, "the session's binding to show on /metrics", func() (bool, string) {
		m := c.scrapeMetrics()
		if m["kvrouter_fsm_bindings"] != 1 || m["kvrouter_raft_applied_index"] <= applied {
			return false, fmt.Sprintf("bindings %v, applied index %v (was %v)", m["kvrouter_fsm_bindings"], m["kvrouter_raft_applied_index"], applied)
		}
		return true, ""
	})
}
