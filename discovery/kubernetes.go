package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// The pod annotations (or labels) a Kubernetes source reads a worker's spec from.
const (
	// AnnotationRole is the worker's role: prefill, decode, or empty for both.
	AnnotationRole = "kvrouter-ha.io/role"
	// AnnotationDPSize is the worker's number of data-parallel ranks.
	AnnotationDPSize = "kvrouter-ha.io/dp-size"
	// AnnotationModels is a comma list of the models the worker serves (an annotation: label
	// values cannot hold commas).
	AnnotationModels = "kvrouter-ha.io/models"
	// AnnotationKVEventsPort is the port of the worker's ZMQ KV-event PUB socket (rank 0).
	AnnotationKVEventsPort = "kvrouter-ha.io/kv-events-port"
	// AnnotationKVReplayPort is the port of the worker's KV-event replay (ROUTER) socket.
	AnnotationKVReplayPort = "kvrouter-ha.io/kv-replay-port"
	// AnnotationCapacityBlocks is the worker's KV cache size in blocks.
	AnnotationCapacityBlocks = "kvrouter-ha.io/capacity-blocks"
)

// inferencePools is the resource of the Gateway API Inference Extension's pool (GAIE v1).
func inferencePools() schema.GroupVersionResource {
	return schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}
}

// KubernetesOptions says which pods a Kubernetes source lists.
type KubernetesOptions struct {
	// Namespace holds the pods (and the pool); required.
	Namespace string
	// Selector picks the pods by label (with Port); exclusive with Pool.
	Selector string
	// Port is the workers' HTTP port, with Selector.
	Port int
	// Pool names an InferencePool in Namespace: its selector picks the pods and its
	// targetPorts are the data-parallel ranks' ports (the first is the worker's URL).
	Pool string
	// Kubeconfig is a kubeconfig file; empty: the in-cluster service account.
	Kubeconfig string
}

// Kubernetes is a source that watches pods through the API server (client-go informers)
// and answers each look from the informers' cache. A worker is a pod that is Ready and not
// terminating; its id is the pod's name and UID, so a pod recreated under the same name is a
// new worker. A pod that is not ready is not listed: it drains as a gone worker does.
//
// The watch starts on the first look of a leadership term and stops when the term ends (the
// discovery duty calls Stop): a replica that does not lead holds no watch on the API server,
// and each term lists afresh. While the API server cannot be reached the look fails (the
// last set stands) and the informers retry; they list again when it is back.
type Kubernetes struct {
	name string
	opts KubernetesOptions
	sel  labels.Selector // Selector parsed; nil with Pool
	// connect makes the clients (a fake in unit tests).
	connect func() (kubernetes.Interface, dynamic.Interface, error)

	mu    sync.Mutex
	watch *podWatch // nil: not watching
}

// podWatch is one run of the informers, from a term's first look to Stop.
type podWatch struct {
	cancel  context.CancelFunc
	running sync.WaitGroup // the informers' goroutines
	pods    cache.SharedIndexInformer
	pool    cache.SharedIndexInformer // nil without Pool
	health  *watchHealth
}

// NewKubernetes is a Kubernetes source named name ("kubernetes:..." as configured) over opts.
// It connects nothing until its first look.
func NewKubernetes(name string, opts KubernetesOptions) (*Kubernetes, error) {
	k := &Kubernetes{name: name, opts: opts}
	if opts.Namespace == "" {
		return nil, fmt.Errorf("discovery %s: namespace is required", name)
	}
	switch {
	case opts.Pool != "" && (opts.Selector != "" || opts.Port != 0):
		return nil, fmt.Errorf("discovery %s: give pool, or selector and port, not both", name)
	case opts.Pool == "":
		if opts.Selector == "" {
			return nil, fmt.Errorf("discovery %s: a selector (with port) or a pool is required", name)
		}
		sel, err := labels.Parse(opts.Selector)
		if err != nil {
			return nil, fmt.Errorf("discovery %s: selector: %w", name, err)
		}
		if opts.Port < 1 || opts.Port > 65535 {
			return nil, fmt.Errorf("discovery %s: port %d out of range 1..65535", name, opts.Port)
		}
		k.sel = sel
	}
	k.connect = func() (kubernetes.Interface, dynamic.Interface, error) {
		cfg, err := restConfig(opts.Kubeconfig)
		if err != nil {
			return nil, nil, err
		}
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			return nil, nil, err
		}
		dc, err := dynamic.NewForConfig(cfg)
		if err != nil {
			return nil, nil, err
		}
		return cs, dc, nil
	}
	return k, nil
}

