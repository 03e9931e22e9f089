package benchreport

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/kvrouter-ha/kvrouter-ha/demo"
	"github.com/kvrouter-ha/kvrouter-ha/sim/replay"
	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
)

// Replays are the routing-quality runs, all through demo.Compare on one trace slice: fresh
// simulated workers and fresh in-process routers per run.
type Replays struct {
	// CeilingTokens is the share of the slice's prompt tokens one unlimited cache would hold
	// (trace.Ceiling), the most any routing can reach.
	CeilingTokens float64 `json:"ceiling_tokens"`
	// Policies are the runs at the default cache size, one per policy, with each run's TTFTs.
	Policies []PolicyRun `json:"policies"`
	// Sweep is hit rate against each worker's cache size, per policy.
	Sweep []SweepPoint `json:"sweep"`
	// Topologies are the kv policy's runs on 1, 3, 5 and 7 replicas.
	Topologies []TopologyRun `json:"topologies"`
	// Tables are the comparisons as demo prints them, by section.
	Tables map[string]string `json:"tables"`
}

// PolicyRun is one policy's run.
type PolicyRun struct {
	Policy  string          `json:"policy"`
	Summary *replay.Summary `json:"summary"`
	// TTFTMs are the successful requests' TTFTs, sorted.
	TTFTMs []float64 `json:"ttft_ms"`
	// Neighbours is how busy the rest of the machine was during the run; Discarded, during
	// runs thrown away for a less disturbed one.
	Neighbours Neighbours   `json:"neighbours"`
	Discarded  []Neighbours `json:"discarded_runs,omitempty"`
}

// SweepPoint is one policy at one cache size.
type SweepPoint struct {
	Policy         string       `json:"policy"`
	CapacityBlocks int          `json:"capacity_blocks"`
	HitRate        float64      `json:"hit_rate"`
	TTFTP50Ms      float64      `json:"ttft_p50_ms"`
	Failed         int          `json:"failed"`
	Neighbours     Neighbours   `json:"neighbours"`
	Discarded      []Neighbours `json:"discarded_runs,omitempty"`
}

// TopologyRun is the kv policy on one number of replicas.
type TopologyRun struct {
	Replicas   int             `json:"replicas"`
	Summary    *replay.Summary `json:"summary"`
	Neighbours Neighbours      `json:"neighbours"`
	Discarded  []Neighbours    `json:"discarded_runs,omitempty"`
}

// slice is the trace slice every replay uses.
func (c Config) slice(limit int) ([]trace.Request, error) {
	reqs, err := trace.ForReplay(c.Trace, c.Start)
	if err != nil {
		return nil, err
	}
	if limit > 0 && limit < len(reqs) {
		reqs = reqs[:limit]
	}
	return reqs, nil
}

// demoConfig is a comparison's demo.Config on cfg's slice and fleet.
func (c Config) demoConfig(log *slog.Logger) demo.Config {
	return demo.Config{
		Workers: c.Workers, CapacityBlocks: c.CapacityBlocks, Modes: []string{"approximate"},
		Topologies: []demo.Topology{{Replicas: 1}}, MinUncachedTokens: 1024,
		TracePath: c.Trace, Start: c.Start, Limit: c.Requests, Speedup: c.Speedup, Concurrency: 256,
		Logger: log,
	}
}

// run is one demo run's outcome.
type run struct {
	sum *replay.Summary
	nb  Neighbours
	// logDir holds its request log (when asked for one); discarded are the neighbours of a
	// run discarded for a less disturbed one.
	logDir    string
	discarded []Neighbours
}

// compare runs one demo comparison of a single run and returns its summary and how busy the
// rest of the machine was meanwhile.
func compare(ctx context.Context, dc demo.Config, work, name string) (run, error) {
	var r run
	dc.JSONPath = filepath.Join(work, name+".json")
	if dc.RequestLogDir != "" {
		dc.RequestLogDir = filepath.Join(dc.RequestLogDir, name)
		if err := os.MkdirAll(dc.RequestLogDir, 0o755); err != nil {
			return r, err
		}
		r.logDir = dc.RequestLogDir
	}
	cpu := readCPU()
	err := demo.Compare(ctx, dc, io.Discard, nil)
	r.nb = cpu.since()
	if err != nil {
		return r, err
	}
	b, err := os.ReadFile(dc.JSONPath)
	if err != nil {
		return r, err
	}
	var sums []*replay.Summary
	if err := json.Unmarshal(b, &sums); err != nil {
		return r, fmt.Errorf("%s: %w", dc.JSONPath, err)
	}
	if len(sums) != 1 {
		return r, fmt.Errorf("%s: %d runs, want 1", dc.JSONPath, len(sums))
	}
	r.sum = sums[0]
	return r, nil
}

// reruns runs a demo run once more when others (processes, or other virtual machines through
// steal) took more than above of the machine's processor time during it, at most left times in all, and keeps the less
// disturbed of the two.
type reruns struct {
	above float64
	left  int
	say   func(string, ...any)
}

func (rr *reruns) compare(ctx context.Context, dc demo.Config, work, name string) (run, error) {
	r, err := compare(ctx, dc, work, name)
	if err != nil || rr.left <= 0 || r.nb.Taken() <= rr.above {
		return r, err
	}
	rr.left--
	rr.say("  others took %.0f%% of the CPU during %s (%s): running it once more (%d re-runs left)", 100*r.nb.Taken(), name, r.nb, rr.left)
	again, err := compare(ctx, dc, work, name+"-again")
	if err != nil {
		return r, err
	}
	if again.nb.Taken() < r.nb.Taken() {
		again.discarded = append(r.discarded, r.nb)
		return again, nil
	}
	r.discarded = append(r.discarded, again.nb)
	return r, nil
}

