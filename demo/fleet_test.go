package demo

import "testing"

func TestParseFleet(t *testing.T) {
	cases := []struct {
		in   string
		want Fleet
		ok   bool
	}{
		{"8agg", Fleet{Aggregated: 8}, true},
		{"4p4d", Fleet{Prefill: 4, Decode: 4}, true},
		{"2p4d2agg", Fleet{Prefill: 2, Decode: 4, Aggregated: 2}, true},
		{"4p", Fleet{}, false}, // nothing decodes
		{"", Fleet{}, false},
		{"0agg", Fleet{}, false},
		{"4x", Fleet{}, false},
		{"4p 4d", Fleet{}, false},
		{"65agg", Fleet{}, false},
	}
	for _, tc := range cases {
		got, err := ParseFleet(tc.in)
		if (err == nil) != tc.ok || tc.ok && got != tc.want {
			t.Errorf("ParseFleet(%q) = %+v, %v; want %+v ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
		if tc.ok && got.String() != tc.in {
			t.Errorf("%+v.String() = %q, want %q", got, got.String(), tc.in)
		}
	}
}
