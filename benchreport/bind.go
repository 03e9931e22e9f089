package benchreport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/replica"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// BindPoint is session-bind throughput at one cluster size: every request opens a new session,
// so each is a binding written through the Raft leader (a follower forwards it) before the
// worker is asked, and the workers answer at once.
type BindPoint struct {
	Replicas int `json:"replicas"`
	// Binds is how many requests of new sessions succeeded in Seconds, with their latency.
	Binds        int     `json:"binds"`
	Failed       int     `json:"failed"`
	Seconds      float64 `json:"seconds"`
	PerSecond    float64 `json:"binds_per_s"`
	LatencyP50Ms float64 `json:"latency_p50_ms"`
	LatencyP99Ms float64 `json:"latency_p99_ms"`
	// GossipBytesPerSecond is what each replica sent on its gossip port meanwhile, averaged.
	GossipBytesPerSecond float64 `json:"gossip_bytes_per_s_per_replica"`
}

// bindCurve measures bind throughput at each of cfg.BindReplicas.
func bindCurve(ctx context.Context, cfg Config, logs io.Writer, progress func(string, ...any)) ([]BindPoint, error) {
	var out []BindPoint
	for _, n := range cfg.BindReplicas {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		p, err := bindThroughput(ctx, cfg, n, logs)
		if err != nil {
			return out, fmt.Errorf("%d replicas: %w", n, err)
		}
		out = append(out, p)
		progress("  %d replicas: %.0f binds/s (p50 %.1f ms, p99 %.1f ms), %d failed, gossip %.0f B/s per replica",
			n, p.PerSecond, p.LatencyP50Ms, p.LatencyP99Ms, p.Failed, p.GossipBytesPerSecond)
	}
	return out, nil
}

func bindThroughput(ctx context.Context, cfg Config, n int, logs io.Writer) (BindPoint, error) {
	p := BindPoint{Replicas: n}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelError}))
	ctx, cancel := context.WithCancel(ctx)
	// Four simulated workers a thousand times faster than real time: their answer is a
	// few microseconds, so the binding is what is measured.
	var specs []routing.WorkerSpec
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	for i := range 4 {
		w, err := sim.New(sim.Config{ID: fmt.Sprintf("w%d", i), Speedup: 1000, Logger: log})
		if err != nil {
			return p, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return p, err
		}
		specs = append(specs, routing.WorkerSpec{ID: fmt.Sprintf("w%d", i), URL: "http://" + ln.Addr().String()})
		wg.Go(func() { w.Serve(ctx, ln) })
	}
	dir, err := os.MkdirTemp("", "kvrouter-benchreport-bind-")
	if err != nil {
		return p, err
	}
	defer os.RemoveAll(dir)
	reps, err := startReplicas(ctx, n, specs, dir, log)
	if err != nil {
		return p, err
	}
	defer closeReplicas(reps)
	gossipOut := func() (sum uint64) {
		for _, r := range reps {
			if st, ok := r.SharingStats(); ok {
				sum += st.Gossip.BytesOut
			}
		}
		return sum
	}

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: cfg.BindConcurrency}, Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	var seq atomic.Int64
	send := func(i int) (time.Duration, error) {
		k := seq.Add(1)
		body := fmt.Sprintf(`{"model":%q,"prompt":"bind %d","max_tokens":1}`, sim.DefaultModel, k)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+reps[i%len(reps)].Addr()+"/v1/completions", strings.NewReader(body))
		if err != nil {
			return 0, err
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Session-ID", fmt.Sprintf("bench-bind-%d", k))
		t0 := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Kvrouter-Binding-Revision") == "" {
			return 0, fmt.Errorf("status %d, binding revision %q", resp.StatusCode, resp.Header.Get("X-Kvrouter-Binding-Revision"))
		}
		return time.Since(t0), nil
	}
	// Warm every replica's connections and the leader's forwarding paths.
	for i := range 2 * n {
		if _, err := send(i); err != nil {
			return p, fmt.Errorf("warm-up request: %w", err)
		}
	}
	var mu sync.Mutex
	var lat []time.Duration
	var failed int
	var firstErr error
	g0 := gossipOut()
	t0 := time.Now()
	end := t0.Add(cfg.BindDuration)
	var clients sync.WaitGroup
	for c := range cfg.BindConcurrency {
		clients.Go(func() {
			for i := c; time.Now().Before(end) && ctx.Err() == nil; i += cfg.BindConcurrency {
				d, err := send(i)
				mu.Lock()
				if err != nil {
					failed++
					if firstErr == nil {
						firstErr = err
					}
				} else {
					lat = append(lat, d)
				}
				mu.Unlock()
			}
		})
	}
	clients.Wait()
	elapsed := time.Since(t0)
	g1 := gossipOut()
	if len(lat) == 0 {
		return p, fmt.Errorf("no session was bound: %v", firstErr)
	}
	slices.Sort(lat)
	p.Binds, p.Failed, p.Seconds = len(lat), failed, elapsed.Seconds()
	p.PerSecond = float64(len(lat)) / elapsed.Seconds()
	p.LatencyP50Ms = quantile(lat, 0.5) / 1e6
	p.LatencyP99Ms = quantile(lat, 0.99) / 1e6
	p.GossipBytesPerSecond = float64(g1-g0) / float64(len(reps)) / elapsed.Seconds()
	return p, nil
}

