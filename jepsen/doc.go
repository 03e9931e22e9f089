// Package jepsen is kvrouter-ha's fault harness. It runs the real binary as separate processes
// (replicas with their own data directories, simulated workers, optionally HAProxy in front),
// drives a workload of sessions through them while a seeded nemesis kills, pauses, restarts and
// partitions them, records every operation and fault in a History, and checks it: porcupine on
// each session's binding, binding changes that no fault explains, bindings lost across a
// full-cluster restart, and availability under each kind of fault.
//
// It imports nothing of the router's: the HTTP interface is its only contract with the code
// under test. It runs its processes through internal/proc, the process harness it shares with
// the demo and the system tests, which imports nothing of the router either. DESIGN.md beside
// this file explains the model and its limits.
package jepsen
