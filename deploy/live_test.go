package deploy_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kvrouter-ha/kvrouter-ha/internal/k8stest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback/loopbacktest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/testpki"
)

// vllmAnnotations are the annotations deploy/README.md and inferencepool.yaml tell operators to
// give the vLLM pods; the live test gives them to its pods.
var vllmAnnotations = map[string]string{"kvrouter-ha.io/kv-events-port": "5557", "kvrouter-ha.io/kv-replay-port": "5558"}

// TestManifestsRunAndServeTheDashboardsMetrics starts, on loopback, a simulated worker from
// docker-compose's w0 and one replica from each of the StatefulSet, compose's r0 and the systemd
// unit with env.example: their own arguments and environment, with only what cannot work here
// replaced (listen and advertise addresses, peers, data directory, secret and certificate files,
// a short drain; the StatefulSet's discovery gets a kubeconfig in place of the pod's mounted
// ServiceAccount token). The StatefulSet's replica finds its workers as its pod would: a real
// kube-apiserver authorizing by RBAC, with rbac.yaml and inferencepool.yaml applied, asked
// with a token of the pod's ServiceAccount; the pool's pods, labelled and annotated as the
// docs say, are the simulated worker (Ready) and a pod that is not ready. Each replica must
// come up ready; the StatefulSet's probe paths must answer 200; the Ready pod (and not the
// other) and compose's workers.json must be what the replicas then list; and after a little
// traffic every metric the Grafana dashboard queries must be on the admin /metrics.
func TestManifestsRunAndServeTheDashboardsMetrics(t *testing.T) {
	b := binary(t)
	k := readKube(t)
	c := readCompose(t)
	sysReplica, _, _, _ := systemdSpecs(t)
	dir := t.TempDir()

	api := k8stest.StartClusterWith(t, podNamespace, k8stest.Options{RBAC: true})
	for _, f := range []string{"kubernetes/rbac.yaml", "kubernetes/inferencepool.yaml"} {
		for _, obj := range manifests(t, f) {
			api.Create(t, obj)
		}
	}
	kubeconfig := api.ServiceAccountKubeconfig(t, dir, ystr(k.sts, "spec", "template", "spec", "serviceAccountName"))
	pool := k.objs["InferencePool/"+k.discovery(t, b)["pool"]]
	poolPort := yint(t, "InferencePool", ylist(pool, "spec", "targetPorts")[0], "number")

	// The simulated worker serves at the pool's port on a loopback address of its own, the
	// Ready pod's IP, and binds its KV-event sockets at the annotated ports, as vLLM does.
	eventsPort, replayPort := vllmAnnotations["kvrouter-ha.io/kv-events-port"], vllmAnnotations["kvrouter-ha.io/kv-replay-port"]
	simHost := freeHost(t, strconv.Itoa(poolPort), eventsPort, replayPort)
	simAddr := net.JoinHostPort(simHost, strconv.Itoa(poolPort))
	sim := c.workers[0]
	simArgs := append(append([]string{}, sim.args...),
		"--listen="+simAddr,
		"--kv-events-endpoint=tcp://"+net.JoinHostPort(simHost, eventsPort), "--kv-events-bind",
		"--kv-events-replay=tcp://"+net.JoinHostPort(simHost, replayPort),
		"--kv-events-topic=kv@"+simAddr+"@sim-model")
	startProc(t, b, "sim-worker", "sim-worker", simArgs, nil)
	simWorker := "--worker=sim=http://" + simAddr
	ready := createPoolPod(t, api, pool, "vllm-0", simHost, true)
	notReady := createPoolPod(t, api, pool, "vllm-1", freeHost(t), false)

	composeWorkers := filepath.Join(dir, "workers-compose.json")
	if err := os.WriteFile(composeWorkers, []byte(onLoopback(t, readFile(t, "workers.json"))), 0o600); err != nil {
		t.Fatal(err)
	}

	type run struct {
		name        string
		spec        execSpec
		workersFile string
		wantWorkers []string
		notWorkers  []string
		extra       []string
		ports       listeners
		proc        *proc
	}
	kubeSpec := k.pod("127.0.0.1")
	kubeSpec.args = withKubeconfig(kubeSpec.args, kubeconfig)
	runs := []*run{
		{name: "statefulset", spec: kubeSpec, wantWorkers: []string{ready}, notWorkers: []string{notReady, "sim"}},
		{name: "compose-r0", spec: c.replicas[0], workersFile: composeWorkers, wantWorkers: append(workerIDs(t, readFile(t, "workers.json")), "sim"),
			extra: []string{simWorker}},
		{name: "systemd", spec: sysReplica, workersFile: "", wantWorkers: []string{"sim"}, extra: []string{simWorker}},
	}
	// The peer certificate names every address a replica advertises, as it must in production.
	var hosts []string
	for _, r := range runs {
		r.ports = listeners{
			client: loopbacktest.Addr(t), admin: loopbacktest.Addr(t),
			raft: loopbacktest.Addr(t), peer: loopbacktest.Addr(t), gossip: loopbacktest.Addr(t),
		}
		hosts = append(hosts, hostOf(t, r.name, r.ports.raft), hostOf(t, r.name, r.ports.peer))
	}
	files := newTestFiles(t, dir, hosts)
	for _, r := range runs {
		args := append(append([]string{}, r.spec.args...), overrides(t, b, r.spec, r.ports, dir, r.name, r.workersFile, files)...)
		args = append(args, r.extra...)
		r.proc = startProc(t, b, r.name, "serve", args, r.spec.env)
	}

	client := &http.Client{Timeout: 10 * time.Second}
	for _, r := range runs {
		waitStatus(t, client, r.proc, "http://"+r.ports.client+kubeProbes["readinessProbe"], http.StatusOK)
		for probe, path := range kubeProbes {
			if code := get(t, client, "http://"+r.ports.client+path, ""); code != http.StatusOK {
				t.Errorf("%s: %s %s answered %d on a ready replica", r.name, probe, path, code)
			}
		}
		// The admin API wants the token from the mounted file; its worker list is the file's,
		// or the Ready pods'.
		if code := get(t, client, "http://"+r.ports.admin+"/admin/workers", ""); code != http.StatusUnauthorized {
			t.Errorf("%s: /admin/workers without the token answered %d, want 401", r.name, code)
		}
		body := getBody(t, client, "http://"+r.ports.admin+"/admin/workers", files.token)
		for _, id := range r.wantWorkers {
			if !strings.Contains(body, `"`+id+`"`) {
				t.Errorf("%s: /admin/workers does not list %s:\n%s", r.name, id, body)
			}
		}
		for _, id := range r.notWorkers {
			if strings.Contains(body, `"`+id+`"`) {
				t.Errorf("%s: /admin/workers lists %s:\n%s", r.name, id, body)
			}
		}
	}
	// The discovered worker is the pod's spec: its URL at the pool's port, its KV-event
	// sockets at the annotated ports.
	var discovered []struct {
		Spec struct {
			ID       string `json:"id"`
			URL      string `json:"url"`
			KVEvents string `json:"kv_events"`
			KVReplay string `json:"kv_replay"`
		} `json:"spec"`
		Source string `json:"source"`
	}
	if err := json.Unmarshal([]byte(getBody(t, client, "http://"+runs[0].ports.admin+"/admin/workers", files.token)), &discovered); err != nil || len(discovered) != 1 {
		t.Fatalf("statefulset: /admin/workers: %v %+v, want the one Ready pod", err, discovered)
	}
	if w := discovered[0]; w.Spec.URL != "http://"+simAddr || w.Spec.KVEvents != "tcp://"+net.JoinHostPort(simHost, eventsPort) ||
		w.Spec.KVReplay != "tcp://"+net.JoinHostPort(simHost, replayPort) || !strings.HasPrefix(w.Source, "discovery:kubernetes:") {
		t.Errorf("statefulset: the discovered worker %+v, want the pod's address at the pool's and the annotated ports", w)
	}

	// Traffic through the StatefulSet's replica, to the pod it discovered.
	kr := runs[0]
	prompt := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 60)
	for i := range 3 {
		code, body := post(t, client, "http://"+kr.ports.client+"/v1/chat/completions", "deploy-test",
			`{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"`+prompt+`"}]}`)
		if code != http.StatusOK {
			t.Fatalf("completion %d: %d %s", i, code, body)
		}
	}
	if code, body := post(t, client, "http://"+kr.ports.client+"/v1/completions", "",
		`{"model":"sim-model","max_tokens":3,"stream":true,"prompt":"`+prompt+`"}`); code != http.StatusOK || !strings.Contains(body, "data:") {
		t.Fatalf("stream: %d %s", code, body)
	}
	if code, _ := post(t, client, "http://"+kr.ports.client+"/v1/chat/completions", "", `{"model":`); code != http.StatusBadRequest {
		t.Errorf("malformed request: %d, want 400", code)
	}

	want := dashboardMetrics(t)
	var missing []string
	deadline := time.Now().Add(15 * time.Second)
	for {
		missing = missingMetrics(want, getBody(t, client, "http://"+kr.ports.admin+"/metrics", ""))
		if len(missing) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond) // polling for KV events and gossip to show, under a deadline
	}
	if len(missing) > 0 {
		t.Errorf("the dashboard queries metrics the replica does not export: %v", missing)
	}
	if len(want) < 20 {
		t.Errorf("only %d metric names found in the dashboard", len(want))
	}
}

