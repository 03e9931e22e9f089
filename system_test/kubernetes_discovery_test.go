package system_test

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/k8stest"
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
			c := startClusterOf(t, binary, 3, nil, discoveryFlags(source)...)
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
