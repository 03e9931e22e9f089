package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/transport/kvevents"
)

// openIndexes makes the approximate index (the replica's decisions, with a TTL), the precise
// index the KV events feed, and the feed's subscribers for the workers known at start, which
// run once serving starts and follow the registry from then on.
func (r *Replica) openIndexes(context.Context) error {
	r.precise = indexer.New(indexer.Options{})
	feed, err := r.openFeed()
	if err != nil {
		return err
	}
	r.feed = feed
	r.approx = indexer.New(indexer.Options{TTL: r.approxTTL(), MaxBlocksPerWorker: r.cfg.ApproxMaxBlocks})
	return nil
}

// approxTTL is how long a decision counts: ApproxTTL, or in precise mode (KV events
// configured at start) OverlayTTL on top of the events. A worker with events added at run
// time to a replica without them feeds the precise index beside decisions kept for ApproxTTL.
func (r *Replica) approxTTL() time.Duration {
	if !r.feed.preciseAtStart {
		return r.cfg.ApproxTTL
	}
	if r.cfg.OverlayTTL > 0 {
		return r.cfg.OverlayTTL
	}
	return 10 * time.Second // a TTL of 0 would keep decisions for ever
}

// eventFeed keeps a replica's KV event subscribers in step with its worker registry: one
// connecting SUB per rank of every worker whose spec names kv_events, started when the worker
// is added and stopped (its index entries purged) when it is removed or its endpoints change;
// and, with KVEventsBind, the bound SUBs (one per data-parallel rank of the largest worker at
// start, on that endpoint's port + rank), whose admitted hosts and topic mapping follow the
// registry. It learns of changes from the registry's notifications, not by polling.
type eventFeed struct {
	base           kvevents.Config // what every subscriber shares: sink, metrics, block size, logger
	registry       *routing.Registry
	log            *slog.Logger
	bind           []*kvevents.Subscriber
	extraHosts     []string // --kv-events-publisher-hosts, beside each worker's own
	anyHost        bool     // --kv-events-publisher-hosts=*: the bound sockets admit anyone
	preciseAtStart bool
	changed        chan struct{}

	mu     sync.Mutex
	conn   map[string]*workerFeed        // worker ID -> its connecting subscribers
	failed map[string]routing.WorkerSpec // specs whose subscribers could not be made (logged once)
	wg     sync.WaitGroup
}

// workerFeed is one worker's connecting subscribers, one per data-parallel rank.
type workerFeed struct {
	spec   routing.WorkerSpec
	subs   []*kvevents.Subscriber
	cancel context.CancelFunc // nil until started
	done   chan struct{}
}

// openFeed builds the feed and the subscribers of the workers the registry holds now.
func (r *Replica) openFeed() (*eventFeed, error) {
	cfg := r.cfg
	metrics, err := kvevents.NewMetrics(r.promReg)
	if err != nil {
		return nil, err
	}
	f := &eventFeed{
		base:     kvevents.Config{BlockSize: r.blockSize(), Sink: r.precise, Metrics: metrics, Logger: r.log},
		registry: r.registry,
		log:      r.log,
		changed:  make(chan struct{}, 1),
		conn:     map[string]*workerFeed{},
		failed:   map[string]routing.WorkerSpec{},
	}
	f.extraHosts, f.anyHost = publisherHosts(cfg.KVEventsPublisherHosts)
	list := r.registry.List()
	for _, st := range list {
		if st.Spec.KVEvents == "" {
			continue
		}
		f.preciseAtStart = true
		wf, err := f.newWorkerFeed(st.Spec)
		if err != nil {
			return nil, err
		}
		f.conn[st.Spec.ID] = wf
	}
	if cfg.KVEventsBind != "" {
		f.preciseAtStart = true
		if f.bind, err = f.bindSubscribers(cfg.KVEventsBind, cfg.TopicPattern, list); err != nil {
			return nil, err
		}
	}
	r.registry.OnChange(func(routing.WorkerStatus, bool) {
		select {
		case f.changed <- struct{}{}:
		default: // a sync is due already; it reads the registry as it is then
		}
	})
	return f, nil
}

