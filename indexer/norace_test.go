//go:build !race

package indexer

// raceEnabled reports a -race build; see race_test.go.
const raceEnabled = false
