package openai

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// statefulWorker is a Responses worker that keeps its answers, as vLLM does with its store
// on: a previous_response_id it did not make is 404. busy makes it answer 429.
type statefulWorker struct {
	*fakeWorker
	mu   sync.Mutex
	kept map[string]bool
	n    int
	busy bool
}

func newStatefulWorker(t *testing.T, id string) *statefulWorker {
	sw := &statefulWorker{kept: map[string]bool{}}
	sw.fakeWorker = newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		raw, _, _ := sw.last()
		var req struct {
			Previous *string `json:"previous_response_id"`
			Store    *bool   `json:"store"`
			Stream   bool    `json:"stream"`
		}
		_ = json.Unmarshal([]byte(raw), &req)
		sw.mu.Lock()
		if sw.busy {
			sw.mu.Unlock()
			http.Error(w, `{"error":{"message":"busy"}}`, http.StatusTooManyRequests)
			return
		}
		if req.Previous != nil && !sw.kept[*req.Previous] {
			sw.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprintf(w, `{"error":{"message":"Response with id '%s' not found.","type":"invalid_request_error"}}`, *req.Previous)
			return
		}
		sw.n++
		rid := fmt.Sprintf("resp_%s_%d", id, sw.n)
		if req.Store == nil || *req.Store {
			sw.kept[rid] = true
		}
		sw.mu.Unlock()
		obj := func(status string) string {
			return fmt.Sprintf(`{"id":%q,"object":"response","status":%q,"output":[]}`, rid, status)
		}
		if !req.Stream {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(obj("completed")))
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for _, ev := range []string{
			fmt.Sprintf(`{"type":"response.created","response":%s}`, obj("in_progress")),
			`{"type":"response.output_text.delta","delta":"hi"}`,
			fmt.Sprintf(`{"type":"response.completed","response":%s}`, obj("completed")),
		} {
			var typ struct{ Type string }
			_ = json.Unmarshal([]byte(ev), &typ)
			fmt.Fprintf(w, "event: %s\ndata: %s\n\n", typ.Type, ev)
			_ = rc.Flush()
		}
	})
	return sw
}

// responseID reads the id of a Responses answer, whole or streamed.
func responseID(t *testing.T, body string) string {
	t.Helper()
	if i := strings.LastIndex(body, "data: "); strings.HasPrefix(body, "event:") && i >= 0 {
		var ev struct {
			Response struct{ ID string } `json:"response"`
		}
		if err := json.Unmarshal([]byte(strings.TrimSpace(body[i+len("data: "):])), &ev); err != nil {
			t.Fatalf("last event of %q: %v", body, err)
		}
		return ev.Response.ID
	}
	var o struct{ ID string }
	if err := json.Unmarshal([]byte(body), &o); err != nil {
		t.Fatalf("answer %q: %v", body, err)
	}
	return o.ID
}

// TestAStoredResponseIsContinuedOnItsWorker: turns chained by previous_response_id, with no
// session header, streamed and not, each go to the worker that stored the one before (any
// other answers 404); an answer stored with store false is not bound; a continued request
// whose worker is busy is not retried on a worker that lacks its state.
func TestAStoredResponseIsContinuedOnItsWorker(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		var ws []*statefulWorker
		var specs []routing.WorkerSpec
		for i := range 4 {
			w := newStatefulWorker(t, fmt.Sprintf("w%d", i))
			ws = append(ws, w)
			specs = append(specs, spec(fmt.Sprintf("w%d", i), w.URL))
		}
		r := newRig(t, specs, rigOptions{server: server})
		send := func(prev string, stream bool, extra string) (*http.Response, string) {
			body := fmt.Sprintf(`{"model":"m","input":"turn","stream":%v%s`, stream, extra)
			if prev != "" {
				body += fmt.Sprintf(`,"previous_response_id":%q`, prev)
			}
			return r.post("/v1/responses", body+"}", nil)
		}
		resp, body := send("", false, "")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("first turn: %d %s", resp.StatusCode, body)
		}
		worker, prev := resp.Header.Get(HeaderWorker), responseID(t, body)
		for turn := 2; turn <= 6; turn++ {
			resp, body := send(prev, turn%2 == 0, "")
			if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderWorker) != worker {
				t.Fatalf("turn %d on %s (%d %s), want %s, the worker that stored %s", turn, resp.Header.Get(HeaderWorker),
					resp.StatusCode, body, worker, prev)
			}
			prev = responseID(t, body)
		}

		resp, body = send(prev, false, `,"store":false`)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("unstored turn: %d %s", resp.StatusCode, body)
		}
		if b, ok, _ := r.affinity.Peek(t.Context(), routing.ResponseSession(responseID(t, body))); ok {
			t.Errorf("an answer sent with store false is bound: %+v", b)
		}

		var held *statefulWorker
		for i, w := range ws {
			if specs[i].ID == worker {
				held = w
			}
		}
		held.mu.Lock()
		held.busy = true
		held.mu.Unlock()
		before := 0
		for _, w := range ws {
			before += w.requests()
		}
		resp, body = send(prev, false, "")
		after := 0
		for _, w := range ws {
			after += w.requests()
		}
		if resp.StatusCode != http.StatusTooManyRequests || after-before != 1 {
			t.Errorf("a continued request whose worker is busy: %d %s after %d dispatches, want its worker's 429 after 1",
				resp.StatusCode, body, after-before)
		}
	})
}