// newWorkerFeed makes (does not start) the connecting subscribers of spec's ranks.
func (f *eventFeed) newWorkerFeed(spec routing.WorkerSpec) (*workerFeed, error) {
	wf := &workerFeed{spec: spec}
	for rank := range max(spec.DPSize, 1) {
		c := f.base
		c.Mode = kvevents.Connect
		c.Worker = indexer.Worker{ID: spec.ID, DPRank: uint32(rank)}
		var err error
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
		wf.subs = append(wf.subs, sub)
	}
	return wf, nil
}

// bindSubscribers makes the bound SUBs: vLLM connects rank r of a worker to our port + r, so
// one per rank of the largest worker of list.
func (f *eventFeed) bindSubscribers(endpoint, pattern string, list []routing.WorkerStatus) ([]*kvevents.Subscriber, error) {
	c := f.base
	c.Mode = kvevents.Bind
	c.TopicPattern = pattern
	ws := f.bindWorkers(list)
	c.URLs, c.Replays, c.Hosts = ws.URLs, ws.Replays, ws.Hosts
	if f.anyHost {
		c.Hosts = nil
		f.log.Warn("--kv-events-publisher-hosts=*: KV events are accepted from any address; anyone who reaches " +
			endpoint + " can forge or purge every worker's events")
	}
	ranks := 1
	for _, st := range list {
		ranks = max(ranks, st.Spec.DPSize)
	}
	if strings.HasSuffix(endpoint, ":0") {
		ranks = 1 // an ephemeral port has no neighbours a worker could know
	}
	var subs []*kvevents.Subscriber
	for rank := range ranks {
		rc := c
		rc.Rank = rank
		ep, err := kvevents.OffsetPort(endpoint, rank)
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
	return subs, nil
}

// bindWorkers is what the bound SUBs admit for the workers of list: a worker's publishers
// connect from the host of its URL or of its kv_events endpoint, or from the hosts the
// operator adds; nothing else is admitted.
func (f *eventFeed) bindWorkers(list []routing.WorkerStatus) kvevents.Workers {
	ws := kvevents.Workers{URLs: map[string]string{}, Replays: map[string]string{}, Hosts: map[string][]string{}}
	for _, st := range list {
		ws.URLs[st.Spec.ID] = st.Spec.URL
		ws.Hosts[st.Spec.ID] = append(kvevents.PublisherHosts(st.Spec.URL, st.Spec.KVEvents), f.extraHosts...)
		if st.Spec.KVReplay != "" {
			ws.Replays[st.Spec.ID] = st.Spec.KVReplay
		}
	}
	return ws
}

// run runs the subscribers until ctx ends, starting and stopping them as the registry changes.
func (f *eventFeed) run(ctx context.Context) {
	for _, sub := range f.bind {
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			if err := sub.Run(ctx); err != nil && ctx.Err() == nil {
				f.log.Error("KV event subscriber stopped", "err", err)
			}
		}()
	}
	defer f.wg.Wait()
	for {
		f.sync(ctx)
		select {
		case <-ctx.Done():
			return
		case <-f.changed:
		}
	}
}