// missingMetrics lists the names in want that the exposition text lacks. A name ending in
// _bucket must be a histogram's.
func missingMetrics(want map[string]bool, exposition string) []string {
	have, histograms := map[string]bool{}, map[string]bool{}
	for _, line := range strings.Split(exposition, "\n") {
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" && f[3] == "histogram" {
			histograms[f[2]] = true
		}
		if line == "" || line[0] == '#' {
			continue
		}
		name, _, _ := strings.Cut(line, "{")
		name, _, _ = strings.Cut(name, " ")
		have[name] = true
	}
	var missing []string
	for n := range want {
		base, isBucket := strings.CutSuffix(n, "_bucket")
		if !have[n] || (isBucket && !histograms[base]) {
			missing = append(missing, n)
		}
	}
	return missing
}

// testFiles are the secrets and certificates the replicas read here instead of the mounted ones.
type testFiles struct {
	gossipKey, adminToken, ca, cert, key string
	token                                string
}

func newTestFiles(t *testing.T, dir string, hosts []string) testFiles {
	t.Helper()
	raw := make([]byte, 32)
	if _, err := rand.Read(raw); err != nil {
		t.Fatal(err)
	}
	// One certificate for the hosts, usable as server and client (mutual TLS between
	// replicas), from a CA of its own.
	ca := testpki.NewCA(t, "kvrouter-ha test CA")
	cert, key := ca.IssueFiles("kvrouter-ha replica", testpki.ServerAndClient, append([]string{"localhost"}, hosts...)...)
	f := testFiles{
		gossipKey: filepath.Join(dir, "gossip.key"), adminToken: filepath.Join(dir, "admin.token"),
		ca: ca.CAFile, cert: cert, key: key,
		token: base64.RawURLEncoding.EncodeToString(raw[:24]),
	}
	write := func(path string, b []byte) {
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(f.gossipKey, []byte(base64.StdEncoding.EncodeToString(raw)+"\n"))
	write(f.adminToken, []byte(f.token+"\n"))
	return f
}

// listeners are one replica's loopback addresses.
type listeners struct{ client, admin, raft, peer, gossip string }

// onLoopback is a workers file with every worker's host name (vllm-0.vllm, w0: names that
// resolve only where the file is deployed) replaced by a loopback address where nothing
// listens, so that the replica's dials, scrapes and look-ups stay on this machine; the ids,
// which the test checks, are the file's.
func onLoopback(t *testing.T, workers string) string {
	t.Helper()
	host, _, err := net.SplitHostPort(loopbacktest.Addr(t))
	if err != nil {
		t.Fatal(err)
	}
	return regexp.MustCompile(`//[A-Za-z0-9.-]+:`).ReplaceAllString(workers, "//"+host+":")
}

// overrides are the flags that make a deploy file's replica run alone on loopback. Every flag
// the file sets that names an address, a peer or a file gets a local value; a file flag this
// test does not know fails it, so a new one cannot go unchecked.
func overrides(t *testing.T, b *kvrBinary, s execSpec, l listeners, dir, name, workersFile string, f testFiles) []string {
	t.Helper()
	out := []string{
		"--listen=" + l.client, "--admin-listen=" + l.admin,
		"--raft-listen=" + l.raft, "--peer-listen=" + l.peer, "--gossip-listen=" + l.gossip,
		"--raft-advertise=", "--peer-advertise=", "--gossip-advertise=",
		"--join=", "--gossip-join=", "--bootstrap-expect=1",
		"--data-dir=" + filepath.Join(dir, name+"-data"),
		"--workers-file=" + workersFile,
		// A drain here has nothing to wait for.
		"--shutdown-delay=0s", "--shutdown-timeout=5s",
	}
	set := b.setFlags(t, s)
	// Every other address the spec binds (the StatefulSet's --ext-proc-listen on its pod's
	// IP and port 9002, a --kv-events-bind) gets a free loopback address of its own: a fixed
	// port fails when anything on the host holds it, and a wildcard binds every interface.
	chosen := map[string]bool{l.client: true, l.admin: true, l.raft: true, l.peer: true, l.gossip: true}
	for name := range set {
		if !bindsAddress(name) || slices.ContainsFunc(out, func(a string) bool { return strings.HasPrefix(a, "--"+name+"=") }) {
			continue
		}
		v := b.value(t, s, name)
		if v == "" {
			continue
		}
		addr := loopbacktest.Addr(t)
		chosen[addr] = true
		if scheme, _, ok := strings.Cut(v, "://"); ok {
			addr = scheme + "://" + addr
		}
		out = append(out, "--"+name+"="+addr)
	}
	files := map[string]string{
		"gossip-key-file": f.gossipKey, "admin-token-file": f.adminToken,
		"peer-tls-ca-file": f.ca, "peer-tls-cert-file": f.cert, "peer-tls-key-file": f.key,
		"tls-cert-file": f.cert, "tls-key-file": f.key,
		"workers-file": workersFile,
	}
	for name := range set {
		if !strings.HasSuffix(name, "-file") || name == "workers-file" {
			continue
		}
		path, ok := files[name]
		if !ok {
			t.Fatalf("%s sets --%s: teach this test which file to give it", s.source, name)
		}
		out = append(out, "--"+name+"="+path)
	}
	// The admin token guards the admin API here too, whatever the file does.
	if !set["admin-token-file"] {
		out = append(out, "--admin-token-file="+f.adminToken)
	}
	// What runs binds only addresses this test chose: free ports on loopback.
	final := s
	final.args = append(append([]string{}, s.args...), out...)
	for name := range b.flags[s.sub] {
		if !bindsAddress(name) {
			continue
		}
		v := b.value(t, final, name)
		if f := b.flags[s.sub][name]; v == f.def && (v == "string" || v == "value") {
			continue // --help's placeholder for an empty default: off
		}
		if _, hostPort, ok := strings.Cut(v, "://"); ok {
			v = hostPort
		}
		if v != "" && !chosen[v] {
			t.Fatalf("%s: --%s=%s is not an address this test chose (a fixed port, or beyond loopback): teach overrides to replace it", s.source, name, v)
		}
	}
	return out
}

// bindsAddress reports whether the serve flag name is an address the replica listens on.
func bindsAddress(name string) bool {
	return strings.HasSuffix(name, "-listen") || strings.HasSuffix(name, "-bind")
}

// podNamespace is the namespace the StatefulSet's pod runs in here.
const podNamespace = "kvrouter"

// withKubeconfig gives each kubernetes discovery source of args the kubeconfig file at path:
// what a pod has from its mounted ServiceAccount token, a process here has from a file.
func withKubeconfig(args []string, path string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, "--discovery=kubernetes:"); ok {
			a = "--discovery=kubernetes:" + v + ",kubeconfig=" + path
		}
		out[i] = a
	}
	return out
}

