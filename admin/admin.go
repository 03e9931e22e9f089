// Package admin is a replica's operator API on the admin listener, behind a bearer token,
// and the client kvrouter-ha ctl speaks it with:
//
//	GET    /admin/workers                   workers with health, drain state and bindings
//	POST   /admin/workers                   add a worker (a routing.WorkerSpec as JSON), cluster-wide
//	POST   /admin/workers/{id}/drain        drain a worker (its sessions move on their next request)
//	DELETE /admin/workers/{id}              remove a worker
//	GET    /admin/discovery                 discovery sources: failing or not, since when, workers kept
//	GET    /admin/sessions/{id}             a session's binding
//	DELETE /admin/sessions/{id}[?revision=] invalidate a session's binding
//	GET    /admin/cluster                   this replica, the leader, members, raft indexes
//	POST   /admin/cluster/transfer-leadership[?to=id]
//	DELETE /admin/cluster/servers/{id}      remove a replica from the Raft configuration
//	POST   /admin/cluster/snapshot          take a Raft snapshot now
//	GET    /admin/models/aliases            model aliases and their weighted targets
//	GET    /admin/models/aliases/{name}     one alias
//	PUT    /admin/models/aliases/{name}     set an alias: {"targets":[{"model":..,"weight":..}]}
//	DELETE /admin/models/aliases/{name}     delete an alias
//
// Writes go through the leader from any replica, except leadership transfer and snapshots,
// which act on the replica asked (a follower answers 409 naming the leader for a transfer).
// The package declares what it needs of the replica (Cluster, Bindings, Workers, Registry)
// and knows nothing of Raft itself.
package admin

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

	"github.com/kvrouter-ha/kvrouter-ha/cluster"
	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/peer"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

// Cluster is the replica's Raft membership as an operator drives it (cluster.Node is one).
type Cluster interface {
	ID() string
	Status() peer.Status
	Servers() ([]cluster.Server, error)
	RaftStats() map[string]string
	Leader() (id, peerAddr string, ok bool)
	// TransferLeadership hands leadership on (to "" for any follower); cluster.ErrNotLeader
	// on a follower, cluster.ErrUnknownReplica for a name not in the cluster.
	TransferLeadership(to string) (string, error)
	Leave(ctx context.Context, id string) error
	Snapshot() (cluster.SnapshotInfo, error)
	// Apply proposes a command through the leader.
	Apply(ctx context.Context, cmd fsm.Command) (*fsm.Result, error)
}

// Bindings reads the replica's session bindings (*fsm.FSM is one).
type Bindings interface {
	Get(session string) (fsm.Binding, bool)
	Range(fn func(fsm.Binding) bool)
	Len() int
}

// Workers carries out worker orders (*workers.Lifecycle is one).
type Workers interface {
	Add(ctx context.Context, spec routing.WorkerSpec) (routing.WorkerSpec, error)
	Drain(ctx context.Context, id string) (int, error)
	Remove(ctx context.Context, id string) (int, error)
	InCluster(id string) bool
	// Owners is each cluster-registered worker's owner, by id (see workers.Owned).
	Owners() map[string]workers.Owned
}

// Registry lists the workers this replica routes to (*routing.Registry is one).
type Registry interface {
	List() []routing.WorkerStatus
}

// Config is what the API serves.
type Config struct {
	// Token guards /admin/* ("" leaves it open: keep the listener on loopback then).
	Token    string
	Cluster  Cluster
	Bindings Bindings
	Workers  Workers
	Registry Registry
	// Aliases reads the model aliases (nil: the alias endpoints answer 404).
	Aliases Aliases
	// Discovery reports the discovery duty's sources (nil: no discovery; GET
	// /admin/discovery then lists none).
	Discovery Discovery
	// Metrics serves /metrics beside the API (nil: none).
	Metrics http.Handler
	// StaticSource names where a worker that is not in the cluster registry came from:
	// SourceFlags or SourceFile (nil: SourceFlags).
	StaticSource func(id string) string
}

// Where a worker came from (WorkerView.Source); a discovered worker's source is its
// discovery source's owner name, "discovery:" and the source (discovery:file:/etc/fleet.json).
const (
	SourceFlags = "flags" // --worker
	SourceFile  = "file"  // --workers-file
	SourceAdmin = "admin" // the admin API (ctl workers add), or a drain of a flags or file worker
)

// A worker's state (WorkerView.State).
const (
	StateActive   = "active"   // routable when healthy
	StateDraining = "draining" // drained: no new requests, in-flight ones finish
	StateGone     = "gone"     // its discovery source no longer lists it: drained, then removed
	// StateNotReady: its discovery source says it is not ready: no new requests, its bindings
	// kept (drained as gone after --discovery-not-ready-grace).
	StateNotReady = "not_ready"
)

