package main

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
)

// adminAPI is the operator's API on the admin listener, behind a bearer token:
//
//	GET    /admin/workers                   workers with health, drain state and bindings
//	POST   /admin/workers                   add a worker (a WorkerSpec as JSON), cluster-wide
//	POST   /admin/workers/{id}/drain        drain a worker (its sessions move on their next request)
//	DELETE /admin/workers/{id}              remove a worker
//	GET    /admin/sessions/{id}             a session's binding
//	DELETE /admin/sessions/{id}[?revision=] invalidate a session's binding
//	GET    /admin/cluster                   this replica, the leader, members, raft indexes
//	POST   /admin/cluster/transfer-leadership[?to=id]
//	DELETE /admin/cluster/servers/{id}      remove a replica from the Raft configuration
//	POST   /admin/cluster/snapshot          take a Raft snapshot now
//
// Writes go through the leader from any replica, except leadership transfer and snapshots,
// which act on the replica asked (a follower answers 409 naming the leader for a transfer).
type adminAPI struct {
	rep   *replica
	token string
}

// adminError is the admin API's error shape.
type adminError struct {
	Error string `json:"error"`
}

func writeAdminJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func adminFail(w http.ResponseWriter, status int, format string, args ...any) {
	writeAdminJSON(w, status, adminError{Error: fmt.Sprintf(format, args...)})
}

// handler returns the admin routes wrapped in the token check, beside /metrics.
func (a *adminAPI) handler(metrics http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", metrics)
	mux.HandleFunc("GET /admin/workers", a.listWorkers)
	mux.HandleFunc("POST /admin/workers", a.addWorker)
	mux.HandleFunc("POST /admin/workers/{id}/drain", a.drainWorker)
	mux.HandleFunc("DELETE /admin/workers/{id}", a.removeWorker)
	mux.HandleFunc("GET /admin/sessions/{id}", a.getSession)
	mux.HandleFunc("DELETE /admin/sessions/{id}", a.invalidateSession)
	mux.HandleFunc("GET /admin/cluster", a.clusterStatus)
	mux.HandleFunc("POST /admin/cluster/transfer-leadership", a.transferLeadership)
	mux.HandleFunc("DELETE /admin/cluster/servers/{id}", a.removeServer)
	mux.HandleFunc("POST /admin/cluster/snapshot", a.snapshot)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/admin/") && !a.authorized(r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="kvrouter-ha admin"`)
			adminFail(w, http.StatusUnauthorized, "missing or wrong bearer token")
			return
		}
		mux.ServeHTTP(w, r)
	})
}

func (a *adminAPI) authorized(r *http.Request) bool {
	if a.token == "" {
		return true
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(got), []byte(a.token)) == 1
}

func (a *adminAPI) ctx(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), 10*time.Second)
}

// apply proposes a command through the leader and answers its result.
func (a *adminAPI) apply(w http.ResponseWriter, r *http.Request, cmd fsm.Command) (*fsm.Result, bool) {
	ctx, cancel := a.ctx(r)
	defer cancel()
	res, err := a.rep.cluster.node.Apply(ctx, cmd)
	if err != nil {
		status := http.StatusServiceUnavailable
		if errors.Is(err, peer.ErrInvalid) {
			status = http.StatusBadRequest
		}
		adminFail(w, status, "%v", err)
		return nil, false
	}
	return res, true
}

// workerView is one worker as the admin API shows it.
type workerView struct {
	routing.WorkerStatus
	Bindings int  `json:"bindings"`
	Cluster  bool `json:"in_cluster_registry"`
}

func (a *adminAPI) listWorkers(w http.ResponseWriter, _ *http.Request) {
	f := a.rep.cluster.node.FSM()
	counts := map[string]int{}
	f.Range(func(b fsm.Binding) bool {
		counts[b.Worker]++
		return true
	})
	var out []workerView
	for _, st := range a.rep.registry.List() {
		_, inFSM := f.Worker(st.Spec.ID)
		out = append(out, workerView{WorkerStatus: st, Bindings: counts[st.Spec.ID], Cluster: inFSM})
	}
	writeAdminJSON(w, http.StatusOK, out)
}

func (a *adminAPI) addWorker(w http.ResponseWriter, r *http.Request) {
	var spec routing.WorkerSpec
	dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&spec); err != nil {
		adminFail(w, http.StatusBadRequest, "worker spec: %v", err)
		return
	}
	if err := routing.ValidateSpec(&spec); err != nil {
		adminFail(w, http.StatusBadRequest, "worker spec: %v", err)
		return
	}
	raw, err := json.Marshal(spec)
	if err != nil {
		adminFail(w, http.StatusInternalServerError, "%v", err)
		return
	}
	if _, ok := a.apply(w, r, &fsm.AddWorker{ID: spec.ID, Spec: raw}); ok {
		writeAdminJSON(w, http.StatusOK, spec)
	}
}

func (a *adminAPI) drainWorker(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if _, ok := a.rep.registry.Lookup(id); !ok {
		adminFail(w, http.StatusNotFound, "no worker %q", id)
		return
	}
	if _, ok := a.rep.cluster.node.FSM().Worker(id); !ok {
		// A worker from flags: register it in the cluster first, so the drain reaches every replica.
		spec, _ := a.rep.registry.Lookup(id)
		raw, _ := json.Marshal(spec)
		if _, ok := a.apply(w, r, &fsm.AddWorker{ID: id, Spec: raw}); !ok {
			return
		}
	}
	if res, ok := a.apply(w, r, &fsm.DrainWorker{ID: id}); ok {
		writeAdminJSON(w, http.StatusOK, map[string]any{"worker": id, "drained": true, "bindings_removed": res.Count})
	}
}

