package replay

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Summary is the outcome of one run. Latencies are as the client measured
// them, in milliseconds; a figure with no samples is 0.
type Summary struct {
	// Label names the run (Config.Label).
	Label string `json:"label"`
	// Planned is how many requests the run meant to send (after Limit).
	Planned int `json:"planned"`
	// Requests is how many were sent.
	Requests int `json:"requests"`
	// OK counts requests that completed with usage.
	OK int `json:"ok"`
	// Failed counts the rest, broken down by cause in Errors.
	Failed int `json:"failed"`
	// Errors maps a cause ("timeout", "http_503", ...) to its count.
	Errors map[string]int `json:"errors"`
	// Interrupted says the run's context ended before the trace did.
	Interrupted bool `json:"interrupted"`
	// DurationSeconds is wall time from the first dispatch to the last reply.
	DurationSeconds float64 `json:"duration_s"`

	// PromptTokens and CachedTokens sum usage over OK requests.
	PromptTokens int64 `json:"prompt_tokens"`
	CachedTokens int64 `json:"cached_tokens"`
	// HitRate is CachedTokens / PromptTokens.
	HitRate float64 `json:"hit_rate"`

	// TTFTSamples counts OK requests whose first token was seen. Without
	// streaming TTFT is the whole latency.
	TTFTSamples int     `json:"ttft_samples"`
	TTFTP50Ms   float64 `json:"ttft_p50_ms"`
	TTFTP90Ms   float64 `json:"ttft_p90_ms"`
	TTFTP99Ms   float64 `json:"ttft_p99_ms"`
	// FirstTTFTSamples counts the TTFT samples of sessions' first requests in the run (new
	// sessions for the router: each waits for its binding), and FirstTTFTP50Ms... are their
	// percentiles.
	FirstTTFTSamples int     `json:"first_turn_ttft_samples"`
	FirstTTFTP50Ms   float64 `json:"first_turn_ttft_p50_ms"`
	FirstTTFTP90Ms   float64 `json:"first_turn_ttft_p90_ms"`
	FirstTTFTP99Ms   float64 `json:"first_turn_ttft_p99_ms"`
	LatencyP50Ms     float64 `json:"latency_p50_ms"`
	LatencyP99Ms     float64 `json:"latency_p99_ms"`
	// ITLSamples counts streamed OK requests with two output tokens or more; ITLP50Ms and
	// ITLP90Ms are percentiles over them of each one's mean inter-token latency, (latency -
	// TTFT) / (output tokens - 1), as vLLM's benchmark reports its TPOT.
	ITLSamples int     `json:"itl_samples"`
	ITLP50Ms   float64 `json:"itl_p50_ms"`
	ITLP90Ms   float64 `json:"itl_p90_ms"`
	// OutputTokens sums the usage's completion_tokens over OK requests, and
	// OutputTokensPerSecond divides it by the run's duration.
	OutputTokens          int64   `json:"output_tokens"`
	OutputTokensPerSecond float64 `json:"output_tokens_per_s"`

	// Workers holds per-worker figures over OK requests, keyed by the
	// worker the response named ("unknown" when a router named none).
	Workers map[string]WorkerStats `json:"workers"`
	// RequestImbalance is max/mean of per-worker requests over the workers
	// seen; 1 is perfectly even. A worker that got nothing is not seen.
	RequestImbalance float64 `json:"request_imbalance"`
	// PromptTokenImbalance is max/mean of per-worker prompt tokens.
	PromptTokenImbalance float64 `json:"prompt_token_imbalance"`

	// OverlapSamples counts OK responses carrying X-Kvrouter-Overlap-Blocks.
	OverlapSamples int `json:"overlap_samples"`
	// OverlapMAETokens is the mean absolute error of the router's predicted
	// cached tokens (overlap blocks x RouterBlockSize, at most the prompt's full
	// blocks before its last token, as vLLM reports) against the worker's
	// reported cached tokens.
	OverlapMAETokens float64 `json:"overlap_mae_tokens"`
	// OverlapBiasTokens is the mean signed error of the same prediction: positive when the
	// router predicted more cached tokens than the workers had, negative when fewer.
	OverlapBiasTokens float64 `json:"overlap_bias_tokens"`
	// Sessions counts the sessions with at least one OK request; SessionsMoved those whose
	// OK requests named more than one worker (with bindings and healthy workers: 0).
	Sessions      int `json:"sessions"`
	SessionsMoved int `json:"sessions_moved"`

	// RouterBlockSize is the block size the prediction was scaled by.
	RouterBlockSize int `json:"router_block_size"`

	// GossipBytesPerSecond is what each router replica sent to the others, all gossip
	// traffic counted, per second of the run, averaged over replicas. The replayer cannot
	// see it: whoever runs the routers fills it in (0: none, or not measured).
	GossipBytesPerSecond float64 `json:"gossip_bytes_per_s_per_replica,omitempty"`
	// GossipDropped is how many gossip messages the replicas dropped during the run (over
	// their byte budget, undecodable, or from non-members), filled in like the above.
	GossipDropped uint64 `json:"gossip_dropped,omitempty"`
	// DecisionGaps is how many decision messages the replicas sent one another that never
	// arrived (sequence gaps seen by the receivers, less the messages that came late),
	// filled in like the above: each leaves a receiver's index short of the blocks it carried.
	DecisionGaps uint64 `json:"decision_gaps,omitempty"`
	// DecisionLagMs is the delay, in milliseconds, from a decision on one replica to its
	// arrival at another, at the 50th, 90th and 99th percentiles over the run's decision
	// messages (each the upper bound of its histogram bucket; -1 past the last bound),
	// filled in like the above.
	DecisionLagMs []float64 `json:"decision_lag_ms_p50_p90_p99,omitempty"`
	// Replicas is how many router replicas the run had (0: not said), filled in like the
	// above; with more than one, the two counters below are shown.
	Replicas int `json:"replicas,omitempty"`
	// LeaderChanges is how many Raft leaders the replicas learned of during the run, summed
	// over replicas (an election seen by all three counts three); ReadLeaseFailures how many
	// of their read-lease rounds failed, during which bound requests waited. Filled in like
	// the above.
	LeaderChanges     uint64 `json:"raft_leader_changes,omitempty"`
	ReadLeaseFailures uint64 `json:"read_lease_failures,omitempty"`
}