// manifests reads a manifest file's objects as the API server takes them (YAML typed as
// kubectl reads it: numbers are numbers).
func manifests(t *testing.T, path string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, doc := range strings.Split(readFile(t, path), "\n---\n") {
		j, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		var obj map[string]any
		if err := json.Unmarshal(j, &obj); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if obj != nil {
			out = append(out, obj)
		}
	}
	return out
}

// freeHost is a loopback host on which every one of ports can be bound now.
func freeHost(t *testing.T, ports ...string) string {
	t.Helper()
	for range 8 {
		host, _, err := net.SplitHostPort(loopbacktest.Addr(t))
		if err != nil {
			t.Fatal(err)
		}
		free := true
		for _, p := range ports {
			l, err := net.Listen("tcp", net.JoinHostPort(host, p))
			if err != nil {
				free = false
				break
			}
			l.Close()
		}
		if free {
			return host
		}
	}
	t.Fatalf("no loopback host with ports %v free", ports)
	return ""
}

// createPoolPod creates a pod that pool selects, annotated with vllmAnnotations, at ip, Ready
// or not, and returns the worker id the kubernetes source gives it.
func createPoolPod(t *testing.T, api *k8stest.Cluster, pool map[string]any, name, ip string, ready bool) string {
	t.Helper()
	labels := map[string]string{}
	for k, v := range ymap(pool, "spec", "selector", "matchLabels") {
		labels[k], _ = v.(string)
	}
	return api.CreatePodWith(t, name, ip, ready, labels, vllmAnnotations)
}

