package jepsen

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"
)

// Step is one planned fault. A plan is a pure function of its PlanConfig, so a seed names the
// same sequence of faults on every machine; what a step hits at run time can still depend on
// the cluster (which replica leads when the step starts).
type Step struct {
	Kind FaultKind `json:"kind"`
	// Leader makes the target whoever leads when the step runs (kill, stop, and partitions
	// that isolate the leader).
	Leader bool `json:"leader,omitempty"`
	// Index is the replica (kill, stop) or worker (worker faults) hit when Leader is false.
	Index int `json:"index"`
	// Mode is "crash" or "hang" for a worker fault; "minority", "isolate-leader" or "bridge"
	// for a partition; "stop" or "partition" for a stale step (how the replica is taken away).
	Mode string `json:"mode,omitempty"`
	// Perm is a seeded order of the replicas from which a partition takes its sides.
	Perm []int `json:"perm,omitempty"`
	// Gap is the quiet time before the step; Hold how long the fault lasts.
	Gap  time.Duration `json:"gap_ns"`
	Hold time.Duration `json:"hold_ns"`
}

// String describes the step in a few words.
func (s Step) String() string {
	target := fmt.Sprintf("r%d", s.Index)
	if s.Leader {
		target = "leader"
	}
	switch s.Kind {
	case FaultRestart:
		return fmt.Sprintf("restart all, down %s", s.Hold.Round(time.Millisecond))
	case FaultWorker:
		return fmt.Sprintf("worker %s w%d for %s", s.Mode, s.Index, s.Hold.Round(time.Millisecond))
	case FaultPartition:
		return fmt.Sprintf("partition %s %v for %s", s.Mode, s.Perm, s.Hold.Round(time.Millisecond))
	case FaultStale:
		return fmt.Sprintf("stale: %s %s, rebind, probe (at least %s)", s.Mode, target, s.Hold.Round(time.Millisecond))
	case FaultDiscovery:
		return fmt.Sprintf("discover spare worker %d for %s, then take it out", s.Index, s.Hold.Round(time.Millisecond))
	}
	return fmt.Sprintf("%s %s for %s", s.Kind, target, s.Hold.Round(time.Millisecond))
}

// PlanConfig is what a nemesis plan depends on.
type PlanConfig struct {
	Seed     int64
	Kinds    []FaultKind
	Replicas int
	Workers  int
	// Duration is the whole run; faults start after Warmup and stop Cooldown before its end.
	Duration, Warmup, Cooldown time.Duration
}

// nemesisKinds are the fault kinds a plan may hold, as --faults names them (read only).
var nemesisKinds = []FaultKind{FaultKill, FaultStop, FaultRestart, FaultPartition, FaultWorker, FaultStale, FaultDiscovery}

