package hints

import "math/bits"

// linkMap maps a block hash to the hash of the block before it in its chain: open
// addressing with linear probing, like hashSet, and no deletion. The zero hash is kept
// aside. Not safe for concurrent use.
type linkMap struct {
	keys, parents []uint64 // a power of two long; key 0 is empty
	shift         uint
	n             int
	zero          bool
	zeroParent    uint64
}

func (m *linkMap) home(h uint64) int { return int((h * 0x9e3779b97f4a7c15) >> m.shift) }

func (m *linkMap) alloc(size int) {
	m.keys, m.parents = make([]uint64, size), make([]uint64, size)
	m.shift = uint(64 - bits.TrailingZeros(uint(size)))
}

func (m *linkMap) len() int {
	if m.zero {
		return m.n + 1
	}
	return m.n
}

func (m *linkMap) get(h uint64) (uint64, bool) {
	if h == 0 {
		return m.zeroParent, m.zero
	}
	if m.n == 0 {
		return 0, false
	}
	mask := len(m.keys) - 1
	for i := m.home(h); ; i = (i + 1) & mask {
		switch m.keys[i] {
		case h:
			return m.parents[i], true
		case 0:
			return 0, false
		}
	}
}

func (m *linkMap) put(h, parent uint64) {
	if h == 0 {
		m.zero, m.zeroParent = true, parent
		return
	}
	if len(m.keys) == 0 {
		m.alloc(hashSetMin)
	} else if 4*(m.n+1) > 3*len(m.keys) {
		m.grow()
	}
	mask := len(m.keys) - 1
	for i := m.home(h); ; i = (i + 1) & mask {
		switch m.keys[i] {
		case h:
			m.parents[i] = parent
			return
		case 0:
			m.keys[i], m.parents[i] = h, parent
			m.n++
			return
		}
	}
}

func (m *linkMap) grow() {
	keys, parents := m.keys, m.parents
	m.alloc(2 * len(keys))
	mask := len(m.keys) - 1
	for j, h := range keys {
		if h == 0 {
			continue
		}
		i := m.home(h)
		for m.keys[i] != 0 {
			i = (i + 1) & mask
		}
		m.keys[i], m.parents[i] = h, parents[j]
	}
}

// chainLinks remembers, for the block hashes decisions brought recently, the block before
// each in its chain, so that a decision sent as a suffix can be stored whole: a receiver
// walks back from the suffix's anchor (the last block the sender had sent before) to the
// chain's head. A chained hash names its whole prefix, so a link holds whoever sent it and
// for whichever worker; one table serves every peer. Two generations bound it: when the
// current one holds perGeneration links it becomes the previous one, and a walk that
// passes a forgotten link fails (the suffix is then stored alone, as before anchors).
// Not safe for concurrent use.
type chainLinks struct {
	cur, prev     linkMap
	perGeneration int
}

const (
	// defaultChainLinks: links per generation. Two generations of 2^19 take 32 MiB at
	// most (tables grow as they fill); they cover the last half million to million blocks
	// decided, minutes of decisions at the replay's rate, more than the sender's FullAfter.
	defaultChainLinks = 1 << 19
	// maxAnchoredPrefix bounds the prefix an anchored entry names: a longer one (2M
	// tokens at 16 per block) is sent whole instead, and a walk never runs further.
	maxAnchoredPrefix = 1 << 17
)

// remember links each hash of chain to the one before it, and chain[0] to anchor when
// the chain continues one (hasAnchor).
func (c *chainLinks) remember(chain []uint64, anchor uint64, hasAnchor bool) {
	if c.cur.len()+len(chain) > c.perGeneration && c.cur.len() > 0 {
		c.prev, c.cur = c.cur, linkMap{}
	}
	if hasAnchor && len(chain) > 0 {
		c.cur.put(chain[0], anchor)
	}
	for i := 1; i < len(chain); i++ {
		c.cur.put(chain[i], chain[i-1])
	}
}

// expand returns the chain's first prefix blocks, ending with anchor, appended to dst in
// chain order, or false when a link on the way is not known.
func (c *chainLinks) expand(dst []uint64, anchor uint64, prefix int) ([]uint64, bool) {
	start := len(dst)
	h := anchor
	dst = append(dst, h)
	for len(dst)-start < prefix {
		p, ok := c.cur.get(h)
		if !ok {
			if p, ok = c.prev.get(h); !ok {
				return dst[:start], false
			}
		}
		dst = append(dst, p)
		h = p
	}
	for i, j := start, len(dst)-1; i < j; i, j = i+1, j-1 {
		dst[i], dst[j] = dst[j], dst[i]
	}
	return dst, true
}
