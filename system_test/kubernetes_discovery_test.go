package system_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/admin"
	"github.com/kvrouter-ha/kvrouter-ha/internal/k8stest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

func TestKubernetesDiscoveryFollowsPodsOnEveryReplicaMovesOnlyADeletedPodsSessionsAndHoldsWhileTheAPIServerIsAway(t *testing.T) {
	for _, tc := range []struct {
		name string
		pool bool
	}{{name: "selector"}, {name: "inference pool", pool: true}} {
		t.Run(tc.name, func(t *testing.T) {
			hosts := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}
			port, _ := startFleetOnPort(t, hosts...)
			k := k8stest.StartCluster(t, "ns")
			source := fmt.Sprintf("kubernetes:namespace=ns,selector=app=vllm,port=%d,kubeconfig=%s", port, k.Kubeconfig)
			if tc.pool {
				k.CreatePool(t, "vllm", port)
				source = "kubernetes:namespace=ns,pool=vllm,kubeconfig=" + k.Kubeconfig
			}
			names := []string{"vllm-0", "vllm-1", "vllm-2", "vllm-3"}
			id := map[string]string{}
			for i, n := range names[:3] {
				id[n] = k.CreatePod(t, n, hosts[i], true)
			}
			id["vllm-3"] = k.CreatePod(t, "vllm-3", hosts[3], false)
			// A grace of 0: a pod made not ready drains at once, as a deleted one (the grace is
			// TestANotReadyPodKeepsItsSessionsWithinTheGraceAndMovesThemOnceBeyondIt's).
			c := startClusterOf(t, binary, 3, nil, discoveryFlags(source, "--discovery-not-ready-grace", "0s")...)
			took := waitFleet(t, c.replicas, []string{id["vllm-0"], id["vllm-1"], id["vllm-2"]}, 60*time.Second)
			t.Logf("3 ready pods on every replica %s after the cluster was ready", took.Round(time.Millisecond))
			bound := bindSessions(t, c, sessionNames("k8s-"+strconv.FormatBool(tc.pool), 30))

			k.SetReady(t, "vllm-3", hosts[3], true)
			took = waitFleet(t, c.replicas, []string{id["vllm-0"], id["vllm-1"], id["vllm-2"], id["vllm-3"]}, 20*time.Second)
			t.Logf("a pod made ready on every replica within %s", took.Round(time.Millisecond))
			k.SetReady(t, "vllm-3", hosts[3], false)
			took = waitFleet(t, c.replicas, []string{id["vllm-0"], id["vllm-1"], id["vllm-2"]}, 20*time.Second)
			t.Logf("a pod made not ready drained and gone from every replica within %s", took.Round(time.Millisecond))

			// The pod holding the most sessions is deleted and recreated under its name: a new
			// worker (a new UID); its sessions move once, no other session moves.
			gone := mostBound(bound)
			var goneName string
			for n, i := range id {
				if i == gone {
					goneName = n
				}
			}
			k.DeletePod(t, goneName)
			var kept []string
			for _, n := range names[:3] {
				if n != goneName {
					kept = append(kept, id[n])
				}
			}
			took = waitFleet(t, c.replicas, kept, 20*time.Second)
			t.Logf("a deleted pod drained and gone from every replica within %s", took.Round(time.Millisecond))
			moved := checkMovedOnce(t, c, bound, gone)
			if moved == 0 {
				t.Fatalf("no session was bound to %s: the test proves nothing", gone)
			}
			ip := hosts[map[string]int{"vllm-0": 0, "vllm-1": 1, "vllm-2": 2}[goneName]]
			id[goneName+" again"] = k.CreatePod(t, goneName, ip, true)
			if id[goneName+" again"] == gone {
				t.Fatalf("the recreated pod kept the id %s", gone)
			}
			all := append(append([]string{}, kept...), id[goneName+" again"])
			took = waitFleet(t, c.replicas, all, 20*time.Second)
			t.Logf("%d sessions moved once; the recreated pod on every replica within %s as %s", moved, took.Round(time.Millisecond), id[goneName+" again"])

			// The API server away for 30 s, under load: no worker removed, every replica
			// answers, and every session stays on its worker.
			steady := bindSessions(t, c, sessionNames("k8s-steady-"+strconv.FormatBool(tc.pool), 12))
			failedBefore, err := metricValue(t.Context(), c.leader(), `kvrouter_discovery_errors_total{source="kubernetes"}`)
			if err != nil {
				failedBefore = 0 // not counted yet
			}
			k.StopAPI()
			done := make(chan int)
			stop := make(chan struct{})
			go func() {
				sent := 0
				defer func() { done <- sent }()
				for sent < 600 {
					for s, b := range steady {
						select {
						case <-stop:
							return
						default:
						}
						a, err := chat(t.Context(), c.replicas[sent%len(c.replicas)], s, "steady "+s)
						sent++
						if err != nil || a.worker != b.worker || a.revision != b.revision {
							t.Errorf("session %s while the API server is away: %+v, %v; want %s@%d", s, a, err, b.worker, b.revision)
							return
						}
					}
				}
			}()
			holdsFleet(t, c.replicas, all, 30*time.Second)
			close(stop)
			t.Logf("%d requests answered on their sessions' workers while the API server was away", <-done)
			failed, err := metricValue(t.Context(), c.leader(), `kvrouter_discovery_errors_total{source="kubernetes"}`)
			if err != nil || failed <= failedBefore {
				t.Fatalf("the leader's kvrouter_discovery_errors_total{source=\"kubernetes\"}: %v (%v before the API server stopped), %v; want the failed looks counted", failed, failedBefore, err)
			}
			if err := k.StartAPI(); err != nil {
				t.Fatal(err)
			}
			// Back: the set converges on what the API server says.
			k.SetReady(t, "vllm-3", hosts[3], true)
			took = waitFleet(t, c.replicas, append(all, id["vllm-3"]), 60*time.Second)
			t.Logf("after the API server's return, a pod made ready on every replica within %s", took.Round(time.Millisecond))
		})
	}
}

