//go:build !jepsen_broken_lease

package cluster

// brokenLeaseHolds is the hook of the jepsen_broken_lease build (broken_lease_on.go); in
// every real build it breaks nothing.
func (n *Node) brokenLeaseHolds() (bool, error) { return false, nil }
