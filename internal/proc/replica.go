package proc

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
)

// Replica is one `kvrouter-ha serve` process as a cluster knows it: its id, the addresses
// it listens on (host:port) and its data directory. A replica started again gets the same
// description, so it comes back on the same addresses with the same state.
type Replica struct {
	// ID is its --replica-id.
	ID string
	// Client is the client port (--listen), the one a load balancer sends to.
	Client string
	// Admin is the admin API and /metrics (--admin-listen).
	Admin string
	// Raft, Peer and Gossip are Raft's TCP port, the gRPC peer port and memberlist's
	// TCP+UDP port.
	Raft, Peer, Gossip string
	// DataDir is its --data-dir.
	DataDir string
	// ExtProc, when set, is its endpoint picker's port (--ext-proc-listen).
	ExtProc string
}

// LoopbackReplicas describes n replicas r0..r<n-1> on free loopback addresses (see
// internal/loopback), each with its data directory dir/r<i>.
func LoopbackReplicas(n int, dir string) ([]Replica, error) {
	out := make([]Replica, n)
	for i := range out {
		r := Replica{ID: fmt.Sprintf("r%d", i), DataDir: filepath.Join(dir, fmt.Sprintf("r%d", i))}
		for _, a := range []*string{&r.Client, &r.Admin, &r.Raft, &r.Peer, &r.Gossip} {
			addr, err := loopback.Addr()
			if err != nil {
				return nil, fmt.Errorf("replica %s: %w", r.ID, err)
			}
			*a = addr
		}
		out[i] = r
	}
	return out, nil
}

// ServeArgv returns the command line that runs r with bin as one replica of cluster (r among
// them), all of which bootstrap together: --bootstrap-expect is the cluster's size, --join
// and --gossip-join name every replica's peer and gossip address. workers are the
// --worker specs (id=url); extra flags come last, so they override the ones here.
func (r Replica) ServeArgv(bin string, cluster []Replica, workers []string, extra ...string) []string {
	var peers, gossip []string
	for _, c := range cluster {
		peers = append(peers, c.Peer)
		gossip = append(gossip, c.Gossip)
	}
	argv := []string{bin, "serve",
		"--replica-id", r.ID, "--listen", r.Client, "--admin-listen", r.Admin,
		"--raft-listen", r.Raft, "--peer-listen", r.Peer, "--data-dir", r.DataDir,
		"--bootstrap-expect", strconv.Itoa(len(cluster)), "--join", strings.Join(peers, ","),
		"--gossip-listen", r.Gossip, "--gossip-join", strings.Join(gossip, ","),
	}
	if len(workers) > 0 {
		argv = append(argv, "--worker", strings.Join(workers, ","))
	}
	if r.ExtProc != "" {
		argv = append(argv, "--ext-proc-listen", r.ExtProc)
	}
	return append(argv, extra...)
}