// TestResponsesStateFieldsAreChecked: previous_response_id and store of the wrong type are
// the client's error, naming the field; an id that cannot be a session key routes freely.
func TestResponsesStateFieldsAreChecked(t *testing.T) {
	tests := []struct {
		name, body string
		want       string // the param of a 400; "" for an accepted request
		resume     bool
		store      bool
	}{
		{"none", `{"model":"m","input":"x"}`, "", false, true},
		{"null", `{"model":"m","input":"x","previous_response_id":null,"store":null}`, "", false, true},
		{"continued", `{"model":"m","input":"x","previous_response_id":"resp_1","store":false}`, "", true, false},
		{"id with a space", `{"model":"m","input":"x","previous_response_id":"resp 1"}`, "", false, true},
		{"id too long", `{"model":"m","input":"x","previous_response_id":"` + strings.Repeat("r", maxSessionKey) + `"}`, "", false, true},
		{"id a number", `{"model":"m","input":"x","previous_response_id":7}`, "previous_response_id", false, false},
		{"store a string", `{"model":"m","input":"x","store":"yes"}`, "store", false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Parse(KindResponses, []byte(tt.body))
			if tt.want != "" {
				var apiErr *Error
				if err == nil || !errors.As(err, &apiErr) || apiErr.Param != tt.want {
					t.Fatalf("Parse: %v, want a 400 naming %s", err, tt.want)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if got := (&Server{}).resumes(p) != ""; got != tt.resume || p.StoreResponse != tt.store {
				t.Errorf("resumes %v store %v, want %v %v", got, p.StoreResponse, tt.resume, tt.store)
			}
		})
	}
}

// FuzzResponseWatch: the watch takes any stream, cut anywhere, without a panic; it finds an
// answer's end the same however the stream is cut, and only a kept response with an id.
func FuzzResponseWatch(f *testing.F) {
	f.Add([]byte("event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"object\":\"response\",\"status\":\"completed\"}}\n\n"), uint8(7))
	f.Add([]byte("data: {\"type\":\"response.incomplete\",\"response\":{\"id\":\"r\",\"status\":\"incomplete\"}}\r\n"), uint8(1))
	f.Add([]byte("data: {\"type\":\"response.failed\",\"response\":{\"id\":\"r\",\"status\":\"failed\"}}\n"), uint8(3))
	f.Add([]byte(`{"id":"r","object":"response","status":"completed"}`), uint8(0))
	f.Fuzz(func(t *testing.T, stream []byte, cut uint8) {
		var whole responseWatch
		wo, wok := whole.feed(stream)
		var parts responseWatch
		var po responseObject
		pok := false
		step := int(cut) + 1
		for i := 0; i < len(stream) && !pok; i += step {
			po, pok = parts.feed(stream[i:min(i+step, len(stream))])
		}
		same := func(a, b responseObject) bool {
			return a.ID == b.ID && a.Object == b.Object && a.Status == b.Status && (a.Store == nil) == (b.Store == nil)
		}
		if wok != pok || !same(wo, po) {
			t.Fatalf("whole %+v %v, cut every %d bytes %+v %v", wo, wok, step, po, pok)
		}
		if wok && !wo.kept() {
			t.Fatalf("found a response that is not kept: %+v", wo)
		}
		if len(whole.line) > maxResponseEvent || len(parts.line) > maxResponseEvent {
			t.Fatalf("a line of %d bytes held", max(len(whole.line), len(parts.line)))
		}
		_, _ = scanResponse(stream)
	})
}

// TestOnlyAnswersTheWorkerKeepsAreBound: what a whole answer must say to be bound.
func TestOnlyAnswersTheWorkerKeepsAreBound(t *testing.T) {
	tests := []struct {
		body string
		want bool
	}{
		{`{"id":"r","object":"response","status":"completed"}`, true},
		{`{"id":"r","object":"response","status":"incomplete","store":true}`, true},
		{`{"id":"r","object":"response","status":"queued"}`, true},
		{`{"id":"r","object":"response","status":"failed"}`, false},
		{`{"id":"r","object":"response","status":"cancelled"}`, false},
		{`{"id":"r","object":"response","status":"completed","store":false}`, false},
		{`{"id":"r","object":"chat.completion","status":"completed"}`, false},
		{`{"id":7,"object":"response","status":"completed"}`, false},
		{`[1]`, false},
	}
	for _, tt := range tests {
		if _, got := scanResponse([]byte(tt.body)); got != tt.want {
			t.Errorf("%s: bound %v, want %v", tt.body, got, tt.want)
		}
	}
}

// TestStoredResponsesPastTheClientLimitsAreServedUnbound: each stored answer is a new session
// of its client's; past the client's new-session rate the answer is still served, but not
// bound (the router stores no more for one client than its sessions would).
func TestStoredResponsesPastTheClientLimitsAreServedUnbound(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w := newStatefulWorker(t, "w0")
		r := newRig(t, []routing.WorkerSpec{spec("w0", w.URL)}, rigOptions{server: server, front: func(c *Config) {
			c.ClientLimits = ClientLimits{SessionRate: 1e-6, SessionBurst: 2}
		}})
		var bound []bool
		for range 3 {
			resp, body := r.post("/v1/responses", `{"model":"m","input":"hi"}`, nil)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			_, ok, _ := r.affinity.Peek(t.Context(), routing.ResponseSession(responseID(t, body)))
			bound = append(bound, ok)
		}
		if !bound[0] || !bound[1] || bound[2] {
			t.Errorf("bound %v, want the first two (the burst) and not the third", bound)
		}
		if n := r.metric("kvrouter_client_limited_total", map[string]string{"what": "session"}); n != 1 {
			t.Errorf("kvrouter_client_limited_total{what=session} = %v, want 1", n)
		}
	})
}

