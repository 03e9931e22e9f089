// Package peerpb holds the protobuf messages and the gRPC service of the peer port
// between kvrouter-ha replicas; package peer wraps them in a Go API.
package peerpb

//go:generate protoc --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative peer.proto