// WorkerStats is one worker's share of a run.
type WorkerStats struct {
	// Requests counts the OK requests the worker served.
	Requests int `json:"requests"`
	// PromptTokens and CachedTokens sum their usage.
	PromptTokens int64 `json:"prompt_tokens"`
	CachedTokens int64 `json:"cached_tokens"`
	// HitRate is CachedTokens / PromptTokens.
	HitRate float64 `json:"hit_rate"`
}

// summarize computes everything but the run-level fields Run fills in.
func summarize(results []result, routerBlockSize int) *Summary {
	s := &Summary{
		Requests:        len(results),
		Errors:          make(map[string]int),
		Workers:         make(map[string]WorkerStats),
		RouterBlockSize: routerBlockSize,
	}
	var ttft, firstTTFT, latency, itl []time.Duration
	var absErr, signedErr float64
	// sessionWorker is each session's first worker, "" once it has moved.
	sessionWorker := map[string]string{}
	for _, r := range results {
		if !r.ok {
			s.Failed++
			s.Errors[r.cause]++
			continue
		}
		s.OK++
		if r.session != "" {
			first, seen := sessionWorker[r.session]
			switch {
			case !seen:
				sessionWorker[r.session] = r.worker
				s.Sessions++
				if r.hasTTFT {
					firstTTFT = append(firstTTFT, r.ttft)
				}
			case first != "" && first != r.worker:
				sessionWorker[r.session] = ""
				s.SessionsMoved++
			}
		}
		s.PromptTokens += r.promptTokens
		s.CachedTokens += r.cachedTokens
		if r.hasTTFT {
			ttft = append(ttft, r.ttft)
		}
		latency = append(latency, r.latency)
		s.OutputTokens += r.outputTokens
		if r.streamed && r.hasTTFT && r.outputTokens >= 2 {
			itl = append(itl, (r.latency-r.ttft)/time.Duration(r.outputTokens-1))
		}
		w := s.Workers[r.worker]
		w.Requests++
		w.PromptTokens += r.promptTokens
		w.CachedTokens += r.cachedTokens
		s.Workers[r.worker] = w
		if r.hasOverlap {
			s.OverlapSamples++
			e := float64(predictedTokens(r.overlap, r.promptTokens, routerBlockSize)) - float64(r.cachedTokens)
			absErr += math.Abs(e)
			signedErr += e
		}
	}
	s.HitRate = ratio(float64(s.CachedTokens), float64(s.PromptTokens))
	s.TTFTSamples = len(ttft)
	slices.Sort(ttft)
	slices.Sort(latency)
	s.TTFTP50Ms = percentileMs(ttft, 0.50)
	s.TTFTP90Ms = percentileMs(ttft, 0.90)
	s.TTFTP99Ms = percentileMs(ttft, 0.99)
	s.FirstTTFTSamples = len(firstTTFT)
	slices.Sort(firstTTFT)
	s.FirstTTFTP50Ms = percentileMs(firstTTFT, 0.50)
	s.FirstTTFTP90Ms = percentileMs(firstTTFT, 0.90)
	s.FirstTTFTP99Ms = percentileMs(firstTTFT, 0.99)
	s.LatencyP50Ms = percentileMs(latency, 0.50)
	s.LatencyP99Ms = percentileMs(latency, 0.99)
	s.ITLSamples = len(itl)
	slices.Sort(itl)
	s.ITLP50Ms = percentileMs(itl, 0.50)
	s.ITLP90Ms = percentileMs(itl, 0.90)

	reqs := make([]float64, 0, len(s.Workers))
	prompts := make([]float64, 0, len(s.Workers))
	for name, w := range s.Workers {
		w.HitRate = ratio(float64(w.CachedTokens), float64(w.PromptTokens))
		s.Workers[name] = w
		reqs = append(reqs, float64(w.Requests))
		prompts = append(prompts, float64(w.PromptTokens))
	}
	s.RequestImbalance = imbalance(reqs)
	s.PromptTokenImbalance = imbalance(prompts)
	s.OverlapMAETokens = ratio(absErr, float64(s.OverlapSamples))
	s.OverlapBiasTokens = ratio(signedErr, float64(s.OverlapSamples))
	return s
}