// sync starts the subscribers of workers with events that have none, and stops those of
// workers gone from the registry or whose event endpoints changed (another endpoint is
// another engine: what the index credits it with is purged).
func (f *eventFeed) sync(ctx context.Context) {
	list := f.registry.List()
	want := map[string]routing.WorkerSpec{}
	for _, st := range list {
		if st.Spec.KVEvents != "" {
			want[st.Spec.ID] = st.Spec
		}
	}
	var stop, start []*workerFeed
	f.mu.Lock()
	for id, wf := range f.conn {
		if spec, ok := want[id]; !ok || !sameFeed(wf.spec, spec) {
			stop = append(stop, wf)
			delete(f.conn, id)
		}
	}
	for id, spec := range want {
		wf, ok := f.conn[id]
		if !ok {
			if bad, ok := f.failed[id]; ok && sameFeed(bad, spec) {
				continue
			}
			var err error
			if wf, err = f.newWorkerFeed(spec); err != nil {
				f.failed[id] = spec
				f.log.Warn("kv events: cannot follow a worker's events", "worker", id, "err", err)
				continue
			}
			delete(f.failed, id)
			f.conn[id] = wf
		}
		if wf.cancel == nil {
			start = append(start, wf)
		}
	}
	for id := range f.failed {
		if _, ok := want[id]; !ok {
			delete(f.failed, id)
		}
	}
	f.mu.Unlock()
	for _, wf := range stop {
		wf.stop()
		for _, sub := range wf.subs {
			sub.Forget()
		}
		// Events applied between the registry's purge (Forget) and the stop are purged too.
		for rank := range max(wf.spec.DPSize, 1) {
			f.base.Sink.RemoveWorker(indexer.Worker{ID: wf.spec.ID, DPRank: uint32(rank)})
		}
		f.log.Info("kv events: stopped following a worker", "worker", wf.spec.ID)
	}
	for _, wf := range start {
		f.start(ctx, wf)
	}
	if len(f.bind) > 0 {
		ws := f.bindWorkers(list)
		for _, sub := range f.bind {
			if err := sub.SetWorkers(ctx, ws); err != nil && ctx.Err() == nil {
				f.log.Warn("kv events: bound socket's workers not updated", "err", err)
			}
		}
	}
}

// sameFeed reports whether a and b are followed by the same subscribers.
func sameFeed(a, b routing.WorkerSpec) bool {
	return a.KVEvents == b.KVEvents && a.KVReplay == b.KVReplay && a.DPSize == b.DPSize && a.URL == b.URL
}

// start runs wf's subscribers under ctx until wf.stop.
func (f *eventFeed) start(ctx context.Context, wf *workerFeed) {
	wctx, cancel := context.WithCancel(ctx)
	wf.cancel, wf.done = cancel, make(chan struct{})
	var wg sync.WaitGroup
	for _, sub := range wf.subs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := sub.Run(wctx); err != nil && wctx.Err() == nil {
				f.log.Error("KV event subscriber stopped", "worker", wf.spec.ID, "err", err)
			}
		}()
	}
	f.wg.Add(1)
	go func() { defer f.wg.Done(); wg.Wait(); close(wf.done) }()
	f.log.Debug("kv events: following a worker", "worker", wf.spec.ID, "endpoint", wf.spec.KVEvents)
}

// stop stops wf's subscribers and waits for them.
func (wf *workerFeed) stop() {
	if wf.cancel == nil {
		return
	}
	wf.cancel()
	<-wf.done
}

// subscribers is every subscriber the feed has now.
func (f *eventFeed) subscribers() []*kvevents.Subscriber {
	f.mu.Lock()
	defer f.mu.Unlock()
	subs := append([]*kvevents.Subscriber(nil), f.bind...)
	for _, wf := range f.conn {
		subs = append(subs, wf.subs...)
	}
	return subs
}

// SnapshotEngineMaps is precise mode's engine-hash maps across all of the feed's subscribers
// (each serves its own workers), for index snapshots.
func (f *eventFeed) SnapshotEngineMaps(ctx context.Context) (map[indexer.Worker]map[uint64]uint64, error) {
	out := map[indexer.Worker]map[uint64]uint64{}
	for _, sub := range f.subscribers() {
		part, err := sub.SnapshotEngineMaps(ctx)
		if err != nil {
			return nil, err
		}
		maps.Copy(out, part)
	}
	return out, nil
}

// RestoreEngineMaps hands a snapshot's engine maps to every subscriber, which keeps its own.
func (f *eventFeed) RestoreEngineMaps(in map[indexer.Worker]map[uint64]uint64) error {
	var errs []error
	for _, sub := range f.subscribers() {
		if err := sub.RestoreEngineMaps(in); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
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
