package cluster

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// Remote is how a node reaches other replicas' peer ports: the leader for commands,
// read-index and touches; any seed for status and join.
type Remote interface {
	// Apply forwards an encoded command to the leader and returns its encoded result.
	Apply(ctx context.Context, cmd []byte) ([]byte, uint64, error)
	ReadIndex(ctx context.Context) (uint64, error)
	Touch(ctx context.Context, touches []peer.Touch) error
	// StatusOf and JoinAt talk to one replica by its peer address.
	// Leave asks the leader to remove a replica.
	Leave(ctx context.Context, id string) error
	StatusOf(ctx context.Context, addr string) (peer.Status, error)
	JoinAt(ctx context.Context, addr string, req peer.JoinRequest) error
}

// Status reports this node for the peer Status call and the admin API.
func (n *Node) Status() peer.Status {
	st := peer.Status{
		ID:           n.cfg.ID,
		RaftAddr:     n.cfg.RaftAdvertise,
		PeerAddr:     n.cfg.PeerAddr,
		State:        n.raft.State().String(),
		Term:         n.raft.CurrentTerm(),
		CommitIndex:  n.raft.CommitIndex(),
		AppliedIndex: n.fsm.AppliedIndex(),
		ClusterID:    n.ClusterID(),
		Version:      n.cfg.Version,
	}
	if id, addr, ok := n.Leader(); ok {
		st.LeaderID, st.LeaderPeerAddr = id, addr
	}
	if lc := n.raft.LastContact(); !lc.IsZero() {
		st.LastContactMs = time.Since(lc).Milliseconds()
	}
	if n.IsLeader() {
		st.LastContactMs = 0
	}
	if fn := n.discovery.Load(); fn != nil {
		st.Discovery = (*fn)()
	}
	return st
}

// SetDiscoveryStatus makes fn tell, in this node's Status (the peer Status call), how the
// discovery duty's looks go while it runs here: a follower's admin API shows the leader's.
func (n *Node) SetDiscoveryStatus(fn func() []peer.DiscoverySource) { n.discovery.Store(&fn) }

// LeaderStatus is the leader's Status: this node's own while it leads, else asked of the
// leader over the peer port.
func (n *Node) LeaderStatus(ctx context.Context) (peer.Status, error) {
	id, addr, ok := n.Leader()
	switch {
	case !ok:
		return peer.Status{}, errors.New("no leader is known")
	case id == n.cfg.ID:
		return n.Status(), nil
	case addr == "" || n.cfg.Remote == nil:
		return peer.Status{}, fmt.Errorf("the leader %s has no known peer address", id)
	}
	st, err := n.cfg.Remote.StatusOf(ctx, addr)
	if err != nil {
		return peer.Status{}, fmt.Errorf("status of the leader %s at %s: %w", id, addr, err)
	}
	return st, nil
}

