package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// defaultShutdownTimeout bounds the wait for in-flight requests when the config leaves it 0.
const defaultShutdownTimeout = 30 * time.Second

// errShuttingDown is what /readyz reports once a replica has begun to stop.
var errShuttingDown = errors.New("shutting down")

// drainState is a replica's stop: once it starts, /readyz fails and responses close their
// connections; Close runs once and every caller gets its result.
type drainState struct {
	draining atomic.Bool
	once     sync.Once
	err      error
}

// Close drains the replica (see Shutdown) and stops it; a second call returns the first's
// result.
func (r *Replica) Close() error { return r.Shutdown(nil) }

// Shutdown stops the replica in the order a load balancer in front of it needs:
//
//  1. /readyz fails at once while the client port keeps serving, and every response from
//     now on closes its connection, so the balancer's pooled keep-alive connections to this
//     replica go away with the last request it sends them;
//  2. ShutdownDelay passes (or skip closes), long enough for the balancer's health checks
//     to take the replica out: closing the port before that would race the requests the
//     balancer is still sending (a request written on an idle connection as the server
//     closes it is lost, not refused);
//  3. leadership is handed to a follower if this replica leads, so the cluster does not
//     wait an election timeout for new bindings;
//  4. the client port closes: new connections are refused and in-flight requests and
//     streams finish, cut after ShutdownTimeout;
//  5. everything Start opened closes in reverse: the admin port, the background loops, the
//     peer port, the Raft node, gossip, the remaining listeners and the peer clients, all
//     within ShutdownTimeout again; a part still closing then is named in the log with
//     every goroutine's stack and left behind (unwind), so a stop always ends.
//
// skip, when it closes, cuts step 2 short (an operator's second signal).
func (r *Replica) Shutdown(skip <-chan struct{}) error {
	r.drain.once.Do(func() { r.drain.err = r.stop(skip) })
	return r.drain.err
}

func (r *Replica) stop(skip <-chan struct{}) error {
	delay := r.cfg.ShutdownDelay
	r.drain.draining.Store(true)
	// A request that finds no read lease from now on is refused at once (a 503 the balancer
	// retries on another replica), not held up to --bind-wait by a replica that is leaving.
	r.node.SetStopping()
	r.log.Info("shutdown: /readyz now fails, the client port keeps serving", "shutdown_delay", delay)
	if delay > 0 {
		t := time.NewTimer(delay)
		select {
		case <-t.C:
			r.log.Info("shutdown: delay over")
		case <-skip:
			t.Stop()
			r.log.Info("shutdown: delay cut short")
		}
	}
	r.handOverLeadership()
	timeout := r.cfg.ShutdownTimeout
	if timeout <= 0 {
		timeout = defaultShutdownTimeout
	}
	r.log.Info("shutdown: client port closed, waiting for in-flight requests", "shutdown_timeout", timeout)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	err := r.http.Shutdown(ctx)
	if r.picker != nil {
		// The gateway's streams finish within the same bound; the picker reported
		// NOT_SERVING since the drain began (its readiness is the replica's).
		if perr := r.picker.Shutdown(ctx); perr != nil && err == nil {
			err = perr
		}
	}
	cancel()
	if err != nil {
		// Past the bound the streams still open are cut: their clients see the body end
		// early, their upstream requests are cancelled.
		_ = r.http.Close()
		err = fmt.Errorf("in-flight requests cut after --shutdown-timeout %s: %w", timeout, err)
		r.log.Warn("shutdown: in-flight requests cut", "err", err)
	} else {
		r.log.Info("shutdown: in-flight requests finished")
	}
	r.log.Info("shutdown: stopping background loops, gossip and the Raft node")
	actx, acancel := context.WithTimeout(context.Background(), 5*time.Second)
	if aerr := r.admin.Shutdown(actx); aerr != nil {
		_ = r.admin.Close()
	}
	acancel()
	if uerr := r.unwind(r.closeBound()); uerr != nil {
		err = errors.Join(err, uerr)
	}
	r.log.Info("shutdown: stopped")
	return err
}

// handOverLeadership transfers Raft leadership to a follower when this replica leads one
// that has others; a failure only costs the cluster an election timeout, so it is logged.
func (r *Replica) handOverLeadership() {
	n := r.node
	handed, err := n.HandOverLeadership()
	switch {
	case err != nil:
		r.log.Warn("shutdown: leadership transfer failed; the others elect a leader after the election timeout", "err", err)
	case !handed:
		r.log.Info("shutdown: no leadership to transfer (not the leader, or the only voter)")
	default:
		lid, _, _ := n.Leader()
		logHandedOver(r.log, lid)
	}
}

// logHandedOver says where leadership went: to lid, or to no replica known yet (its
// first heartbeat has not arrived, or every replica is stopping at once).
func logHandedOver(log *slog.Logger, lid string) {
	if lid == "" {
		log.Info("shutdown: leadership transferred; no leader known yet (the others elect one, unless they are stopping too)")
		return
	}
	log.Info("shutdown: leadership transferred", "leader", lid)
}

// closeWhileDraining makes every response of a stopping replica close its connection, so a
// client (or balancer) holding a keep-alive connection learns it cannot reuse it instead of
// finding it closed under its next request.
func (r *Replica) closeWhileDraining(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if r.drain.draining.Load() {
			w.Header().Set("Connection", "close")
		}
		h.ServeHTTP(w, req)
	})
}