// Error is the API's error shape.
type Error struct {
	Error string `json:"error"`
}

// WorkerView is one worker as GET /admin/workers shows it.
type WorkerView struct {
	routing.WorkerStatus
	Bindings int  `json:"bindings"`
	Cluster  bool `json:"in_cluster_registry"`
	// Source is where the worker came from: SourceFlags, SourceFile, SourceAdmin or
	// "discovery:NAME".
	Source string `json:"source"`
	// State is StateActive, StateDraining, StateGone or StateNotReady.
	State string `json:"state"`
}

// SessionView is a binding as GET /admin/sessions/{id} shows it.
type SessionView struct {
	Session   string `json:"session"`
	Worker    string `json:"worker"`
	DPRank    uint32 `json:"dp_rank"`
	Revision  uint64 `json:"revision"`
	TTLMillis int64  `json:"ttl_ms"`
	// Model is the alias target the session is sent as, when it was bound through an alias.
	Model string `json:"model,omitempty"`
}

// ClusterView is the cluster as one replica sees it (GET /admin/cluster).
type ClusterView struct {
	Self     peer.Status       `json:"self"`
	Servers  []cluster.Server  `json:"servers"`
	Bindings int               `json:"bindings"`
	Raft     map[string]string `json:"raft"`
}

// api serves Config.
type api struct{ cfg Config }

// Handler returns the admin routes, wrapped in the token check, beside /metrics.
func Handler(cfg Config) http.Handler {
	a := &api{cfg: cfg}
	mux := http.NewServeMux()
	if cfg.Metrics != nil {
		mux.Handle("/metrics", cfg.Metrics)
	}
	mux.HandleFunc("GET /admin/workers", a.listWorkers)
	mux.HandleFunc("POST /admin/workers", a.addWorker)
	mux.HandleFunc("POST /admin/workers/{id}/drain", a.drainWorker)
	mux.HandleFunc("DELETE /admin/workers/{id}", a.removeWorker)
	mux.HandleFunc("GET /admin/discovery", a.discovery)
	mux.HandleFunc("GET /admin/sessions/{id}", a.getSession)
	mux.HandleFunc("DELETE /admin/sessions/{id}", a.invalidateSession)
	mux.HandleFunc("GET /admin/cluster", a.clusterStatus)
	mux.HandleFunc("POST /admin/cluster/transfer-leadership", a.transferLeadership)
	mux.HandleFunc("DELETE /admin/cluster/servers/{id}", a.removeServer)
	mux.HandleFunc("POST /admin/cluster/snapshot", a.snapshot)
	if cfg.Aliases != nil {
		mux.HandleFunc("GET /admin/models/aliases", a.listAliases)
		mux.HandleFunc("GET /admin/models/aliases/{name}", a.getAlias)
		mux.HandleFunc("PUT /admin/models/aliases/{name}", a.setAlias)
		mux.HandleFunc("DELETE /admin/models/aliases/{name}", a.deleteAlias)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/admin/") && !a.authorized(r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="kvrouter-ha admin"`)
			fail(w, http.StatusUnauthorized, "missing or wrong bearer token")
			return
		}
		mux.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func fail(w http.ResponseWriter, status int, format string, args ...any) {
	writeJSON(w, status, Error{Error: fmt.Sprintf(format, args...)})
}

func (a *api) authorized(r *http.Request) bool {
	if a.cfg.Token == "" {
		return true
	}
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(got), []byte(a.cfg.Token)) == 1
}

func ctxOf(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), 10*time.Second)
}

// statusOf maps an order's error to its answer.
func statusOf(err error) int {
	switch {
	case errors.Is(err, peer.ErrInvalid), errors.Is(err, workers.ErrInvalid), errors.Is(err, fsm.ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, workers.ErrUnknown), errors.Is(err, cluster.ErrUnknownReplica):
		return http.StatusNotFound
	}
	return http.StatusServiceUnavailable
}

// apply proposes a command through the leader and answers its result.
func (a *api) apply(w http.ResponseWriter, r *http.Request, cmd fsm.Command) (*fsm.Result, bool) {
	ctx, cancel := ctxOf(r)
	defer cancel()
	res, err := a.cfg.Cluster.Apply(ctx, cmd)
	if err != nil {
		fail(w, statusOf(err), "%v", err)
		return nil, false
	}
	return res, true
}

