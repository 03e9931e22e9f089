//go:build jepsen_broken

package fsm

// brokenSkipCAS makes Bind overwrite a live binding instead of answering Exists. It exists
// only in builds with the jepsen_broken tag, never in a release, so that the fault harness
// can show its checker catches a router that breaks the contract.
const brokenSkipCAS = true
