package routing

import (
	"context"
	"errors"
	"fmt"
)

// Disaggregation modes (Config.Disagg.Mode).
const (
	// DisaggNever serves every request aggregated, on one worker.
	DisaggNever = "never"
	// DisaggAlways sends every request's prefill to a prefill worker when one is routable.
	DisaggAlways = "always"
	// DisaggConditional disaggregates a request only when the part of its prompt its decode
	// worker does not hold is long enough, and the chosen prefill worker is not too loaded.
	DisaggConditional = "conditional"
)

// DisaggModes lists the accepted modes.
func DisaggModes() []string { return []string{DisaggConditional, DisaggAlways, DisaggNever} }

// DisaggConfig says when a request's prefill goes to a prefill worker of its own.
type DisaggConfig struct {
	// Mode is conditional (the default), always or never. Nothing is disaggregated while no
	// prefill worker is routable, whatever the mode.
	Mode string
	// MinUncachedTokens (conditional): disaggregate only when the decode worker would have
	// at least this many prompt tokens to compute itself (its predicted overlap excluded).
	// A prompt mostly cached where it decodes gains nothing from a prefill worker. 1024.
	MinUncachedTokens int
	// MaxPrefillQueueTokens (conditional): serve aggregated when the chosen prefill worker
	// already has more in-flight prefill tokens than this; 0 is no limit.
	MaxPrefillQueueTokens int64
}

func (c *DisaggConfig) setDefaults() error {
	if c.Mode == "" {
		c.Mode = DisaggConditional
	}
	switch c.Mode {
	case DisaggConditional, DisaggAlways, DisaggNever:
	default:
		return fmt.Errorf("disaggregation mode %q: one of %v", c.Mode, DisaggModes())
	}
	if c.MinUncachedTokens == 0 {
		c.MinUncachedTokens = 1024
	}
	if c.MinUncachedTokens < 0 || c.MaxPrefillQueueTokens < 0 {
		return errors.New("disaggregation thresholds must not be negative")
	}
	return nil
}

// Why a request is or is not disaggregated (PrefillPlan.Outcome, a metric label).
const (
	OutcomeDisaggregated = "disaggregated"
	OutcomeNever         = "never"           // the mode is never
	OutcomeNoPrefill     = "no_prefill"      // no prefill worker is routable
	OutcomeCached        = "cached"          // too little of the prompt is uncached on the decode worker
	OutcomePrefillBusy   = "prefill_busy"    // the prefill worker's queue is over the limit, or all are busy
	OutcomeTargeted      = "explicit_target" // the client named the worker (X-Target-Worker)
)

// PrefillPlan is the outcome of deciding whether a request is disaggregated.
type PrefillPlan struct {
	// Outcome is OutcomeDisaggregated or why not.
	Outcome string
	// Uncached is the number of prompt tokens the decode worker is predicted to lack.
	Uncached int
}

// prefillRequest is req's prefill leg: the same prompt, free of the session (a session binds
// its decode worker, where its KV lives afterwards) and of an explicit target or rank, for
// prefill workers only. An alias is resolved already: the leg goes as the same target.
func prefillRequest(req *Request) *Request {
	p := *req
	p.Session, p.Target, p.Role, p.DPRank, p.Alias = "", nil, RolePrefill, -1, nil
	return &p
}

// PlanPrefill decides whether the attempt's request is disaggregated, on its current
// decision (call it after Route or Retry, before dispatching). When it is, it returns the
// prefill leg, started (its load counted on the prefill worker, its prompt recorded there),
// and this attempt's own prefill tokens stop counting on the decode worker, which receives
// the prompt's KV instead of computing it. The caller dispatches the leg, then Commits,
// FirstTokens, Completes and Finishes it like any attempt, and Retries it on a failure before
// its answer. A nil leg means aggregated, with the reason in the plan.
func (a *Attempt) PlanPrefill(ctx context.Context) (*Attempt, PrefillPlan, error) {
	d, plan, err := a.choosePrefill(ctx, false)
	if err != nil || plan.Outcome != "" {
		return nil, plan, err
	}
	p := &Attempt{router: a.router, req: prefillRequest(a.req), decision: d}
	p.startDispatch()
	a.ticket.FirstToken()
	plan.Outcome = OutcomeDisaggregated
	return p, plan, nil
}

// choosePrefill chooses the prefill worker of the attempt's request, or says in the plan's
// Outcome why it is served aggregated (Outcome empty: d is the prefill worker). Conditional
// mode never queues for a prefill worker (a busy prefill fleet is a reason to prefill where
// the request decodes), and neither does a query; always waits like any selection.
func (a *Attempt) choosePrefill(ctx context.Context, query bool) (d Decision, plan PrefillPlan, err error) {
	r := a.router
	plan = a.gatePrefill()
	if plan.Outcome != "" {
		return Decision{}, plan, nil
	}
	conditional := r.cfg.Disagg.Mode == DisaggConditional
	req := prefillRequest(a.req)
	req.NoWait = conditional || query
	d, err = r.selectWorker(ctx, req, nil, nil)
	switch {
	case errors.Is(err, ErrNoWorker) && !req.NoWait:
		plan.Outcome = OutcomeNoPrefill
	case errors.Is(err, ErrBusy) || errors.Is(err, ErrNoWorker):
		plan.Outcome = OutcomePrefillBusy
	case err != nil:
		return Decision{}, plan, err
	case conditional && r.prefillQueueFull(d):
		plan.Outcome = OutcomePrefillBusy
	}
	if plan.Outcome != "" {
		return Decision{}, plan, nil
	}
	return d, plan, nil
}

// gatePrefill is the plan's part that needs no prefill worker chosen: its Outcome is set
// when the request is served aggregated, empty when a prefill worker is to be chosen.
func (a *Attempt) gatePrefill() PrefillPlan {
	r := a.router
	cfg := r.cfg.Disagg
	plan := PrefillPlan{Uncached: max(a.req.PromptTokens-a.decision.Overlap*r.cfg.BlockSize, 0)}
	switch {
	case cfg.Mode == DisaggNever:
		plan.Outcome = OutcomeNever
	case a.req.Target != nil:
		plan.Outcome = OutcomeTargeted
	case !r.hasPrefillWorker():
		plan.Outcome = OutcomeNoPrefill
	case cfg.Mode == DisaggConditional && plan.Uncached < cfg.MinUncachedTokens:
		plan.Outcome = OutcomeCached
	}
	return plan
}

// prefillQueueFull reports whether the chosen prefill worker is over the conditional mode's
// queue limit.
func (r *Router) prefillQueueFull(d Decision) bool {
	limit := r.cfg.Disagg.MaxPrefillQueueTokens
	return limit > 0 && r.deps.Load.Load(d.Target.Worker).PrefillTokens > limit
}

// QueryPrefill is PlanPrefill for a query-only decision (POST /v1/route): it answers the
// prefill worker a disaggregated request would go to, and changes nothing.
func (a *Attempt) QueryPrefill(ctx context.Context) (Decision, PrefillPlan, error) {
	d, plan, err := a.choosePrefill(ctx, true)
	if err == nil && plan.Outcome == "" {
		plan.Outcome = OutcomeDisaggregated
	}
	return d, plan, err
}

// hasPrefillWorker reports whether a prefill-role worker is routable.
func (r *Router) hasPrefillWorker() bool {
	return r.view(r.deps.Workers.Routable()).prefill
}
