package cluster

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// MemberSource is the membership the leader reconciles the Raft configuration with
// (*gossip.Gossip is one).
type MemberSource interface {
	Members() []gossip.Member
}

// ReconcileConfig tunes how Raft voters follow gossip members. Zero values take defaults.
type ReconcileConfig struct {
	// MinQuorum is the fewest voters reconciliation leaves (3): it never removes a voter
	// below it, however long the others have been dead.
	MinQuorum int
	// CleanupInterval is how long a member must be dead (or unknown to gossip) before its
	// server is removed (5m). A member that left on purpose is removed at once.
	CleanupInterval time.Duration
	// Interval between passes (1s).
	Interval time.Duration
	// Now is the clock (tests; nil: time.Now).
	Now func() time.Time
}

func (c *ReconcileConfig) defaults() {
	if c.MinQuorum <= 0 {
		c.MinQuorum = 3
	}
	if c.CleanupInterval <= 0 {
		c.CleanupInterval = 5 * time.Minute
	}
	if c.Interval <= 0 {
		c.Interval = time.Second
	}
	if c.Now == nil {
		c.Now = time.Now
	}
}

// ReconcileMembers makes the Raft configuration follow gossip membership: a leader duty
// (AddDuty), so it runs while this node leads, each term from a clean slate (what an earlier
// term saw of the followers says nothing about this one), and stops with the term:
//
//   - an Alive member that advertises a Raft address, names itself consistently and
//     belongs to no other cluster, and is not a voter (absent, a non-voter, or at another
//     address), is added as a voter;
//   - a member that Left on purpose is removed at once;
//   - a member Dead for CleanupInterval, or a server gossip has not known for
//     CleanupInterval, is removed only if Raft cannot reach it either (the leader's
//     heartbeats to it are failing), so a gossip-only fault never costs a healthy voter;
//   - no removal leaves fewer than MinQuorum voters, and the leader never removes itself.
func (n *Node) ReconcileMembers(src MemberSource, cfg ReconcileConfig) {
	n.AddDuty("reconcile raft voters with gossip members", func(ctx context.Context) {
		r := newReconciler(n, src, cfg)
		r.watch(ctx)
		t := time.NewTicker(r.cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if err := r.once(ctx); err != nil && ctx.Err() == nil {
				n.log.Warn("reconciling raft voters with gossip members", "err", err)
			}
		}
	})
}

// reconciler is one replica's reconciliation state; it is reset whenever leadership moves
// (what an earlier term saw of the followers says nothing about this one).
type reconciler struct {
	n   *Node
	src MemberSource
	cfg ReconcileConfig

	mu          sync.Mutex
	term        uint64
	unreachable map[string]time.Time // last failed heartbeat, by server id
	missing     map[string]time.Time // since when a server is unknown to gossip
	refused     map[string]string    // members not added, and why (logged once)
}

func newReconciler(n *Node, src MemberSource, cfg ReconcileConfig) *reconciler {
	cfg.defaults()
	return &reconciler{n: n, src: src, cfg: cfg, unreachable: map[string]time.Time{}, missing: map[string]time.Time{}, refused: map[string]string{}}
}

// watch follows the leader's heartbeats to each follower until ctx ends.
func (r *reconciler) watch(ctx context.Context) {
	obs := make(chan raft.Observation, 64)
	o := raft.NewObserver(obs, false, func(o *raft.Observation) bool {
		switch o.Data.(type) {
		case raft.FailedHeartbeatObservation, raft.ResumedHeartbeatObservation:
			return true
		}
		return false
	})
	r.n.raft.RegisterObserver(o)
	go func() {
		defer r.n.raft.DeregisterObserver(o)
		for {
			select {
			case <-ctx.Done():
				return
			case ob := <-obs:
				r.mu.Lock()
				switch d := ob.Data.(type) {
				case raft.FailedHeartbeatObservation:
					r.unreachable[string(d.PeerID)] = r.cfg.Now()
				case raft.ResumedHeartbeatObservation:
					delete(r.unreachable, string(d.PeerID))
				}
				r.mu.Unlock()
			}
		}
	}()
}

// raftUnreachable reports whether the leader's heartbeats to id failed recently. A failing
// peer produces a failure every half heartbeat timeout at most, so a missed "resumed"
// observation (a dropped one) cannot keep a reachable peer marked for long.
func (r *reconciler) raftUnreachable(id string, now time.Time) bool {
	at, ok := r.unreachable[id]
	return ok && now.Sub(at) <= max(2*time.Second, 4*r.n.cfg.HeartbeatTimeout)
}

