// Package dnstest is a DNS server for tests: real DNS packets over UDP on a loopback address,
// answering A, AAAA and SRV questions from records a test sets and changes while it runs, and
// able to stop answering or to answer SERVFAIL, as a broken server does.
package dnstest

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"

	"github.com/miekg/dns"
)

// Mode is how the server treats a question.
type Mode int

// The modes.
const (
	// Answer answers from the records (NXDOMAIN for a name it has none of).
	Answer Mode = iota
	// Silent reads every question and answers none (a server that times out).
	Silent
	// ServFail answers every question SERVFAIL.
	ServFail
)

// SRV is one SRV record's target and port.
type SRV struct {
	Target string
	Port   uint16
}

// Server is a running DNS server; Close stops it.
type Server struct {
	srv *dns.Server
	pc  net.PacketConn

	mu   sync.Mutex
	mode Mode
	ips  map[string][]netip.Addr
	srvs map[string][]SRV
	seen int
}

// Start serves on a free UDP port of 127.0.0.1.
func Start() (*Server, error) {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("dnstest: %w", err)
	}
	s := &Server{pc: pc, ips: map[string][]netip.Addr{}, srvs: map[string][]SRV{}}
	started := make(chan struct{})
	s.srv = &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(s.serve), NotifyStartedFunc: func() { close(started) }}
	done := make(chan error, 1)
	go func() { done <- s.srv.ActivateAndServe() }()
	select {
	case <-started:
	case err := <-done:
		return nil, fmt.Errorf("dnstest: %w", err)
	}
	return s, nil
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return s.pc.LocalAddr().String() }

// Close stops the server.
func (s *Server) Close() error { return s.srv.Shutdown() }

// SetMode changes how the server treats the next questions.
func (s *Server) SetMode(m Mode) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.mode = m
}

// SetAddrs makes name's A and AAAA records addrs (none: the name does not exist).
func (s *Server) SetAddrs(name string, addrs ...netip.Addr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ips[fqdn(name)] = addrs
}

// SetSRV makes name's SRV records srvs (none: the name does not exist).
func (s *Server) SetSRV(name string, srvs ...SRV) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.srvs[fqdn(name)] = srvs
}

// Questions is how many questions the server has read.
func (s *Server) Questions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seen
}

func fqdn(name string) string { return dns.Fqdn(strings.ToLower(name)) }

func (s *Server) serve(w dns.ResponseWriter, q *dns.Msg) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seen++
	if s.mode == Silent {
		return
	}
	m := new(dns.Msg)
	m.SetReply(q)
	m.Authoritative = true
	if s.mode == ServFail || len(q.Question) != 1 {
		m.SetRcode(q, dns.RcodeServerFailure)
		_ = w.WriteMsg(m)
		return
	}
	qq := q.Question[0]
	name := strings.ToLower(qq.Name)
	ips, hasIPs := s.ips[name]
	srvs, hasSRV := s.srvs[name]
	if len(ips) == 0 && len(srvs) == 0 {
		if !hasIPs && !hasSRV {
			m.SetRcode(q, dns.RcodeNameError)
		}
		_ = w.WriteMsg(m)
		return
	}
	hdr := func(t uint16) dns.RR_Header {
		return dns.RR_Header{Name: qq.Name, Rrtype: t, Class: dns.ClassINET, Ttl: 1}
	}
	switch qq.Qtype {
	case dns.TypeA:
		for _, a := range ips {
			if a.Is4() {
				m.Answer = append(m.Answer, &dns.A{Hdr: hdr(dns.TypeA), A: a.AsSlice()})
			}
		}
	case dns.TypeAAAA:
		for _, a := range ips {
			if a.Is6() {
				m.Answer = append(m.Answer, &dns.AAAA{Hdr: hdr(dns.TypeAAAA), AAAA: a.AsSlice()})
			}
		}
	case dns.TypeSRV:
		for _, r := range srvs {
			m.Answer = append(m.Answer, &dns.SRV{Hdr: hdr(dns.TypeSRV), Priority: 10, Weight: 10, Port: r.Port, Target: dns.Fqdn(r.Target)})
		}
	}
	_ = w.WriteMsg(m)
}
