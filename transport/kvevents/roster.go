package kvevents

import (
	"context"
	"fmt"
	"maps"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// roster is what a Bind subscriber knows of its workers, replaced whole by SetWorkers: readers
// (the guard's connection readers, Run) load it without a lock.
type roster struct {
	hosts   map[string]string // host:port of a worker's URL -> worker ID, for the pattern
	ids     map[string]bool   // the worker IDs a topic can name
	replays map[string]string // worker ID -> rank-0 replay endpoint
}

// newRoster builds the roster of urls and replays (Config.URLs and Config.Replays), with the
// workers of Config.Topics, which never change.
func (s *Subscriber) newRoster(urls, replays map[string]string) (*roster, error) {
	r := &roster{
		hosts:   make(map[string]string, len(urls)),
		ids:     make(map[string]bool, len(s.cfg.Topics)+len(urls)),
		replays: maps.Clone(replays),
	}
	for _, w := range s.cfg.Topics {
		r.ids[w.ID] = true
	}
	if s.pattern == nil {
		return r, nil
	}
	for id, raw := range urls {
		hp, err := hostPort(raw)
		if err != nil {
			return nil, fmt.Errorf("kvevents: worker %s: %w", id, err)
		}
		r.hosts[hp] = id
		r.ids[id] = true
	}
	return r, nil
}

// Workers is the set of workers a Bind subscriber serves, as SetWorkers takes it: the fields of
// Config that follow the worker registry.
type Workers struct {
	// URLs, Replays and Hosts are as in Config. Hosts is ignored by a subscriber made with nil
	// Hosts (any address is admitted).
	URLs, Replays map[string]string
	Hosts         map[string][]string
}

// SetWorkers replaces, in Bind mode, the workers the subscriber serves while it runs, as the
// worker registry changes: a new worker's publishers are admitted from its hosts and its topics
// applied; a worker no longer listed is forgotten (its stream and engine map dropped; the
// caller purges its index entries), its topics are unknown from now on, and a new connection
// from its hosts is refused unless another worker publishes from there. A connection already
// open stays, but nothing it sends under a forgotten worker's topic is applied. It waits for
// the message in hand (like SnapshotEngineMaps) or for ctx. Connect mode has nothing to set:
// one subscriber per worker, started and stopped with it.
func (s *Subscriber) SetWorkers(ctx context.Context, ws Workers) error {
	if s.cfg.Mode != Bind {
		return fmt.Errorf("kvevents: SetWorkers on a connect-mode subscriber")
	}
	r, err := s.newRoster(ws.URLs, ws.Replays)
	if err != nil {
		return err
	}
	select {
	case s.turn <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("kvevents: set workers: %w", ctx.Err())
	}
	defer s.release()
	s.roster.Store(r)
	if s.from != nil {
		s.from.set(maps.Clone(ws.Hosts))
	}
	clear(s.topicCache)
	for w := range s.streams {
		if !r.ids[w.ID] {
			delete(s.streams, w)
			s.forgetLabels(w)
		}
	}
	return nil
}

// Forget drops, once Run has returned, what the subscriber keeps per worker: its streams,
// engine maps and gauges (a Connect subscriber of a worker that left the registry; the
// counters stay, as counters do).
func (s *Subscriber) Forget() {
	s.acquire()
	defer s.release()
	for w := range s.streams {
		delete(s.streams, w)
		s.forgetLabels(w)
	}
}

// forgetLabels deletes the per-worker series of a worker the subscriber no longer serves.
func (s *Subscriber) forgetLabels(w indexer.Worker) {
	label := w.String()
	s.m.lastSeq.DeleteLabelValues(label)
	s.m.silence.DeleteLabelValues(label)
}
