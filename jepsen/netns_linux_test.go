package jepsen

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// listenIn opens a TCP listener inside a network namespace, from a thread that enters it and
// then ends.
func listenIn(t *testing.T, nsPath, addr string) net.Listener {
	t.Helper()
	type res struct {
		l   net.Listener
		err error
	}
	ch := make(chan res, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		fd, err := syscall.Open(nsPath, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
		if err != nil {
			ch <- res{nil, err}
			return
		}
		defer syscall.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			ch <- res{nil, err}
			return
		}
		l, err := net.Listen("tcp", addr)
		ch <- res{l, err}
	}()
	r := <-ch
	if r.err != nil {
		t.Fatalf("listen in %s: %v", nsPath, r.err)
	}
	t.Cleanup(func() { r.l.Close() })
	go func() {
		for {
			c, err := r.l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return r.l
}

func TestNamespacePartitionCutsOnlyTheChosenLink(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root")
	}
	for _, tool := range []string{"ip", "iptables"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("no %s", tool)
		}
	}
	var b [3]byte
	_, _ = rand.Read(b[:])
	nw, err := newNetns(hex.EncodeToString(b[:]), 3)
	if err != nil {
		t.Fatal(err)
	}
	n := nw.(*netns)
	defer func() {
		if err := n.close(); err != nil {
			t.Errorf("teardown: %v", err)
		}
		if _, err := os.Stat("/var/run/netns/" + n.nsName("r0")); !os.IsNotExist(err) {
			t.Errorf("namespace %s left behind", n.nsName("r0"))
		}
	}()
	if ok, why := n.canPartition(); !ok {
		t.Fatalf("cannot partition: %s", why)
	}
	target := net.JoinHostPort(replicaIP(1), "7001")
	listenIn(t, "/var/run/netns/"+n.nsName("r1"), target)
	fromR0, err := newNSDialer("/var/run/netns/"+n.nsName("r0"), 1)
	if err != nil {
		t.Fatal(err)
	}
	defer fromR0.close()
	fromR2, err := newNSDialer("/var/run/netns/"+n.nsName("r2"), 1)
	if err != nil {
		t.Fatal(err)
	}
	defer fromR2.close()
	reach := func(dial func(context.Context, string, string) (net.Conn, error)) error {
		ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
		defer cancel()
		c, err := dial(ctx, "tcp", target)
		if err == nil {
			c.Close()
		}
		return err
	}
	for name, d := range map[string]func(context.Context, string, string) (net.Conn, error){"r0": fromR0.dial, "r2": fromR2.dial, "harness": n.dial} {
		if err := reach(d); err != nil {
			t.Fatalf("before the partition %s cannot reach r1: %v", name, err)
		}
	}
	if err := n.partition(context.Background(), nil, [][2]int{{0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := reach(fromR0.dial); err == nil {
		t.Fatal("r0 reaches r1 across the partition")
	}
	if err := reach(fromR2.dial); err != nil {
		t.Fatalf("r2 lost r1 although only r0-r1 was cut: %v", err)
	}
	if err := reach(n.dial); err != nil {
		t.Fatalf("the harness lost r1: %v", err)
	}
	if err := n.heal(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	if err := reach(fromR0.dial); err != nil {
		t.Fatalf("after healing r0 still cannot reach r1: %v", err)
	}
}
