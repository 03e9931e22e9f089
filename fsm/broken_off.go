//go:build !jepsen_broken

package fsm

// brokenSkipCAS is false in every real build; see broken_on.go.
const brokenSkipCAS = false
