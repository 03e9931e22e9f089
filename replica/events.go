package replica

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

// openIndexes makes the approximate index (the replica's decisions, with a TTL), and, with
// KV events configured, the precise index and its subscribers, which run once serving starts.
func (r *Replica) openIndexes(context.Context) error {
	subs, err := r.kvEventSubscribers(r.promReg, r.log)
	if err != nil {
		return err
	}
	r.subs = subs
	r.approx = indexer.New(indexer.Options{TTL: r.approxTTL(), MaxBlocksPerWorker: r.cfg.ApproxMaxBlocks})
	return nil
}

// approxTTL is how long a decision counts: ApproxTTL, or in precise mode OverlayTTL on top
// of the events.
func (r *Replica) approxTTL() time.Duration {
	if r.precise == nil {
		return r.cfg.ApproxTTL
	}
	if r.cfg.OverlayTTL > 0 {
		return r.cfg.OverlayTTL
	}
	return 10 * time.Second // a TTL of 0 would keep decisions for ever
}

// kvEventSubscribers builds the precise index and its KV event subscribers: one connecting
// SUB per worker rank whose spec names kv_events, and, when KVEventsBind is set, one bound SUB
// per data-parallel rank of the largest worker, on that endpoint's port + rank.
// Without either, precise mode is off and r.precise stays nil.
func (r *Replica) kvEventSubscribers(reg prometheus.Registerer, log *slog.Logger) ([]*kvevents.Subscriber, error) {
	cfg := r.cfg
	var specs []routing.WorkerSpec
	for _, st := range r.registry.List() {
		if st.Spec.KVEvents != "" {
			specs = append(specs, st.Spec)
		}
	}
	if len(specs) == 0 && cfg.KVEventsBind == "" {
		return nil, nil
	}
	r.precise = indexer.New(indexer.Options{})
	metrics, err := kvevents.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	base := kvevents.Config{BlockSize: r.blockSize(), Sink: r.precise, Metrics: metrics, Logger: log}
	var subs []*kvevents.Subscriber
	for _, spec := range specs {
		for rank := range max(spec.DPSize, 1) {
			c := base
			c.Mode = kvevents.Connect
			c.Worker = indexer.Worker{ID: spec.ID, DPRank: uint32(rank)}
			if c.Endpoint, err = kvevents.OffsetPort(spec.KVEvents, rank); err != nil {
				return nil, fmt.Errorf("worker %s kv_events: %w", spec.ID, err)
			}
			if spec.KVReplay != "" {
				if c.Replay, err = kvevents.OffsetPort(spec.KVReplay, rank); err != nil {
					return nil, fmt.Errorf("worker %s kv_replay: %w", spec.ID, err)
				}
			}
			sub, err := kvevents.NewSubscriber(c)
			if err != nil {
				return nil, fmt.Errorf("worker %s: %w", spec.ID, err)
			}
			subs = append(subs, sub)
		}
	}
	if cfg.KVEventsBind != "" {
		c := base
		c.Mode = kvevents.Bind
		c.TopicPattern = cfg.TopicPattern
		c.URLs = map[string]string{}
		c.Replays = map[string]string{}
		// A worker's publishers connect from the host of its URL or of its kv_events
		// endpoint, or from the hosts the operator adds; nothing else is admitted.
		extra, anyHost := publisherHosts(cfg.KVEventsPublisherHosts)
		c.Hosts = map[string][]string{}
		ranks := 1
		for _, st := range r.registry.List() {
			c.URLs[st.Spec.ID] = st.Spec.URL
			c.Hosts[st.Spec.ID] = append(kvevents.PublisherHosts(st.Spec.URL, st.Spec.KVEvents), extra...)
			if st.Spec.KVReplay != "" {
				c.Replays[st.Spec.ID] = st.Spec.KVReplay
			}
			ranks = max(ranks, st.Spec.DPSize)
		}
		if anyHost {
			c.Hosts = nil
			log.Warn("--kv-events-publisher-hosts=*: KV events are accepted from any address; anyone who reaches " +
				cfg.KVEventsBind + " can forge or purge every worker's events")
		}
		if strings.HasSuffix(cfg.KVEventsBind, ":0") {
			ranks = 1 // an ephemeral port has no neighbours a worker could know
		}
		// vLLM connects rank r of a worker to our port + r: one bound socket per rank.
		for rank := range ranks {
			rc := c
			rc.Rank = rank
			ep, err := kvevents.OffsetPort(cfg.KVEventsBind, rank)
			if err != nil {
				return nil, fmt.Errorf("--kv-events-bind (dp rank %d): %w", rank, err)
			}
			rc.Endpoint = ep
			sub, err := kvevents.NewSubscriber(rc)
			if err != nil {
				return nil, fmt.Errorf("--kv-events-bind: %w", err)
			}
			subs = append(subs, sub)
		}
	}
	return subs, nil
}

// publisherHosts splits --kv-events-publisher-hosts, and reports whether it names "*".
func publisherHosts(flag string) (hosts []string, anyHost bool) {
	for h := range strings.SplitSeq(flag, ",") {
		switch h = strings.TrimSpace(h); h {
		case "":
		case "*":
			anyHost = true
		default:
			hosts = append(hosts, h)
		}
	}
	return hosts, anyHost
}

// blockSize is the block size the router will use (its config's, or the default); the KV event
// subscribers are built before the router.
func (r *Replica) blockSize() int {
	if r.cfg.Router.BlockSize > 0 {
		return r.cfg.Router.BlockSize
	}
	return indexer.DefaultBlockSize
}