// notReadyOnEveryReplica checks that every replica of rs lists worker id as not ready (not
// routable) with its n bindings kept, and routes to exactly the others of all.
func notReadyOnEveryReplica(ctx context.Context, rs []*replica, id string, n int, all []string) error {
	want := slices.DeleteFunc(slices.Clone(all), func(w string) bool { return w == id })
	slices.Sort(want)
	for _, r := range rs {
		var ws []admin.WorkerView
		if err := proc.Get(ctx, httpClient, "http://"+r.Admin+"/admin/workers", &ws); err != nil {
			return err
		}
		i := slices.IndexFunc(ws, func(w admin.WorkerView) bool { return w.Spec.ID == id })
		if i < 0 {
			return fmt.Errorf("%s does not list %s", r.ID, id)
		}
		if w := ws[i]; !w.NotReady || w.Drained || w.State != admin.StateNotReady || w.Bindings != n {
			return fmt.Errorf("%s lists %s as %s (not ready %v, drained %v) with %d bindings, want not_ready with %d", r.ID, id, w.State, w.NotReady, w.Drained, w.Bindings, n)
		}
		route, _, err := routable(ctx, r)
		if err != nil {
			return err
		}
		if !slices.Equal(route, want) {
			return fmt.Errorf("%s routes to %v, want %v", r.ID, route, want)
		}
	}
	return nil
}

func TestANotReadyPodKeepsItsSessionsWithinTheGraceAndMovesThemOnceBeyondIt(t *testing.T) {
	for _, tc := range []struct {
		name string
		pool bool
	}{{name: "selector"}, {name: "inference pool", pool: true}} {
		t.Run(tc.name, func(t *testing.T) { notReadyPodsLife(t, tc.pool) })
	}
}

