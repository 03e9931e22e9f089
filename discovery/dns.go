package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// DNS is a source that resolves a name every look: its A and AAAA records with a fixed port,
// or its SRV records (each target's addresses with the record's port). A worker's id is its
// address:port, so a pod that comes back on a new address is a new worker with an empty
// cache, never the old one.
//
// A name that does not exist (NXDOMAIN, or no records) is an empty fleet, which the suspect
// rule holds before acting on; a timeout, SERVFAIL or refused query is a failed look that
// keeps the last set.
type DNS struct {
	name string
	port int // 0: SRV
	res  *net.Resolver
}

// NewDNS is a DNS source for the A/AAAA records of name with port, or, with port 0, for the
// SRV records of name. server, when set (host:port), is the only DNS server asked; empty
// asks the system's resolvers.
func NewDNS(name string, port int, server string) (*DNS, error) {
	if name == "" {
		return nil, errors.New("discovery dns: the name is empty")
	}
	if port < 0 || port > 65535 {
		return nil, fmt.Errorf("discovery dns %s: port %d out of range", name, port)
	}
	d := &DNS{name: name, port: port, res: net.DefaultResolver}
	if server != "" {
		if _, _, err := net.SplitHostPort(server); err != nil {
			return nil, fmt.Errorf("discovery dns server %q: %w", server, err)
		}
		var dialer net.Dialer
		d.res = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, server)
		}}
	}
	return d, nil
}

// Name is "dns:NAME:PORT" (A/AAAA) or "dns-srv:NAME".
func (d *DNS) Name() string {
	if d.port == 0 {
		return "dns-srv:" + d.name
	}
	return "dns:" + d.name + ":" + strconv.Itoa(d.port)
}

// Kind is "dns".
func (d *DNS) Kind() string { return "dns" }

// Lookup resolves the name.
func (d *DNS) Lookup(ctx context.Context) ([]routing.WorkerSpec, error) {
	type target struct {
		host string
		port int
	}
	targets := []target{{d.name, d.port}}
	if d.port == 0 {
		_, srvs, err := d.res.LookupSRV(ctx, "", "", d.name)
		if notFound(err) {
			return []routing.WorkerSpec{}, nil
		}
		if err != nil {
			return nil, fmt.Errorf("discovery %s: %w", d.Name(), err)
		}
		targets = targets[:0]
		for _, s := range srvs {
			targets = append(targets, target{s.Target, int(s.Port)})
		}
	}
	var out []routing.WorkerSpec
	seen := map[string]bool{}
	for _, tg := range targets {
		addrs, err := d.res.LookupNetIP(ctx, "ip", tg.host)
		if notFound(err) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("discovery %s: %s: %w", d.Name(), tg.host, err)
		}
		for _, a := range addrs {
			hp := netip.AddrPortFrom(a.Unmap(), uint16(tg.port)).String()
			if seen[hp] {
				continue
			}
			seen[hp] = true
			spec := routing.WorkerSpec{ID: hp, URL: "http://" + hp}
			if err := routing.ValidateSpec(&spec); err != nil {
				return nil, fmt.Errorf("discovery %s: %w", d.Name(), err)
			}
			out = append(out, spec)
		}
	}
	slices.SortFunc(out, func(a, b routing.WorkerSpec) int { return strings.Compare(a.ID, b.ID) })
	if out == nil {
		out = []routing.WorkerSpec{}
	}
	return out, nil
}

// notFound reports an authoritative "no such name" or "no records".
func notFound(err error) bool {
	var de *net.DNSError
	return errors.As(err, &de) && de.IsNotFound
}
