package admin

import (
	"net/http"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

// Discovery tells how the discovery duty's sources are doing (the replica wires the
// discovery package's Duty).
type Discovery interface {
	// Sources names the configured sources, in their flags' order.
	Sources() []string
	// Status reports whether the duty runs on this replica now (it leads) and then each
	// source's looks, in the order of Sources.
	Status() (running bool, sources []SourceView)
}

// SourceView is one discovery source as GET /admin/discovery shows it.
type SourceView struct {
	// Source is the source's name, its flag value (file:/etc/fleet.json).
	Source string `json:"source"`
	// LastGood is when the leader's last good look at it was (zero: none in this term).
	LastGood time.Time `json:"last_good,omitzero"`
	// FailingSince is when its looks started to fail (zero: they do not).
	FailingSince time.Time `json:"failing_since,omitzero"`
	// Failures is how many looks in a row failed.
	Failures int `json:"failed_looks,omitempty"`
	// LastError is the last failed look's error.
	LastError string `json:"last_error,omitempty"`
	// SuspectDrains is how many drains the suspect rule holds.
	SuspectDrains int `json:"suspect_drains,omitempty"`
	// Workers is how many workers of the cluster registry the source owns and lists (kept
	// as they are while it fails); Gone how many more it no longer lists (draining, then removed).
	Workers int `json:"workers"`
	Gone    int `json:"gone,omitempty"`
}

// DiscoveryView is the discovery duty as one replica sees it (GET /admin/discovery). Only the
// leader runs the duty: a follower names the leader and lists the sources with the workers
// the registry holds from each, without the looks it cannot see.
type DiscoveryView struct {
	// Replica is the replica answering.
	Replica string `json:"replica"`
	// Running is true on the replica that runs the duty now (the leader): the sources'
	// look fields are its own.
	Running bool `json:"running"`
	// LeaderID and LeaderPeerAddr name the leader this replica knows ("" while none is known).
	LeaderID       string       `json:"leader_id,omitempty"`
	LeaderPeerAddr string       `json:"leader_peer_addr,omitempty"`
	Sources        []SourceView `json:"sources"`
}

func (a *api) discovery(w http.ResponseWriter, _ *http.Request) {
	view := DiscoveryView{Replica: a.cfg.Cluster.ID(), Sources: []SourceView{}}
	view.LeaderID, view.LeaderPeerAddr, _ = a.cfg.Cluster.Leader()
	if a.cfg.Discovery == nil {
		writeJSON(w, http.StatusOK, view)
		return
	}
	running, looks := a.cfg.Discovery.Status()
	view.Running = running
	owners := a.cfg.Workers.Owners()
	for i, name := range a.cfg.Discovery.Sources() {
		v := SourceView{Source: name}
		if running && i < len(looks) && looks[i].Source == name {
			v = looks[i]
		}
		v.Workers, v.Gone = 0, 0
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