// restConfig is the in-cluster config, or the kubeconfig file's current context.
func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		return rest.InClusterConfig()
	}
	return clientcmd.BuildConfigFromFlags("", kubeconfig)
}

// parseKubernetes parses the value after "kubernetes:": comma-separated key=value options
// (namespace, selector, port, pool, kubeconfig). A part that does not start with one of
// those keys continues the option before it, so a selector may hold commas ("selector=app=vllm,tier=gpu").
func parseKubernetes(spec, rest string) (*Kubernetes, error) {
	var opts KubernetesOptions
	var last *string
	var port string
	keys := map[string]*string{"namespace": &opts.Namespace, "selector": &opts.Selector, "port": &port, "pool": &opts.Pool, "kubeconfig": &opts.Kubeconfig}
	seen := map[string]bool{}
	for part := range strings.SplitSeq(rest, ",") {
		key, val, _ := strings.Cut(part, "=")
		dst, ok := keys[key]
		if !ok {
			if last == nil {
				return nil, fmt.Errorf("discovery %q: unknown option %q (want namespace, selector, port, pool or kubeconfig)", spec, key)
			}
			*last += "," + part
			continue
		}
		if seen[key] {
			return nil, fmt.Errorf("discovery %q: %s given twice", spec, key)
		}
		seen[key] = true
		*dst, last = val, dst
	}
	if port != "" {
		p, err := strconv.Atoi(port)
		if err != nil {
			return nil, fmt.Errorf("discovery %q: port %q is not a number", spec, port)
		}
		opts.Port = p
	}
	return NewKubernetes(spec, opts)
}

// Name is the configured value, "kubernetes:namespace=...".
func (k *Kubernetes) Name() string { return k.name }

// Kind is "kubernetes".
func (k *Kubernetes) Kind() string { return "kubernetes" }

// Stop stops the watch and returns once none of its goroutines runs (its watches on the API
// server closed); the next Lookup starts a new one. The discovery duty calls it as its term
// ends.
func (k *Kubernetes) Stop() {
	k.mu.Lock()
	w := k.watch
	k.watch = nil
	k.mu.Unlock()
	if w != nil {
		w.cancel()
		w.running.Wait()
	}
}

// Lookup lists the ready pods from the informers' cache, starting the watch if it is not
// running.
func (k *Kubernetes) Lookup(ctx context.Context) ([]routing.WorkerSpec, error) {
	ready, _, err := k.LookupReadiness(ctx)
	return ready, err
}

// LookupReadiness lists, from the informers' cache, the ready pods and the ids of the pods
// that are there but not ready: running or pending, not terminating, their Ready condition
// not true (or no IP yet). It starts the watch if it is not running.
func (k *Kubernetes) LookupReadiness(ctx context.Context) (ready []routing.WorkerSpec, notReady []string, err error) {
	w, fresh, err := k.start()
	if err != nil {
		return nil, nil, err
	}
	if fresh {
		w.awaitFirstList(ctx)
	}
	if !w.synced() {
		return nil, nil, fmt.Errorf("discovery %s: waiting for the first list from the API server", k.name)
	}
	if err := w.health.err(); err != nil {
		return nil, nil, fmt.Errorf("discovery %s: %w", k.name, err)
	}
	sel, ports := k.sel, []int{k.opts.Port}
	if w.pool != nil {
		obj, ok, err := w.pool.GetStore().GetByKey(k.opts.Namespace + "/" + k.opts.Pool)
		if err != nil {
			return nil, nil, fmt.Errorf("discovery %s: %w", k.name, err)
		}
		if !ok {
			// The pool is gone: an answer (no workers), which the suspect rule holds.
			return []routing.WorkerSpec{}, nil, nil
		}
		u, _ := obj.(*unstructured.Unstructured)
		if u == nil {
			return nil, nil, fmt.Errorf("discovery %s: the pool is a %T", k.name, obj)
		}
		if sel, ports, err = decodePool(u); err != nil {
			return nil, nil, fmt.Errorf("discovery %s: InferencePool %s: %w", k.name, k.opts.Pool, err)
		}
	}
	ready = []routing.WorkerSpec{}
	for _, obj := range w.pods.GetStore().List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok || !sel.Matches(labels.Set(pod.Labels)) {
			continue
		}
		switch podState(pod) {
		case podIsReady:
			spec, err := podSpec(pod, ports)
			if err != nil {
				return nil, nil, fmt.Errorf("discovery %s: %w", k.name, err)
			}
			ready = append(ready, spec)
		case podIsNotReady:
			notReady = append(notReady, podID(pod))
		}
	}
	slices.SortFunc(ready, func(a, b routing.WorkerSpec) int { return strings.Compare(a.ID, b.ID) })
	slices.Sort(notReady)
	return ready, notReady, nil
}

