package deploy_test

import (
	"fmt"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// kube is deploy/kubernetes read into what the checks need.
type kube struct {
	objs      map[string]map[string]any // "Kind/name"
	sts       map[string]any
	podLabels map[string]any
	container map[string]any
	spec      execSpec
	envFrom   map[string]string // variables set from the downward API: name -> fieldPath
}

func readKube(t *testing.T) kube {
	t.Helper()
	paths, err := filepath.Glob("kubernetes/*.yaml")
	if err != nil || len(paths) == 0 {
		t.Fatalf("no kubernetes/*.yaml (%v)", err)
	}
	k := kube{objs: map[string]map[string]any{}, envFrom: map[string]string{}}
	for _, p := range paths {
		for _, d := range readYAML(t, p) {
			key := ystr(d, "kind") + "/" + ystr(d, "metadata", "name")
			if ystr(d, "apiVersion") == "" || strings.HasPrefix(key, "/") || strings.HasSuffix(key, "/") {
				t.Fatalf("%s: a document without apiVersion, kind or name", p)
			}
			if _, dup := k.objs[key]; dup {
				t.Fatalf("%s: %s defined twice", p, key)
			}
			k.objs[key] = ymap(d)
		}
	}
	for key, o := range k.objs {
		if strings.HasPrefix(key, "StatefulSet/") {
			if k.sts != nil {
				t.Fatal("more than one StatefulSet")
			}
			k.sts = o
		}
	}
	if k.sts == nil {
		t.Fatal("no StatefulSet in kubernetes/")
	}
	k.podLabels = ymap(k.sts, "spec", "template", "metadata", "labels")
	for _, c := range ylist(k.sts, "spec", "template", "spec", "containers") {
		if ystr(c, "name") == "kvrouter-ha" {
			k.container = ymap(c)
		}
	}
	if k.container == nil {
		t.Fatal("StatefulSet: no container named kvrouter-ha")
	}
	args := strList(ylist(k.container, "args"))
	if len(args) == 0 {
		t.Fatal("StatefulSet: the container has no args (the image's entrypoint is the binary: args start with the subcommand)")
	}
	env := map[string]string{}
	for _, e := range ylist(k.container, "env") {
		name := ystr(e, "name")
		if fp := ystr(e, "valueFrom", "fieldRef", "fieldPath"); fp != "" {
			k.envFrom[name] = fp
			env[name] = "$(" + fp + ")"
		} else {
			env[name] = ystr(e, "value")
		}
	}
	k.spec = execSpec{source: "kubernetes/statefulset.yaml", sub: args[0], args: args[1:], env: env}
	return k
}

// subset reports whether every label of sel is in labels (and sel is not empty).
func subset(sel, labels map[string]any) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return len(sel) > 0
}

// containerPort resolves a probe's or Service's port (a number or a container port's name).
func (k kube) containerPort(t *testing.T, p string) (int, string) {
	t.Helper()
	for _, cp := range ylist(k.container, "ports") {
		num := yint(t, "StatefulSet containerPort", cp, "containerPort")
		proto := ystr(cp, "protocol")
		if proto == "" {
			proto = "TCP"
		}
		if ystr(cp, "name") == p || strconv.Itoa(num) == p {
			return num, proto
		}
	}
	t.Errorf("StatefulSet: no container port %q", p)
	return 0, ""
}

// mountedFile finds the ConfigMap or Secret key that the container sees at path, and returns
// its content.
func (k kube) mountedFile(t *testing.T, path string) (string, bool) {
	dir, key := filepath.Dir(path), filepath.Base(path)
	for _, m := range ylist(k.container, "volumeMounts") {
		if ystr(m, "mountPath") != dir {
			continue
		}
		for _, v := range ylist(k.sts, "spec", "template", "spec", "volumes") {
			if ystr(v, "name") != ystr(m, "name") {
				continue
			}
			var obj map[string]any
			var data map[string]any
			if cm := ystr(v, "configMap", "name"); cm != "" {
				obj = k.objs["ConfigMap/"+cm]
				data = ymap(obj, "data")
			} else if sec := ystr(v, "secret", "secretName"); sec != "" {
				obj = k.objs["Secret/"+sec]
				data = ymap(obj, "stringData")
				if data == nil {
					data = ymap(obj, "data")
				}
			}
			if s, ok := data[key].(string); ok {
				return s, true
			}
		}
	}
	return "", false
}