// predictedTokens is the cached tokens a router's overlap of overlap blocks predicts for a
// prompt of promptTokens: the blocks' tokens, at most the prompt's full blocks before its last
// token, since vLLM computes the last prompt token even when the whole prompt is cached (a
// 128-token prompt reports 112 cached tokens at 16-token blocks). Routers cap their overlap
// there already; the cap here keeps the error honest for one that does not.
func predictedTokens(overlap, promptTokens int64, blockSize int) int64 {
	p := overlap * int64(blockSize)
	if promptTokens > 0 && blockSize > 0 {
		p = min(p, (promptTokens-1)/int64(blockSize)*int64(blockSize))
	}
	return p
}

func ratio(num, den float64) float64 {
	if den == 0 {
		return 0
	}
	return num / den
}

// percentileMs is the nearest-rank percentile of sorted, in milliseconds:
// the smallest sample with at least p of the samples at or below it.
func percentileMs(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p*float64(len(sorted)))) - 1
	rank = max(0, min(rank, len(sorted)-1))
	return float64(sorted[rank]) / float64(time.Millisecond)
}

// imbalance is max/mean of xs: 1 when even, len(xs) when one takes all.
func imbalance(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	var sum, top float64
	for _, x := range xs {
		sum += x
		top = max(top, x)
	}
	return ratio(top, sum/float64(len(xs)))
}