func (a *adminAPI) removeWorker(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	_, inReg := a.rep.registry.Lookup(id)
	_, inFSM := a.rep.cluster.node.FSM().Worker(id)
	if !inReg && !inFSM {
		adminFail(w, http.StatusNotFound, "no worker %q", id)
		return
	}
	res, ok := a.apply(w, r, &fsm.RemoveWorker{ID: id})
	if !ok {
		return
	}
	if !inFSM {
		// A worker from flags: RemoveWorker dropped its bindings all the same, but the cluster
		// registry never had it, so syncWorkers will not take it out of this replica's routing.
		_ = a.rep.registry.Remove(id)
	}
	writeAdminJSON(w, http.StatusOK, map[string]any{"worker": id, "removed": true, "bindings_removed": res.Count})
}

// sessionView is a binding as the admin API shows it.
type sessionView struct {
	Session   string `json:"session"`
	Worker    string `json:"worker"`
	DPRank    uint32 `json:"dp_rank"`
	Revision  uint64 `json:"revision"`
	TTLMillis int64  `json:"ttl_ms"`
}

func (a *adminAPI) getSession(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	b, ok := a.rep.cluster.node.FSM().Get(id)
	if !ok {
		adminFail(w, http.StatusNotFound, "session %q has no binding", id)
		return
	}
	writeAdminJSON(w, http.StatusOK, sessionView{Session: b.Session, Worker: b.Worker, DPRank: b.DPRank, Revision: b.Revision, TTLMillis: b.TTL.Milliseconds()})
}

func (a *adminAPI) invalidateSession(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	b, ok := a.rep.cluster.node.FSM().Get(id)
	if !ok {
		adminFail(w, http.StatusNotFound, "session %q has no binding", id)
		return
	}
	rev := b.Revision
	if s := r.URL.Query().Get("revision"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			adminFail(w, http.StatusBadRequest, "revision %q: %v", s, err)
			return
		}
		rev = v
	}
	res, ok := a.apply(w, r, &fsm.Invalidate{Session: id, Revision: rev})
	if !ok {
		return
	}
	if res.Status != fsm.Removed {
		adminFail(w, http.StatusConflict, "session %q not invalidated: %s (current revision %d)", id, res.Status, res.Binding.Revision)
		return
	}
	writeAdminJSON(w, http.StatusOK, map[string]any{"session": id, "invalidated_revision": rev})
}

// clusterView is the cluster as one replica sees it.
type clusterView struct {
	Self     peer.Status       `json:"self"`
	Servers  []serverView      `json:"servers"`
	Bindings int               `json:"bindings"`
	Raft     map[string]string `json:"raft"`
}

type serverView struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"`
	PeerAddr string `json:"peer_addr"`
	Suffrage string `json:"suffrage"`
	Leader   bool   `json:"leader"`
}

func (a *adminAPI) clusterStatus(w http.ResponseWriter, _ *http.Request) {
	n := a.rep.cluster.node
	view := clusterView{Self: n.Status(), Bindings: n.FSM().Len(), Raft: n.Raft().Stats()}
	f := n.Raft().GetConfiguration()
	if err := f.Error(); err == nil {
		lid, _, _ := n.Leader()
		for _, s := range f.Configuration().Servers {
			sv := serverView{ID: string(s.ID), RaftAddr: string(s.Address), Suffrage: s.Suffrage.String(), Leader: string(s.ID) == lid}
			if m, ok := n.FSM().Member(string(s.ID)); ok {
				sv.PeerAddr = m.PeerAddr
			}
			view.Servers = append(view.Servers, sv)
		}
	}
	writeAdminJSON(w, http.StatusOK, view)
}

func (a *adminAPI) transferLeadership(w http.ResponseWriter, r *http.Request) {
	n := a.rep.cluster.node
	if !n.IsLeader() {
		lid, addr, _ := n.Leader()
		adminFail(w, http.StatusConflict, "replica %s does not lead; ask the leader %s (peer %s)", n.ID(), lid, addr)
		return
	}
	var f raft.Future
	if to := r.URL.Query().Get("to"); to != "" {
		m, ok := n.FSM().Member(to)
		if !ok {
			adminFail(w, http.StatusNotFound, "no replica %q", to)
			return
		}
		f = n.Raft().LeadershipTransferToServer(raft.ServerID(to), raft.ServerAddress(m.RaftAddr))
	} else {
		f = n.Raft().LeadershipTransfer()
	}
	if err := f.Error(); err != nil {
		adminFail(w, http.StatusServiceUnavailable, "leadership transfer: %v", err)
		return
	}
	lid, _, _ := n.Leader()
	writeAdminJSON(w, http.StatusOK, map[string]any{"transferred": true, "leader": lid})
}

func (a *adminAPI) removeServer(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	ctx, cancel := a.ctx(r)
	defer cancel()
	if err := a.rep.cluster.node.Leave(ctx, id); err != nil {
		adminFail(w, http.StatusServiceUnavailable, "remove %s: %v", id, err)
		return
	}
	writeAdminJSON(w, http.StatusOK, map[string]any{"removed": id})
}

func (a *adminAPI) snapshot(w http.ResponseWriter, _ *http.Request) {
	f := a.rep.cluster.node.Raft().Snapshot()
	if err := f.Error(); err != nil {
		adminFail(w, http.StatusServiceUnavailable, "snapshot: %v", err)
		return
	}
	meta, rc, err := f.Open()
	if err != nil {
		adminFail(w, http.StatusInternalServerError, "snapshot taken, but: %v", err)
		return
	}
	rc.Close()
	writeAdminJSON(w, http.StatusOK, map[string]any{"id": meta.ID, "index": meta.Index, "term": meta.Term, "bytes": meta.Size})
}