func (a *api) listWorkers(w http.ResponseWriter, _ *http.Request) {
	counts := map[string]int{}
	a.cfg.Bindings.Range(func(b fsm.Binding) bool {
		counts[b.Worker]++
		return true
	})
	owners := a.cfg.Workers.Owners()
	out := []WorkerView{}
	for _, st := range a.cfg.Registry.List() {
		owner, inCluster := owners[st.Spec.ID]
		v := WorkerView{WorkerStatus: st, Bindings: counts[st.Spec.ID], Cluster: inCluster,
			Source: owner.Source, State: StateActive}
		switch {
		case !inCluster && a.cfg.StaticSource != nil:
			v.Source = a.cfg.StaticSource(st.Spec.ID)
		case !inCluster:
			v.Source = SourceFlags
		case owner.Source == "":
			v.Source = SourceAdmin
		}
		switch {
		case st.Drained && owner.Gone:
			v.State = StateGone
		case st.Drained:
			v.State = StateDraining
		case st.NotReady:
			v.State = StateNotReady
		}
		out = append(out, v)
	}
	writeJSON(w, http.StatusOK, out)
}

func (a *api) addWorker(w http.ResponseWriter, r *http.Request) {
	var spec routing.WorkerSpec
	dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&spec); err != nil {
		_, msg := jsonerr.Describe(err)
		fail(w, http.StatusBadRequest, "worker spec: %s", msg)
		return
	}
	ctx, cancel := ctxOf(r)
	defer cancel()
	spec, err := a.cfg.Workers.Add(ctx, spec)
	if err != nil {
		fail(w, statusOf(err), "worker spec: %v", err)
		return
	}
	writeJSON(w, http.StatusOK, spec)
}

func (a *api) drainWorker(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	ctx, cancel := ctxOf(r)
	defer cancel()
	n, err := a.cfg.Workers.Drain(ctx, id)
	if err != nil {
		fail(w, statusOf(err), "drain %s: %v", id, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"worker": id, "drained": true, "bindings_removed": n})
}

func (a *api) removeWorker(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	ctx, cancel := ctxOf(r)
	defer cancel()
	n, err := a.cfg.Workers.Remove(ctx, id)
	if err != nil {
		fail(w, statusOf(err), "remove %s: %v", id, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"worker": id, "removed": true, "bindings_removed": n})
}

func (a *api) getSession(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	b, ok := a.cfg.Bindings.Get(id)
	if !ok {
		fail(w, http.StatusNotFound, "session %q has no binding", id)
		return
	}
	writeJSON(w, http.StatusOK, SessionView{Session: b.Session, Worker: b.Worker, DPRank: b.DPRank, Revision: b.Revision, TTLMillis: b.TTL.Milliseconds(), Model: b.Model})
}

func (a *api) invalidateSession(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	b, ok := a.cfg.Bindings.Get(id)
	if !ok {
		fail(w, http.StatusNotFound, "session %q has no binding", id)
		return
	}
	rev := b.Revision
	if s := r.URL.Query().Get("revision"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			fail(w, http.StatusBadRequest, "revision %q: %v", s, err)
			return
		}
		rev = v
	}
	res, ok := a.apply(w, r, &fsm.Invalidate{Session: id, Revision: rev})
	if !ok {
		return
	}
	if res.Status != fsm.Removed {
		fail(w, http.StatusConflict, "session %q not invalidated: %s (current revision %d)", id, res.Status, res.Binding.Revision)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"session": id, "invalidated_revision": rev})
}

func (a *api) clusterStatus(w http.ResponseWriter, _ *http.Request) {
	c := a.cfg.Cluster
	view := ClusterView{Self: c.Status(), Bindings: a.cfg.Bindings.Len(), Raft: c.RaftStats()}
	if servers, err := c.Servers(); err == nil {
		view.Servers = servers
	}
	writeJSON(w, http.StatusOK, view)
}

func (a *api) transferLeadership(w http.ResponseWriter, r *http.Request) {
	c := a.cfg.Cluster
	leader, err := c.TransferLeadership(r.URL.Query().Get("to"))
	switch {
	case errors.Is(err, cluster.ErrNotLeader):
		lid, addr, _ := c.Leader()
		fail(w, http.StatusConflict, "replica %s does not lead; ask the leader %s (peer %s)", c.ID(), lid, addr)
	case errors.Is(err, cluster.ErrUnknownReplica):
		fail(w, http.StatusNotFound, "%v", err)
	case err != nil:
		fail(w, http.StatusServiceUnavailable, "%v", err)
	default:
		writeJSON(w, http.StatusOK, map[string]any{"transferred": true, "leader": leader})
	}
}

func (a *api) removeServer(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	ctx, cancel := ctxOf(r)
	defer cancel()
	if err := a.cfg.Cluster.Leave(ctx, id); err != nil {
		fail(w, http.StatusServiceUnavailable, "remove %s: %v", id, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"removed": id})
}

func (a *api) snapshot(w http.ResponseWriter, _ *http.Request) {
	info, err := a.cfg.Cluster.Snapshot()
	if err != nil {
		fail(w, http.StatusServiceUnavailable, "%v", err)
		return
	}
	writeJSON(w, http.StatusOK, info)
}
