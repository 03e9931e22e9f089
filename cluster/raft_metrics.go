package cluster

import (
	"strconv"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
)

// raftCollector exposes a Node's Raft state to Prometheus. It reads everything at scrape
// time: raft keeps these values behind short locks and atomics, so a scrape neither waits
// on the Raft main loop nor needs a goroutine of its own, and it works on a node that is
// shutting down or shut down (state "shutdown", the last values it had).
type raftCollector struct {
	n *Node

	state, term, commit, applied, lastLog, lastSnapshot *prometheus.Desc
	lastContact, voters, servers, leaderChanges         *prometheus.Desc
	quorumContact                                       *prometheus.Desc
	bindings, leaseRemaining, leaseRounds               *prometheus.Desc
	logFile, logFree, logCompactions, logReclaimed      *prometheus.Desc
	checkpointBytes, checkpointEntries                  *prometheus.Desc
	// fromStats pairs gauges with the raft.Raft.Stats key each is read from.
	fromStats []raftStat
}

// raftStat is a gauge read from one raft.Raft.Stats key.
type raftStat struct {
	desc *prometheus.Desc
	key  string
}

// NewRaftCollector returns a collector of n's Raft state for the replica's registry:
// kvrouter_raft_state{state}, kvrouter_raft_term, kvrouter_raft_commit_index,
// kvrouter_raft_applied_index, kvrouter_raft_last_log_index,
// kvrouter_raft_last_snapshot_index, kvrouter_raft_last_contact_seconds (0 on the leader,
// -1 before any contact with a leader), kvrouter_raft_quorum_contact_age_seconds (the
// leader's, -1 elsewhere), kvrouter_raft_voters, kvrouter_raft_servers,
// kvrouter_raft_leader_changes_total, kvrouter_fsm_bindings, and the read lease's
// kvrouter_read_lease_remaining_seconds and kvrouter_read_lease_rounds_total{result}, and
// raft.db's kvrouter_raft_log_file_bytes, kvrouter_raft_log_free_bytes,
// kvrouter_raft_log_compactions_total and kvrouter_raft_log_reclaimed_bytes_total, and the
// leader's kvrouter_checkpoint_bytes_total and kvrouter_checkpoint_entries_total.
// README.md's metrics table says what each means.
func NewRaftCollector(n *Node) prometheus.Collector {
	c := &raftCollector{
		n:            n,
		state:        prometheus.NewDesc("kvrouter_raft_state", "1 for this replica's Raft state (follower, candidate, leader, shutdown), 0 for the others.", []string{"state"}, nil),
		term:         prometheus.NewDesc("kvrouter_raft_term", "Current Raft term.", nil, nil),
		commit:       prometheus.NewDesc("kvrouter_raft_commit_index", "Index of the last Raft log entry known committed.", nil, nil),
		applied:      prometheus.NewDesc("kvrouter_raft_applied_index", "Index of the last Raft log entry handed to the state machine (no-op and barrier entries included).", nil, nil),
		lastLog:      prometheus.NewDesc("kvrouter_raft_last_log_index", "Index of the last entry in this replica's Raft log.", nil, nil),
		lastSnapshot: prometheus.NewDesc("kvrouter_raft_last_snapshot_index", "Index of the last Raft snapshot taken or installed (0: none).", nil, nil),
		lastContact:  prometheus.NewDesc("kvrouter_raft_last_contact_seconds", "Seconds since this replica last heard from the leader: 0 on the leader, -1 before any contact.", nil, nil),
		quorumContact: prometheus.NewDesc("kvrouter_raft_quorum_contact_age_seconds",
			"On the leader, seconds since it last heard from a quorum of voters (the answer to a heartbeat or an append, counted from when it was sent); -1 on other replicas and before any answer. Past 0.2 x --raft-heartbeat-timeout a new session is bound before any worker is asked.", nil, nil),
		voters:        prometheus.NewDesc("kvrouter_raft_voters", "Voters in the latest Raft configuration this replica knows.", nil, nil),
		servers:       prometheus.NewDesc("kvrouter_raft_servers", "Servers (voters and non-voters) in the latest Raft configuration this replica knows.", nil, nil),
		leaderChanges: prometheus.NewDesc("kvrouter_raft_leader_changes_total", "Leaders this replica learned of: each time the leader it knows became another one, or one after none (the first leader included).", nil, nil),
		bindings:      prometheus.NewDesc("kvrouter_fsm_bindings", "Session bindings in this replica's state machine.", nil, nil),
		leaseRemaining: prometheus.NewDesc("kvrouter_read_lease_remaining_seconds",
			"Seconds left on this replica's read lease (0: none; bounded reads and /readyz fail).", nil, nil),
		leaseRounds: prometheus.NewDesc("kvrouter_read_lease_rounds_total",
			"Read-lease rounds by result: renewed, failed (no leader, no answer, not applied in time), discarded (the term or role changed meanwhile).", []string{"result"}, nil),
		logFile:        prometheus.NewDesc("kvrouter_raft_log_file_bytes", "Size of raft.db, the Raft log and stable store, on disk.", nil, nil),
		logFree:        prometheus.NewDesc("kvrouter_raft_log_free_bytes", "Bytes of raft.db that bbolt holds free (reused by later writes, given back only by a compaction).", nil, nil),
		logCompactions: prometheus.NewDesc("kvrouter_raft_log_compactions_total", "Times raft.db was rewritten to give its free space back after a snapshot compacted the log.", nil, nil),
		logReclaimed:   prometheus.NewDesc("kvrouter_raft_log_reclaimed_bytes_total", "Bytes raft.db shrank by in its compactions.", nil, nil),
		checkpointBytes: prometheus.NewDesc("kvrouter_checkpoint_bytes_total",
			"Bytes of TTL checkpoints this replica wrote to the Raft log while it led.", nil, nil),
		checkpointEntries: prometheus.NewDesc("kvrouter_checkpoint_entries_total",
			"Bindings whose remaining TTL this replica checkpointed while it led (only those touched since their last checkpoint, or never checkpointed).", nil, nil),
	}
	c.fromStats = []raftStat{
		{c.term, "term"}, {c.commit, "commit_index"}, {c.applied, "applied_index"},
		{c.lastLog, "last_log_index"}, {c.lastSnapshot, "last_snapshot_index"},
	}
	return c
}