// ErrorList renders Errors sorted by cause, e.g. "http_503 2, timeout 1".
func (s *Summary) ErrorList() string {
	if len(s.Errors) == 0 {
		return "none"
	}
	causes := make([]string, 0, len(s.Errors))
	for c := range s.Errors {
		causes = append(causes, c)
	}
	slices.Sort(causes)
	parts := make([]string, len(causes))
	for i, c := range causes {
		parts[i] = fmt.Sprintf("%s %d", c, s.Errors[c])
	}
	return strings.Join(parts, ", ")
}

func (s *Summary) name() string {
	if s.Label != "" {
		return s.Label
	}
	return "replay"
}

// WriteText writes s as a readable block.
func (s *Summary) WriteText(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	state := ""
	if s.Interrupted {
		state = " (interrupted)"
	}
	fmt.Fprintf(tw, "%s: %d of %d requests in %.1f s%s\n", s.name(), s.Requests, s.Planned, s.DurationSeconds, state)
	fmt.Fprintf(tw, "  ok\t%d\n", s.OK)
	fmt.Fprintf(tw, "  errors\t%d (%s)\n", s.Failed, s.ErrorList())
	fmt.Fprintf(tw, "  prompt tokens\t%d, cached %d\n", s.PromptTokens, s.CachedTokens)
	fmt.Fprintf(tw, "  hit rate\t%.1f%%\n", 100*s.HitRate)
	fmt.Fprintf(tw, "  TTFT ms\tp50 %.1f  p90 %.1f  p99 %.1f  (%d samples)\n", s.TTFTP50Ms, s.TTFTP90Ms, s.TTFTP99Ms, s.TTFTSamples)
	fmt.Fprintf(tw, "  latency ms\tp50 %.1f  p99 %.1f\n", s.LatencyP50Ms, s.LatencyP99Ms)
	if s.ITLSamples > 0 {
		fmt.Fprintf(tw, "  inter-token ms\tp50 %.2f  p90 %.2f  (%d samples)\n", s.ITLP50Ms, s.ITLP90Ms, s.ITLSamples)
	}
	fmt.Fprintf(tw, "  output tokens\t%d, %.0f/s\n", s.OutputTokens, s.OutputTokensPerSecond)
	fmt.Fprintf(tw, "  imbalance\trequests %.2f, prompt tokens %.2f (%d workers)\n",
		s.RequestImbalance, s.PromptTokenImbalance, len(s.Workers))
	if s.OverlapSamples > 0 {
		fmt.Fprintf(tw, "  overlap MAE\t%.1f tokens over %d requests (router block %d), bias %+.1f\n",
			s.OverlapMAETokens, s.OverlapSamples, s.RouterBlockSize, s.OverlapBiasTokens)
	}
	_ = tw.Flush()

	// Worker names can be long URLs; a separate block keeps them from
	// widening the figures above.
	names := make([]string, 0, len(s.Workers))
	for n := range s.Workers {
		names = append(names, n)
	}
	slices.Sort(names)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, n := range names {
		ws := s.Workers[n]
		fmt.Fprintf(tw, "  %s\t%d requests\t%d prompt tokens\thit rate %.1f%%\n", n, ws.Requests, ws.PromptTokens, 100*ws.HitRate)
	}
	_ = tw.Flush()
}

