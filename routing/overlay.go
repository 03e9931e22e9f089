package routing

import "github.com/kvrouter-ha/kvrouter-ha/indexer"

// Overlay answers from several indexes at once, taking each worker's largest overlap. Precise
// mode layers the replica's own recent decisions (short TTL) over the index the workers' KV
// events feed: a burst of siblings of a new prompt then follows the first one to its worker
// before that worker's BlockStored arrives.
type Overlay []PrefixIndex

// FindMatches implements PrefixIndex.
func (o Overlay) FindMatches(seq []uint64, dst []indexer.Match) []indexer.Match {
	dst = dst[:0]
	for _, idx := range o {
		if idx == nil {
			continue
		}
		if len(dst) == 0 {
			// Nothing to merge with: the matches go straight into dst.
			dst = idx.FindMatches(seq, dst)
			continue
		}
		// The next index's matches go into dst's spare room (or a slice of their own when
		// it has none) and are merged down into dst: each kept match moves to dst's end,
		// which is never past the match being read, so nothing is overwritten unread.
		n := len(dst)
		part := idx.FindMatches(seq, dst[n:])
	merge:
		for _, m := range part {
			for i := range dst[:n] {
				if dst[i].Worker == m.Worker {
					dst[i].Blocks = max(dst[i].Blocks, m.Blocks)
					continue merge
				}
			}
			dst = append(dst, m)
		}
	}
	return dst
}
