package system_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/envoytest"
	"github.com/kvrouter-ha/kvrouter-ha/internal/loopback"
	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// clientFrom is an HTTP client whose connections (keep-alive, up to conns of them) come
// from the loopback address ip, so the replica sees it as its own client.
func clientFrom(ip string, conns int) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 5 * time.Second}
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		DialContext: d.DialContext, MaxIdleConns: conns, MaxIdleConnsPerHost: conns, MaxConnsPerHost: conns,
		IdleConnTimeout: time.Minute,
	}}
}

// floodReply is one flood request's outcome: its status, and for a 429 whether it came in
// the OpenAI error shape of the client limit with a Retry-After.
type floodReply struct {
	status  int
	shaped  bool
	problem string
}

// newSession sends the first request of session through hc to base: a new binding to make.
func newSession(ctx context.Context, hc *http.Client, base, session string) (floodReply, error) {
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello from %s"}],"max_tokens":1}`, sim.DefaultModel, session)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return floodReply{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := hc.Do(req)
	if err != nil {
		return floodReply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return floodReply{}, err
	}
	rep := floodReply{status: resp.StatusCode}
	if resp.StatusCode == http.StatusTooManyRequests {
		var e struct {
			Error *struct {
				Message string `json:"message"`
				Type    string `json:"type"`
				Code    string `json:"code"`
			} `json:"error"`
		}
		retry, rerr := strconv.Atoi(resp.Header.Get("Retry-After"))
		switch {
		case json.Unmarshal(b, &e) != nil || e.Error == nil || e.Error.Message == "":
			rep.problem = "not the OpenAI error shape: " + string(b)
		case e.Error.Type != "rate_limit_error" || e.Error.Code != "client_rate_limited":
			rep.problem = "not the client limit: " + string(b)
		case rerr != nil || retry < 1:
			rep.problem = fmt.Sprintf("Retry-After %q", resp.Header.Get("Retry-After"))
		default:
			rep.shaped = true
		}
	}
	return rep, nil
}

// fileSize is the size of path in bytes.
func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

// rssOf is a process's resident set in MiB, for the log ("?" where it cannot be read).
func rssOf(pid int) string {
	m, err := proc.ReadMemory(strconv.Itoa(pid))
	if err != nil {
		return "?"
	}
	return fmt.Sprintf("%d MiB", m.RSS>>20)
}

// otherClient sends up to n requests from another client, each a turn of one of its few
// sessions (a new one every tenth), until n or until stop closes; it returns their latencies
// and fails the test on any answer but 200.
func otherClient(t *testing.T, hc *http.Client, base, name string, n int, stop <-chan struct{}) []time.Duration {
	t.Helper()
	var lat []time.Duration
	for i := range n {
		select {
		case <-stop:
			return lat
		default:
		}
		session := fmt.Sprintf("%s-%d", name, i/10)
		start := time.Now()
		a, err := chatVia(t.Context(), hc, base, session, fmt.Sprintf("turn %d of %s", i, session), 1)
		lat = append(lat, time.Since(start))
		if err != nil || a.status != http.StatusOK {
			t.Errorf("the other client's request %d (%s): %+v %v", i, session, a, err)
			return lat
		}
	}
	return lat
}

