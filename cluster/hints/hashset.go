package hints

import "math/bits"

// hashSet is a set of block hashes: open addressing with linear probing and backward-shift
// deletion, the hash itself (already uniform) choosing the slot. It is what decision
// sharing marks sent hashes in, on the request path: a Go map costs several times more per
// insert. The zero hash is kept aside, since a zero slot is empty. Not safe for concurrent
// use.
type hashSet struct {
	slots []uint64 // a power of two long; 0 is empty
	shift uint     // 64 - log2(len(slots))
	n     int      // non-zero hashes held
	zero  bool
}

const hashSetMin = 64

func (s *hashSet) len() int {
	if s.zero {
		return s.n + 1
	}
	return s.n
}

func (s *hashSet) home(h uint64) int {
	// Fibonacci hashing, so that hashes that share low bits still spread.
	return int((h * 0x9e3779b97f4a7c15) >> s.shift)
}

// alloc gives the set an empty table of size slots, a power of two.
func (s *hashSet) alloc(size int) {
	s.slots = make([]uint64, size)
	s.shift = uint(64 - bits.TrailingZeros(uint(size)))
}

func (s *hashSet) has(h uint64) bool {
	if h == 0 {
		return s.zero
	}
	if s.n == 0 {
		return false
	}
	mask := len(s.slots) - 1
	for i := s.home(h); ; i = (i + 1) & mask {
		switch s.slots[i] {
		case h:
			return true
		case 0:
			return false
		}
	}
}

func (s *hashSet) add(h uint64) {
	if h == 0 {
		s.zero = true
		return
	}
	if len(s.slots) == 0 {
		s.alloc(hashSetMin)
	} else if 4*(s.n+1) > 3*len(s.slots) {
		s.resize(2 * len(s.slots))
	}
	mask := len(s.slots) - 1
	for i := s.home(h); ; i = (i + 1) & mask {
		switch s.slots[i] {
		case h:
			return
		case 0:
			s.slots[i] = h
			s.n++
			return
		}
	}
}

func (s *hashSet) del(h uint64) {
	if h == 0 {
		s.zero = false
		return
	}
	if s.n == 0 {
		return
	}
	mask := len(s.slots) - 1
	i := s.home(h)
	for ; s.slots[i] != h; i = (i + 1) & mask {
		if s.slots[i] == 0 {
			return
		}
	}
	// Move later members of the probe run back into the hole when the hole lies between
	// their home and their slot, so that every member stays reachable without tombstones.
	for j := (i + 1) & mask; s.slots[j] != 0; j = (j + 1) & mask {
		if home := s.home(s.slots[j]); (j-home)&mask >= (j-i)&mask {
			s.slots[i] = s.slots[j]
			i = j
		}
	}
	s.slots[i] = 0
	s.n--
}

func (s *hashSet) resize(size int) {
	old := s.slots
	s.alloc(size)
	mask := size - 1
	for _, h := range old {
		if h == 0 {
			continue
		}
		i := s.home(h)
		for s.slots[i] != 0 {
			i = (i + 1) & mask
		}
		s.slots[i] = h
	}
}
