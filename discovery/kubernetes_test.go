package discovery

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	dynfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// testPod is a pod of app=vllm with an IP; ready sets its Ready condition.
func testPod(name, uid, ip string, ready bool, ann map[string]string) *corev1.Pod {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID(uid), Labels: map[string]string{"app": "vllm"}, Annotations: ann},
		Status:     corev1.PodStatus{PodIP: ip, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}},
	}
}

func TestParseKubernetes(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want KubernetesOptions
		err  string
	}{
		{spec: "kubernetes:namespace=ns,selector=app=vllm,port=8000", want: KubernetesOptions{Namespace: "ns", Selector: "app=vllm", Port: 8000}},
		{spec: "kubernetes:namespace=ns,port=8000,selector=app=vllm,tier in (gpu),kubeconfig=/k", want: KubernetesOptions{Namespace: "ns", Selector: "app=vllm,tier in (gpu)", Port: 8000, Kubeconfig: "/k"}},
		{spec: "kubernetes:namespace=ns,pool=vllm", want: KubernetesOptions{Namespace: "ns", Pool: "vllm"}},
		{spec: "kubernetes:selector=app=vllm,port=8000", err: "namespace is required"},
		{spec: "kubernetes:namespace=ns,selector=app=vllm", err: "port 0 out of range"},
		{spec: "kubernetes:namespace=ns,selector=app=vllm,port=x", err: "not a number"},
		{spec: "kubernetes:namespace=ns,pool=p,selector=a=b", err: "not both"},
		{spec: "kubernetes:namespace=ns", err: "a selector (with port) or a pool is required"},
		{spec: "kubernetes:bogus=1", err: "unknown option"},
		{spec: "kubernetes:namespace=a,namespace=b,pool=p", err: "given twice"},
		{spec: "kubernetes:namespace=ns,selector=app in (,port=1", err: "selector"},
	} {
		t.Run(tc.spec, func(t *testing.T) {
			s, err := Parse(tc.spec, "")
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			k := s.(*Kubernetes)
			if k.opts != tc.want || k.Name() != tc.spec || k.Kind() != "kubernetes" {
				t.Fatalf("got %+v named %s, want %+v", k.opts, k.Name(), tc.want)
			}
		})
	}
}