// TestOneClientFloodingNewSessionsIsRefusedPastItsRate: one client (127.0.0.1, many
// keep-alive connections) opens 200,000 new sessions paced over 60 s (the flood), against
// a replica with the default limits (50 new sessions/s, burst 200). It gets 429 past its
// rate, every one in the OpenAI error shape with Retry-After, and no more sessions than the
// rate and burst allow; another client (127.0.0.2) is never refused meanwhile. Its p99
// before and during the flood, the replica's RSS and its raft.db size are logged.
func TestOneClientFloodingNewSessionsIsRefusedPastItsRate(t *testing.T) {
	const (
		rate, burst = 50, 200 // the defaults of --client-session-rate and --client-session-burst
		maxRequests = 200_000
		maxFlood    = 60 * time.Second
		// The flood is paced at 200,000 in 60 s: as fast as possible, the load generator
		// itself takes most of a 2-core machine from the replica and the other client.
		pace       = maxFlood / maxRequests
		floodConns = 32
		otherMax   = 5_000 // the other client's requests, at most, in each phase
	)
	fl := startFleet(t, 2)
	c := startCluster(t, 1, fl)
	r := c.replicas[0]
	base := "http://" + r.Client
	raftDB := filepath.Join(r.DataDir, "raft.db")
	other := clientFrom("127.0.0.2", 1)
	flood := clientFrom("127.0.0.1", floodConns)

	baseline := otherClient(t, other, base, "calm", 300, nil)
	dbBefore, rssBefore := fileSize(t, raftDB), rssOf(r.proc.PID())

	var sent, accepted, limited, cut atomic.Int64
	var mu sync.Mutex
	var problems []string
	stop := make(chan struct{})
	ctx, cancel := context.WithTimeout(t.Context(), maxFlood)
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	for range floodConns {
		wg.Go(func() {
			for ctx.Err() == nil {
				n := sent.Add(1)
				if n > maxRequests {
					return
				}
				if wait := time.Until(start.Add(time.Duration(n) * pace)); wait > 0 {
					select {
					case <-ctx.Done():
						return
					case <-time.After(wait):
					}
				}
				rep, err := newSession(ctx, flood, base, fmt.Sprintf("flood-%d", n))
				switch {
				case err != nil && ctx.Err() != nil:
					cut.Add(1)
					return
				case err != nil:
					rep.problem = err.Error()
				case rep.status == http.StatusOK:
					accepted.Add(1)
					continue
				case rep.shaped:
					limited.Add(1)
					continue
				case rep.problem == "":
					rep.problem = fmt.Sprintf("status %d", rep.status)
				}
				mu.Lock()
				if len(problems) < 10 {
					problems = append(problems, rep.problem)
				}
				mu.Unlock()
			}
		})
	}
	var during []time.Duration
	otherDone := make(chan struct{})
	go func() {
		defer close(otherDone)
		during = otherClient(t, other, base, "during", otherMax, stop)
	}()
	wg.Wait()
	elapsed := time.Since(start)
	close(stop)
	<-otherDone
	rssAfter := rssOf(r.proc.PID())

	total := min(sent.Load(), maxRequests)
	t.Logf("flood: %d requests in %v (%.0f/s) on %d connections: %d accepted, %d refused with 429, %d cut at the end",
		total, elapsed.Round(time.Millisecond), float64(total)/elapsed.Seconds(), floodConns, accepted.Load(), limited.Load(), cut.Load())
	if len(problems) > 0 {
		t.Errorf("flood answers neither 200 nor the client limit's 429 (first %d): %q", len(problems), problems)
	}
	if limited.Load() == 0 {
		t.Errorf("no flood request was refused with 429")
	}
	if most := burst + rate*elapsed.Seconds(); float64(accepted.Load()) > most {
		t.Errorf("%d new sessions accepted in %v, more than burst+rate*duration = %.0f", accepted.Load(), elapsed, most)
	}
	slices.Sort(baseline)
	slices.Sort(during)
	p99b, p99d := percentile(baseline, 0.99), percentile(during, 0.99)
	ratio := 0.0
	if p99b > 0 {
		ratio = float64(p99d) / float64(p99b)
	}
	t.Logf("the other client (127.0.0.2): baseline p50 %v p99 %v over %d requests; during the flood p50 %v p99 %v over %d requests; p99 ratio %.2f",
		percentile(baseline, 0.5), p99b, len(baseline), percentile(during, 0.5), p99d, len(during), ratio)
	t.Logf("replica RSS %s before the flood, %s after; raft.db %d bytes before, %d after",
		rssBefore, rssAfter, dbBefore, fileSize(t, raftDB))
	if len(during) == 0 {
		t.Error("the other client sent nothing during the flood")
	}
	if err := ctx.Err(); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal(err)
	}
}

