package discovery

import (
	"context"
	"errors"
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
			t.Cleanup(func() { src.(*Kubernetes).Close() })
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