// bootstrapOrJoin brings a node without state into a cluster: alone when it expects no
// one, else by joining a live leader found through the seeds, else by bootstrapping with
// the first BootstrapExpect unbootstrapped replicas it can see (lowest ids).
func (n *Node) bootstrapOrJoin() {
	defer n.wg.Done()
	if n.cfg.BootstrapExpect <= 1 && len(n.cfg.Join) == 0 {
		if err := n.bootstrap([]peer.Status{n.Status()}); err != nil {
			n.log.Error("bootstrap", "err", err)
		}
		return
	}
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	// lastErr keeps a failure that repeats every tick (a seed not up yet, a certificate the
	// seeds refuse) to one log line until it changes.
	var lastErr string
	for {
		if n.inConfiguration() {
			return
		}
		done, err := n.tryJoinOrBootstrap()
		msg := ""
		if err != nil {
			msg = err.Error()
		}
		if msg != "" && msg != lastErr {
			n.log.Warn("joining the cluster", "err", err)
		}
		lastErr = msg
		if done {
			return
		}
		select {
		case <-n.ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// inConfiguration reports whether this node already has a Raft configuration (someone
// added it, or it bootstrapped) and a cluster id.
func (n *Node) inConfiguration() bool {
	f := n.raft.GetConfiguration()
	if f.Error() != nil || len(f.Configuration().Servers) == 0 {
		return false
	}
	return n.ClusterID() != ""
}

func (n *Node) tryJoinOrBootstrap() (bool, error) {
	if n.cfg.Remote == nil {
		return false, errors.New("no peer client to reach the seeds")
	}
	ctx, cancel := context.WithTimeout(n.ctx, 2*time.Second)
	defer cancel()
	seen := map[string]peer.Status{n.cfg.ID: n.Status()}
	// unanswered says why seeds did not answer, so that a replica that cannot join (a
	// certificate the others refuse, a wrong address) says so rather than waiting quietly.
	var unanswered []error
	for _, addr := range n.seedAddrs(ctx) {
		st, err := n.cfg.Remote.StatusOf(ctx, addr)
		if err != nil {
			unanswered = append(unanswered, fmt.Errorf("seed %s: %w", addr, err))
			continue
		}
		if st.ID == "" || st.ID == n.cfg.ID {
			continue
		}
		if st.LeaderID != "" && st.ClusterID != "" {
			return n.joinVia(ctx, st)
		}
		seen[st.ID] = st
	}
	var fresh []peer.Status
	for _, st := range seen {
		if st.ClusterID == "" {
			fresh = append(fresh, st)
		}
	}
	if len(fresh) < n.cfg.BootstrapExpect {
		if len(unanswered) > 0 {
			return false, fmt.Errorf("found no leader and %d of the %d replicas needed to bootstrap: %w",
				len(fresh), n.cfg.BootstrapExpect, errors.Join(unanswered...))
		}
		return false, nil
	}
	slices.SortFunc(fresh, func(a, b peer.Status) int { return strings.Compare(a.ID, b.ID) })
	fresh = fresh[:n.cfg.BootstrapExpect]
	if !slices.ContainsFunc(fresh, func(s peer.Status) bool { return s.ID == n.cfg.ID }) {
		return false, nil // not among the founders: join once they have a leader
	}
	return true, n.bootstrap(fresh)
}

// joinVia asks the leader a seed named to add this node.
func (n *Node) joinVia(ctx context.Context, st peer.Status) (bool, error) {
	if err := n.setClusterID(st.ClusterID); err != nil {
		// Refuse for good: a data directory of another cluster must not mix in.
		n.log.Error("refusing to join", "err", err)
		return true, err
	}
	addr := st.LeaderPeerAddr
	if addr == "" {
		addr = st.PeerAddr
	}
	err := n.cfg.Remote.JoinAt(ctx, addr, peer.JoinRequest{
		ID: n.cfg.ID, RaftAddr: n.cfg.RaftAdvertise, PeerAddr: n.cfg.PeerAddr, ClusterID: st.ClusterID, Voter: true,
	})
	if err != nil {
		return false, fmt.Errorf("join via %s: %w", addr, err)
	}
	n.log.Info("joined the cluster", "leader", st.LeaderID, "cluster_id", st.ClusterID)
	return true, nil
}

// bootstrap starts a new cluster of these founders. Every founder computes the same
// configuration and cluster id from the same list.
func (n *Node) bootstrap(founders []peer.Status) error {
	var conf raft.Configuration
	h := xxhash.New()
	for _, f := range founders {
		conf.Servers = append(conf.Servers, raft.Server{ID: raft.ServerID(f.ID), Address: raft.ServerAddress(f.RaftAddr), Suffrage: raft.Voter})
		_, _ = h.WriteString(f.ID + "=" + f.RaftAddr + ";")
		n.memMu.Lock()
		n.pendingMembers = append(n.pendingMembers, fsm.Member{ID: f.ID, RaftAddr: f.RaftAddr, PeerAddr: f.PeerAddr})
		n.memMu.Unlock()
	}
	id := hex.EncodeToString(h.Sum(nil))
	if err := n.setClusterID(id); err != nil {
		return err
	}
	if err := n.raft.BootstrapCluster(conf).Error(); err != nil && !errors.Is(err, raft.ErrCantBootstrap) {
		return fmt.Errorf("bootstrap: %w", err)
	}
	n.log.Info("bootstrapped a new cluster", "cluster_id", id, "founders", len(founders))
	return nil
}

// seedAddrs resolves the join seeds: a host that resolves to several addresses (a headless
// Service) yields each.
func (n *Node) seedAddrs(ctx context.Context) []string {
	var out []string
	for _, s := range n.cfg.Join {
		host, port, err := net.SplitHostPort(s)
		if err != nil {
			out = append(out, s)
			continue
		}
		// With mutual TLS a seed is dialled by its name: the replicas' certificates name
		// hosts, not the addresses a name resolves to (a Kubernetes headless Service's pod
		// IPs are not known when the certificate is made). The dial picks one of the name's
		// addresses, and the join loop retries until it reaches a live one.
		if net.ParseIP(host) != nil || n.cfg.RaftTLS != nil {
			out = append(out, s)
			continue
		}
		ips, err := net.DefaultResolver.LookupHost(ctx, host)
		if err != nil {
			out = append(out, s)
			continue
		}
		for _, ip := range ips {
			out = append(out, net.JoinHostPort(ip, port))
		}
	}
	return out
}

// recordMembers (leader) writes this node's and the founders' peer addresses into the FSM
// so that every replica can find the leader's peer port.
func (n *Node) recordMembers(ctx context.Context) error {
	n.memMu.Lock()
	want := append([]fsm.Member{{ID: n.cfg.ID, RaftAddr: n.cfg.RaftAdvertise, PeerAddr: n.cfg.PeerAddr}}, n.pendingMembers...)
	n.memMu.Unlock()
	for _, m := range want {
		if cur, ok := n.fsm.Member(m.ID); ok && cur == m {
			continue
		}
		if m.ID != n.cfg.ID {
			if cur, ok := n.fsm.Member(m.ID); ok && cur.PeerAddr != "" {
				continue // the member's own report wins over the founders' list
			}
		}
		b, err := fsm.Encode(&fsm.SetMember{Member: m})
		if err != nil {
			return err
		}
		if _, _, err := n.applyLocal(ctx, b); err != nil {
			return err
		}
	}
	return nil
}

// PeerHandler serves the peer port for this node.
func (n *Node) PeerHandler() peer.Handler { return handler{n} }

// handler implements peer.Handler: every write only on the leader, never applied locally
// by a follower.
type handler struct{ n *Node }

func (h handler) notLeader() error {
	id, addr, _ := h.n.Leader()
	return &peer.NotLeaderError{LeaderID: id, LeaderAddr: addr}
}

func (h handler) Apply(ctx context.Context, cmd []byte) ([]byte, uint64, error) {
	if !h.n.IsLeader() {
		return nil, 0, h.notLeader()
	}
	if _, err := fsm.Decode(cmd); err != nil {
		return nil, 0, fmt.Errorf("%w: %w", peer.ErrInvalid, err)
	}
	res, idx, err := h.n.applyLeader(ctx, cmd)
	if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost) {
		return nil, 0, h.notLeader()
	}
	if res == nil {
		return nil, 0, err
	}
	out, eerr := fsm.EncodeResult(res)
	if eerr != nil {
		return nil, 0, eerr
	}
	return out, idx, nil
}

func (h handler) ReadIndex(ctx context.Context) (uint64, error) {
	if !h.n.IsLeader() {
		return 0, h.notLeader()
	}
	return h.n.lead.readIndex(ctx)
}

func (h handler) Touch(_ context.Context, touches []peer.Touch) error {
	if !h.n.IsLeader() {
		return h.notLeader()
	}
	for _, t := range touches {
		if err := h.n.lead.touch(t.Session, t.Revision, t.Age); err != nil {
			// The sender keeps its touches and sends them again (peer.Forwarder retries).
			return fmt.Errorf("%w: %w", peer.ErrUnavailable, err)
		}
	}
	return nil
}

func (h handler) Status(context.Context) (peer.Status, error) { return h.n.Status(), nil }

func (h handler) Join(ctx context.Context, req peer.JoinRequest) error {
	if !h.n.IsLeader() {
		return h.notLeader()
	}
	if req.ID == "" || req.RaftAddr == "" {
		return fmt.Errorf("%w: join needs an id and a raft address", peer.ErrInvalid)
	}
	if err := h.n.authorizeJoin(ctx, req); err != nil {
		return err
	}
	if req.ClusterID != "" && req.ClusterID != h.n.ClusterID() {
		return fmt.Errorf("%w: replica %s belongs to cluster %s, this is cluster %s", peer.ErrInvalid, req.ID, req.ClusterID, h.n.ClusterID())
	}
	return h.n.AddServer(ctx, req.ID, req.RaftAddr, req.PeerAddr, req.Voter)
}

func (h handler) Leave(ctx context.Context, id string) error {
	if !h.n.IsLeader() {
		return h.notLeader()
	}
	return h.n.RemoveServer(ctx, id)
}

// AddServer (leader) adds a replica to the Raft configuration and records its addresses.
func (n *Node) AddServer(ctx context.Context, id, raftAddr, peerAddr string, voter bool) error {
	var f raft.IndexFuture
	if voter {
		f = n.raft.AddVoter(raft.ServerID(id), raft.ServerAddress(raftAddr), 0, 10*time.Second)
	} else {
		f = n.raft.AddNonvoter(raft.ServerID(id), raft.ServerAddress(raftAddr), 0, 10*time.Second)
	}
	if err := f.Error(); err != nil {
		return fmt.Errorf("add %s: %w", id, err)
	}
	b, err := fsm.Encode(&fsm.SetMember{Member: fsm.Member{ID: id, RaftAddr: raftAddr, PeerAddr: peerAddr}})
	if err != nil {
		return err
	}
	_, _, err = n.applyLocal(ctx, b)
	n.log.Info("replica added", "id", id, "raft", raftAddr, "peer", peerAddr, "voter", voter)
	return err
}

// Leave removes a replica from the cluster, through the leader from any replica.
func (n *Node) Leave(ctx context.Context, id string) error {
	if n.IsLeader() {
		return n.RemoveServer(ctx, id)
	}
	if n.cfg.Remote == nil {
		return ErrNoLeader
	}
	return n.cfg.Remote.Leave(ctx, id)
}

// RemoveServer (leader) removes a replica from the Raft configuration.
func (n *Node) RemoveServer(ctx context.Context, id string) error {
	if err := n.raft.RemoveServer(raft.ServerID(id), 0, 10*time.Second).Error(); err != nil {
		return fmt.Errorf("remove %s: %w", id, err)
	}
	b, err := fsm.Encode(&fsm.RemoveMember{ID: id})
	if err != nil {
		return err
	}
	_, _, err = n.applyLocal(ctx, b)
	n.log.Info("replica removed", "id", id)
	return err
}
