package jepsen

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Shape of a stale step.
const (
	// staleSessions is how many recently active sessions a stale step rebinds.
	staleSessions = 12
	// staleLeadFactor times the stale bound is how long after the last rebind was
	// acknowledged the probes go out: past the bound, so an old binding in their answers is
	// a violation, not a lag.
	staleLeadFactor = 1.5
)

// staleStep is the stale fault: pause (SIGSTOP) or cut off one replica; through the leader of
// the others, drop the binding of recently active sessions and bind each anew on another
// worker; wait past the stale bound; then probe the faulted replica directly with those
// sessions, once while it is still paused or cut off (those requests wait in its queue and run
// as it returns) and once the moment it resumes or heals. Every answer must carry the new
// binding or a newer one, or be an error: the checker's revision order flags an old one.
func (n *nemesis) staleStep(ctx context.Context, s Step) error {
	f := n.f
	heal := context.WithoutCancel(ctx)
	r, how := f.pick(ctx, s)
	if r == nil {
		return errors.New("no running replica to hit")
	}
	mode := s.Mode
	if mode == "partition" {
		if ok, why := f.net.canPartition(); !ok {
			mode = "stop"
			how += "; partition not possible (" + why + "), stopped instead"
		}
	}
	var others []*replica
	var cut [][2]int
	for _, o := range f.replicas {
		if o != r {
			others = append(others, o)
			cut = append(cut, [2]int{r.index, o.index})
		}
	}
	id := n.rec.beginFault(FaultStale, []string{r.ID}, fmt.Sprintf("%s %s (%s), rebind through the others, probe it as it returns", mode, r.ID, how))
	began := time.Now()
	var err error
	if mode == "stop" {
		err = r.proc.Pause()
	} else {
		err = f.net.partition(ctx, f, cut)
	}
	if err != nil {
		n.rec.faultError(id, err)
	}
	resume := func() {
		var err error
		if mode == "stop" {
			err = r.proc.Resume()
		} else {
			err = f.net.heal(heal, f)
		}
		if err != nil {
			n.rec.faultError(id, err)
		}
		n.rec.endFault(id)
	}

	rebound := n.rebindThroughOthers(ctx, id, others)
	// The probes must go out more than the bound after the last acknowledgement, and the
	// fault lasts at least its planned hold.
	lead := time.Duration(staleLeadFactor * float64(max(n.cfg.StaleBound, 0)))
	_ = sleep(ctx, max(lead, time.Until(began.Add(s.Hold))))
	w := &workload{f: f, rec: n.rec, cfg: n.cfg}
	probe := &client{id: n.cfg.Clients, w: w} // one client id past the workload's
	var wg sync.WaitGroup
	fire := func(lane int) {
		for _, sess := range rebound {
			wg.Go(func() {
				body := probeBody(sess)
				op := probe.send(ctx, &session{name: sess}, r.ID, "", lane, false, false, body)
				op.Nemesis = "probe"
				n.rec.addOp(op)
			})
		}
	}
	fire(1) // queued on the paused replica, or asked while it is cut off
	if ctx.Err() == nil {
		_ = sleep(ctx, 100*time.Millisecond)
	}
	resume()
	fire(2) // the moment it is back
	wg.Wait()
	n.recover(ctx, id)
	return nil
}

func probeBody(session string) []byte {
	b, _ := json.Marshal(chatRequest{Model: "sim-model", MaxTokens: 2, Messages: []chatMessage{
		{Role: "user", Content: "Session " + session + ": are you still there?"},
	}})
	return b
}

