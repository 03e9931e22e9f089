package k8stest

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
)

// InferencePools is the InferencePool resource (GAIE v1).
func InferencePools() schema.GroupVersionResource {
	return schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}
}

// Cluster is a Server with clients, a namespace and the InferencePool CRD.
type Cluster struct {
	*Server
	Namespace string
	Pods      kubernetes.Interface
	Dynamic   dynamic.Interface
}

// StartCluster starts a Server and makes namespace and the InferencePool CRD in it.
func StartCluster(t testing.TB, namespace string) *Cluster {
	t.Helper()
	srv := Start(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", srv.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Server: srv, Namespace: namespace, Pods: kubernetes.NewForConfigOrDie(cfg), Dynamic: dynamic.NewForConfigOrDie(cfg)}
	ctx := context.Background()
	if _, err := c.Pods.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
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
	if _, err := c.Dynamic.Resource(crds).Create(ctx, crd, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 30*time.Second, func() error {
		_, err := c.Dynamic.Resource(InferencePools()).Namespace(namespace).List(ctx, metav1.ListOptions{})
		return err
	})
	return c
}

// CreatePool creates an InferencePool selecting app=vllm at ports.
func (c *Cluster) CreatePool(t testing.TB, name string, ports ...int) {
	t.Helper()
	var tp []any
	for _, p := range ports {
		tp = append(tp, map[string]any{"number": int64(p)})
	}
	pool := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": name, "namespace": c.Namespace},
		"spec":     map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"app": "vllm"}}, "targetPorts": tp},
	}}
	if _, err := c.Dynamic.Resource(InferencePools()).Namespace(c.Namespace).Create(context.Background(), pool, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// DeletePool deletes an InferencePool.
func (c *Cluster) DeletePool(t testing.TB, name string) {
	t.Helper()
	if err := c.Dynamic.Resource(InferencePools()).Namespace(c.Namespace).Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// CreatePod creates a pod labelled app=vllm and sets its IP and readiness (there is no
// kubelet: through the status subresource). It returns the worker id the kubernetes
// discovery source gives it, name_uid.
func (c *Cluster) CreatePod(t testing.TB, name, ip string, ready bool) string {
	t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: c.Namespace, Labels: map[string]string{"app": "vllm"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vllm", Image: "vllm"}}},
	}
	p, err := c.Pods.CoreV1().Pods(c.Namespace).Create(context.Background(), p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c.SetReady(t, name, ip, ready)
	return name + "_" + string(p.UID)
}

// SetReady sets a pod's IP and its Ready condition.
func (c *Cluster) SetReady(t testing.TB, name, ip string, ready bool) {
	t.Helper()
	ctx := context.Background()
	pods := c.Pods.CoreV1().Pods(c.Namespace)
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

// DeletePod deletes a pod (an unscheduled pod goes at once).
func (c *Cluster) DeletePod(t testing.TB, name string) {
	t.Helper()
	if err := c.Pods.CoreV1().Pods(c.Namespace).Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}
