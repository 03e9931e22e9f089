package proc

import (
	"strings"
	"testing"
)

func TestParseHAProxyLogLine(t *testing.T) {
	cases := []struct {
		name    string
		line    string
		want    HAProxyRequest
		ok      bool
		wantErr bool
	}{
		{name: "served", line: "kvrouter-lb 17 r1 0 200 --", ok: true,
			want: HAProxyRequest{Tag: "17", Server: "r1", Status: 200, Termination: "--"}},
		{name: "retried elsewhere", line: "kvrouter-lb 18 r2 +1 200 --", ok: true,
			want: HAProxyRequest{Tag: "18", Server: "r2", Retries: 1, Redispatched: true, Status: 200, Termination: "--"}},
		{name: "cut by the server", line: "kvrouter-lb 19 r0 0 200 SD\n", ok: true,
			want: HAProxyRequest{Tag: "19", Server: "r0", Status: 200, Termination: "SD"}},
		{name: "no server, no tag", line: "kvrouter-lb - <NOSRV> 2 503 SC", ok: true,
			want: HAProxyRequest{Retries: 2, Status: 503, Termination: "SC"}},
		{name: "no status", line: "kvrouter-lb 20 r0 3 -1 CD", ok: true,
			want: HAProxyRequest{Tag: "20", Server: "r0", Retries: 3, Status: -1, Termination: "CD"}},
		{name: "haproxy's own line", line: "[WARNING]  (1) : Server replicas/r0 is DOWN"},
		{name: "empty", line: ""},
		{name: "too few fields", line: "kvrouter-lb 17 r1 0 200", ok: true, wantErr: true},
		{name: "bad retries", line: "kvrouter-lb 17 r1 x 200 --", ok: true, wantErr: true},
		{name: "negative retries", line: "kvrouter-lb 17 r1 -2 200 --", ok: true, wantErr: true},
		{name: "bad status", line: "kvrouter-lb 17 r1 0 2000 --", ok: true, wantErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, ok, err := ParseHAProxyLogLine(tc.line)
			if ok != tc.ok || (err != nil) != tc.wantErr {
				t.Fatalf("ok %v err %v, want ok %v err %v", ok, err, tc.ok, tc.wantErr)
			}
			if err == nil && got != tc.want {
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

func FuzzParseHAProxyLogLine(f *testing.F) {
	for _, s := range []string{"kvrouter-lb 17 r1 0 200 --", "kvrouter-lb - <NOSRV> +2 -1 SC", "kvrouter-lb", "x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		req, ok, err := ParseHAProxyLogLine(line)
		if !ok && (err != nil || req != HAProxyRequest{}) {
			t.Fatalf("a line of another kind gave %+v, %v", req, err)
		}
		if err == nil && ok {
			if req.Retries < 0 || req.Status < -1 || req.Status > 999 || strings.ContainsAny(req.Tag+req.Server+req.Termination, " \t\n") {
				t.Fatalf("parsed %q as %+v", line, req)
			}
		}
	})
}