// start returns the running watch, starting it if there is none (fresh).
func (k *Kubernetes) start() (w *podWatch, fresh bool, err error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.watch != nil {
		return k.watch, false, nil
	}
	cs, dc, err := k.connect()
	if err != nil {
		return nil, false, fmt.Errorf("discovery %s: %w", k.name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	w = &podWatch{cancel: cancel, health: &watchHealth{}}
	ns := k.opts.Namespace
	selector := ""
	if k.sel != nil {
		selector = k.sel.String()
	}
	podsAPI := cs.CoreV1().Pods(ns)
	w.pods = cache.NewSharedIndexInformer(w.health.listWatch(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = selector
			return podsAPI.List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = selector
			return podsAPI.Watch(ctx, o)
		}), &corev1.Pod{}, 0, cache.Indexers{})
	informers := []cache.SharedIndexInformer{w.pods}
	if k.opts.Pool != "" {
		poolAPI := dc.Resource(inferencePools()).Namespace(ns)
		field := fields.OneTermEqualSelector("metadata.name", k.opts.Pool).String()
		w.pool = cache.NewSharedIndexInformer(w.health.listWatch(
			func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				o.FieldSelector = field
				return poolAPI.List(ctx, o)
			},
			func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				o.FieldSelector = field
				return poolAPI.Watch(ctx, o)
			}), &unstructured.Unstructured{}, 0, cache.Indexers{})
		informers = append(informers, w.pool)
	}
	for _, inf := range informers {
		if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
			w.health.failed(err)
		}); err != nil {
			cancel()
			return nil, false, fmt.Errorf("discovery %s: %w", k.name, err)
		}
	}
	for _, inf := range informers {
		w.running.Go(func() { inf.RunWithContext(ctx) })
	}
	k.watch = w
	return w, true, nil
}

// firstListWait bounds how long the look that starts a watch waits for its first list.
const firstListWait = 5 * time.Second

// awaitFirstList waits, until ctx ends or firstListWait, for the informers' first list, or
// for a list or watch that fails: a new leader's first look then answers with the pods
// rather than failing while they are listed.
func (w *podWatch) awaitFirstList(ctx context.Context) {
	_ = wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, firstListWait, true, func(context.Context) (bool, error) {
		return w.synced() || w.health.err() != nil, nil
	})
}

// synced reports that every informer has had its first list.
func (w *podWatch) synced() bool {
	return w.pods.HasSynced() && (w.pool == nil || w.pool.HasSynced())
}

// watchHealth remembers whether the informers' last call to the API server failed: a list or
// watch that fails, or a watch that breaks, sets the error; a list or watch that succeeds
// clears it. While it is set, a look fails and the last set stands.
type watchHealth struct {
	mu   sync.Mutex
	last error
}

func (h *watchHealth) failed(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.last = err
}

func (h *watchHealth) err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.last
}

// listWatch wraps list and watch calls so that their outcome is recorded.
func (h *watchHealth) listWatch(
	list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error),
) *cache.ListWatch {
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			obj, err := list(ctx, o)
			h.failed(err)
			return obj, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			w, err := watchFn(ctx, o)
			h.failed(err)
			return w, err
		},
	}
}

// What a pod is to discovery (podState).
const (
	podIsGone     = iota // terminating, or ended (failed or succeeded): drained at once
	podIsReady           // takes requests
	podIsNotReady        // there, and expected back: out of rotation, its bindings kept
)

