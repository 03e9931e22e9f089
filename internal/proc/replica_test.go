package proc

import (
	"net"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// flagValues reads --flag value pairs after "serve"; a repeated flag keeps its last value,
// as the flag package does.
func flagValues(t *testing.T, argv []string) map[string]string {
	t.Helper()
	i := slices.Index(argv, "serve")
	if i != 1 {
		t.Fatalf("argv %q: want the binary, then serve", argv)
	}
	out := map[string]string{}
	rest := argv[2:]
	if len(rest)%2 != 0 {
		t.Fatalf("argv %q: flags without values", argv)
	}
	for j := 0; j < len(rest); j += 2 {
		if !strings.HasPrefix(rest[j], "--") {
			t.Fatalf("argv %q: %q is not a flag", argv, rest[j])
		}
		out[rest[j]] = rest[j+1]
	}
	return out
}

func TestServeArgv(t *testing.T) {
	rs, err := LoopbackReplicas(3, "/data")
	if err != nil {
		t.Fatal(err)
	}
	peers := rs[0].Peer + "," + rs[1].Peer + "," + rs[2].Peer
	gossip := rs[0].Gossip + "," + rs[1].Gossip + "," + rs[2].Gossip
	cases := []struct {
		name    string
		r       Replica
		cluster []Replica
		workers []string
		extra   []string
		want    map[string]string
		absent  []string
	}{
		{
			name: "one of three", r: rs[1], cluster: rs, workers: []string{"w0=http://a", "w1=http://b"},
			want: map[string]string{
				"--replica-id": "r1", "--listen": rs[1].Client, "--admin-listen": rs[1].Admin,
				"--raft-listen": rs[1].Raft, "--peer-listen": rs[1].Peer, "--gossip-listen": rs[1].Gossip,
				"--data-dir": filepath.Join("/data", "r1"), "--bootstrap-expect": "3",
				"--join": peers, "--gossip-join": gossip, "--worker": "w0=http://a,w1=http://b",
			},
		},
		{
			name: "extra flags override", r: rs[0], cluster: rs, workers: []string{"w0=http://a"},
			extra: []string{"--log-level", "warn", "--bootstrap-expect", "5"},
			want:  map[string]string{"--replica-id": "r0", "--log-level": "warn", "--bootstrap-expect": "5"},
		},
		{
			name: "a lone replica without workers", r: rs[2], cluster: rs[2:],
			want:   map[string]string{"--bootstrap-expect": "1", "--join": rs[2].Peer, "--gossip-join": rs[2].Gossip},
			absent: []string{"--worker"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			argv := tc.r.ServeArgv("/bin/kvr", tc.cluster, tc.workers, tc.extra...)
			if argv[0] != "/bin/kvr" {
				t.Fatalf("argv[0] = %q", argv[0])
			}
			got := flagValues(t, argv)
			for f, v := range tc.want {
				if got[f] != v {
					t.Errorf("%s = %q, want %q", f, got[f], v)
				}
			}
			for _, f := range tc.absent {
				if _, ok := got[f]; ok {
					t.Errorf("%s is set (%q), want it absent", f, got[f])
				}
			}
			if len(tc.extra) > 0 && !slices.Equal(argv[len(argv)-len(tc.extra):], tc.extra) {
				t.Errorf("argv %q does not end with the extra flags %q", argv, tc.extra)
			}
		})
	}
}

func TestLoopbackReplicasAreDistinctAndBindable(t *testing.T) {
	dir := t.TempDir()
	rs, err := LoopbackReplicas(3, dir)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for i, r := range rs {
		if want := "r" + string(rune('0'+i)); r.ID != want {
			t.Errorf("replica %d has id %q, want %q", i, r.ID, want)
		}
		if want := filepath.Join(dir, r.ID); r.DataDir != want {
			t.Errorf("%s: data dir %q, want %q", r.ID, r.DataDir, want)
		}
		for _, a := range []string{r.Client, r.Admin, r.Raft, r.Peer, r.Gossip} {
			if seen[a] {
				t.Errorf("%s: address %s handed out twice", r.ID, a)
			}
			seen[a] = true
			l, err := net.Listen("tcp", a)
			if err != nil {
				t.Errorf("%s: %s cannot be bound: %v", r.ID, a, err)
				continue
			}
			l.Close()
		}
	}
}
