package jepsen

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The namespaces' private subnet. Addresses exist only inside the harness's own namespaces:
// the host's namespace gets no address, no route and no interface.
const (
	subnetPrefix = "10.213.0."
	bridgeIP     = subnetPrefix + "1" // the harness's vantage point and HAProxy
	workersIP    = subnetPrefix + "2"
	replicaIP0   = 10 // replica i is 10.213.0.(10+i)
)

// netns puts every replica in a network namespace of its own, the workers in another, and
// joins them with veth pairs to a bridge that lives in a third namespace, where the harness's
// own connections start (a goroutine locked to a thread that entered it) and HAProxy runs.
// Partitions are iptables DROP rules on the replicas' INPUT chains, so cut links fall silent
// in both directions, as a real partition does.
type netns struct {
	prefix   string
	replicas int
	iptables string
	created  []string
	dialer   *nsDialer
}

func (n *netns) nsName(where string) string {
	switch where {
	case "lb", "bridge":
		return n.prefix + "-br"
	case "workers":
		return n.prefix + "-w"
	}
	return n.prefix + "-" + where
}

func replicaIP(i int) string { return fmt.Sprintf("%s%d", subnetPrefix, replicaIP0+i) }

// newNetns builds the namespaces; whatever it created is removed again if a step fails.
func newNetns(id string, replicas int) (network, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("network namespaces need root")
	}
	if replicas > 200 {
		return nil, fmt.Errorf("%d replicas do not fit the namespace subnet", replicas)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, fmt.Errorf("network namespaces need iproute2's ip: %w", err)
	}
	n := &netns{prefix: "kvj" + id, replicas: replicas}
	if p, err := exec.LookPath("iptables"); err == nil {
		n.iptables = p
	}
	if err := n.setup(); err != nil {
		n.close()
		return nil, err
	}
	d, err := newNSDialer("/var/run/netns/"+n.nsName("bridge"), 4)
	if err != nil {
		n.close()
		return nil, err
	}
	n.dialer = d
	return n, nil
}

func runCmd(argv ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func (n *netns) setup() error {
	br := n.nsName("bridge")
	members := []struct{ where, ip string }{{"workers", workersIP}}
	for i := range n.replicas {
		members = append(members, struct{ where, ip string }{fmt.Sprintf("r%d", i), replicaIP(i)})
	}
	for _, ns := range append([]string{br}, n.nsName("workers")) {
		if err := runCmd("ip", "netns", "add", ns); err != nil {
			return err
		}
		n.created = append(n.created, ns)
	}
	for i := range n.replicas {
		ns := n.nsName(fmt.Sprintf("r%d", i))
		if err := runCmd("ip", "netns", "add", ns); err != nil {
			return err
		}
		n.created = append(n.created, ns)
	}
	steps := [][]string{
		{"ip", "-n", br, "link", "set", "lo", "up"},
		{"ip", "-n", br, "link", "add", "br0", "type", "bridge"},
		{"ip", "-n", br, "addr", "add", bridgeIP + "/24", "dev", "br0"},
		{"ip", "-n", br, "link", "set", "br0", "up"},
	}
	for _, m := range members {
		ns := n.nsName(m.where)
		veth := "v-" + m.where
		if len(veth) > 15 {
			veth = veth[:15]
		}
		steps = append(steps,
			[]string{"ip", "-n", br, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns},
			[]string{"ip", "-n", br, "link", "set", veth, "master", "br0", "up"},
			[]string{"ip", "-n", ns, "addr", "add", m.ip + "/24", "dev", "eth0"},
			[]string{"ip", "-n", ns, "link", "set", "eth0", "up"},
			[]string{"ip", "-n", ns, "link", "set", "lo", "up"},
		)
	}
	for _, s := range steps {
		if err := runCmd(s...); err != nil {
			return err
		}
	}
	return nil
}

func (n *netns) describe() string {
	part := "iptables partitions"
	if n.iptables == "" {
		part = "no iptables: no partitions"
	}
	return fmt.Sprintf("network namespaces %s-* on %s0/24 (%s)", n.prefix, subnetPrefix, part)
}

func (n *netns) replicaHost(i int) string { return replicaIP(i) }
func (n *netns) workerHost() string       { return workersIP }
func (n *netns) lbHost() string           { return bridgeIP }

func (n *netns) addr(host string, port int) (string, error) {
	return net.JoinHostPort(host, fmt.Sprint(port)), nil
}

func (n *netns) wrap(where string) []string {
	return []string{"ip", "netns", "exec", n.nsName(where)}
}

func (n *netns) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	return n.dialer.dial(ctx, network, addr)
}

