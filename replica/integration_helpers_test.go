package replica

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
	"github.com/kvrouter-ha/kvrouter-ha/transport/openai"
)

// itSpeedup makes the simulated workers' prefill and overhead negligible; tests that need a
// stream to stay open slow the decode down explicitly (simConfig's decodeWall).
const itSpeedup = 200

// pollTimeout bounds every wait for an eventual condition.
const pollTimeout = 15 * time.Second

// testWorker is one simulated worker on loopback that a test can fault, cut or stop.
type testWorker struct {
	*sim.Worker
	spec     routing.WorkerSpec
	cancel   context.CancelFunc
	done     chan struct{}
	stopOnce sync.Once
	conns    *cutListener
}

// cut closes every connection the worker has open, mid-answer or not, as its process dying
// would; it still takes new ones.
func (w *testWorker) cut() { w.conns.cut() }

// cutListener is a listener that can close every connection it accepted.
type cutListener struct {
	net.Listener
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

// Accept accepts a connection and keeps it until it is closed or cut.
func (l *cutListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conns == nil {
		l.conns = make(map[net.Conn]struct{})
	}
	l.conns[c] = struct{}{}
	return &cutConn{Conn: c, l: l}, nil
}

// cut closes every connection accepted and not yet closed.
func (l *cutListener) cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for c := range l.conns {
		_ = c.Close()
		delete(l.conns, c)
	}
}

// cutConn forgets itself in its listener when closed.
type cutConn struct {
	net.Conn
	l *cutListener
}

func (c *cutConn) Close() error {
	c.l.mu.Lock()
	delete(c.l.conns, c.Conn)
	c.l.mu.Unlock()
	return c.Conn.Close()
}

// stop ends the worker's Serve and waits for it: its listener is closed, so new connections
// are refused as they would be by a dead process.
func (w *testWorker) stop() {
	w.stopOnce.Do(func() {
		w.cancel()
		<-w.done
	})
}

// testFleet is the workers of one test, indexed like their ids w0, w1, ...
type testFleet []*testWorker

func (f testFleet) specs() []routing.WorkerSpec {
	out := make([]routing.WorkerSpec, len(f))
	for i, w := range f {
		out[i] = w.spec
	}
	return out
}

// byID returns the worker named id, failing the test when there is none.
func (f testFleet) byID(t *testing.T, id string) *testWorker {
	t.Helper()
	for _, w := range f {
		if w.spec.ID == id {
			return w
		}
	}
	t.Fatalf("no worker %q in the fleet (router answered with an unknown worker)", id)
	return nil
}

// other returns a worker that is not id.
func (f testFleet) other(id string) *testWorker {
	for _, w := range f {
		if w.spec.ID != id {
			return w
		}
	}
	return nil
}

// simConfig is a worker config for the tests: fast everywhere, and decodeWall of wall time
// per output token when it is positive.
func simConfig(decodeWall time.Duration) sim.Config {
	c := sim.Config{
		Speedup:         itSpeedup,
		Logger:          slog.New(slog.DiscardHandler),
		ShutdownTimeout: 500 * time.Millisecond,
	}
	if decodeWall > 0 {
		c.DecodePerToken = decodeWall * itSpeedup
	}
	return c
}

// startWorkers starts n simulated workers on 127.0.0.1:0, stopped at cleanup.
func startWorkers(t *testing.T, n int, base sim.Config) testFleet {
	t.Helper()
	roles := make([]workerRole, n)
	for i := range roles {
		roles[i] = workerRole{id: fmt.Sprintf("w%d", i)}
	}
	return startRoleWorkers(t, roles, base)
}

// workerRole names a worker and its part in disaggregated serving.
type workerRole struct {
	id   string
	role routing.Role
}

// startRoleWorkers starts a simulated worker per role on 127.0.0.1:0, stopped at cleanup.
func startRoleWorkers(t *testing.T, roles []workerRole, base sim.Config) testFleet {
	t.Helper()
	var fleet testFleet
	for _, wr := range roles {
		c := base
		c.ID = wr.id
		c.Role = map[routing.Role]string{routing.RoleBoth: sim.RoleBoth, routing.RolePrefill: sim.RolePrefill, routing.RoleDecode: sim.RoleDecode}[wr.role]
		sw, err := sim.New(c)
		if err != nil {
			t.Fatalf("sim.New: %v", err)
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("listen: %v", err)
		}
		ln := &cutListener{Listener: l}
		ctx, cancel := context.WithCancel(context.Background())
		w := &testWorker{
			Worker: sw,
			spec:   routing.WorkerSpec{ID: c.ID, URL: "http://" + ln.Addr().String(), CapacityBlocks: sw.Config().CapacityBlocks, Role: wr.role},
			cancel: cancel,
			done:   make(chan struct{}),
			conns:  ln,
		}
		go func() {
			defer close(w.done)
			if err := sw.Serve(ctx, ln); err != nil {
				t.Errorf("worker %s: %v", c.ID, err)
			}
		}()
		fleet = append(fleet, w)
	}
	// Cleanups run last-in first-out: the workers, started before the replica, stop after
	// it, so the replica never drains towards a worker that is already gone.
	t.Cleanup(func() {
		for _, w := range fleet {
			w.stop()
		}
	})
	return fleet
}