// pod is the StatefulSet's first pod's command line: the downward API's values (its name,
// namespace and podIP) in the environment, and $(VAR) expanded in its arguments.
func (k kube) pod(podIP string) execSpec {
	s := k.spec
	s.env = map[string]string{}
	for name, v := range k.spec.env {
		s.env[name] = v
	}
	for name, fp := range k.envFrom {
		s.env[name] = map[string]string{"metadata.name": "kvrouter-ha-0", "metadata.namespace": podNamespace, "status.podIP": podIP}[fp]
	}
	s.args = expandKubeVars(s.args, s.env)
	return s
}

// expandKubeVars does Kubernetes' $(VAR) expansion of args from env.
func expandKubeVars(args []string, env map[string]string) []string {
	re := regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = re.ReplaceAllStringFunc(a, func(m string) string {
			if v, ok := env[m[2:len(m)-1]]; ok {
				return v
			}
			return m
		})
	}
	return out
}

func workerIDs(t *testing.T, jsonArray string) []string {
	t.Helper()
	var ids []string
	for _, m := range regexp.MustCompile(`"id"\s*:\s*"([^"]+)"`).FindAllStringSubmatch(jsonArray, -1) {
		ids = append(ids, m[1])
	}
	if len(ids) == 0 {
		t.Fatalf("no worker ids in %s", jsonArray)
	}
	return ids
}