func TestPodSpecAndReadiness(t *testing.T) {
	deleting := testPod("p", "u1", "10.0.0.1", true, nil)
	now := metav1.Now()
	deleting.DeletionTimestamp = &now
	noCond := testPod("p", "u1", "10.0.0.1", true, nil)
	noCond.Status.Conditions = nil
	ended := map[corev1.PodPhase]*corev1.Pod{}
	for _, ph := range []corev1.PodPhase{corev1.PodFailed, corev1.PodSucceeded} {
		ended[ph] = testPod("p", "u1", "10.0.0.1", false, nil)
		ended[ph].Status.Phase = ph
	}
	for _, tc := range []struct {
		name  string
		pod   *corev1.Pod
		ports []int
		state int // what podState says
		want  routing.WorkerSpec
		err   string
	}{
		{name: "ready", pod: testPod("p", "u1", "10.0.0.1", true, nil), ports: []int{8000}, state: podIsReady,
			want: routing.WorkerSpec{ID: "p_u1", URL: "http://10.0.0.1:8000", DPSize: 1}},
		{name: "not ready", pod: testPod("p", "u1", "10.0.0.1", false, nil), ports: []int{8000}, state: podIsNotReady},
		{name: "terminating", pod: deleting, ports: []int{8000}, state: podIsGone},
		{name: "failed", pod: ended[corev1.PodFailed], ports: []int{8000}, state: podIsGone},
		{name: "succeeded", pod: ended[corev1.PodSucceeded], ports: []int{8000}, state: podIsGone},
		{name: "no ready condition", pod: noCond, ports: []int{8000}, state: podIsNotReady},
		{name: "no ip", pod: testPod("p", "u1", "", true, nil), ports: []int{8000}, state: podIsNotReady},
		{name: "annotations", pod: testPod("p", "u1", "fd00::1", true, map[string]string{
			AnnotationRole: "prefill", AnnotationModels: "a, b", AnnotationKVEventsPort: "5557", AnnotationKVReplayPort: "5558", AnnotationCapacityBlocks: "32768"}), ports: []int{8000, 8001}, state: podIsReady,
			want: routing.WorkerSpec{ID: "p_u1", URL: "http://[fd00::1]:8000", Role: routing.RolePrefill, DPSize: 2, Models: []string{"a", "b"}, KVEvents: "tcp://[fd00::1]:5557", KVReplay: "tcp://[fd00::1]:5558", CapacityBlocks: 32768}},
		{name: "dp size annotation", pod: testPod("p", "u1", "10.0.0.1", true, map[string]string{AnnotationDPSize: "4"}), ports: []int{8000}, state: podIsReady,
			want: routing.WorkerSpec{ID: "p_u1", URL: "http://10.0.0.1:8000", DPSize: 4}},
		{name: "bad dp size", pod: testPod("p", "u1", "10.0.0.1", true, map[string]string{AnnotationDPSize: "x"}), ports: []int{8000}, state: podIsReady, err: "not a number"},
		{name: "dp size out of range", pod: testPod("p", "u1", "10.0.0.1", true, map[string]string{AnnotationDPSize: "5000"}), ports: []int{8000}, state: podIsReady, err: "dp_size"},
		{name: "bad role", pod: testPod("p", "u1", "10.0.0.1", true, map[string]string{AnnotationRole: "boss"}), ports: []int{8000}, state: podIsReady, err: "role"},
		{name: "bad capacity", pod: testPod("p", "u1", "10.0.0.1", true, map[string]string{AnnotationCapacityBlocks: "lots"}), ports: []int{8000}, state: podIsReady, err: "not a number"},
		{name: "bad replay port", pod: testPod("p", "u1", "10.0.0.1", true, map[string]string{AnnotationKVReplayPort: "-1"}), ports: []int{8000}, state: podIsReady, err: "not a port"},
		{name: "bad kv port", pod: testPod("p", "u1", "10.0.0.1", true, map[string]string{AnnotationKVEventsPort: "70000"}), ports: []int{8000}, state: podIsReady, err: "not a port"},
		{name: "long name is cut to fit the id", pod: testPod(strings.Repeat("n", 200), "u1", "10.0.0.1", true, nil), ports: []int{8000}, state: podIsReady,
			want: routing.WorkerSpec{ID: strings.Repeat("n", 125) + "_u1", URL: "http://10.0.0.1:8000", DPSize: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := podState(tc.pod); got != tc.state {
				t.Fatalf("state %v, want %v", got, tc.state)
			}
			if podID(tc.pod) != tc.want.ID && tc.want.ID != "" {
				t.Fatalf("id %s, want %s", podID(tc.pod), tc.want.ID)
			}
			if tc.state != podIsReady {
				return
			}
			spec, err := podSpec(tc.pod, tc.ports)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if spec.ID != tc.want.ID || spec.URL != tc.want.URL || spec.Role != tc.want.Role || spec.DPSize != tc.want.DPSize ||
				!slices.Equal(spec.Models, tc.want.Models) || spec.KVEvents != tc.want.KVEvents || spec.KVReplay != tc.want.KVReplay || spec.CapacityBlocks != tc.want.CapacityBlocks {
				t.Fatalf("spec %+v, want %+v", spec, tc.want)
			}
		})
	}
}

