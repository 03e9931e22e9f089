package discovery

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvrouter-ha/kvrouter-ha/internal/k8stest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// realCluster is a real API server with the test namespace and the InferencePool CRD.
type realCluster struct {
	srv *k8stest.Server
	cs  kubernetes.Interface
	dc  dynamic.Interface
}

func startRealCluster(t *testing.T) *realCluster {
	t.Helper()
	srv := k8stest.Start(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", srv.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	cs := kubernetes.NewForConfigOrDie(cfg)
	dc := dynamic.NewForConfigOrDie(cfg)
	ctx := context.Background()
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ns"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	crd := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
		"metadata": map[string]any{
			"name": "inferencepools.inference.networking.k8s.io",
			// A CRD in a *.k8s.io group must name its API review.
			"annotations": map[string]any{"api-approved.kubernetes.io": "https://github.com/kubernetes-sigs/gateway-api-inference-extension"},
		},
		"spec": map[string]any{
			"group": "inference.networking.k8s.io", "scope": "Namespaced",
			"names": map[string]any{"plural": "inferencepools", "singular": "inferencepool", "kind": "InferencePool", "listKind": "InferencePoolList"},
			"versions": []any{map[string]any{"name": "v1", "served": true, "storage": true,
				"schema": map[string]any{"openAPIV3Schema": map[string]any{"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}},
		},
	}}
	crds := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	if _, err := dc.Resource(crds).Create(ctx, crd, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 30*time.Second, func() error {
		_, err := dc.Resource(inferencePools()).Namespace("ns").List(ctx, metav1.ListOptions{})
		return err
	})
	return &realCluster{srv: srv, cs: cs, dc: dc}
}

// createPod creates a pod of app=vllm; there is no kubelet, so its IP and readiness are set
// through the status subresource.
func (c *realCluster) createPod(t *testing.T, name, ip string, ready bool) string {
	t.Helper()
	ctx := context.Background()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", Labels: map[string]string{"app": "vllm"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm"}}},
	}
	p, err := c.cs.CoreV1().Pods("ns").Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c.setReady(t, name, ip, ready)
	return name + "_" + string(p.UID)
}

func (c *realCluster) setReady(t *testing.T, name, ip string, ready bool) {
	t.Helper()
	ctx := context.Background()
	pods := c.cs.CoreV1().Pods("ns")
	p, err := pods.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	p.Status.PodIP = ip
	p.Status.PodIPs = []corev1.PodIP{{IP: ip}}
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}
	if _, err := pods.UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (c *realCluster) deletePod(t *testing.T, name string) {
	t.Helper()
	if err := c.cs.CoreV1().Pods("ns").Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

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
	c := startRealCluster(t)
	for _, tc := range []struct {
		name string
		spec string
		pool bool
	}{
		{name: "selector", spec: "kubernetes:namespace=ns,selector=app=vllm,port=8000,kubeconfig=" + c.srv.Kubeconfig},
		{name: "inference pool", spec: "kubernetes:namespace=ns,pool=vllm,kubeconfig=" + c.srv.Kubeconfig, pool: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			if tc.pool {
				pool := &unstructured.Unstructured{Object: map[string]any{
					"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
					"metadata": map[string]any{"name": "vllm", "namespace": "ns"},
					"spec": map[string]any{
						"selector":    map[string]any{"matchLabels": map[string]any{"app": "vllm"}},
						"targetPorts": []any{map[string]any{"number": int64(8000)}},
					},
				}}
				if _, err := c.dc.Resource(inferencePools()).Namespace("ns").Create(ctx, pool, metav1.CreateOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			src, err := Parse(tc.spec, "")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { src.(*Kubernetes).Close() })
			sees(t, src)
			a := c.createPod(t, "a", "127.0.0.2", false)
			sees(t, src)
			c.setReady(t, "a", "127.0.0.2", true)
			sees(t, src, a)
			b := c.createPod(t, "b", "127.0.0.3", true)
			sees(t, src, a, b)
			c.setReady(t, "b", "127.0.0.3", false)
			sees(t, src, a)
			c.deletePod(t, "a")
			sees(t, src)
			a2 := c.createPod(t, "a", "127.0.0.2", true)
			if a2 == a {
				t.Fatalf("a recreated pod kept its id %s", a)
			}
			sees(t, src, a2)

			// The API server away: the look fails (the leader keeps the last set), and on
			// its return the source follows the pods again.
			c.srv.StopAPI()
			poll.Until(t, 60*time.Second, func() error {
				if _, err := src.Lookup(ctx); err == nil {
					return errors.New("a look succeeds while the API server is stopped")
				}
				return nil
			})
			if err := c.srv.StartAPI(); err != nil {
				t.Fatal(err)
			}
			c.deletePod(t, "a")
			c.setReady(t, "b", "127.0.0.3", true)
			sees(t, src, b)
			c.deletePod(t, "b")
			sees(t, src)
			if tc.pool {
				if err := c.dc.Resource(inferencePools()).Namespace("ns").Delete(ctx, "vllm", metav1.DeleteOptions{}); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