// rebindThroughOthers drops, through the leader among others, the bindings of up to
// staleSessions recently active sessions and binds each on another worker (X-Target-Worker),
// recording both; it returns the sessions that got a new binding.
func (n *nemesis) rebindThroughOthers(ctx context.Context, fault int, others []*replica) []string {
	f := n.f
	leader, err := f.leaderAmong(ctx, others, 20*time.Second)
	if err != nil {
		n.rec.faultError(fault, fmt.Errorf("rebind: %w", err))
		return nil
	}
	now := n.rec.now()
	last := n.rec.sessionsBefore(now)
	latest := n.rec.latest(now)
	var cands []string
	for sess := range latest {
		if n.cfg.SessionTTL <= 0 || now-last[sess] < n.cfg.SessionTTL/4 {
			cands = append(cands, sess)
		}
	}
	// The most recently active first: they are the likeliest to be asked again.
	sort.Slice(cands, func(i, j int) bool {
		if last[cands[i]] != last[cands[j]] {
			return last[cands[i]] > last[cands[j]]
		}
		return cands[i] < cands[j]
	})
	cands = cands[:min(len(cands), staleSessions)]
	slices.Sort(cands)
	w := &workload{f: f, rec: n.rec, cfg: n.cfg}
	rebinder := &client{id: n.cfg.Clients, w: w}
	var out []string
	for _, sess := range cands {
		if ctx.Err() != nil {
			break
		}
		rb := n.invalidate(ctx, fault, leader, sess, latest[sess].Revision)
		n.rec.addRebind(rb)
		if rb.Result != ResultOK {
			continue
		}
		to := otherWorker(f, latest[sess].Worker, rb.Revision)
		op := rebinder.send(ctx, &session{name: sess}, leader.ID, to, 0, false, false, probeBody(sess))
		op.Nemesis = "rebind"
		n.rec.addOp(op)
		if op.Observed() && op.Revision > rb.Revision {
			out = append(out, sess)
		}
	}
	n.rec.note(leader.ID, "stale fault #%d: %d of %d sessions rebound through %s", fault, len(out), len(cands), leader.ID)
	return out
}

// otherWorker picks a worker other than from, varied by seed.
func otherWorker(f *fleet, from string, seed uint64) string {
	var ids []string
	for _, w := range f.workers {
		if w.id != from {
			ids = append(ids, w.id)
		}
	}
	if len(ids) == 0 {
		return from
	}
	return ids[seed%uint64(len(ids))]
}

// invalidate drops a session's binding at revision through r's admin API (a binding that
// has moved on since is refused, and left alone).
func (n *nemesis) invalidate(ctx context.Context, fault int, r *replica, session string, revision uint64) (rb Rebind) {
	rb = Rebind{Fault: fault, Session: session, Replica: r.ID, Invoke: n.rec.now(), Revision: revision}
	defer func() { rb.Complete = n.rec.now() }()
	u := "http://" + r.Admin + "/admin/sessions/" + url.PathEscape(session) + "?revision=" + strconv.FormatUint(revision, 10)
	req, err := http.NewRequestWithContext(ctx, http.MethodDelete, u, nil)
	if err != nil {
		rb.Result, rb.Error = ResultFail, err.Error()
		return rb
	}
	resp, err := n.f.admin.Do(req)
	if err != nil {
		// The DELETE may have reached the leader: its effect is unknown.
		rb.Result, rb.Error = ResultUnknown, err.Error()
		return rb
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		rb.Result, rb.Error = refusedRebind(resp.StatusCode, body)
		return rb
	}
	var v struct {
		Revision uint64 `json:"invalidated_revision"`
	}
	if err := json.Unmarshal(body, &v); err != nil || v.Revision != revision {
		rb.Result, rb.Error = ResultUnknown, "unexpected answer: "+strconv.Quote(string(body))
		return rb
	}
	rb.Result = ResultOK
	return rb
}

// refusedRebind classifies an invalidation the admin API did not acknowledge. A 503 saying
// the outcome is unknown is the replica's own word that the entry may have committed (it led,
// stepped down before the entry committed, and could not learn what the next leader did with
// it in time). A 409 saying the session has no binding at all may still answer this very
// DELETE when the replica forwarded it to a leader that stopped answering (a pause) and sent
// it again to the next one, which found nothing left. Both are unknown, not failed. (A
// replica that led and stepped down answered such a 409 too until it learned to settle its
// own entry: issue 29's one unexplained churn, r2 appending the invalidation in term 23,
// stepping down, winning term 24 and committing it, then answering its retry "not found
// (current revision 0)"; it now answers 200.) Any other refusal failed: the binding was
// another revision, or the replica had none to send.
func refusedRebind(status int, body []byte) (Result, string) {
	msg := fmt.Sprintf("%d: %s", status, strings.TrimSpace(string(body)))
	switch {
	case status == http.StatusServiceUnavailable && strings.Contains(string(body), "outcome is unknown"):
		return ResultUnknown, msg
	case status == http.StatusConflict && strings.Contains(string(body), "not found (current revision 0)"):
		return ResultUnknown, msg + " (gone: this invalidation may have removed it across a change of leader)"
	}
	return ResultFail, msg
}
