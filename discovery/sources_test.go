package discovery

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/dnstest"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/workers"
)

func ids(specs []routing.WorkerSpec) []string {
	out := []string{}
	for _, s := range specs {
		out = append(out, s.ID)
	}
	slices.Sort(out)
	return out
}

func TestFileSourceRereadsItsFileAndRefusesABadOne(t *testing.T) {
	path := filepath.Join(t.TempDir(), "workers.json")
	f := NewFile(path)
	cases := []struct {
		name    string
		content string // "" leaves the file absent
		want    []string
		wantErr error
	}{
		{"absent", "", nil, os.ErrNotExist},
		{"two workers", `[{"id":"a","url":"http://127.0.0.1:1"},{"id":"b","url":"http://127.0.0.1:2"}]`, []string{"a", "b"}, nil},
		{"one more", `[{"id":"a","url":"http://127.0.0.1:1"},{"id":"b","url":"http://127.0.0.1:2"},{"id":"c","url":"http://127.0.0.1:3"}]`, []string{"a", "b", "c"}, nil},
		{"half written", `[{"id":"a","url":"http://127.0.0.1:1"},{"id":"b","ur`, nil, workers.ErrInvalid},
		{"unknown field", `[{"id":"a","url":"http://127.0.0.1:1","color":"red"}]`, nil, workers.ErrInvalid},
		{"bad url", `[{"id":"a","url":"ftp://x"}]`, nil, workers.ErrInvalid},
		{"id twice", `[{"id":"a","url":"http://127.0.0.1:1"},{"id":"a","url":"http://127.0.0.1:2"}]`, nil, workers.ErrInvalid},
		{"trailing value", `[] []`, nil, workers.ErrInvalid},
		{"empty fleet", `[]`, []string{}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.content != "" {
				if err := os.WriteFile(path, []byte(tc.content), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			got, err := f.Lookup(context.Background())
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("Lookup: %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if g := ids(got); !slices.Equal(g, tc.want) {
				t.Fatalf("Lookup: %v, want %v", g, tc.want)
			}
		})
	}
}

func TestDNSSourceResolvesAddressesAndSRVAndFailsOnABrokenServer(t *testing.T) {
	srv, err := dnstest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	a, err := NewDNS("vllm.test.", 8000, srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewDNS("_http._tcp.vllm.test.", 0, srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	ip := netip.MustParseAddr
	cases := []struct {
		name    string
		set     func()
		src     *DNS
		want    []string
		wantErr bool
	}{
		{"no such name is an empty fleet", func() {}, a, []string{}, false},
		{"A and AAAA with the port", func() {
			srv.SetAddrs("vllm.test", ip("127.0.0.2"), ip("127.0.0.3"), ip("::1"))
		}, a, []string{"127.0.0.2:8000", "127.0.0.3:8000", "[::1]:8000"}, false},
		{"one address gone", func() { srv.SetAddrs("vllm.test", ip("127.0.0.3"), ip("::1")) }, a, []string{"127.0.0.3:8000", "[::1]:8000"}, false},
		{"SRV targets with their ports", func() {
			srv.SetAddrs("p0.vllm.test", ip("127.0.0.4"))
			srv.SetAddrs("p1.vllm.test", ip("127.0.0.5"))
			srv.SetSRV("_http._tcp.vllm.test", dnstest.SRV{Target: "p0.vllm.test", Port: 8001}, dnstest.SRV{Target: "p1.vllm.test", Port: 8002})
		}, s, []string{"127.0.0.4:8001", "127.0.0.5:8002"}, false},
		{"SERVFAIL is a failed look", func() { srv.SetMode(dnstest.ServFail) }, a, nil, true},
		{"a silent server is a failed look", func() { srv.SetMode(dnstest.Silent) }, s, nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.set()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			got, err := tc.src.Lookup(ctx)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("Lookup: %v, want an error", ids(got))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if g := ids(got); !slices.Equal(g, tc.want) {
				t.Fatalf("Lookup: %v, want %v", g, tc.want)
			}
		})
	}
}

func TestParseSources(t *testing.T) {
	cases := []struct {
		spec, name string
		ok         bool
	}{
		{"file:/etc/workers.json", "file:/etc/workers.json", true},
		{"dns:vllm.default.svc:8000", "dns:vllm.default.svc:8000", true},
		{"dns-srv:_http._tcp.vllm", "dns-srv:_http._tcp.vllm", true},
		{"file:", "", false},
		{"dns:vllm", "", false},
		{"dns:vllm:0", "", false},
		{"dns:vllm:99999", "", false},
		{"dns-srv:", "", false},
		{"consul:x", "", false},
	}
	for _, tc := range cases {
		s, err := Parse(tc.spec, "")
		if (err == nil) != tc.ok {
			t.Fatalf("Parse(%q): %v, want ok=%v", tc.spec, err, tc.ok)
		}
		if tc.ok && s.Name() != tc.name {
			t.Fatalf("Parse(%q).Name() = %q, want %q", tc.spec, s.Name(), tc.name)
		}
	}
}
