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
	var buf [64]indexer.Match
	for _, idx := range o {
		if idx == nil {
			continue
		}
		part := idx.FindMatches(seq, buf[:0])
	merge:
		for _, m := range part {
			for i := range dst {
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