func TestDecodePool(t *testing.T) {
	pool := func(spec map[string]any) *unstructured.Unstructured {
		return &unstructured.Unstructured{Object: map[string]any{"spec": spec}}
	}
	sel := map[string]any{"matchLabels": map[string]any{"app": "vllm"}}
	for _, tc := range []struct {
		name  string
		pool  *unstructured.Unstructured
		ports []int
		err   string
	}{
		{name: "ranks", pool: pool(map[string]any{"selector": sel, "targetPorts": []any{map[string]any{"number": int64(8000)}, map[string]any{"number": int64(8001)}}}), ports: []int{8000, 8001}},
		{name: "no selector", pool: pool(map[string]any{"targetPorts": []any{map[string]any{"number": int64(8000)}}}), err: "matchLabels is empty"},
		{name: "selector not a map", pool: pool(map[string]any{"selector": map[string]any{"matchLabels": "x"}}), err: "matchLabels"},
		{name: "bad label", pool: pool(map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"a b": "c"}}, "targetPorts": []any{map[string]any{"number": int64(1)}}}), err: "selector"},
		{name: "no ports", pool: pool(map[string]any{"selector": sel}), err: "targetPorts is empty"},
		{name: "port not an object", pool: pool(map[string]any{"selector": sel, "targetPorts": []any{"8000"}}), err: "not an object"},
		{name: "port out of range", pool: pool(map[string]any{"selector": sel, "targetPorts": []any{map[string]any{"number": int64(0)}}}), err: "not a port"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, ports, err := decodePool(tc.pool)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(ports, tc.ports) || s.String() != "app=vllm" {
				t.Fatalf("selector %s ports %v", s, ports)
			}
		})
	}
}

// fakeKubernetes is a Kubernetes source over client-go's fake clientsets.
// fakeAPI is client-go's fake clientsets behind a Kubernetes source, counting the watches
// the source's informers have open: the fakes' watches do not resume from the list's
// resource version, so an object changed between an informer's list and its watch is never
// seen, and a test waits for the watches before it changes anything.
type fakeAPI struct {
	cs      *fake.Clientset
	dc      *dynfake.FakeDynamicClient
	watches atomic.Int32
}

// watching waits until the source's informers have n watches open.
func (f *fakeAPI) watching(t *testing.T, n int32) {
	t.Helper()
	poll.Until(t, 10*time.Second, func() error {
		if got := f.watches.Load(); got < n {
			return fmt.Errorf("%d watches open, want %d", got, n)
		}
		return nil
	})
}

func fakeKubernetes(t *testing.T, spec string, objs ...runtime.Object) (*Kubernetes, *fakeAPI) {
	t.Helper()
	s, err := Parse(spec, "")
	if err != nil {
		t.Fatal(err)
	}
	k := s.(*Kubernetes)
	f := &fakeAPI{cs: fake.NewClientset()}
	scheme := runtime.NewScheme()
	f.dc = dynfake.NewSimpleDynamicClientWithCustomListKinds(scheme, map[schema.GroupVersionResource]string{inferencePools(): "InferencePoolList"}, objs...)
	// As the fakes' own watch reactors, counting each watch once it is registered.
	f.cs.PrependWatchReactor("*", func(action k8stesting.Action) (bool, watch.Interface, error) {
		var opts metav1.ListOptions
		if wa, ok := action.(k8stesting.WatchActionImpl); ok {
			opts = wa.ListOptions
		}
		w, err := f.cs.Tracker().Watch(action.GetResource(), action.GetNamespace(), opts)
		if err != nil {
			return false, nil, err
		}
		f.watches.Add(1)
		return true, w, nil
	})
	f.dc.PrependWatchReactor("*", func(action k8stesting.Action) (bool, watch.Interface, error) {
		w, err := f.dc.Tracker().Watch(action.GetResource(), action.GetNamespace())
		if err != nil {
			return false, nil, err
		}
		f.watches.Add(1)
		return true, w, nil
	})
	k.connect = func() (kubernetes.Interface, dynamic.Interface, error) { return f.cs, f.dc, nil }
	t.Cleanup(func() { k.Stop() })
	return k, f
}

