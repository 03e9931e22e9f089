package discovery

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/k8stest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// sees polls src until it lists exactly want.
func sees(t *testing.T, src Source, want ...string) {
	t.Helper()
	slices.Sort(want)
	poll.Until(t, 30*time.Second, func() error {
		specs, err := src.Lookup(context.Background())
		if err != nil {
			return err
		}
		if got := ids(specs); !slices.Equal(got, append([]string{}, want...)) {
			return errors.New("sees [" + strings.Join(got, " ") + "], want [" + strings.Join(want, " ") + "]")
		}
		return nil
	})
}

func TestKubernetesSourceFollowsARealAPIServer(t *testing.T) {
	c := k8stest.StartCluster(t, "ns")
	for _, tc := range []struct {
		name string
		spec string
		pool bool
	}{
		{name: "selector", spec: "kubernetes:namespace=ns,selector=app=vllm,port=8000,kubeconfig=" + c.Kubeconfig},
		{name: "inference pool", spec: "kubernetes:namespace=ns,pool=vllm,kubeconfig=" + c.Kubeconfig, pool: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			if tc.pool {
				c.CreatePool(t, "vllm", 8000)
			}
			src, err := Parse(tc.spec, "")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { src.(*Kubernetes).Stop() })
			sees(t, src)
			a := c.CreatePod(t, "a", "127.0.0.2", false)
			sees(t, src)
			c.SetReady(t, "a", "127.0.0.2", true)
			sees(t, src, a)
			b := c.CreatePod(t, "b", "127.0.0.3", true)
			sees(t, src, a, b)
			c.SetReady(t, "b", "127.0.0.3", false)
			sees(t, src, a)
			c.DeletePod(t, "a")
			sees(t, src)
			a2 := c.CreatePod(t, "a", "127.0.0.2", true)
			if a2 == a {
				t.Fatalf("a recreated pod kept its id %s", a)
			}
			sees(t, src, a2)

			// The API server away: the look fails (the leader keeps the last set), and on
			// its return the source follows the pods again.
			c.StopAPI()
			poll.Until(t, 60*time.Second, func() error {
				if _, err := src.Lookup(ctx); err == nil {
					return errors.New("a look succeeds while the API server is stopped")
				}
				return nil
			})
			if err := c.StartAPI(); err != nil {
				t.Fatal(err)
			}
			c.DeletePod(t, "a")
			c.SetReady(t, "b", "127.0.0.3", true)
			sees(t, src, b)
			c.DeletePod(t, "b")
			sees(t, src)
			if tc.pool {
				c.DeletePool(t, "vllm")
			}
		})
	}
}

// dutyCluster is a memCluster that keeps the duty discovery registers, for the test to run
// and end as terms of leadership would.
type dutyCluster struct {
	*memCluster
	duty func(context.Context)
}

func (c *dutyCluster) AddDuty(_ string, run func(context.Context)) { c.duty = run }

// active polls c until the workers not draining are exactly want.
func (c *dutyCluster) active(t *testing.T, want ...string) {
	t.Helper()
	slices.Sort(want)
	poll.Until(t, 30*time.Second, func() error {
		var got []string
		for _, w := range c.Workers() {
			if !w.Draining {
				got = append(got, w.ID)
			}
		}
		slices.Sort(got)
		if !slices.Equal(got, want) {
			return fmt.Errorf("active workers %v, want %v", got, want)
		}
		return nil
	})
}

func TestKubernetesWatchRunsOnlyWhileThisReplicaLeads(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts string
		pool bool
	}{
		{name: "selector", opts: "selector=app=vllm,port=8000"},
		{name: "inference pool", opts: "pool=vllm", pool: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := k8stest.StartCluster(t, "ns")
			ctx := context.Background()
			// watching polls until the source's watches open at the API server are n (its
			// pool's too, with a pool).
			watching := func(n int) {
				t.Helper()
				poll.Until(t, 30*time.Second, func() error {
					for res, want := range map[string]int{"pods": n, "inferencepools": map[bool]int{true: n}[tc.pool]} {
						got, err := c.NamespaceWatches(ctx, res)
						if err != nil {
							return err
						}
						if got != want {
							return fmt.Errorf("%d %s watches open at the API server, want %d", got, res, want)
						}
					}
					return nil
				})
			}
			if tc.pool {
				c.CreatePool(t, "vllm", 8000)
			}
			src, err := Parse("kubernetes:namespace=ns,"+tc.opts+",kubeconfig="+c.Kubeconfig, "")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(src.(*Kubernetes).Stop)
			cl := &dutyCluster{memCluster: newMemCluster()}
			if _, err := Start(Config{Sources: []Source{src}, Cluster: cl, Interval: 100 * time.Millisecond,
				DrainFor: time.Hour, SuspectFor: time.Hour}); err != nil {
				t.Fatal(err)
			}
			want := []string{c.CreatePod(t, "a", "127.0.0.2", true)}
			watching(0)
			goroutines := 0
			for term := range 4 {
				// A term of leadership: the duty runs from its start to its end.
				tctx, end := context.WithCancel(ctx)
				done := make(chan struct{})
				go func() {
					defer close(done)
					cl.duty(tctx)
				}()
				// The set is the pods' now, whatever changed while this replica did not lead.
				cl.active(t, want...)
				watching(1)
				end()
				<-done
				// Leadership lost: no watch left at the API server, no goroutine of it here.
				watching(0)
				if term == 0 {
					// The first term leaves what a client keeps for good (its connection pool).
					goroutines = runtime.NumGoroutine()
				} else {
					poll.Until(t, 30*time.Second, func() error {
						if n := runtime.NumGoroutine(); n > goroutines {
							return fmt.Errorf("%d goroutines after term %d, %d after the first", n, term+1, goroutines)
						}
						return nil
					})
				}
				// The fleet changes while another replica leads.
				want = append(want, c.CreatePod(t, fmt.Sprintf("p%d", term), fmt.Sprintf("127.0.1.%d", term+1), true))
				if term == 1 {
					c.DeletePod(t, "a")
					want = want[1:]
				}
			}
			t.Logf("goroutines after the first term: %d", goroutines)
		})
	}
}
