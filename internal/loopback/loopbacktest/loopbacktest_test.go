package loopbacktest

import (
	"net"
	"testing"
)

func TestAddrIsALoopbackAddressThatCanBeBound(t *testing.T) {
	a, b := Addr(t), Addr(t)
	if a == b {
		t.Fatalf("%s handed out twice in a row", a)
	}
	host, _, err := net.SplitHostPort(a)
	if err != nil {
		t.Fatal(err)
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		t.Fatalf("%s is not a loopback address", a)
	}
	l, err := net.Listen("tcp", a)
	if err != nil {
		t.Fatalf("%s cannot be bound: %v", a, err)
	}
	l.Close()
}