func (n *netns) canPartition() (bool, string) {
	if n.iptables == "" {
		return false, "iptables is not installed"
	}
	return true, ""
}

// partition drops, on both replicas of every cut pair, what arrives from the other.
func (n *netns) partition(_ context.Context, _ *fleet, cut [][2]int) error {
	if ok, why := n.canPartition(); !ok {
		return fmt.Errorf("%w: %s", errNoPartitions, why)
	}
	var errs []error
	for _, c := range cut {
		for _, dir := range [][2]int{{c[0], c[1]}, {c[1], c[0]}} {
			ns := n.nsName(fmt.Sprintf("r%d", dir[0]))
			errs = append(errs, runCmd("ip", "netns", "exec", ns, n.iptables, "-w", "-A", "INPUT", "-s", replicaIP(dir[1]), "-j", "DROP"))
		}
	}
	return errors.Join(errs...)
}

// heal removes every rule from every replica's namespace.
func (n *netns) heal(context.Context, *fleet) error {
	if n.iptables == "" {
		return nil
	}
	var errs []error
	for i := range n.replicas {
		errs = append(errs, runCmd("ip", "netns", "exec", n.nsName(fmt.Sprintf("r%d", i)), n.iptables, "-w", "-F", "INPUT"))
	}
	return errors.Join(errs...)
}

// close removes every namespace the harness made (their interfaces go with them). The
// processes inside must have been stopped first.
func (n *netns) close() error {
	if n.dialer != nil {
		n.dialer.close()
	}
	var errs []error
	for i := len(n.created) - 1; i >= 0; i-- {
		errs = append(errs, runCmd("ip", "netns", "del", n.created[i]))
	}
	n.created = nil
	return errors.Join(errs...)
}

// nsDialer opens connections from inside a network namespace. Sockets belong to the namespace
// of the thread that creates them, so each dialing goroutine locks itself to a thread, moves
// that thread into the namespace, and never unlocks: the runtime ends the thread with it.
type nsDialer struct {
	reqs chan dialReq
	done chan struct{}
	once sync.Once
	wg   sync.WaitGroup
}

type dialReq struct {
	ctx           context.Context
	network, addr string
	reply         chan dialRes
}

type dialRes struct {
	c   net.Conn
	err error
}

var errDialerClosed = errors.New("namespace dialer closed")

func newNSDialer(path string, n int) (*nsDialer, error) {
	d := &nsDialer{reqs: make(chan dialReq), done: make(chan struct{})}
	ready := make(chan error, n)
	for range n {
		d.wg.Add(1)
		go d.loop(path, ready)
	}
	var errs []error
	for range n {
		errs = append(errs, <-ready)
	}
	if err := errors.Join(errs...); err != nil {
		d.close()
		return nil, err
	}
	return d, nil
}

func (d *nsDialer) loop(path string, ready chan<- error) {
	defer d.wg.Done()
	runtime.LockOSThread()
	fd, err := syscall.Open(path, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		ready <- fmt.Errorf("open %s: %w", path, err)
		return
	}
	err = unix.Setns(fd, unix.CLONE_NEWNET)
	syscall.Close(fd)
	if err != nil {
		ready <- fmt.Errorf("setns %s: %w", path, err)
		return
	}
	ready <- nil
	for {
		select {
		case <-d.done:
			return
		case req := <-d.reqs:
			var dl net.Dialer
			c, err := dl.DialContext(req.ctx, req.network, req.addr)
			req.reply <- dialRes{c, err}
		}
	}
}

func (d *nsDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	reply := make(chan dialRes, 1)
	select {
	case d.reqs <- dialReq{ctx: ctx, network: network, addr: addr, reply: reply}:
	case <-d.done:
		return nil, errDialerClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	r := <-reply // the dial itself honours ctx
	return r.c, r.err
}

func (d *nsDialer) close() {
	d.once.Do(func() { close(d.done) })
	d.wg.Wait()
}