// Describe sends every metric's description.
func (c *raftCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		c.state, c.term, c.commit, c.applied, c.lastLog, c.lastSnapshot,
		c.lastContact, c.quorumContact, c.voters, c.servers, c.leaderChanges, c.bindings, c.leaseRemaining, c.leaseRounds,
		c.logFile, c.logFree, c.logCompactions, c.logReclaimed, c.checkpointBytes, c.checkpointEntries,
	} {
		ch <- d
	}
}

// Collect reads the node's Raft state now.
func (c *raftCollector) Collect(ch chan<- prometheus.Metric) {
	r := c.n.raft
	st := r.State()
	for _, s := range [...]struct {
		state raft.RaftState
		name  string
	}{{raft.Follower, "follower"}, {raft.Candidate, "candidate"}, {raft.Leader, "leader"}, {raft.Shutdown, "shutdown"}} {
		v := 0.0
		if s.state == st {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(c.state, prometheus.GaugeValue, v, s.name)
	}
	// Stats takes raft's locks briefly and is the only source of the last log and snapshot
	// indexes. A key it stopped reporting (another raft version) leaves its gauge out rather
	// than failing the whole scrape; the tests notice.
	stats := r.Stats()
	for _, g := range c.fromStats {
		if v, err := strconv.ParseUint(stats[g.key], 10, 64); err == nil {
			ch <- prometheus.MustNewConstMetric(g.desc, prometheus.GaugeValue, float64(v))
		}
	}
	// A number, not an absent series, before any contact: "never heard from a leader" is
	// the state of a replica that cannot join, and an alert on < 0 should see it.
	contact := -1.0
	if st == raft.Leader {
		contact = 0
	} else if lc := r.LastContact(); !lc.IsZero() {
		contact = time.Since(lc).Seconds()
	}
	ch <- prometheus.MustNewConstMetric(c.lastContact, prometheus.GaugeValue, contact)
	quorum := -1.0
	if age, ok := c.n.contactAge(); ok && st == raft.Leader {
		quorum = age.Seconds()
	}
	ch <- prometheus.MustNewConstMetric(c.quorumContact, prometheus.GaugeValue, quorum)
	// GetConfiguration answers from a copy raft keeps for readers: it does not wait on the
	// main loop, and it answers after shutdown too.
	if f := r.GetConfiguration(); f.Error() == nil {
		servers := f.Configuration().Servers
		voters := 0
		for _, s := range servers {
			if s.Suffrage == raft.Voter {
				voters++
			}
		}
		ch <- prometheus.MustNewConstMetric(c.voters, prometheus.GaugeValue, float64(voters))
		ch <- prometheus.MustNewConstMetric(c.servers, prometheus.GaugeValue, float64(len(servers)))
	}
	ch <- prometheus.MustNewConstMetric(c.leaderChanges, prometheus.CounterValue, float64(c.n.leaderChanges.Load()))
	ch <- prometheus.MustNewConstMetric(c.bindings, prometheus.GaugeValue, float64(c.n.fsm.Len()))
	l := c.n.lease
	ch <- prometheus.MustNewConstMetric(c.leaseRemaining, prometheus.GaugeValue, c.n.leaseRemaining().Seconds())
	for _, r := range [...]struct {
		name string
		v    uint64
	}{{"renewed", l.renewed.Load()}, {"failed", l.failed.Load()}, {"discarded", l.discarded.Load()}} {
		ch <- prometheus.MustNewConstMetric(c.leaseRounds, prometheus.CounterValue, float64(r.v), r.name)
	}
	ch <- prometheus.MustNewConstMetric(c.checkpointBytes, prometheus.CounterValue, float64(c.n.lead.checkpointBytes.Load()))
	ch <- prometheus.MustNewConstMetric(c.checkpointEntries, prometheus.CounterValue, float64(c.n.lead.checkpointEntries.Load()))
	if c.n.store != nil {
		st := c.n.store.Stats()
		ch <- prometheus.MustNewConstMetric(c.logFile, prometheus.GaugeValue, float64(st.FileBytes))
		ch <- prometheus.MustNewConstMetric(c.logFree, prometheus.GaugeValue, float64(st.FreeBytes))
		ch <- prometheus.MustNewConstMetric(c.logCompactions, prometheus.CounterValue, float64(st.Compactions))
		ch <- prometheus.MustNewConstMetric(c.logReclaimed, prometheus.CounterValue, float64(st.Reclaimed))
	}
}