// startTestReplica starts a replica over fleet on loopback; tune adjusts the config first.
// Health probes run once at start and then hourly, so a test decides when the router learns
// of a failure.
func startTestReplica(t testing.TB, fleet testFleet, tune func(*Config)) *Replica {
	t.Helper()
	cfg := Config{
		Listen: "127.0.0.1:0", AdminListen: "127.0.0.1:0", ID: "it-replica",
		Workers:   fleet.specs(),
		Router:    routing.Config{Policy: "kv"},
		ApproxTTL: 2 * time.Minute, ApproxMaxBlocks: 1 << 20,
		SessionTTL: 10 * time.Minute, MaxSessions: 10_000,
		Health:  openai.HealthConfig{Interval: time.Hour},
		Cluster: testClusterConfig(t),
		Logger:  slog.New(slog.DiscardHandler),
	}
	if tune != nil {
		tune(&cfg)
	}
	rep, err := Start(t.Context(), cfg)
	if err != nil {
		t.Fatalf("startReplica: %v", err)
	}
	t.Cleanup(func() {
		if err := rep.Close(); err != nil {
			t.Errorf("replica close: %v", err)
		}
	})
	return rep
}

// testClusterConfig is a lone replica's Raft node on loopback with a throwaway data directory
// and LAN-fast timeouts.
func testClusterConfig(t testing.TB) ClusterConfig {
	return ClusterConfig{
		DataDir: t.TempDir(), RaftListen: "127.0.0.1:0", PeerListen: "127.0.0.1:0", BootstrapExpect: 1,
		Heartbeat: 100 * time.Millisecond, Election: 100 * time.Millisecond, LeaderLease: 50 * time.Millisecond,
		BindWait: 5 * time.Second,
	}
}

// eventually polls cond until it reports true, failing the test with cond's last word when
// pollTimeout passes.
func eventually(t testing.TB, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(pollTimeout)
	for {
		ok, detail := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s: %s", what, detail)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// routerIdle reports whether the replica's tracker holds no load on any worker.
func routerIdle(rep *Replica) (bool, string) {
	for w, l := range rep.tracker.Snapshot() {
		if l != (routing.Load{}) {
			return false, fmt.Sprintf("worker %s still has %+v", w, l)
		}
	}
	return true, ""
}

// waitRouterIdle waits until every request's load has been released. The router releases a
// request's load after the last byte went to the client, so a client can have its answer a
// moment before the load is gone; tests whose next choice depends on load wait for it.
func waitRouterIdle(t testing.TB, rep *Replica) {
	t.Helper()
	eventually(t, "the router's load to return to zero", func() (bool, string) { return routerIdle(rep) })
}

// workerLoad is the replica's accounted load on worker id (rank 0).
func workerLoad(rep *Replica, id string) routing.Load {
	return rep.tracker.Load(indexer.Worker{ID: id})
}

// promptTokens is a deterministic token prompt of n ids; different seeds give prompts that
// differ from their first block on.
func promptTokens(seed uint64, n int) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 0x5eed5eed))
	out := make([]uint32, n)
	for i := range out {
		out[i] = sim.FirstPieceToken + uint32(rng.IntN(int(sim.PieceTokens)))
	}
	return out
}

// wordsText is deterministic text of about n bytes: lower-case words separated by spaces.
func wordsText(seed uint64, n int) string {
	rng := rand.New(rand.NewPCG(seed, 0x7e47))
	var b strings.Builder
	// Each pass adds at least two bytes.
	for b.Len() < n {
		for range 3 + rng.IntN(5) {
			b.WriteByte(byte('a' + rng.IntN(26)))
		}
		b.WriteByte(' ')
	}
	return b.String()
}

// concat returns a followed by b in a new slice.
func concat(a, b []uint32) []uint32 {
	return append(append(make([]uint32, 0, len(a)+len(b)), a...), b...)
}

