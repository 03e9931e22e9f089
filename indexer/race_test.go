//go:build race

package indexer

// raceEnabled reports a -race build, in which sync.Pool drops items at random and allocation
// counts say nothing about the code under test.
const raceEnabled = true