func TestKubernetesMatchesTheBinary(t *testing.T) {
	b := binary(t)
	k := readKube(t)
	s := k.spec
	if s.sub != "serve" {
		t.Fatalf("%s: subcommand %q, want serve", s.source, s.sub)
	}
	settings, err := b.parse(s)
	if err != nil {
		t.Fatal(err)
	}
	checkNoInlineSecrets(t, b, s)
	// Kubernetes leaves an undefined $(VAR) in args as it is: every one must be in env.
	for _, a := range s.args {
		for _, m := range regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`).FindAllStringSubmatch(a, -1) {
			if _, ok := s.env[m[1]]; !ok {
				t.Errorf("%s: %s uses $(%s), which the container's env does not define", s.source, a, m[1])
			}
		}
	}
	if fp := k.envFrom[envName("replica-id")]; fp != "metadata.name" {
		t.Errorf("%s: %s comes from %q, want the pod name (metadata.name): a stable identity per pod", s.source, envName("replica-id"), fp)
	}

	replicas := yint(t, "StatefulSet", k.sts, "spec", "replicas")
	if got := b.value(t, s, "bootstrap-expect"); got != strconv.Itoa(replicas) {
		t.Errorf("%s: --bootstrap-expect %s, want the StatefulSet's %d replicas", s.source, got, replicas)
	}
	if got := ystr(k.sts, "spec", "podManagementPolicy"); got != "Parallel" {
		t.Errorf("StatefulSet: podManagementPolicy %q, want Parallel: no replica is ready before a quorum has started", got)
	}
	if !subset(ymap(k.sts, "spec", "selector", "matchLabels"), k.podLabels) {
		t.Error("StatefulSet: selector does not match the pod labels")
	}

	// Ports: every listener has its container port, and nothing else is declared.
	listenPorts := map[string]int{}
	for _, f := range []string{"listen", "admin-listen", "raft-listen", "peer-listen", "gossip-listen", "ext-proc-listen"} {
		listenPorts[f] = b.port(t, s, f)
	}
	declared := map[string]bool{}
	for _, cp := range ylist(k.container, "ports") {
		proto := ystr(cp, "protocol")
		if proto == "" {
			proto = "TCP"
		}
		declared[fmt.Sprintf("%s/%s", ystr(cp, "containerPort"), proto)] = true
	}
	want := map[string]bool{fmt.Sprintf("%d/UDP", listenPorts["gossip-listen"]): true}
	for _, p := range listenPorts {
		want[fmt.Sprintf("%d/TCP", p)] = true
	}
	if fmt.Sprint(declared) != fmt.Sprint(want) {
		t.Errorf("StatefulSet: container ports %v, want the listeners' %v", keys(declared), keys(want))
	}

	// Probes on the client port, on the paths the live test GETs.
	for probe, path := range kubeProbes {
		p := ymap(k.container, probe, "httpGet")
		if p == nil {
			t.Errorf("StatefulSet: no %s httpGet", probe)
			continue
		}
		if got := ystr(p, "path"); got != path {
			t.Errorf("StatefulSet: %s path %q, want %q", probe, got, path)
		}
		if port, _ := k.containerPort(t, ystr(p, "port")); port != listenPorts["listen"] {
			t.Errorf("StatefulSet: %s on port %d, want the client port --listen %d", probe, port, listenPorts["listen"])
		}
	}

	grace := yint(t, "StatefulSet", k.sts, "spec", "template", "spec", "terminationGracePeriodSeconds")
	if drain := b.drain(t, s); time.Duration(grace)*time.Second <= drain {
		t.Errorf("StatefulSet: terminationGracePeriodSeconds %d is not above --shutdown-delay + --shutdown-timeout (%v)", grace, drain)
	}
	podSec := ymap(k.sts, "spec", "template", "spec", "securityContext")
	cSec := ymap(k.container, "securityContext")
	if ystr(podSec, "runAsNonRoot") != "true" && ystr(cSec, "runAsNonRoot") != "true" {
		t.Error("StatefulSet: runAsNonRoot is not set")
	}
	if ystr(podSec, "runAsUser") == "0" || ystr(cSec, "runAsUser") == "0" {
		t.Error("StatefulSet: runs as uid 0")
	}
	if ystr(cSec, "readOnlyRootFilesystem") != "true" || ystr(cSec, "allowPrivilegeEscalation") != "false" {
		t.Error("StatefulSet: want readOnlyRootFilesystem true and allowPrivilegeEscalation false")
	}

	// Discovery through the headless Service: its DNS name resolves to every pod, and each pod
	// has a stable name under it.
	headlessName := ystr(k.sts, "spec", "serviceName")
	headless := k.objs["Service/"+headlessName]
	if headless == nil {
		t.Fatalf("StatefulSet: serviceName %q is not a Service in kubernetes/", headlessName)
	}
	if ystr(headless, "spec", "clusterIP") != "None" || ystr(headless, "spec", "publishNotReadyAddresses") != "true" {
		t.Errorf("Service %s: want clusterIP None and publishNotReadyAddresses true (replicas meet before they are ready)", headlessName)
	}
	domain := headlessName + ".$(POD_NAMESPACE).svc.cluster.local"
	if got, want := b.value(t, s, "join"), fmt.Sprintf("%s:%d", domain, listenPorts["peer-listen"]); got != want {
		t.Errorf("%s: --join %q, want the headless Service's name at the peer port, %q", s.source, got, want)
	}
	for _, kind := range []string{"raft", "peer"} {
		if got, want := b.value(t, s, kind+"-advertise"), fmt.Sprintf("$(POD_NAME).%s:%d", domain, listenPorts[kind+"-listen"]); got != want {
			t.Errorf("%s: --%s-advertise %q, want the pod's stable name %q", s.source, kind, got, want)
		}
	}
	if got := portOf(t, s.source+" --gossip-advertise", b.value(t, s, "gossip-advertise")); got != listenPorts["gossip-listen"] {
		t.Errorf("%s: --gossip-advertise port %d, want --gossip-listen's %d", s.source, got, listenPorts["gossip-listen"])
	}
	exposedByHeadless := map[string]bool{}
	for _, p := range ylist(headless, "spec", "ports") {
		num, proto := k.containerPort(t, ystr(p, "targetPort"))
		if ystr(p, "port") != strconv.Itoa(num) {
			t.Errorf("Service %s: port %s maps to %d; a headless Service is dialled at the pods' own ports", headlessName, ystr(p, "port"), num)
		}
		if want := ystr(p, "protocol"); want != "" && want != proto {
			t.Errorf("Service %s: port %s is %s, the container's %s", headlessName, ystr(p, "name"), want, proto)
		}
		exposedByHeadless[fmt.Sprintf("%d/%s", num, proto)] = true
	}
	wantHeadless := map[string]bool{
		fmt.Sprintf("%d/TCP", listenPorts["raft-listen"]): true, fmt.Sprintf("%d/TCP", listenPorts["peer-listen"]): true,
		fmt.Sprintf("%d/TCP", listenPorts["gossip-listen"]): true, fmt.Sprintf("%d/UDP", listenPorts["gossip-listen"]): true,
	}
	if fmt.Sprint(exposedByHeadless) != fmt.Sprint(wantHeadless) {
		t.Errorf("Service %s: ports %v, want peer, Raft and gossip %v", headlessName, keys(exposedByHeadless), keys(wantHeadless))
	}

	// The client Service: the client port of every ready replica, never the admin port; and
	// the picker's Service: the ext_proc port, over HTTP/2 cleartext.
	clients, pickers := 0, map[string]int{}
	for key, o := range k.objs {
		if !strings.HasPrefix(key, "Service/") {
			continue
		}
		if !subset(ymap(o, "spec", "selector"), k.podLabels) {
			t.Errorf("%s: selector does not match the StatefulSet's pods", key)
		}
		if key == "Service/"+headlessName {
			continue
		}
		ports := ylist(o, "spec", "ports")
		if len(ports) != 1 {
			t.Errorf("%s: %d ports, want one (the client port, or the picker's)", key, len(ports))
			continue
		}
		switch num, _ := k.containerPort(t, ystr(ports[0], "targetPort")); num {
		case listenPorts["listen"]:
			clients++
		case listenPorts["ext-proc-listen"]:
			if ystr(ports[0], "appProtocol") != "kubernetes.io/h2c" {
				t.Errorf("%s: appProtocol %q, want kubernetes.io/h2c (gRPC without TLS)", key, ystr(ports[0], "appProtocol"))
			}
			pickers[ystr(o, "metadata", "name")] = yint(t, key, ports[0], "port")
		default:
			t.Errorf("%s: targets port %d; only the client port %d and the picker's %d may be exposed", key, num, listenPorts["listen"], listenPorts["ext-proc-listen"])
		}
	}
	if clients != 1 || len(pickers) != 1 {
		t.Errorf("want one client Service and one picker Service, found %d and %d", clients, len(pickers))
	}
	checkInferencePool(t, k, pickers)

	// A PodDisruptionBudget that keeps a Raft quorum but still lets a node drain.
	pdbs := 0
	for key, o := range k.objs {
		if !strings.HasPrefix(key, "PodDisruptionBudget/") {
			continue
		}
		pdbs++
		if !subset(ymap(o, "spec", "selector", "matchLabels"), k.podLabels) {
			t.Errorf("%s: selector does not match the StatefulSet's pods", key)
		}
		quorum := replicas/2 + 1
		if minAvail := yint(t, key, o, "spec", "minAvailable"); minAvail < quorum || minAvail >= replicas {
			t.Errorf("%s: minAvailable %d, want at least the quorum %d of %d replicas and fewer than all", key, minAvail, quorum, replicas)
		}
	}
	if pdbs != 1 {
		t.Errorf("want one PodDisruptionBudget, found %d", pdbs)
	}

	// The Raft data on a claim per pod; every file flag reads a mounted ConfigMap or Secret key.
	dataDir := b.value(t, s, "data-dir")
	onClaim := false
	for _, m := range ylist(k.container, "volumeMounts") {
		for _, vct := range ylist(k.sts, "spec", "volumeClaimTemplates") {
			if ystr(m, "mountPath") == dataDir && ystr(m, "name") == ystr(vct, "metadata", "name") {
				onClaim = true
			}
		}
	}
	if !onClaim {
		t.Errorf("StatefulSet: --data-dir %s is not on a volumeClaimTemplate", dataDir)
	}
	for _, f := range settings {
		if !strings.HasSuffix(f.name, "-file") {
			continue
		}
		if _, ok := k.mountedFile(t, f.value); !ok {
			t.Errorf("%s: --%s %s is no key of a ConfigMap or Secret mounted there", s.source, f.name, f.value)
		}
	}
	checkDiscovery(t, b, k)
}

// discovery is the options of the StatefulSet's --discovery kubernetes:... value.
func (k kube) discovery(t *testing.T, b *kvrBinary) map[string]string {
	t.Helper()
	v := b.value(t, k.spec, "discovery")
	rest, ok := strings.CutPrefix(v, "kubernetes:")
	if !ok {
		t.Fatalf("%s: --discovery %q, want the kubernetes source: the replicas follow the vLLM pods", k.spec.source, v)
	}
	opts := map[string]string{}
	for _, part := range strings.Split(rest, ",") {
		key, val, _ := strings.Cut(part, "=")
		opts[key] = val
	}
	return opts
}

// checkDiscovery holds the StatefulSet's discovery to the other files: its pods run as the
// ServiceAccount of rbac.yaml, whose Role (bound to it) lets it get, list and watch what the
// kubernetes source watches (pods, and the InferencePool it names, which inferencepool.yaml
// ships), in the pods' own namespace; and no workers file is left to keep alike.
func checkDiscovery(t *testing.T, b *kvrBinary, k kube) {
	t.Helper()
	opts := k.discovery(t, b)
	if opts["namespace"] != "$(POD_NAMESPACE)" || k.envFrom["POD_NAMESPACE"] != "metadata.namespace" {
		t.Errorf("%s: discovery namespace %q, want $(POD_NAMESPACE) from metadata.namespace: the Role grants this namespace only", k.spec.source, opts["namespace"])
	}
	if opts["kubeconfig"] != "" {
		t.Errorf("%s: discovery kubeconfig %q, want the pod's ServiceAccount", k.spec.source, opts["kubeconfig"])
	}
	if _, ok := k.objs["InferencePool/"+opts["pool"]]; !ok {
		t.Errorf("%s: discovery pool %q is not the InferencePool in kubernetes/", k.spec.source, opts["pool"])
	}
	if b.setFlags(t, k.spec)["workers-file"] {
		t.Errorf("%s: --workers-file beside discovery: a fixed list the pods do not follow", k.spec.source)
	}
	// The pod annotations the live test gives its pods are the ones the docs tell operators.
	for key, v := range vllmAnnotations {
		for _, f := range []string{"README.md", "kubernetes/inferencepool.yaml"} {
			if !strings.Contains(readFile(t, f), key+`: "`+v+`"`) {
				t.Errorf("%s does not document the vLLM pods' annotation %s: %q", f, key, v)
			}
		}
	}
	sa := ystr(k.sts, "spec", "template", "spec", "serviceAccountName")
	if k.objs["ServiceAccount/"+sa] == nil {
		t.Fatalf("StatefulSet: serviceAccountName %q is not a ServiceAccount in kubernetes/", sa)
	}
	// What the informers call: list and watch (and get) pods, and the InferencePools.
	need := map[string]bool{}
	for _, r := range []string{"/pods", "inference.networking.k8s.io/inferencepools"} {
		for _, verb := range []string{"get", "list", "watch"} {
			need[verb+" "+r] = true
		}
	}
	for key, rb := range k.objs {
		if !strings.HasPrefix(key, "RoleBinding/") {
			continue
		}
		bound := false
		for _, sub := range ylist(rb, "subjects") {
			bound = bound || (ystr(sub, "kind") == "ServiceAccount" && ystr(sub, "name") == sa && ystr(sub, "namespace") == "")
		}
		role := k.objs[ystr(rb, "roleRef", "kind")+"/"+ystr(rb, "roleRef", "name")]
		if !bound || role == nil {
			continue
		}
		for _, rule := range ylist(role, "rules") {
			for _, g := range strList(ylist(rule, "apiGroups")) {
				for _, r := range strList(ylist(rule, "resources")) {
					for _, verb := range strList(ylist(rule, "verbs")) {
						delete(need, verb+" "+g+"/"+r)
					}
				}
			}
		}
	}
	if len(need) > 0 {
		t.Errorf("rbac.yaml: no Role bound to the ServiceAccount %s (in the pods' namespace) grants %v", sa, keys(need))
	}
}

// kubeProbes are the StatefulSet's probes and the paths they must use.
var kubeProbes = map[string]string{"readinessProbe": "/readyz", "livenessProbe": "/healthz", "startupProbe": "/healthz"}

// checkInferencePool checks the InferencePool against the picker's Service: its picker is
// the Service at its port, failing closed or open, and it has target ports and a selector
// (the StatefulSet discovers its workers from them: see checkDiscovery).
func checkInferencePool(t *testing.T, k kube, pickers map[string]int) {
	t.Helper()
	var pool map[string]any
	for key, o := range k.objs {
		if strings.HasPrefix(key, "InferencePool/") {
			if pool != nil {
				t.Fatal("more than one InferencePool")
			}
			pool = o
		}
	}
	if pool == nil {
		t.Fatal("no InferencePool in kubernetes/")
	}
	if got := ystr(pool, "apiVersion"); got != "inference.networking.k8s.io/v1" {
		t.Errorf("InferencePool: apiVersion %q, want inference.networking.k8s.io/v1", got)
	}
	ref := ymap(pool, "spec", "endpointPickerRef")
	port, ok := pickers[ystr(ref, "name")]
	if !ok {
		t.Errorf("InferencePool: endpointPickerRef %q is not the picker's Service (%v)", ystr(ref, "name"), pickers)
	} else if got := yint(t, "InferencePool", ref, "port", "number"); got != port {
		t.Errorf("InferencePool: endpointPickerRef port %d, the Service's %d", got, port)
	}
	if fm := ystr(ref, "failureMode"); fm != "FailClose" && fm != "FailOpen" {
		t.Errorf("InferencePool: failureMode %q", fm)
	}
	targets := map[string]bool{}
	for _, tp := range ylist(pool, "spec", "targetPorts") {
		targets[strconv.Itoa(yint(t, "InferencePool targetPorts", tp, "number"))] = true
	}
	if len(targets) == 0 || len(targets) > 8 {
		t.Errorf("InferencePool: %d target ports, want 1 to 8", len(targets))
	}
	if len(ymap(pool, "spec", "selector", "matchLabels")) == 0 {
		t.Error("InferencePool: no selector")
	}
}