// completionBody is a /v1/completions body over a token prompt.
func completionBody(tokens []uint32, maxTokens int, stream bool) []byte {
	b, err := json.Marshal(map[string]any{
		"model": sim.DefaultModel, "prompt": tokens, "max_tokens": maxTokens, "stream": stream,
	})
	if err != nil {
		panic(err) // a map of plain values always marshals
	}
	return b
}

// hdr builds a header from key, value pairs.
func hdr(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return h
}

// routerClient talks to one replica over loopback HTTP.
type routerClient struct {
	t     *testing.T
	base  string
	admin string
	hc    *http.Client
}

func newRouterClient(t *testing.T, rep *Replica) *routerClient {
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	// The timeout is a backstop against a hung router, far above any answer or stream a
	// test reads to its end.
	hc := &http.Client{Transport: tr, Timeout: 4 * pollTimeout}
	return &routerClient{t: t, base: "http://" + rep.Addr(), admin: "http://" + rep.AdminAddr(), hc: hc}
}

// with returns the client for a subtest, so that its failures land on the subtest.
func (c *routerClient) with(t *testing.T) *routerClient {
	cc := *c
	cc.t = t
	return &cc
}

// answer is a whole response.
type answer struct {
	status int
	header http.Header
	body   []byte
}

// do sends one request and reads the whole answer. It does not touch t, so goroutines may
// call it.
func (c *routerClient) do(ctx context.Context, method, path string, body io.Reader, h http.Header) (answer, error) {
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return answer{}, err
	}
	for k, vs := range h {
		req.Header[k] = vs
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, fmt.Errorf("read %s answer: %w", path, err)
	}
	return answer{status: resp.StatusCode, header: resp.Header, body: b}, nil
}

// post sends body to path and fails the test on a transport error.
func (c *routerClient) post(path string, body []byte, h http.Header) answer {
	c.t.Helper()
	a, err := c.do(c.t.Context(), http.MethodPost, path, bytes.NewReader(body), h)
	if err != nil {
		c.t.Fatalf("POST %s: %v", path, err)
	}
	return a
}

// complete sends a non-streamed completion of tokens.
func (c *routerClient) complete(tokens []uint32, maxTokens int, h http.Header) answer {
	c.t.Helper()
	return c.post("/v1/completions", completionBody(tokens, maxTokens, false), h)
}

// mustOK fails the test unless the answer is 200.
func (a answer) mustOK(t *testing.T) answer {
	t.Helper()
	if a.status != http.StatusOK {
		t.Fatalf("status %d, want 200; body %s", a.status, a.body)
	}
	return a
}

func (a answer) worker() string { return a.header.Get(openai.HeaderWorker) }

// revision is the binding revision header, 0 when absent.
func (a answer) revision(t *testing.T) uint64 {
	t.Helper()
	return headerRevision(t, a.header)
}

func headerRevision(t *testing.T, h http.Header) uint64 {
	t.Helper()
	v := h.Get(openai.HeaderRevision)
	if v == "" {
		return 0
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		t.Fatalf("%s %q: %v", openai.HeaderRevision, v, err)
	}
	return n
}

func (a answer) overlap(t *testing.T) int {
	t.Helper()
	v := a.header.Get(openai.HeaderOverlap)
	n, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s %q: %v", openai.HeaderOverlap, v, err)
	}
	return n
}

// cachedTokens is usage.prompt_tokens_details.cached_tokens of a worker's answer.
func (a answer) cachedTokens(t *testing.T) int {
	t.Helper()
	var body struct {
		Usage *struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails *struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(a.body, &body); err != nil {
		t.Fatalf("answer is not JSON: %v: %s", err, a.body)
	}
	if body.Usage == nil || body.Usage.PromptTokensDetails == nil {
		t.Fatalf("answer has no usage.prompt_tokens_details: %s", a.body)
	}
	return body.Usage.PromptTokensDetails.CachedTokens
}

// apiError is the OpenAI error shape.
type apiError struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   string `json:"param"`
	Code    string `json:"code"`
}

// wantError checks the answer is status in the OpenAI error shape and returns the error.
func (a answer) wantError(t *testing.T, status int) apiError {
	t.Helper()
	if a.status != status {
		t.Fatalf("status %d, want %d; body %s", a.status, status, a.body)
	}
	if ct := a.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("error Content-Type %q, want application/json", ct)
	}
	var body struct {
		Error *apiError `json:"error"`
	}
	if err := json.Unmarshal(a.body, &body); err != nil || body.Error == nil {
		t.Fatalf("error body is not {\"error\": {...}}: %v: %s", err, a.body)
	}
	if body.Error.Message == "" || body.Error.Type == "" {
		t.Errorf("error lacks message or type: %s", a.body)
	}
	return *body.Error
}

