package k8stest

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"
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
	return StartClusterWith(t, namespace, Options{})
}

// StartClusterWith is StartCluster with opts.
func StartClusterWith(t testing.TB, namespace string, opts Options) *Cluster {
	t.Helper()
	srv := StartWith(t, opts)
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
	return c.CreatePodWith(t, name, ip, ready, map[string]string{"app": "vllm"}, nil)
}

// CreatePodWith is CreatePod with the pod's labels and annotations.
func (c *Cluster) CreatePodWith(t testing.TB, name, ip string, ready bool, labels, annotations map[string]string) string {
	t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: c.Namespace, Labels: labels, Annotations: annotations},
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

// Create creates obj (a manifest as YAML decodes it: apiVersion, kind, metadata, ...) in the
// cluster's namespace, or cluster-wide for a kind that has no namespace, as kubectl apply -n
// does.
func (c *Cluster) Create(t testing.TB, obj map[string]any) {
	t.Helper()
	u := &unstructured.Unstructured{Object: obj}
	gvk := u.GroupVersionKind()
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(c.Pods.Discovery()))
	m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		t.Fatalf("%s %s: %v", gvk, u.GetName(), err)
	}
	var ri dynamic.ResourceInterface = c.Dynamic.Resource(m.Resource)
	if m.Scope.Name() == meta.RESTScopeNameNamespace {
		u.SetNamespace(c.Namespace)
		ri = c.Dynamic.Resource(m.Resource).Namespace(c.Namespace)
	}
	if _, err := ri.Create(context.Background(), u, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create %s %s: %v", gvk.Kind, u.GetName(), err)
	}
}

// ServiceAccountKubeconfig writes a kubeconfig file in dir that authenticates as the
// ServiceAccount name of the namespace, with a token from the TokenRequest API (what a pod
// of that ServiceAccount is given), and returns its path.
func (c *Cluster) ServiceAccountKubeconfig(t testing.TB, dir, name string) string {
	t.Helper()
	exp := int64(time.Hour / time.Second)
	tr, err := c.Pods.CoreV1().ServiceAccounts(c.Namespace).CreateToken(context.Background(), name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token of ServiceAccount %s: %v", name, err)
	}
	path := filepath.Join(dir, "kubeconfig-"+name)
	if err := c.WriteKubeconfig(path, tr.Status.Token); err != nil {
		t.Fatal(err)
	}
	return path
}
