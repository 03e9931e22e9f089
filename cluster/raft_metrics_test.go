package cluster

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// scrapeRaft gathers n's Raft collector through a registry of its own, as /metrics would,
// and returns "name" or "name{label=value}" -> value. It fails the test on a gather error
// or a metric name or help text that breaks Prometheus conventions (promlint).
func scrapeRaft(t *testing.T, n *Node) map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(NewRaftCollector(n)); err != nil {
		t.Fatalf("register: %v", err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	problems, err := promlint.NewWithMetricFamilies(mfs).Lint()
	if err != nil {
		t.Fatalf("lint: %v", err)
	}
	for _, p := range problems {
		t.Errorf("metric %s: %s", p.Metric, p.Text)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			out[seriesKey(mf.GetName(), m)] = metricValue(m)
		}
	}
	return out
}

func seriesKey(name string, m *dto.Metric) string {
	if len(m.GetLabel()) == 0 {
		return name
	}
	var ls []string
	for _, l := range m.GetLabel() {
		ls = append(ls, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
	}
	sort.Strings(ls)
	return name + "{" + strings.Join(ls, ",") + "}"
}

func metricValue(m *dto.Metric) float64 {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	}
	return 0
}

func stateKey(s string) string { return `kvrouter_raft_state{state="` + s + `"}` }

// raftStateOf is the one state a scrape reports as 1, or an error when it is not exactly one.
func raftStateOf(m map[string]float64) (string, error) {
	var on []string
	for _, s := range []string{"follower", "candidate", "leader", "shutdown"} {
		v, ok := m[stateKey(s)]
		if !ok {
			return "", fmt.Errorf("no series for state %s", s)
		}
		if v == 1 {
			on = append(on, s)
		} else if v != 0 {
			return "", fmt.Errorf("state %s is %v, want 0 or 1", s, v)
		}
	}
	if len(on) != 1 {
		return "", fmt.Errorf("states at 1: %v, want exactly one", on)
	}
	return on[0], nil
}

// leadersAmong scrapes the live nodes and returns the index of the one reporting leader,
// or an error unless exactly one does.
func leadersAmong(t *testing.T, nodes []*Node) (int, error) {
	t.Helper()
	leader, count := -1, 0
	for i, n := range nodes {
		if n == nil {
			continue
		}
		st, err := raftStateOf(scrapeRaft(t, n))
		if err != nil {
			return -1, fmt.Errorf("node %d: %w", i, err)
		}
		if st == "leader" {
			leader, count = i, count+1
		}
	}
	if count != 1 {
		return -1, fmt.Errorf("%d nodes report leader, want exactly 1", count)
	}
	return leader, nil
}

