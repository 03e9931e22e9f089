// Package hints is what the replicas share over gossip (cluster/gossip) besides membership:
// each replica's routing decisions (Decisions), its per-worker in-flight load (LoadShare),
// its view of worker health (HealthView), and whole index snapshots for a starting replica
// (IndexSync, over the peer port). Every hint degrades to a slightly worse choice when it is
// lost or late, never to a wrong binding: bindings live in Raft (package cluster), and this
// package knows nothing of Raft. DESIGN.md in package cluster explains what is shared and
// what it costs.
package hints