// TestPickerRefusesNewSessionsPastTheClientRate: through the ext_proc endpoint picker, a
// client past its burst of new sessions gets the same 429 as on the client port (the
// gateway answers it, nothing is picked), while its bound session still goes through.
func TestPickerRefusesNewSessionsPastTheClientRate(t *testing.T) {
	const burst = 3
	fl := startFleet(t, 2)
	var workers []string
	for i, u := range fl.urls {
		workers = append(workers, fl.ids[i]+"="+u)
	}
	c := startClusterTuned(t, binary, 1, workers, func(r *proc.Replica) {
		addr, err := loopback.Addr()
		if err != nil {
			t.Fatal(err)
		}
		r.ExtProc = addr
	}, "--client-session-rate", "0.001", "--client-session-burst", strconv.Itoa(burst))
	gw, err := envoytest.Dial(c.replicas[0].ExtProc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gw.Close() })
	pick := func(session string) (*envoytest.Result, error) {
		return gw.Do(t.Context(), envoytest.Request{Path: "/v1/chat/completions",
			Header: http.Header{"X-Session-Id": {session}}, Body: chatBody("hello from " + session)})
	}
	for i := range burst {
		if res, err := pick(fmt.Sprint("gw-", i)); err != nil || res.Status != http.StatusOK {
			t.Fatalf("new session %d: %v %+v", i, err, res)
		}
	}
	res, err := pick("gw-refused")
	if err != nil {
		t.Fatal(err)
	}
	if res.Immediate == nil || res.Status != http.StatusTooManyRequests || res.Endpoint != "" {
		t.Fatalf("new session past the burst: status %d, endpoint %q, body %q; want the picker's 429", res.Status, res.Endpoint, res.Body)
	}
	var e struct {
		Error struct{ Type, Code string } `json:"error"`
	}
	if err := json.Unmarshal(res.Body, &e); err != nil || e.Error.Type != "rate_limit_error" || e.Error.Code != "client_rate_limited" {
		t.Fatalf("the picker's 429 body %q: %v", res.Body, err)
	}
	if res, err := pick("gw-0"); err != nil || res.Status != http.StatusOK {
		t.Fatalf("the bound session past the burst: %v %+v", err, res)
	}
}

// TestLiveSessionsPerClientAreCappedUntilTheyExpire: with --client-max-sessions 3, a client's
// fourth live session is refused with 429, and once its bindings expire (the leader's Expire
// through the Raft log) it may open new ones again.
func TestLiveSessionsPerClientAreCappedUntilTheyExpire(t *testing.T) {
	fl := startFleet(t, 2)
	c := startCluster(t, 1, fl, "--client-max-sessions", "3", "--session-ttl", "2s")
	base := "http://" + c.replicas[0].Client
	hc := clientFrom("127.0.0.1", 1)
	for i := range 3 {
		if rep, err := newSession(t.Context(), hc, base, fmt.Sprint("live-", i)); err != nil || rep.status != http.StatusOK {
			t.Fatalf("session %d: %+v %v", i, rep, err)
		}
	}
	full := func() (bool, error) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, base+"/v1/chat/completions",
			strings.NewReader(string(chatBody("one more"))))
		if err != nil {
			return false, err
		}
		req.Header.Set("X-Session-ID", "live-more")
		resp, err := hc.Do(req)
		if err != nil {
			return false, err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		switch {
		case resp.StatusCode == http.StatusOK:
			return false, nil
		case resp.StatusCode == http.StatusTooManyRequests && strings.Contains(string(b), `"client_sessions_full"`):
			return true, nil
		}
		return false, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	if refused, err := full(); err != nil || !refused {
		t.Fatalf("a fourth live session: refused %v, %v", refused, err)
	}
	eventually(t, 60*time.Second, func() error {
		refused, err := full()
		if err == nil && refused {
			err = errors.New("still refused")
		}
		return err
	})
}
