package loopback

import (
	"net"
	"testing"
)

func TestAddrIsBindableLoopback(t *testing.T) {
	seen := map[string]bool{}
	for range 20 {
		a, err := Addr()
		if err != nil {
			t.Fatal(err)
		}
		host, _, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatal(err)
		}
		if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
			t.Fatalf("%s is not a loopback address", a)
		}
		if seen[a] {
			t.Fatalf("%s handed out twice", a)
		}
		seen[a] = true
		l, err := net.Listen("tcp", a)
		if err != nil {
			t.Fatalf("address handed out cannot be bound: %v", err)
		}
		l.Close()
	}
}
