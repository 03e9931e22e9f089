// Package fsmpb holds the protobuf bodies of the affinity state machine's commands and
// results; package fsm owns their meaning and validation.
package fsmpb

//go:generate protoc --go_out=. --go_opt=paths=source_relative commands.proto