// podState says whether a pod takes requests: its Ready condition is true, it has an IP, and
// it is not terminating. A pod that is not terminating and has not ended but is not ready
// (a readiness probe failing, an engine loading) is not ready rather than gone.
func podState(p *corev1.Pod) int {
	if p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
		return podIsGone
	}
	if p.Status.PodIP == "" {
		return podIsNotReady
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			return podIsReady
		}
	}
	return podIsNotReady
}

// podID is a pod's worker id: "name_uid" (a pod name holds no "_"), the name cut so that the
// id fits 128 bytes.
func podID(p *corev1.Pod) string {
	uid := string(p.UID)
	name := p.Name
	if n := 128 - 1 - len(uid); len(name) > n && n > 0 {
		name = name[:n]
	}
	return name + "_" + uid
}

// podMeta is a pod's annotation, or else its label, under key.
func podMeta(p *corev1.Pod, key string) string {
	if v, ok := p.Annotations[key]; ok {
		return v
	}
	return p.Labels[key]
}

// podSpec is the worker spec of a ready pod: its podID, the URL at its IP and the first port;
// role, dp size, models, KV-event and replay ports and capacity from its annotations (or
// labels).
func podSpec(p *corev1.Pod, ports []int) (routing.WorkerSpec, error) {
	ip := p.Status.PodIP
	spec := routing.WorkerSpec{
		ID:   podID(p),
		URL:  "http://" + net.JoinHostPort(ip, strconv.Itoa(ports[0])),
		Role: routing.Role(podMeta(p, AnnotationRole)),
	}
	if len(ports) > 1 {
		spec.DPSize = len(ports)
	}
	if v := podMeta(p, AnnotationDPSize); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return spec, fmt.Errorf("pod %s: %s %q is not a number", p.Name, AnnotationDPSize, v)
		}
		spec.DPSize = n
	}
	if v := podMeta(p, AnnotationModels); v != "" {
		for m := range strings.SplitSeq(v, ",") {
			if m = strings.TrimSpace(m); m != "" {
				spec.Models = append(spec.Models, m)
			}
		}
	}
	for key, dst := range map[string]*string{AnnotationKVEventsPort: &spec.KVEvents, AnnotationKVReplayPort: &spec.KVReplay} {
		if v := podMeta(p, key); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 65535 {
				return spec, fmt.Errorf("pod %s: %s %q is not a port", p.Name, key, v)
			}
			*dst = "tcp://" + net.JoinHostPort(ip, strconv.Itoa(n))
		}
	}
	if v := podMeta(p, AnnotationCapacityBlocks); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return spec, fmt.Errorf("pod %s: %s %q is not a number", p.Name, AnnotationCapacityBlocks, v)
		}
		spec.CapacityBlocks = n
	}
	if err := routing.ValidateSpec(&spec); err != nil {
		return spec, fmt.Errorf("pod %s: %w", p.Name, err)
	}
	return spec, nil
}

// decodePool reads an InferencePool's spec.selector.matchLabels and spec.targetPorts[].number.
func decodePool(u *unstructured.Unstructured) (labels.Selector, []int, error) {
	match, found, err := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	if err != nil {
		return nil, nil, fmt.Errorf("spec.selector.matchLabels: %w", err)
	}
	if !found || len(match) == 0 {
		return nil, nil, errors.New("spec.selector.matchLabels is empty")
	}
	sel, err := metav1.LabelSelectorAsSelector(&metav1.LabelSelector{MatchLabels: match})
	if err != nil {
		return nil, nil, fmt.Errorf("spec.selector: %w", err)
	}
	raw, found, err := unstructured.NestedSlice(u.Object, "spec", "targetPorts")
	if err != nil || !found || len(raw) == 0 {
		return nil, nil, errors.New("spec.targetPorts is empty")
	}
	var ports []int
	for i, r := range raw {
		m, ok := r.(map[string]any)
		if !ok {
			return nil, nil, fmt.Errorf("spec.targetPorts[%d] is not an object", i)
		}
		n, ok, err := unstructured.NestedInt64(m, "number")
		if err != nil || !ok || n < 1 || n > 65535 {
			return nil, nil, fmt.Errorf("spec.targetPorts[%d].number is not a port", i)
		}
		ports = append(ports, int(n))
	}
	return sel, ports, nil
}
