package kvevents

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

// The engine maps travel with index snapshots (cluster's EngineMaps): the router keys in a
// peer's index say which blocks a worker holds, but the BlockRemoved events that will take
// them out name engine hashes, which only the map translates. DESIGN.md says more.

// SnapshotEngineMaps copies the engine block -> router key map of every worker this
// subscriber has a translator for (workers with an empty map are left out: restoring nothing
// changes nothing). Keys are as the translator holds them, the engine hash XOR its medium's
// salt, so that a GPU block and its CPU copy stay apart; RestoreEngineMaps takes them back as
// they are. It may be called at any time, concurrently with Run: it waits for Run to finish the
// message in hand (a message that needs a replay can take up to ReplayTimeout), or until ctx
// ends, and a ctx already done fails at once. Holding the turn it only copies the tables' slot
// arrays; the maps are built after, so a snapshot of a few hundred thousand blocks holds up the
// events for a memory copy, not for a map insert per block.
func (s *Subscriber) SnapshotEngineMaps(ctx context.Context) (map[indexer.Worker]map[uint64]uint64, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("kvevents: engine maps snapshot: %w", err)
	}
	select {
	case s.turn <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("kvevents: engine maps snapshot: %w", ctx.Err())
	}
	copies := make(map[indexer.Worker]*table, len(s.streams))
	for w, st := range s.streams {
		if st.tr.Len() > 0 {
			copies[w] = st.tr.keys.clone()
		}
	}
	s.release()

	out := make(map[indexer.Worker]map[uint64]uint64, len(copies))
	for w, t := range copies {
		m := make(map[uint64]uint64, t.Len())
		t.each(func(k, v uint64) { m[k] = v })
		out[w] = m
		delete(copies, w) // its slot array can go before the next one is walked
	}
	return out, nil
}

// RestoreEngineMaps merges maps, as SnapshotEngineMaps returned them (here or on another
// replica subscribed to the same engines), into the translators of the workers this
// subscriber serves, and ignores the others: every subscriber of a replica is handed the whole
// snapshot. A Connect subscriber serves its one worker and rank; a Bind subscriber every rank of
// the worker IDs a topic can name (those of Topics, and with a TopicPattern those of URLs),
// since a batch's data_parallel_rank chooses the rank. An entry the translator already has is
// kept as it is (it came from a live event, newer than the snapshot); entries past MaxBlocks
// are dropped and counted in over_capacity_blocks_total. The index is not touched: its blocks
// come with the index snapshot. Meant to be called before Run, as a replica loads its snapshot
// before it turns ready; called while Run runs it waits for the message in hand.
func (s *Subscriber) RestoreEngineMaps(maps map[indexer.Worker]map[uint64]uint64) error {
	s.acquire()
	defer s.release()
	var (
		errs                                     []error
		workers, added, kept, dropped, notServed int
	)
	for w, m := range maps {
		if len(m) == 0 {
			continue
		}
		if !s.serves(w) {
			notServed++
			continue
		}
		st := s.stream(w)
		if st == nil {
			errs = append(errs, fmt.Errorf("worker %s: over %d workers", w, maxStreams))
			continue
		}
		a, k, d := st.tr.merge(m)
		workers, added, kept, dropped = workers+1, added+a, kept+k, dropped+d
		if d > 0 {
			s.m.overCapacity.WithLabelValues(st.label).Add(float64(d))
			s.log.Warn("kv events: restored engine map over the cap, blocks dropped", "worker", st.label,
				"dropped", d, "max_blocks", st.tr.maxBlocks)
		}
	}
	if workers > 0 {
		s.log.Info("kv events: engine maps restored", "endpoint", s.cfg.Endpoint, "workers", workers,
			"blocks", added, "kept_live", kept, "dropped", dropped, "not_served", notServed)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("kvevents: restore engine maps: %w", err)
	}
	return nil
}

// serves reports whether events of w can reach this subscriber (see RestoreEngineMaps).
func (s *Subscriber) serves(w indexer.Worker) bool {
	if s.cfg.Mode == Connect {
		return w == s.cfg.Worker
	}
	return s.roster.Load().ids[w.ID]
}
