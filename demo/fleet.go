package demo

import (
	"fmt"
	"regexp"
	"strconv"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Fleet is the simulated workers of a run by role: prefill-only, decode-only and aggregated.
type Fleet struct {
	Prefill, Decode, Aggregated int
}

// Size is the fleet's number of workers (simulated GPUs).
func (f Fleet) Size() int { return f.Prefill + f.Decode + f.Aggregated }

// Disaggregated reports whether the fleet has prefill workers, so that its runs compare
// disaggregation modes.
func (f Fleet) Disaggregated() bool { return f.Prefill > 0 }

// String is the fleet as --fleet spells it: 4p4d, 8agg, 2p4d2agg.
func (f Fleet) String() string {
	s := ""
	if f.Prefill > 0 {
		s += fmt.Sprintf("%dp", f.Prefill)
	}
	if f.Decode > 0 {
		s += fmt.Sprintf("%dd", f.Decode)
	}
	if f.Aggregated > 0 {
		s += fmt.Sprintf("%dagg", f.Aggregated)
	}
	return s
}

// roles lists each worker's name and role, prefill workers first.
func (f Fleet) roles() []struct {
	id   string
	role routing.Role
} {
	var out []struct {
		id   string
		role routing.Role
	}
	add := func(n int, prefix string, r routing.Role) {
		for i := range n {
			out = append(out, struct {
				id   string
				role routing.Role
			}{fmt.Sprintf("%s%d", prefix, i), r})
		}
	}
	add(f.Prefill, "p", routing.RolePrefill)
	add(f.Decode, "d", routing.RoleDecode)
	add(f.Aggregated, "w", routing.RoleBoth)
	return out
}

var fleetPart = regexp.MustCompile(`(\d+)(agg|p|d)`)

// ParseFleet reads one --fleet item: counts followed by p (prefill), d (decode) or agg
// (aggregated), e.g. 8agg, 4p4d or 2p4d2agg; 1 to 64 workers, with a decode-capable one.
func ParseFleet(s string) (Fleet, error) {
	var f Fleet
	rest := s
	for rest != "" {
		m := fleetPart.FindStringSubmatchIndex(rest)
		if m == nil || m[0] != 0 {
			return f, fmt.Errorf("--fleet item %q: want counts of p, d and agg workers, such as 8agg or 4p4d", s)
		}
		n, err := strconv.Atoi(rest[m[2]:m[3]])
		if err != nil || n < 1 {
			return f, fmt.Errorf("--fleet item %q: bad count %q", s, rest[m[2]:m[3]])
		}
		switch rest[m[4]:m[5]] {
		case "p":
			f.Prefill += n
		case "d":
			f.Decode += n
		case "agg":
			f.Aggregated += n
		}
		rest = rest[m[1]:]
	}
	if f.Size() < 1 || f.Size() > 64 || f.Decode+f.Aggregated == 0 {
		return f, fmt.Errorf("--fleet item %q: want 1 to 64 workers, at least one of them decode or aggregated", s)
	}
	return f, nil
}
