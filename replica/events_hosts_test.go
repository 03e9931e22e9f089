package replica

import (
	"slices"
	"testing"
)

func TestPublisherHostsFlag(t *testing.T) {
	cases := []struct {
		flag    string
		hosts   []string
		anyHost bool
	}{
		{"", nil, false},
		{"10.0.0.5", []string{"10.0.0.5"}, false},
		{" nat-gw , 10.0.0.6,,", []string{"nat-gw", "10.0.0.6"}, false},
		{"*", nil, true},
		{"10.0.0.5,*", []string{"10.0.0.5"}, true},
	}
	for _, c := range cases {
		hosts, anyHost := publisherHosts(c.flag)
		if !slices.Equal(hosts, c.hosts) || anyHost != c.anyHost {
			t.Errorf("publisherHosts(%q) = %q, %v; want %q, %v", c.flag, hosts, anyHost, c.hosts, c.anyHost)
		}
	}
}