func TestRaftMetricsFollowBindsAndAFailover(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	li, _ := c.leader()

	// One leader, every series present (the state's four: raftStateOf), three voters everywhere.
	poll.Until(t, 5*time.Second, func() error {
		got, err := leadersAmong(t, c.nodes)
		if err != nil {
			return err
		}
		if got != li {
			return fmt.Errorf("node %d reports leader, raft says node %d", got, li)
		}
		for i, n := range c.nodes {
			m := scrapeRaft(t, n)
			for _, name := range []string{
				"kvrouter_raft_term", "kvrouter_raft_commit_index", "kvrouter_raft_applied_index",
				"kvrouter_raft_last_log_index", "kvrouter_raft_last_snapshot_index",
				"kvrouter_raft_last_contact_seconds", "kvrouter_raft_voters", "kvrouter_raft_servers",
				"kvrouter_raft_leader_changes_total", "kvrouter_fsm_bindings",
				"kvrouter_read_lease_remaining_seconds", `kvrouter_read_lease_rounds_total{result="renewed"}`,
			} {
				if _, ok := m[name]; !ok {
					return fmt.Errorf("node %d: no %s", i, name)
				}
			}
			if m["kvrouter_raft_voters"] != 3 || m["kvrouter_raft_servers"] != 3 {
				return fmt.Errorf("node %d: voters %v servers %v, want 3 and 3", i, m["kvrouter_raft_voters"], m["kvrouter_raft_servers"])
			}
			if m["kvrouter_read_lease_remaining_seconds"] <= 0 || m[`kvrouter_read_lease_rounds_total{result="renewed"}`] < 1 {
				return fmt.Errorf("node %d: read lease %vs left after %v renewals, want a lease", i,
					m["kvrouter_read_lease_remaining_seconds"], m[`kvrouter_read_lease_rounds_total{result="renewed"}`])
			}
			if m["kvrouter_raft_leader_changes_total"] < 1 {
				return fmt.Errorf("node %d: leader changes %v, want the first leader counted", i, m["kvrouter_raft_leader_changes_total"])
			}
			contact := m["kvrouter_raft_last_contact_seconds"]
			if i == li && contact != 0 || i != li && contact < 0 {
				return fmt.Errorf("node %d (leader %d): last contact %v", i, li, contact)
			}
		}
		return nil
	})

	// A bind through a follower advances every replica's applied index and binding count.
	before := make([]float64, 3)
	for i, n := range c.nodes {
		m := scrapeRaft(t, n)
		before[i] = m["kvrouter_raft_applied_index"]
		if got := m["kvrouter_fsm_bindings"]; got != 0 {
			t.Fatalf("node %d: %v bindings before any bind", i, got)
		}
	}
	fi := (li + 1) % 3
	bindVia(t, NewAffinity(c.nodes[fi]), "metrics-session", indexer.Worker{ID: "w1"})
	poll.Until(t, 5*time.Second, func() error {
		for i, n := range c.nodes {
			m := scrapeRaft(t, n)
			applied := m["kvrouter_raft_applied_index"]
			if applied <= before[i] {
				return fmt.Errorf("node %d: applied index %v, was %v before the bind", i, applied, before[i])
			}
			if m["kvrouter_fsm_bindings"] != 1 {
				return fmt.Errorf("node %d: %v bindings, want 1", i, m["kvrouter_fsm_bindings"])
			}
			if commit, last := m["kvrouter_raft_commit_index"], m["kvrouter_raft_last_log_index"]; commit < applied || last < commit {
				return fmt.Errorf("node %d: applied %v, commit %v, last log %v: want applied <= commit <= last", i, applied, commit, last)
			}
		}
		return nil
	})

	// Stopping the leader: the survivors elect another and each counts the change.
	changes := map[int]float64{}
	var term float64
	for i, n := range c.nodes {
		m := scrapeRaft(t, n)
		if i != li {
			changes[i] = m["kvrouter_raft_leader_changes_total"]
		}
		term = max(term, m["kvrouter_raft_term"])
	}
	old := c.nodes[li]
	c.kill(li)
	nli, _ := c.leader()
	poll.Until(t, 10*time.Second, func() error {
		got, err := leadersAmong(t, c.nodes)
		if err != nil {
			return err
		}
		if got != nli {
			return fmt.Errorf("node %d reports leader, raft says node %d", got, nli)
		}
		for i, was := range changes {
			m := scrapeRaft(t, c.nodes[i])
			if now := m["kvrouter_raft_leader_changes_total"]; now <= was {
				return fmt.Errorf("node %d: leader changes %v, was %v before the leader stopped", i, now, was)
			}
			if m["kvrouter_raft_term"] <= term {
				return fmt.Errorf("node %d: term %v, was %v before the election", i, m["kvrouter_raft_term"], term)
			}
		}
		return nil
	})

	// The stopped node still answers a scrape: shut down, its last values.
	m := scrapeRaft(t, old)
	if st, err := raftStateOf(m); err != nil || st != "shutdown" {
		t.Fatalf("stopped node: state %q (%v), want shutdown", st, err)
	}
	if m["kvrouter_fsm_bindings"] != 1 {
		t.Errorf("stopped node: %v bindings, want the 1 it had", m["kvrouter_fsm_bindings"])
	}
}

func TestRaftMetricsOfANodeThatNeverReachedALeader(t *testing.T) {
	// A node waiting for seeds that never answer: no configuration and no leader.
	_, tr := raft.NewInmemTransport("raft-lonely")
	n, err := Open(context.Background(), Config{
		ID: "lonely", InMemory: true, Transport: tr, PeerAddr: "peer-lonely",
		BootstrapExpect: 3, Join: []string{"peer-nowhere"},
		Remote:           memRemote{net: newMemNet(), self: func() *Node { return nil }},
		HeartbeatTimeout: 50 * time.Millisecond, ElectionTimeout: 50 * time.Millisecond,
		LeaderLeaseTimeout: 25 * time.Millisecond,
	})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	t.Cleanup(func() { _ = n.Close() })

	tests := []struct {
		name   string
		before func(t *testing.T)
		state  string
	}{
		{name: "running", before: func(*testing.T) {}, state: "follower"},
		{name: "shut down", before: func(t *testing.T) {
			if err := n.Close(); err != nil {
				t.Fatalf("kill: %v", err)
			}
		}, state: "shutdown"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.before(t)
			m := scrapeRaft(t, n)
			if st, err := raftStateOf(m); err != nil || st != tc.state {
				t.Errorf("state %q (%v), want %s", st, err, tc.state)
			}
			want := map[string]float64{
				"kvrouter_raft_last_contact_seconds": -1,
				"kvrouter_raft_voters":               0,
				"kvrouter_raft_servers":              0,
				"kvrouter_raft_leader_changes_total": 0,
				"kvrouter_fsm_bindings":              0,
				"kvrouter_raft_term":                 0,
			}
			for name, v := range want {
				got, ok := m[name]
				if !ok || got != v {
					t.Errorf("%s = %v (present %v), want %v", name, got, ok, v)
				}
			}
		})
	}
}
