package hints

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestLinkMapAgreesWithAMap puts random links, with hashes that collide on their homes,
// into the table and a map, and compares them throughout.
func TestLinkMapAgreesWithAMap(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	var lm linkMap
	m := map[uint64]uint64{}
	pool := make([]uint64, 3000)
	for i := range pool {
		pool[i] = r.Uint64() >> (r.IntN(4) * 20)
	}
	pool[0] = 0
	for step := range 50_000 {
		h, p := pool[r.IntN(len(pool))], r.Uint64()
		lm.put(h, p)
		m[h] = p
		if step%1000 == 0 {
			for _, h := range pool {
				got, ok := lm.get(h)
				want, wok := m[h]
				if ok != wok || got != want {
					t.Fatalf("step %d: get(%x) = %x %v, map says %x %v", step, h, got, ok, want, wok)
				}
			}
			if lm.len() != len(m) {
				t.Fatalf("step %d: len %d, map %d", step, lm.len(), len(m))
			}
		}
	}
}

func TestChainLinksExpandAnchors(t *testing.T) {
	chain := sharePrompt(1, 40)
	tests := []struct {
		name          string
		setup         func(c *chainLinks)
		anchorAt, pre int // expand from chain[anchorAt] for pre blocks
		want          []uint64
		ok            bool
	}{
		{"a whole chain remembered", func(c *chainLinks) { c.remember(chain, 0, false) }, 29, 30, chain[:30], true},
		{"the head alone", func(c *chainLinks) { c.remember(chain, 0, false) }, 0, 1, chain[:1], true},
		{"pieces joined by their anchors", func(c *chainLinks) {
			c.remember(chain[20:], chain[19], true)
			c.remember(chain[:20], 0, false)
		}, 39, 40, chain, true},
		{"a prefix longer than what is known", func(c *chainLinks) { c.remember(chain[10:], 0, false) }, 39, 40, nil, false},
		{"a missing piece", func(c *chainLinks) {
			c.remember(chain[:10], 0, false)
			c.remember(chain[20:], chain[19], true)
		}, 39, 40, nil, false},
		{"a link two generations old is forgotten", func(c *chainLinks) {
			c.perGeneration = 40
			c.remember(chain, 0, false)
			c.remember(sharePrompt(2, 40), 0, false)
			c.remember(sharePrompt(3, 40), 0, false)
		}, 39, 40, nil, false},
		{"a link one generation old is kept", func(c *chainLinks) {
			c.perGeneration = 40
			c.remember(chain, 0, false)
			c.remember(sharePrompt(2, 40), 0, false)
		}, 39, 40, chain, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := &chainLinks{perGeneration: defaultChainLinks}
			tc.setup(c)
			dst := []uint64{7}
			got, ok := c.expand(dst, chain[tc.anchorAt], tc.pre)
			if ok != tc.ok {
				t.Fatalf("expanded %v, want %v", ok, tc.ok)
			}
			if !slices.Equal(got[1:], tc.want) || got[0] != 7 {
				t.Fatalf("got %d blocks after dst's one, want %d (or dst was clobbered)", len(got)-1, len(tc.want))
			}
		})
	}
}

// TestChainLinksSurviveACycle: links a peer sent that loop (nothing a real chain does)
// make a walk return nonsense of the length asked for, never run on.
func TestChainLinksSurviveACycle(t *testing.T) {
	c := &chainLinks{perGeneration: defaultChainLinks}
	c.remember([]uint64{1, 2}, 2, true) // 1 -> 2 -> 1
	got, ok := c.expand(nil, 2, maxAnchoredPrefix)
	if !ok || len(got) != maxAnchoredPrefix {
		t.Fatalf("walk of a cycle: %d blocks, %v", len(got), ok)
	}
}