// ParseFaults reads a comma-separated list of fault kinds ("all" for every kind).
func ParseFaults(s string) ([]FaultKind, error) {
	var out []FaultKind
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		switch {
		case f == "":
			continue
		case f == "all":
			out = append(out, nemesisKinds...)
		case slices.Contains(nemesisKinds, FaultKind(f)):
			out = append(out, FaultKind(f))
		default:
			return nil, fmt.Errorf("unknown fault %q (want some of kill, stop, restart, partition, worker, stale, discovery, or all)", f)
		}
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// weight is how often a kind comes up once each has had its turn: a full restart costs the
// most time, so it comes least often.
func weight(k FaultKind) int {
	switch k {
	case FaultKill:
		return 3
	case FaultRestart:
		return 1
	}
	return 2
}

// holdRange is how long each kind of fault lasts.
func holdRange(k FaultKind) (time.Duration, time.Duration) {
	switch k {
	case FaultKill:
		return 2 * time.Second, 6 * time.Second
	case FaultStop:
		return 2 * time.Second, 5 * time.Second
	case FaultRestart:
		return 500 * time.Millisecond, 2 * time.Second
	case FaultPartition:
		return 4 * time.Second, 8 * time.Second
	case FaultStale:
		// A floor: the step lasts as long as its rebinds and the bound take.
		return 2 * time.Second, 4 * time.Second
	}
	return 3 * time.Second, 6 * time.Second
}

// recoveryEstimate is planning slack for the cluster to settle after a fault.
const recoveryEstimate = 3 * time.Second

// Plan returns the seeded fault schedule: every kind once in a seeded order, then kinds drawn
// by weight, until the planned time (gaps, holds and a recovery estimate) fills the window
// between warmup and cooldown.
func Plan(cfg PlanConfig) ([]Step, error) {
	if cfg.Replicas < 1 || cfg.Workers < 1 {
		return nil, fmt.Errorf("plan: %d replicas and %d workers: need at least one of each", cfg.Replicas, cfg.Workers)
	}
	for _, k := range cfg.Kinds {
		if !slices.Contains(nemesisKinds, k) {
			return nil, fmt.Errorf("plan: unknown fault kind %q", k)
		}
	}
	r := rand.New(rand.NewPCG(uint64(cfg.Seed), 0x6e656d65736973)) // "nemesis"
	kinds := slices.Clone(cfg.Kinds)
	slices.Sort(kinds)
	kinds = slices.Compact(kinds)
	r.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
	total := 0
	for _, k := range kinds {
		total += weight(k)
	}
	window := cfg.Duration - cfg.Warmup - cfg.Cooldown
	var steps []Step
	var used time.Duration
	for i := 0; i < 10_000 && len(kinds) > 0; i++ {
		var kind FaultKind
		if i < len(kinds) {
			kind = kinds[i]
		} else {
			n := r.IntN(total)
			for _, k := range kinds {
				if n -= weight(k); n < 0 {
					kind = k
					break
				}
			}
		}
		lo, hi := holdRange(kind)
		s := Step{
			Kind: kind,
			Gap:  2*time.Second + time.Duration(r.Int64N(int64(3*time.Second))),
			Hold: lo + time.Duration(r.Int64N(int64(hi-lo))),
		}
		switch kind {
		case FaultKill, FaultStop:
			s.Leader = r.IntN(2) == 0
			s.Index = r.IntN(cfg.Replicas)
		case FaultWorker:
			s.Index = r.IntN(cfg.Workers)
			s.Mode = []string{"crash", "hang"}[r.IntN(2)]
		case FaultPartition:
			s.Mode = []string{"minority", "isolate-leader", "bridge"}[r.IntN(3)]
			s.Perm = r.Perm(cfg.Replicas)
			s.Leader = s.Mode == "isolate-leader"
		case FaultStale:
			s.Mode = []string{"stop", "partition"}[r.IntN(2)]
			s.Leader = r.IntN(2) == 0
			s.Index = r.IntN(cfg.Replicas)
		case FaultDiscovery:
			s.Index = r.IntN(spareWorkers)
		}
		if i > 0 && used+s.Gap+s.Hold+recoveryEstimate > window {
			break
		}
		used += s.Gap + s.Hold + recoveryEstimate
		steps = append(steps, s)
	}
	return steps, nil
}

// partitionSides returns the pairs of replica indexes a partition cuts, and who ends up cut off.
func partitionSides(s Step, n, leader int) (cut [][2]int, isolated []int, detail string) {
	perm := s.Perm
	if len(perm) != n {
		perm = make([]int, n)
		for i := range perm {
			perm[i] = i
		}
	}
	across := func(a, b []int) {
		for _, x := range a {
			for _, y := range b {
				cut = append(cut, [2]int{x, y})
			}
		}
	}
	rest := func(without int) []int {
		var out []int
		for _, i := range perm {
			if i != without {
				out = append(out, i)
			}
		}
		return out
	}
	switch s.Mode {
	case "isolate-leader":
		if leader < 0 {
			leader = perm[0]
		}
		others := rest(leader)
		across([]int{leader}, others)
		return cut, []int{leader}, fmt.Sprintf("leader r%d | %s", leader, names(others))
	case "bridge":
		if n < 3 {
			break
		}
		bridge := perm[0]
		others := rest(bridge)
		a, b := others[:len(others)/2], others[len(others)/2:]
		across(a, b)
		return cut, nil, fmt.Sprintf("%s | %s, bridged by r%d", names(a), names(b), bridge)
	}
	minority := perm[:(n-1)/2]
	if len(minority) == 0 {
		minority = perm[:1]
	}
	majority := perm[len(minority):]
	across(minority, majority)
	return cut, slices.Clone(minority), fmt.Sprintf("minority %s | majority %s", names(minority), names(majority))
}

func names(idx []int) string {
	parts := make([]string, len(idx))
	for i, x := range idx {
		parts[i] = fmt.Sprintf("r%d", x)
	}
	return "[" + strings.Join(parts, " ") + "]"
}

// nemesis runs a plan against a fleet and records every fault.
type nemesis struct {
	f    *fleet
	rec  *recorder
	cfg  *Config
	mu   sync.Mutex
	skip []string
}

func (n *nemesis) skipped(format string, args ...any) {
	n.mu.Lock()
	n.skip = append(n.skip, fmt.Sprintf(format, args...))
	n.mu.Unlock()
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// run executes the steps in order until the plan ends or the deadline for new faults passes.
// Every fault is healed before run returns, even when ctx ends.
func (n *nemesis) run(ctx context.Context, steps []Step, stopAt time.Time) {
	for i, s := range steps {
		if sleep(ctx, s.Gap) != nil {
			n.skipped("step %d (%s): run cancelled", i+1, s)
			continue
		}
		if time.Now().Add(s.Hold).After(stopAt) {
			n.skipped("step %d (%s): no time left before the cooldown", i+1, s)
			continue
		}
		if err := n.step(ctx, s); err != nil {
			n.skipped("step %d (%s): %v", i+1, s, err)
		}
	}
}

// errNoPartitions marks a partition step the environment cannot make.
var errNoPartitions = errors.New("partitions not made")

func (n *nemesis) step(ctx context.Context, s Step) error {
	f := n.f
	// Healing must happen even when the run is cancelled, so it runs on a context of its own;
	// waiting for the cluster to recover need not.
	heal := context.WithoutCancel(ctx)
	switch s.Kind {
	case FaultKill, FaultStop:
		r, detail := f.pick(ctx, s)
		if r == nil {
			return errors.New("no running replica to hit")
		}
		id := n.rec.beginFault(s.Kind, []string{r.ID}, detail)
		if s.Kind == FaultKill {
			r.proc.Kill()
		} else if err := r.proc.Pause(); err != nil {
			n.rec.faultError(id, err)
		}
		_ = sleep(ctx, s.Hold)
		var err error
		if s.Kind == FaultKill {
			err = r.proc.Start()
		} else {
			err = r.proc.Resume()
		}
		n.rec.endFault(id)
		if err != nil {
			n.rec.faultError(id, err)
		}
		n.recover(ctx, id)
	case FaultRestart:
		all := make([]string, len(f.replicas))
		for i, r := range f.replicas {
			all[i] = r.ID
		}
		id := n.rec.beginFault(FaultRestart, all, "kill -9 every replica, then start them")
		var wg sync.WaitGroup
		for _, r := range f.replicas {
			wg.Go(r.proc.Kill)
		}
		wg.Wait()
		_ = sleep(ctx, s.Hold)
		for _, r := range f.replicas {
			if err := r.proc.Start(); err != nil {
				n.rec.faultError(id, err)
			}
		}
		n.rec.endFault(id)
		n.recover(ctx, id)
		n.readBack(ctx, id)
	case FaultPartition:
		if ok, why := f.net.canPartition(); !ok {
			return fmt.Errorf("%w: %s", errNoPartitions, why)
		}
		leader := -1
		if r := f.leader(ctx); r != nil {
			leader = r.index
		}
		cut, isolated, detail := partitionSides(s, len(f.replicas), leader)
		targets := []string{}
		for _, i := range isolated {
			targets = append(targets, f.replicas[i].ID)
		}
		id := n.rec.beginFault(FaultPartition, targets, s.Mode+": "+detail)
		if err := f.net.partition(ctx, f, cut); err != nil {
			n.rec.faultError(id, err)
		}
		_ = sleep(ctx, s.Hold)
		if err := f.net.heal(heal, f); err != nil {
			n.rec.faultError(id, err)
		}
		n.rec.endFault(id)
		n.recover(ctx, id)
	case FaultWorker:
		w := f.workers[s.Index%len(f.workers)]
		kind := FaultWorkerCrash
		if s.Mode == "hang" {
			kind = FaultWorkerStop
		}
		id := n.rec.beginFault(kind, []string{w.id}, s.Mode)
		var err error
		if kind == FaultWorkerCrash {
			w.proc.Kill()
		} else {
			err = w.proc.Pause()
		}
		if err != nil {
			n.rec.faultError(id, err)
		}
		_ = sleep(ctx, s.Hold)
		if kind == FaultWorkerCrash {
			err = w.proc.Start()
		} else {
			err = w.proc.Resume()
		}
		n.rec.endFault(id)
		if err != nil {
			n.rec.faultError(id, err)
		}
		n.recover(ctx, id)
		if err := f.waitWorkerHealthy(ctx, w.id, 30*time.Second); err != nil {
			n.rec.faultError(id, err)
		}
	case FaultStale:
		return n.staleStep(ctx, s)
	case FaultDiscovery:
		n.discoveryStep(ctx, s)
	default:
		return fmt.Errorf("unknown fault kind %q", s.Kind)
	}
	return nil
}

// recover waits for every replica to report ready and marks the fault recovered.
func (n *nemesis) recover(ctx context.Context, id int) {
	if err := n.f.waitAllReady(ctx, 60*time.Second); err != nil {
		n.rec.faultError(id, fmt.Errorf("not recovered: %w", err))
		return
	}
	n.rec.recoverFault(id)
}

// readBack reads, from the leader's admin API, every session acknowledged before the restart
// and active within half a TTL of it, and records what came back. A binding that reads as
// missing or older than acknowledged is read again for up to 10 s: a just-elected leader serves
// its admin API before it has applied its log, and a late answer is counted apart.
func (n *nemesis) readBack(ctx context.Context, id int) {
	var start time.Duration
	n.rec.updateFault(id, func(f *Fault) { start = f.Start })
	acked := map[string]uint64{}
	for sess, op := range n.rec.latest(start) {
		acked[sess] = op.Revision
	}
	var sessions []string
	for s, last := range n.rec.sessionsBefore(start) {
		if start-last <= n.cfg.SessionTTL/2 {
			sessions = append(sessions, s)
		}
	}
	slices.Sort(sessions)
	final := map[string]Read{}
	pending := sessions
	deadline := time.Now().Add(10 * time.Second)
	for attempt := 1; len(pending) > 0 && attempt <= 40; attempt++ {
		var again []string
		for _, rd := range n.f.readSessions(ctx, n.rec, pending, id, true) {
			rd.Attempts = attempt
			final[rd.Session] = rd
			if rd.Error != "" || !rd.Found || rd.Revision < acked[rd.Session] {
				again = append(again, rd.Session)
			}
		}
		pending = again
		if len(pending) == 0 || time.Now().After(deadline) || sleep(ctx, 250*time.Millisecond) != nil {
			break
		}
	}
	for _, s := range sessions {
		if rd, ok := final[s]; ok {
			n.rec.addRead(rd)
		}
	}
}