// sseStream is a streamed answer read event by event.
type sseStream struct {
	resp   *http.Response
	rd     *bufio.Reader
	cancel context.CancelFunc
}

// openStream sends a streamed completion and returns once the response headers are in.
func (c *routerClient) openStream(tokens []uint32, maxTokens int, h http.Header) *sseStream {
	c.t.Helper()
	ctx, cancel := context.WithCancel(c.t.Context())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/v1/completions",
		bytes.NewReader(completionBody(tokens, maxTokens, true)))
	if err != nil {
		cancel()
		c.t.Fatalf("build stream request: %v", err)
	}
	for k, vs := range h {
		req.Header[k] = vs
	}
	req.Header.Set("Content-Type", "application/json")
	// A router that held the stream back would keep the headers until the worker is done;
	// the guard turns that into a failure instead of a long wait.
	guard := time.AfterFunc(pollTimeout, cancel)
	resp, err := c.hc.Do(req)
	if !guard.Stop() {
		err = errors.Join(err, fmt.Errorf("no response headers within %s", pollTimeout))
	}
	if err != nil {
		cancel()
		if resp != nil {
			resp.Body.Close()
		}
		c.t.Fatalf("open stream: %v", err)
	}
	s := &sseStream{resp: resp, rd: bufio.NewReader(resp.Body), cancel: cancel}
	c.t.Cleanup(s.close)
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		c.t.Fatalf("stream status %d, want 200: %s", resp.StatusCode, b)
	}
	return s
}

// next returns the data of the next event; io.EOF at a clean end of the body.
func (s *sseStream) next() (string, error) {
	// Each pass consumes one line; the body is finite or the test's context ends it.
	for {
		line, err := s.rd.ReadString('\n')
		if data, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), "data: "); ok {
			return data, nil
		}
		if err != nil {
			if errors.Is(err, io.EOF) && line == "" {
				return "", io.EOF
			}
			return "", err
		}
	}
}

// close cancels the stream's request and closes its body; it is idempotent.
func (s *sseStream) close() {
	s.cancel()
	s.resp.Body.Close()
}

func (s *sseStream) worker() string { return s.resp.Header.Get(openai.HeaderWorker) }

// firstChunk reads the first event and checks it is a completion chunk with text.
func (s *sseStream) firstChunk(t *testing.T) {
	t.Helper()
	guard := time.AfterFunc(pollTimeout, s.cancel)
	data, err := s.next()
	if !guard.Stop() {
		t.Fatalf("no first chunk within %s (%v)", pollTimeout, err)
	}
	if err != nil {
		t.Fatalf("first chunk: %v", err)
	}
	if chunkText(t, data) == "" {
		t.Fatalf("first chunk has no text: %s", data)
	}
}

// chunkText is the text of a completion stream chunk.
func chunkText(t *testing.T, data string) string {
	t.Helper()
	var chunk struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if err := json.Unmarshal([]byte(data), &chunk); err != nil {
		t.Fatalf("chunk is not JSON: %v: %s", err, data)
	}
	if len(chunk.Choices) == 0 {
		return ""
	}
	return chunk.Choices[0].Text
}

// scrapeMetrics reads the admin listener's /metrics as "name{labels}" -> value.
func (c *routerClient) scrapeMetrics() map[string]float64 {
	c.t.Helper()
	req, err := http.NewRequestWithContext(c.t.Context(), http.MethodGet, c.admin+"/metrics", nil)
	if err != nil {
		c.t.Fatalf("build scrape: %v", err)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		c.t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		c.t.Fatalf("scrape status %d", resp.StatusCode)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			c.t.Fatalf("metrics line %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	if err := sc.Err(); err != nil {
		c.t.Fatalf("read metrics: %v", err)
	}
	return out
}

// sawNothing reports whether the worker never prefilled a prompt.
func sawNothing(w *testWorker) bool {
	s := w.Stats()
	return s.PromptTokens == 0 && s.Served == 0 && s.Running == 0 && s.Waiting == 0 && s.Aborted == 0
}

// requireNoTrace checks that requests the router turned away left nothing behind: no session,
// no load, and no request on any worker.
func requireNoTrace(t *testing.T, rep *Replica, fleet testFleet, what string) {
	t.Helper()
	if got := rep.affinity.Len(); got != 0 {
		t.Errorf("%s left %d sessions", what, got)
	}
	if ok, why := routerIdle(rep); !ok {
		t.Errorf("%s left load: %s", what, why)
	}
	for _, w := range fleet {
		if !sawNothing(w) {
			t.Errorf("worker %s saw one of the %s: %+v", w.spec.ID, what, w.Stats())
		}
	}
}