// once is one reconciliation pass; it does nothing unless this node leads.
func (r *reconciler) once(ctx context.Context) error {
	n := r.n
	r.mu.Lock()
	defer r.mu.Unlock()
	term := n.raft.CurrentTerm()
	if !n.IsLeader() || !n.lead.isEstablished() {
		r.term = 0
		return nil
	}
	if term != r.term {
		r.term = term
		r.missing = map[string]time.Time{}
		// Heartbeat failures seen in an earlier term may be stale; fresh ones arrive within
		// a heartbeat timeout.
		r.unreachable = map[string]time.Time{}
	}
	f := n.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return fmt.Errorf("raft configuration: %w", err)
	}
	servers := map[string]raft.Server{}
	voters := 0
	for _, s := range f.Configuration().Servers {
		servers[string(s.ID)] = s
		if s.Suffrage == raft.Voter {
			voters++
		}
	}
	now := r.cfg.Now()
	members := map[string]gossip.Member{}
	for _, m := range r.src.Members() {
		members[m.Name] = m
	}
	var errs []error

	for _, m := range members {
		if m.Name == n.cfg.ID || m.State != gossip.Alive {
			continue
		}
		why := r.addable(m)
		s, known := servers[m.Name]
		if why == "" && known && s.Suffrage == raft.Voter && string(s.Address) == m.Meta.RaftAddr {
			delete(r.refused, m.Name)
			continue
		}
		if why == "" {
			var server *raft.Server
			if known {
				server = &s
			}
			why = n.confirmMember(ctx, m, server)
		}
		if why != "" {
			if r.refused[m.Name] != why {
				r.refused[m.Name] = why
				n.log.Warn("gossip member not added to raft", "member", m.Name, "why", why)
			}
			continue
		}
		delete(r.refused, m.Name)
		if err := n.AddServer(ctx, m.Name, m.Meta.RaftAddr, m.Meta.PeerAddr, true); err != nil {
			errs = append(errs, err)
			continue
		}
		was := "absent"
		if known {
			was = s.Suffrage.String() + " at " + string(s.Address)
		}
		n.log.Info("reconcile: alive gossip member made a raft voter", "member", m.Name, "raft", m.Meta.RaftAddr, "was", was)
		if !known || s.Suffrage != raft.Voter {
			voters++
		}
	}

	for id, s := range servers {
		if id == n.cfg.ID {
			continue
		}
		m, known := members[id]
		if known {
			delete(r.missing, id)
		} else if _, ok := r.missing[id]; !ok {
			r.missing[id] = now
		}
		var why string
		switch {
		case known && m.State == gossip.Left:
			why = "left the cluster"
		case known && m.State == gossip.Dead && now.Sub(m.Since) >= r.cfg.CleanupInterval && r.raftUnreachable(id, now):
			why = fmt.Sprintf("dead for %s and unreachable by raft", now.Sub(m.Since).Round(time.Second))
		case !known && now.Sub(r.missing[id]) >= r.cfg.CleanupInterval && r.raftUnreachable(id, now):
			why = fmt.Sprintf("unknown to gossip for %s and unreachable by raft", now.Sub(r.missing[id]).Round(time.Second))
		default:
			continue
		}
		if s.Suffrage == raft.Voter && voters-1 < r.cfg.MinQuorum {
			n.log.Debug("reconcile: not removing a voter below the minimum quorum", "server", id, "why", why, "voters", voters, "min_quorum", r.cfg.MinQuorum)
			continue
		}
		if err := n.RemoveServer(ctx, id); err != nil {
			errs = append(errs, err)
			continue
		}
		n.log.Info("reconcile: raft server removed", "server", id, "why", why)
		delete(r.missing, id)
		if s.Suffrage == raft.Voter {
			voters--
		}
	}
	return errors.Join(errs...)
}

// addable says why a member cannot become a voter ("" if it can).
func (r *reconciler) addable(m gossip.Member) string {
	switch {
	case m.Meta.RaftAddr == "":
		return "it advertises no raft address"
	case m.Meta.ID != "" && m.Meta.ID != m.Name:
		return fmt.Sprintf("its metadata names it %q", m.Meta.ID)
	case m.Meta.ClusterID != "" && r.n.ClusterID() != "" && m.Meta.ClusterID != r.n.ClusterID():
		return fmt.Sprintf("its data belongs to cluster %s, this is cluster %s", m.Meta.ClusterID, r.n.ClusterID())
	}
	return ""
}

// certifiedRemote is a Remote that also gives the certificate a replica presented on its
// peer port (peerRemote is one).
type certifiedRemote interface {
	CertifiedStatusOf(ctx context.Context, addr string) (peer.Status, *x509.Certificate, error)
}

// confirmMember says why the leader must not make gossip member m a voter yet ("" when it
// may); s is the server of that name in the configuration, nil when there is none. With
// RaftTLS on, the gossip key alone does not admit a replica: the leader asks the member over
// its peer port, where it must present a certificate from the cluster's CA (and accept
// ours), and the answer must name the member and its Raft address. A member that is a
// server already and would move to other addresses must present a certificate naming it
// (its id, or the addresses it has), as a join must: a certificate of the CA for another
// host cannot take a replica's place. Without RaftTLS (or without a peer client) gossip
// membership is trusted as before.
func (n *Node) confirmMember(ctx context.Context, m gossip.Member, s *raft.Server) string {
	if n.cfg.RaftTLS == nil || n.cfg.Remote == nil {
		return ""
	}
	if m.Meta.PeerAddr == "" {
		return "it advertises no peer address to prove its certificate on"
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var (
		st   peer.Status
		cert *x509.Certificate
		err  error
	)
	if cr, ok := n.cfg.Remote.(certifiedRemote); ok {
		st, cert, err = cr.CertifiedStatusOf(cctx, m.Meta.PeerAddr)
	} else {
		st, err = n.cfg.Remote.StatusOf(cctx, m.Meta.PeerAddr)
	}
	if err != nil {
		return fmt.Sprintf("its peer port %s did not answer over mutual TLS: %v", m.Meta.PeerAddr, err)
	}
	if st.ID != m.Name || st.RaftAddr != m.Meta.RaftAddr {
		return fmt.Sprintf("its peer port %s answers as %q with raft address %s, gossip says %q at %s",
			m.Meta.PeerAddr, st.ID, st.RaftAddr, m.Name, m.Meta.RaftAddr)
	}
	if s != nil && cert != nil && !certNames(cert, string(s.ID), n.memberAddrs(*s)...) {
		return fmt.Sprintf("it is server %s at %s, and the certificate on its peer port %s names neither that id nor its addresses (a replica moves with a certificate naming its id)",
			s.ID, s.Address, m.Meta.PeerAddr)
	}
	return ""
}