// notReadyPodsLife is TestANotReadyPodKeepsItsSessionsWithinTheGraceAndMovesThemOnceBeyondIt
// with the pods selected by a label selector, or by an InferencePool (pool).
func notReadyPodsLife(t *testing.T, pool bool) {
	const grace = 20 * time.Second
	hosts := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	port, _ := startFleetOnPort(t, hosts...)
	k := k8stest.StartCluster(t, "ns")
	source := fmt.Sprintf("kubernetes:namespace=ns,selector=app=vllm,port=%d,kubeconfig=%s", port, k.Kubeconfig)
	if pool {
		k.CreatePool(t, "vllm", port)
		source = "kubernetes:namespace=ns,pool=vllm,kubeconfig=" + k.Kubeconfig
	}
	names := []string{"vllm-0", "vllm-1", "vllm-2"}
	id := map[string]string{}
	var all []string
	for i, n := range names {
		id[n] = k.CreatePod(t, n, hosts[i], true)
		all = append(all, id[n])
	}
	c := startClusterOf(t, binary, 3, nil, discoveryFlags(source, "--discovery-not-ready-grace", grace.String())...)
	waitFleet(t, c.replicas, all, 60*time.Second)
	bound := bindSessions(t, c, sessionNames("not-ready", 30))
	target := mostBound(bound)
	name := names[slices.Index(all, target)]
	ip := hosts[slices.Index(all, target)]
	onTarget := 0
	for _, b := range bound {
		if b.worker == target {
			onTarget++
		}
	}
	if onTarget == 0 {
		t.Fatalf("no session was bound to %s: the test proves nothing", target)
	}

	// Not ready, then ready again within the grace: out of rotation on every replica with its
	// bindings kept; new sessions go elsewhere, a bound session's request is served elsewhere
	// without moving its binding; once ready, every session is where it was, same revision.
	start := time.Now()
	k.SetReady(t, name, ip, false)
	eventually(t, 20*time.Second, func() error { return notReadyOnEveryReplica(t.Context(), c.replicas, target, onTarget, all) })
	t.Logf("a pod made not ready: out of rotation on every replica, %d bindings kept, within %s", onTarget, time.Since(start).Round(time.Millisecond))
	for s, a := range bindSessions(t, c, sessionNames("not-ready-new", 12)) {
		if a.worker == target {
			t.Errorf("new session %s went to the not ready %s", s, target)
		}
	}
	i := 0
	for s, b := range bound {
		if b.worker != target {
			continue
		}
		r := c.replicas[i%len(c.replicas)]
		i++
		a, err := chat(t.Context(), r, s, "while not ready "+s)
		if err != nil || a.status != http.StatusOK || a.worker == target || a.revision != 0 {
			t.Errorf("session %s bound to the not ready %s via %s: %+v, %v; want served elsewhere without a binding revision", s, target, r.ID, a, err)
		}
		for _, r := range c.replicas {
			var sv admin.SessionView
			if err := proc.Get(t.Context(), httpClient, "http://"+r.Admin+"/admin/sessions/"+s, &sv); err != nil || sv.Worker != target || sv.Revision != b.revision {
				t.Errorf("session %s on %s after a request while not ready: %+v, %v; want %s@%d kept", s, r.ID, sv, err, target, b.revision)
			}
		}
	}
	k.SetReady(t, name, ip, true)
	took := waitFleet(t, c.replicas, all, 20*time.Second)
	spell := time.Since(start)
	t.Logf("ready again: routable on every replica within %s, after a not-ready spell of %s (grace %s)", took.Round(time.Millisecond), spell.Round(time.Millisecond), grace)
	if spell >= grace {
		t.Fatalf("the not-ready spell took %s, not within the grace of %s: the test proves nothing (a slow machine)", spell, grace)
	}
	if moved := checkMovedOnce(t, c, bound); moved != 0 {
		t.Fatalf("%d sessions moved", moved)
	}

	// Not ready beyond the grace: drained as a gone worker on every replica, then removed; its
	// sessions move once, with a higher revision, and no other session moves.
	start = time.Now()
	k.SetReady(t, name, ip, false)
	eventually(t, 20*time.Second, func() error { return notReadyOnEveryReplica(t.Context(), c.replicas, target, onTarget, all) })
	kept := slices.DeleteFunc(slices.Clone(all), func(w string) bool { return w == target })
	took = waitFleet(t, c.replicas, kept, grace+40*time.Second)
	t.Logf("not ready beyond the grace: drained and gone from every replica %s after it turned not ready (grace %s)", took.Round(time.Millisecond), grace)
	moved := checkMovedOnce(t, c, bound, target)
	if moved != onTarget {
		t.Fatalf("%d sessions moved, want the %d bound to %s", moved, onTarget, target)
	}
	t.Logf("%d sessions moved once, with a higher revision; the other %d kept their workers", moved, len(bound)-moved)
}