// Table writes the runs side by side, one column per run, for comparing a
// router against baselines.
func Table(w io.Writer, sums []*Summary) {
	// Figures align right; padding every row name to one width keeps the
	// name column reading left-aligned.
	const nameWidth = len("prediction bias tok")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name string, cell func(*Summary) string) {
		fmt.Fprintf(tw, "%-*s", nameWidth, name)
		for _, s := range sums {
			fmt.Fprint(tw, "\t", cell(s))
		}
		fmt.Fprint(tw, "\t\n")
	}
	row("", func(s *Summary) string { return s.name() })
	row("requests ok", func(s *Summary) string { return fmt.Sprintf("%d/%d", s.OK, s.Requests) })
	row("hit rate", func(s *Summary) string { return fmt.Sprintf("%.1f%%", 100*s.HitRate) })
	row("TTFT p50 ms", func(s *Summary) string { return fmt.Sprintf("%.1f", s.TTFTP50Ms) })
	row("TTFT p90 ms", func(s *Summary) string { return fmt.Sprintf("%.1f", s.TTFTP90Ms) })
	row("TTFT p99 ms", func(s *Summary) string { return fmt.Sprintf("%.1f", s.TTFTP99Ms) })
	if slices.ContainsFunc(sums, func(s *Summary) bool { return s.FirstTTFTSamples > 0 }) {
		row("first-turn TTFT p50", func(s *Summary) string { return fmt.Sprintf("%.1f", s.FirstTTFTP50Ms) })
		row("first-turn TTFT p90", func(s *Summary) string { return fmt.Sprintf("%.1f", s.FirstTTFTP90Ms) })
		row("first-turn TTFT p99", func(s *Summary) string { return fmt.Sprintf("%.1f", s.FirstTTFTP99Ms) })
	}
	row("latency p99 ms", func(s *Summary) string { return fmt.Sprintf("%.1f", s.LatencyP99Ms) })
	if slices.ContainsFunc(sums, func(s *Summary) bool { return s.ITLSamples > 0 }) {
		row("inter-token p50 ms", func(s *Summary) string { return fmt.Sprintf("%.2f", s.ITLP50Ms) })
		row("inter-token p90 ms", func(s *Summary) string { return fmt.Sprintf("%.2f", s.ITLP90Ms) })
	}
	row("output tok/s", func(s *Summary) string { return fmt.Sprintf("%.0f", s.OutputTokensPerSecond) })
	row("errors", func(s *Summary) string { return fmt.Sprintf("%d", s.Failed) })
	row("imbalance req", func(s *Summary) string { return fmt.Sprintf("%.2f", s.RequestImbalance) })
	row("imbalance tokens", func(s *Summary) string { return fmt.Sprintf("%.2f", s.PromptTokenImbalance) })
	row("prediction MAE tok", func(s *Summary) string {
		if s.OverlapSamples == 0 {
			return "-"
		}
		return fmt.Sprintf("%.0f", s.OverlapMAETokens)
	})
	row("prediction bias tok", func(s *Summary) string {
		if s.OverlapSamples == 0 {
			return "-"
		}
		return fmt.Sprintf("%+.0f", s.OverlapBiasTokens)
	})
	if slices.ContainsFunc(sums, func(s *Summary) bool { return s.GossipBytesPerSecond > 0 }) {
		row("gossip B/s/replica", func(s *Summary) string {
			if s.GossipBytesPerSecond == 0 {
				return "-"
			}
			return fmt.Sprintf("%.0f", s.GossipBytesPerSecond)
		})
		row("gossip dropped", func(s *Summary) string {
			if s.GossipBytesPerSecond == 0 {
				return "-"
			}
			return fmt.Sprintf("%d", s.GossipDropped)
		})
		row("decision msgs lost", func(s *Summary) string {
			if s.GossipBytesPerSecond == 0 {
				return "-"
			}
			return fmt.Sprintf("%d", s.DecisionGaps)
		})
		row("decision lag p50/90/99 ms", func(s *Summary) string {
			if len(s.DecisionLagMs) == 0 {
				return "-"
			}
			parts := make([]string, len(s.DecisionLagMs))
			for i, v := range s.DecisionLagMs {
				parts[i] = fmt.Sprintf("%g", v)
				if v < 0 {
					parts[i] = "more"
				}
			}
			return strings.Join(parts, "/")
		})
	}
	if slices.ContainsFunc(sums, func(s *Summary) bool { return s.Replicas > 1 }) {
		row("raft leader changes", func(s *Summary) string {
			if s.Replicas == 0 {
				return "-"
			}
			return fmt.Sprintf("%d", s.LeaderChanges)
		})
		row("read lease failures", func(s *Summary) string {
			if s.Replicas == 0 {
				return "-"
			}
			return fmt.Sprintf("%d", s.ReadLeaseFailures)
		})
	}
	_ = tw.Flush()
}