// startReplicas starts n router replicas in this process that form one Raft cluster on
// loopback, gossiping, over the workers, and waits until all are ready.
func startReplicas(ctx context.Context, n int, workers []routing.WorkerSpec, dir string, log *slog.Logger) ([]*replica.Replica, error) {
	type addrs struct{ raft, peer, gossip string }
	var all []addrs
	var seeds, gossipSeeds []string
	for range n {
		var a addrs
		for _, s := range []*string{&a.raft, &a.peer, &a.gossip} {
			addr, err := loopback.Addr()
			if err != nil {
				return nil, err
			}
			*s = addr
		}
		all = append(all, a)
		seeds = append(seeds, a.peer)
		gossipSeeds = append(gossipSeeds, a.gossip)
	}
	var reps []*replica.Replica
	for i, a := range all {
		c := replica.Config{
			ID: fmt.Sprintf("bench-%d", i), Listen: "127.0.0.1:0", AdminListen: "127.0.0.1:0",
			Workers: workers, MaxSessions: 10_000_000,
			Health: openai.HealthConfig{Timeout: 2 * time.Second, FailThreshold: 3},
			Logger: log.With("replica", i),
			Cluster: replica.ClusterConfig{
				DataDir: filepath.Join(dir, fmt.Sprint(i)), RaftListen: a.raft, PeerListen: a.peer,
				BootstrapExpect: n, Join: seeds, BindWait: 10 * time.Second,
				Gossip: replica.GossipConfig{Listen: a.gossip, Join: gossipSeeds, MaxBytesPerSecond: replica.DefaultGossipBudget,
					JoinWait: 100 * time.Millisecond, SnapshotDiscovery: time.Second, MinQuorum: 3, CleanupInterval: 5 * time.Minute},
			},
		}
		r, err := replica.Start(ctx, c)
		if err != nil {
			closeReplicas(reps)
			return nil, err
		}
		reps = append(reps, r)
	}
	deadline := time.Now().Add(60 * time.Second)
	for _, r := range reps {
		for r.Ready() != nil {
			if time.Now().After(deadline) || ctx.Err() != nil {
				err := r.Ready()
				closeReplicas(reps)
				return nil, errors.Join(errors.New("replicas not ready"), err, ctx.Err())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return reps, nil
}

// closeReplicas stops replicas, all at once (they would otherwise each wait out the others'
// absence in turn).
func closeReplicas(reps []*replica.Replica) {
	var wg sync.WaitGroup
	for _, r := range reps {
		wg.Go(func() { _ = r.Close() })
	}
	wg.Wait()
}