// table is replay.Table's side-by-side comparison of runs.
func table(sums []*replay.Summary) string {
	var b bytes.Buffer
	replay.Table(&b, sums)
	return strings.TrimRight(b.String(), "\n")
}

// runReplays runs the policy comparison, the cache-size sweep and the replica counts, one
// demo run at a time, so that each has its own reading of the neighbours.
func runReplays(ctx context.Context, cfg Config, work string, log *slog.Logger, progress func(string, ...any)) (*Replays, error) {
	reqs, err := cfg.slice(cfg.Requests)
	if err != nil {
		return nil, err
	}
	r := &Replays{Tables: map[string]string{}}
	_, r.CeilingTokens = trace.Ceiling(reqs)

	rr := &reruns{above: cfg.RerunAbove, left: cfg.MaxReruns, say: progress}
	// The policies, with every request's TTFT.
	logDir := filepath.Join(work, "policies")
	progress("policies %s on %d requests (%d workers of %d blocks), %gx speed", strings.Join(cfg.Policies, ", "), len(reqs), cfg.Workers, cfg.CapacityBlocks, cfg.Speedup)
	var sums []*replay.Summary
	for _, pol := range cfg.Policies {
		dc := cfg.demoConfig(log)
		dc.Policies = []string{pol}
		dc.RequestLogDir = logDir
		run, err := rr.compare(ctx, dc, work, "policy-"+pol)
		if err != nil {
			return nil, fmt.Errorf("policy %s: %w", pol, err)
		}
		s, nb := run.sum, run.nb
		p := PolicyRun{Policy: pol, Summary: s, Neighbours: nb, Discarded: run.discarded}
		if p.TTFTMs, err = readTTFTs(filepath.Join(run.logDir, strings.NewReplacer(" ", "_", "/", "-").Replace(s.Label)+".jsonl")); err != nil {
			return nil, err
		}
		r.Policies = append(r.Policies, p)
		sums = append(sums, s)
		progress("  %-13s hit rate %5.1f%%, TTFT p50 %6.1f ms, p99 %6.1f ms, %d failed (%s)", pol, 100*s.HitRate, s.TTFTP50Ms, s.TTFTP99Ms, s.Failed, nb)
	}
	r.Tables["policies"] = table(sums)

	// Hit rate against the cache size, per policy.
	for _, capacity := range cfg.SweepCapacities {
		var sums []*replay.Summary
		for _, pol := range cfg.SweepPolicies {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			if i := slices.IndexFunc(r.Policies, func(pr PolicyRun) bool { return pr.Policy == pol }); i >= 0 && capacity == cfg.CapacityBlocks {
				pr := r.Policies[i]
				r.Sweep = append(r.Sweep, sweepPoint(pol, capacity, run{sum: pr.Summary, nb: pr.Neighbours, discarded: pr.Discarded}))
				sums = append(sums, pr.Summary)
				continue
			}
			dc := cfg.demoConfig(log)
			dc.Policies = []string{pol}
			dc.CapacityBlocks = capacity
			run, err := rr.compare(ctx, dc, work, fmt.Sprintf("sweep-%d-%s", capacity, pol))
			if err != nil {
				return nil, fmt.Errorf("cache size %d, policy %s: %w", capacity, pol, err)
			}
			s, nb := run.sum, run.nb
			r.Sweep = append(r.Sweep, sweepPoint(pol, capacity, run))
			sums = append(sums, s)
			progress("  cache %6d blocks, %-13s hit rate %5.1f%% (%s)", capacity, pol, 100*s.HitRate, nb)
		}
		r.Tables[fmt.Sprintf("sweep %d", capacity)] = table(sums)
	}

	// Replicas, with the kv policy.
	sums = nil
	for _, n := range cfg.Replicas {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if i := slices.Index(cfg.Policies, "kv"); n == 1 && i >= 0 {
			pr := r.Policies[i]
			r.Topologies = append(r.Topologies, TopologyRun{Replicas: 1, Summary: pr.Summary, Neighbours: pr.Neighbours, Discarded: pr.Discarded})
			sums = append(sums, r.Policies[i].Summary)
			continue
		}
		dc := cfg.demoConfig(log)
		dc.Policies = []string{"kv"}
		dc.Topologies = []demo.Topology{{Replicas: n}}
		run, err := rr.compare(ctx, dc, work, fmt.Sprintf("replicas-%d", n))
		if err != nil {
			return nil, fmt.Errorf("%d replicas: %w", n, err)
		}
		s, nb := run.sum, run.nb
		r.Topologies = append(r.Topologies, TopologyRun{Replicas: n, Summary: s, Neighbours: nb, Discarded: run.discarded})
		sums = append(sums, s)
		progress("  x%d: hit rate %5.1f%%, prediction MAE %.0f tokens, gossip %.0f B/s per replica, %d failed (%s)",
			n, 100*s.HitRate, s.OverlapMAETokens, s.GossipBytesPerSecond, s.Failed, nb)
	}
	r.Tables["replicas"] = table(sums)
	return r, nil
}

func sweepPoint(pol string, capacity int, r run) SweepPoint {
	return SweepPoint{Policy: pol, CapacityBlocks: capacity, HitRate: r.sum.HitRate, TTFTP50Ms: r.sum.TTFTP50Ms, Failed: r.sum.Failed,
		Neighbours: r.nb, Discarded: r.discarded}
}

// readTTFTs reads a request log's successful TTFTs, sorted.
func readTTFTs(path string) ([]float64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []float64
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		var rec replay.RequestRecord
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if rec.OK {
			out = append(out, rec.TTFTMs)
		}
	}
	slices.Sort(out)
	return out, sc.Err()
}
