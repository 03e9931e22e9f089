package routing

import (
	"sort"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
)

func TestOverlayTakesEachWorkersLargestOverlap(t *testing.T) {
	precise, approx := newFakeIndex(), newFakeIndex()
	seq := hashes(1, 10)
	precise.Record(worker("a"), seq[:6])
	precise.Record(worker("b"), seq[:2])
	approx.Record(worker("a"), seq[:3])
	approx.Record(worker("b"), seq[:9])
	approx.Record(worker("c"), seq[:1])
	want := []indexer.Match{{Worker: worker("a"), Blocks: 6}, {Worker: worker("b"), Blocks: 9}, {Worker: worker("c"), Blocks: 1}}
	// The later index's matches are merged down inside dst's spare room when it has some:
	// every capacity must give the same answer.
	for _, tc := range []struct {
		name string
		dst  []indexer.Match
	}{
		{"no dst", nil},
		{"dst without room", make([]indexer.Match, 0, 1)},
		{"dst with room for some", make([]indexer.Match, 0, 3)},
		{"dst with room for all", make([]indexer.Match, 0, 16)},
		{"dst holding stale matches", []indexer.Match{{Worker: worker("z"), Blocks: 99}, {Worker: worker("a"), Blocks: 99}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Overlay{precise, nil, approx}.FindMatches(seq, tc.dst)
			sort.Slice(got, func(i, j int) bool { return got[i].Worker.ID < got[j].Worker.ID })
			if len(got) != len(want) {
				t.Fatalf("got %v, want %v", got, want)
			}
			for i := range want {
				if got[i] != want[i] {
					t.Fatalf("got %v, want %v", got, want)
				}
			}
		})
	}
}