// syncBuffer collects a child's output for the failure report.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startProc runs the binary with the given environment (on top of the test's, less any
// KVROUTER_ variable of the caller) and stops it when the test ends: SIGTERM, then SIGKILL if
// it has not exited within a bound.
func startProc(t *testing.T, b *kvrBinary, name, sub string, args []string, env map[string]string) *proc {
	t.Helper()
	cmd := exec.Command(b.path, append([]string{sub}, args...)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KVROUTER_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		select {
		case <-done:
			t.Errorf("%s exited before the test ended:\n%s", name, out)
			return
		default:
		}
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			cmd.Process.Kill()
			<-done
			t.Errorf("%s did not stop within 15s of SIGTERM", name)
		}
		if t.Failed() {
			t.Logf("%s %s output:\n%s", name, sub, out)
		}
	})
	return &proc{name: name, done: done, out: out}
}

// proc is a started child: done closes when it exits.
type proc struct {
	name string
	done chan struct{}
	out  *syncBuffer
}

func get(t *testing.T, c *http.Client, url, token string) int {
	t.Helper()
	code, _ := request(t, c, http.MethodGet, url, token, "", "")
	return code
}

func getBody(t *testing.T, c *http.Client, url, token string) string {
	t.Helper()
	code, body := request(t, c, http.MethodGet, url, token, "", "")
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", url, code, body)
	}
	return body
}

func post(t *testing.T, c *http.Client, url, session, body string) (int, string) {
	t.Helper()
	return request(t, c, http.MethodPost, url, "", session, body)
}

func request(t *testing.T, c *http.Client, method, url, token, session, body string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if session != "" {
		req.Header.Set("X-Session-ID", session)
	}
	if method == http.MethodPost {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: body: %v", method, url, err)
	}
	return resp.StatusCode, string(b)
}

// waitStatus polls url until it answers want, under a deadline, and gives up at once if the
// process exits.
func waitStatus(t *testing.T, c *http.Client, p *proc, url string, want int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	last := "no answer"
	for time.Now().Before(deadline) {
		select {
		case <-p.done:
			t.Fatalf("%s exited while starting:\n%s", p.name, p.out)
		default:
		}
		resp, err := c.Get(url)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == want {
				return
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, b)
		} else {
			last = err.Error()
		}
		time.Sleep(100 * time.Millisecond) // polling a starting process under a deadline
	}
	t.Fatalf("%s: %s never answered %d (last: %s)", p.name, url, want, last)
}
