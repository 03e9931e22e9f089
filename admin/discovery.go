package admin

import (
	"context"
	"net/http"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

// Discovery tells how the discovery duty's sources are doing (the replica wires the
// discovery package's Duty and the Raft node).
type Discovery interface {
	// Sources names the sources configured on this replica, in their flags' order.
	Sources() []string
	// Looks reports whether the duty runs on this replica now (it leads) and then each
	// source's looks, in the order of Sources.
	Looks() (running bool, looks []peer.DiscoverySource)
	// LeaderStatus is the leader's peer Status, whose Discovery holds its looks.
	LeaderStatus(ctx context.Context) (peer.Status, error)
}

// SourceView is one discovery source as GET /admin/discovery shows it: its looks on the
// replica that runs them and the workers the cluster registry holds from it.
type SourceView struct {
	peer.DiscoverySource
	// Workers is how many workers of the registry the source owns and lists (kept as they
	// are while it fails); Gone how many more it no longer lists (draining, then removed).
	Workers int `json:"workers"`
	Gone    int `json:"gone,omitempty"`
}

// DiscoveryView is the discovery duty as one replica sees it (GET /admin/discovery). Only the
// leader runs the duty: a follower asks the leader for its looks over the peer port, and
// says why when it cannot.
type DiscoveryView struct {
	// Replica is the replica answering.
	Replica string `json:"replica"`
	// Running is true on the replica that runs the duty now (the leader).
	Running bool `json:"running"`
	// LooksFrom is the replica whose looks the sources show: this one while it leads, else
	// the leader ("" when there are none to show).
	LooksFrom string `json:"looks_from,omitempty"`
	// LeaderID and LeaderPeerAddr name the leader this replica knows ("" while none is known).
	LeaderID       string `json:"leader_id,omitempty"`
	LeaderPeerAddr string `json:"leader_peer_addr,omitempty"`
	// LeaderError says why a follower shows no looks: the leader could not be asked, or
	// it runs no discovery.
	LeaderError string       `json:"leader_error,omitempty"`
	Sources     []SourceView `json:"sources"`
}

// leaderAskWithin bounds a follower's question to the leader.
const leaderAskWithin = 3 * time.Second

func (a *api) discovery(w http.ResponseWriter, r *http.Request) {
	view := DiscoveryView{Replica: a.cfg.Cluster.ID(), Sources: []SourceView{}}
	view.LeaderID, view.LeaderPeerAddr, _ = a.cfg.Cluster.Leader()
	d := a.cfg.Discovery
	if d == nil {
		writeJSON(w, http.StatusOK, view)
		return
	}
	names := d.Sources()
	var looks []peer.DiscoverySource
	view.Running, looks = d.Looks()
	switch {
	case view.Running:
		view.LooksFrom = view.Replica
	case view.LeaderID == "":
	default:
		ctx, cancel := context.WithTimeout(r.Context(), leaderAskWithin)
		st, err := d.LeaderStatus(ctx)
		cancel()
		switch {
		case err != nil:
			view.LeaderError = err.Error()
		case len(st.Discovery) == 0:
			view.LeaderError = "the leader " + st.ID + " runs no discovery (started without --discovery, or its term just began)"
		default:
			looks, view.LooksFrom = st.Discovery, st.ID
		}
	}
	if view.LooksFrom != "" {
		// The looks that count are the leader's, of its own sources.
		names = names[:0:0]
		for _, l := range looks {
			names = append(names, l.Source)
		}
	}
	byName := map[string]peer.DiscoverySource{}
	for _, l := range looks {
		byName[l.Source] = l
	}
	owners := a.cfg.Workers.Owners()
	for _, name := range names {
		v := SourceView{DiscoverySource: byName[name]}
		v.Source = name
		for _, o := range owners {
			if o.Source != workers.DiscoveryOwner(name) {
				continue
			}
			if o.Gone {
				v.Gone++
			} else {
				v.Workers++
			}
		}
		view.Sources = append(view.Sources, v)
	}
	writeJSON(w, http.StatusOK, view)
}
