// Package loopback hands out loopback addresses for servers that must be told their
// address before they bind it (Raft advertises its address; a test starts a process
// with a flag).
//
// Picking 127.0.0.1:0, closing it and binding later races with every outgoing
// connection on the machine: the kernel gives clients ephemeral ports on 127.0.0.1,
// and one may take the port in between. Addresses here use a random host in
// 127.0.0.0/8 instead, where no client connection takes a local port (clients to
// 127.0.0.1 bind 127.0.0.1), so the window is closed for practical purposes.
package loopback

import (
	"fmt"
	"math/rand/v2"
	"net"
)

// Addr returns host:port on a random 127.x.y.z host with a port that was free on it a
// moment ago.
func Addr() (string, error) {
	var last error
	for range 8 {
		host := fmt.Sprintf("127.%d.%d.%d", 1+rand.IntN(254), rand.IntN(256), 1+rand.IntN(254))
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			last = err
			continue
		}
		addr := l.Addr().String()
		if err := l.Close(); err != nil {
			return "", fmt.Errorf("loopback: close probe: %w", err)
		}
		return addr, nil
	}
	return "", fmt.Errorf("loopback: no free address: %w", last)
}
