package hints

import (
	"slices"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/cluster/gossip"
)

func TestFromVotersHearsAndListsOnlyVoters(t *testing.T) {
	net := newFakeNet()
	self := net.join("r0", "127.0.0.1:1")
	net.join("r1", "127.0.0.1:2")
	net.join("intruder", "127.0.0.1:3")
	voters := FromVoters(self, func(name string) bool { return name == "r1" })

	var names []string
	for _, m := range voters.Members() {
		names = append(names, m.Name)
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"r0", "r1"}) {
		t.Errorf("members %v, want this replica and the voter r1", names)
	}
	if got := GossipPeers(voters)(); len(got) != 1 || got[0].ID != "r1" {
		t.Errorf("snapshot peers %+v, want r1 alone", got)
	}

	var heard []string
	voters.Handle(gossip.KindLoad, func(from string, _ []byte) { heard = append(heard, from) })
	for _, from := range []string{"r1", "intruder", "r1"} {
		net.inject(from, "r0", gossip.KindLoad, []byte{1})
	}
	if !slices.Equal(heard, []string{"r1", "r1"}) {
		t.Errorf("heard from %v, want r1 twice and never the intruder", heard)
	}
}