// TestNoResponsesAffinityBindsNothing: with the binding off, a stored answer is not bound and
// a request continuing it is routed as any other (no session).
func TestNoResponsesAffinityBindsNothing(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w := newStatefulWorker(t, "w0")
		r := newRig(t, []routing.WorkerSpec{spec("w0", w.URL)}, rigOptions{server: server, front: func(c *Config) { c.NoResponsesAffinity = true }})
		resp, body := r.post("/v1/responses", `{"model":"m","input":"hi"}`, nil)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		id := responseID(t, body)
		if _, ok, _ := r.affinity.Peek(t.Context(), routing.ResponseSession(id)); ok {
			t.Error("a stored answer is bound with the binding off")
		}
		resp, body = r.post("/v1/responses", `{"model":"m","input":"more","previous_response_id":"`+id+`"}`, nil)
		if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderRevision) != "" {
			t.Errorf("continued with the binding off: %d, revision %q: %s", resp.StatusCode, resp.Header.Get(HeaderRevision), body)
		}
	})
}

// TestTheStreamWatchFindsTheEnd: where a stream's id and end are read from.
func TestTheStreamWatchFindsTheEnd(t *testing.T) {
	created := `event: response.created` + "\n" + `data: {"type":"response.created","response":{"id":"r1","object":"response","status":"in_progress"%s}}` + "\n\n"
	huge := strings.Repeat("x", maxResponseEvent)
	tests := []struct {
		name, stream string
		want         string // the id found, "" for none
	}{
		{"event lines", fmt.Sprintf(created, "") + "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r1\",\"output\":\"" + huge + "\"}}\n\n", "r1"},
		{"incomplete", fmt.Sprintf(created, "") + "event: response.incomplete\n", "r1"},
		{"data only", "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"r2\",\"object\":\"response\",\"status\":\"completed\"}}\r\n", "r2"},
		{"data only, longer than the bound", "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"r2\",\"status\":\"completed\",\"x\":\"" + huge + "\"}}\n", ""},
		{"not stored", fmt.Sprintf(created, `,"store":false`) + "event: response.completed\n", ""},
		{"failed", fmt.Sprintf(created, "") + "event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"id\":\"r1\",\"status\":\"failed\"}}\n", ""},
		{"cut off", fmt.Sprintf(created, ""), ""},
	}
	for _, tt := range tests {
		var w responseWatch
		var got responseObject
		ok := false
		for i := 0; i < len(tt.stream) && !ok; i += 4096 {
			got, ok = w.feed([]byte(tt.stream[i:min(i+4096, len(tt.stream))]))
		}
		if got.ID != tt.want || ok != (tt.want != "") {
			t.Errorf("%s: found %q (%v), want %q", tt.name, got.ID, ok, tt.want)
		}
		if cap(w.line) > 2*maxResponseEvent {
			t.Errorf("%s: the watch holds %d bytes", tt.name, cap(w.line))
		}
	}
}
