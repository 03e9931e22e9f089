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
	got := Overlay{precise, nil, approx}.FindMatches(seq, nil)
	sort.Slice(got, func(i, j int) bool { return got[i].Worker.ID < got[j].Worker.ID })
	want := []indexer.Match{{Worker: worker("a"), Blocks: 6}, {Worker: worker("b"), Blocks: 9}, {Worker: worker("c"), Blocks: 1}}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("got %v, want %v", got, want)
		}
	}
}