// lookupIDs polls the source until it lists want.
func lookupIDs(t *testing.T, k *Kubernetes, want ...string) {
	t.Helper()
	poll.Until(t, 10*time.Second, func() error {
		specs, err := k.Lookup(context.Background())
		if err != nil {
			return err
		}
		if got := ids(specs); !slices.Equal(got, append([]string{}, want...)) {
			return errors.New("ids " + strings.Join(got, " ") + ", want " + strings.Join(want, " "))
		}
		return nil
	})
}

// lookupNotReady polls the source until it sees want there but not ready.
func lookupNotReady(t *testing.T, k *Kubernetes, want ...string) {
	t.Helper()
	poll.Until(t, 10*time.Second, func() error {
		_, notReady, err := k.LookupReadiness(context.Background())
		if err != nil {
			return err
		}
		if !slices.Equal(notReady, want) {
			return fmt.Errorf("not ready %v, want %v", notReady, want)
		}
		return nil
	})
}

func TestKubernetesFollowsPodsOfASelector(t *testing.T) {
	k, f := fakeKubernetes(t, "kubernetes:namespace=ns,selector=app=vllm,port=8000")
	ctx := context.Background()
	pods := f.cs.CoreV1().Pods("ns")
	lookupIDs(t, k)
	f.watching(t, 1)
	must := func(_ any, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(pods.Create(ctx, testPod("a", "ua", "10.0.0.1", false, nil), metav1.CreateOptions{}))
	must(pods.Create(ctx, testPod("b", "ub", "10.0.0.2", true, nil), metav1.CreateOptions{}))
	other := testPod("c", "uc", "10.0.0.3", true, nil)
	other.Labels = map[string]string{"app": "other"}
	must(pods.Create(ctx, other, metav1.CreateOptions{}))
	lookupIDs(t, k, "b_ub")
	lookupNotReady(t, k, "a_ua")
	must(pods.UpdateStatus(ctx, testPod("a", "ua", "10.0.0.1", true, nil), metav1.UpdateOptions{}))
	lookupIDs(t, k, "a_ua", "b_ub")
	lookupNotReady(t, k)
	must(pods.UpdateStatus(ctx, testPod("b", "ub", "10.0.0.2", false, nil), metav1.UpdateOptions{}))
	lookupIDs(t, k, "a_ua")
	lookupNotReady(t, k, "b_ub")
	// Terminating, or ended: gone, neither ready nor not ready.
	terminating := testPod("b", "ub", "10.0.0.2", false, nil)
	terminating.DeletionTimestamp = &metav1.Time{Time: time.Unix(1000, 0)}
	must(pods.Update(ctx, terminating, metav1.UpdateOptions{}))
	lookupNotReady(t, k)
	lookupIDs(t, k, "a_ua")
	must(nil, pods.Delete(ctx, "a", metav1.DeleteOptions{}))
	lookupIDs(t, k)
	must(pods.Create(ctx, testPod("a", "ua2", "10.0.0.9", true, nil), metav1.CreateOptions{}))
	lookupIDs(t, k, "a_ua2")
}

func TestKubernetesFollowsAnInferencePool(t *testing.T) {
	pool := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": "vllm", "namespace": "ns"},
		"spec": map[string]any{
			"selector":    map[string]any{"matchLabels": map[string]any{"app": "vllm"}},
			"targetPorts": []any{map[string]any{"number": int64(8000)}, map[string]any{"number": int64(8001)}},
		},
	}}
	k, f := fakeKubernetes(t, "kubernetes:namespace=ns,pool=vllm", pool)
	cs, dc := f.cs, f.dc
	ctx := context.Background()
	if _, err := cs.CoreV1().Pods("ns").Create(ctx, testPod("a", "ua", "10.0.0.1", true, nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	lookupIDs(t, k, "a_ua")
	f.watching(t, 2) // pods and the pool
	specs, err := k.Lookup(ctx)
	if err != nil || specs[0].URL != "http://10.0.0.1:8000" || specs[0].DPSize != 2 {
		t.Fatalf("specs %+v, %v", specs, err)
	}
	// The pool now selects other pods: the old ones are no longer listed.
	unstructured.SetNestedStringMap(pool.Object, map[string]string{"app": "other"}, "spec", "selector", "matchLabels")
	if _, err := dc.Resource(inferencePools()).Namespace("ns").Update(ctx, pool, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	lookupIDs(t, k)
	// A pool that is deleted is an empty fleet (which the suspect rule holds).
	if err := dc.Resource(inferencePools()).Namespace("ns").Delete(ctx, "vllm", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	lookupIDs(t, k)
}

func TestKubernetesLookupFailsWhileTheAPIServerFails(t *testing.T) {
	k, f := fakeKubernetes(t, "kubernetes:namespace=ns,selector=app=vllm,port=8000")
	cs := f.cs
	ctx := context.Background()
	if _, err := cs.CoreV1().Pods("ns").Create(ctx, testPod("a", "ua", "10.0.0.1", true, nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	lookupIDs(t, k, "a_ua")
	// A failed list or a broken watch fails the look (the leader keeps the last set) rather
	// than answering from a cache that no longer follows the API server; a list or watch that
	// works again clears it.
	away := errors.New("the API server is away")
	health := k.watch.health
	health.failed(away)
	if _, err := k.Lookup(ctx); !errors.Is(err, away) {
		t.Fatalf("look while the watch is broken: %v", err)
	}
	lw := health.listWatch(
		func(context.Context, metav1.ListOptions) (runtime.Object, error) {
			return cs.CoreV1().Pods("ns").List(ctx, metav1.ListOptions{})
		},
		func(context.Context, metav1.ListOptions) (watch.Interface, error) { return nil, away })
	if _, err := lw.ListWithContext(ctx, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	lookupIDs(t, k, "a_ua")
	if _, err := lw.WatchWithContext(ctx, metav1.ListOptions{}); !errors.Is(err, away) {
		t.Fatal(err)
	}
	if _, err := k.Lookup(ctx); !errors.Is(err, away) {
		t.Fatalf("look after a failed watch: %v", err)
	}
}

func TestKubernetesLookupFailsBeforeTheFirstList(t *testing.T) {
	k, f := fakeKubernetes(t, "kubernetes:namespace=ns,selector=app=vllm,port=8000")
	f.cs.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("the API server is away")
	})
	// No first list: the look fails (the leader keeps the last set) rather than answering "none".
	for range 3 {
		if specs, err := k.Lookup(context.Background()); err == nil {
			t.Fatalf("a look before the first list answered %v", specs)
		}
	}
}

func FuzzDecodePool(f *testing.F) {
	f.Add([]byte(`{"spec":{"selector":{"matchLabels":{"app":"vllm"}},"targetPorts":[{"number":8000},{"number":8001}]}}`))
	f.Add([]byte(`{"spec":{"selector":{"matchLabels":{"a b":1}},"targetPorts":[8000]}}`))
	f.Add([]byte(`{"spec":[]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(b); err != nil {
			return
		}
		sel, ports, err := decodePool(u)
		if err != nil {
			return
		}
		if sel == nil || len(ports) == 0 {
			t.Fatalf("no error, but selector %v ports %v", sel, ports)
		}
		for _, p := range ports {
			if p < 1 || p > 65535 {
				t.Fatalf("port %d", p)
			}
		}
	})
}

func FuzzParseKubernetes(f *testing.F) {
	f.Add("namespace=ns,selector=app=vllm,tier in (a,b),port=8000")
	f.Add("namespace=ns,pool=p,kubeconfig=/k")
	f.Fuzz(func(t *testing.T, rest string) {
		k, err := parseKubernetes("kubernetes:"+rest, rest)
		if err != nil {
			return
		}
		if k.opts.Namespace == "" || (k.opts.Pool == "") == (k.sel == nil) {
			t.Fatalf("accepted %+v", k.opts)
		}
	})
}
