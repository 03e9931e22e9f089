package openai

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// twoModels serves "small" on w-small and "large" on w-large, declared.
func twoModels(t *testing.T) (*rig, *fakeWorker, *fakeWorker) {
	t.Helper()
	small, large := newFakeWorker(t, okJSON), newFakeWorker(t, okJSON)
	s, l := spec("w-small", small.URL), spec("w-large", large.URL)
	s.Models, l.Models = []string{"small"}, []string{"large", "org/large-instruct"}
	return newRig(t, []routing.WorkerSpec{s, l}, rigOptions{router: roundRobin}), small, large
}

func TestARequestGoesOnlyToAWorkerOfItsModel(t *testing.T) {
	rg, small, large := twoModels(t)
	for i := range 8 {
		model := []string{"small", "large", "org/large-instruct"}[i%3]
		want := map[string]string{"small": "w-small", "large": "w-large", "org/large-instruct": "w-large"}[model]
		resp, body := rg.post("/v1/chat/completions", `{"model":"`+model+`","messages":[{"role":"user","content":"hi"}]}`, nil)
		if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderWorker) != want {
			t.Fatalf("request %d for %s: %d on %q, want 200 on %s: %s", i, model, resp.StatusCode, resp.Header.Get(HeaderWorker), want, body)
		}
	}
	if small.requests() != 3 || large.requests() != 5 {
		t.Fatalf("workers saw %d and %d requests, want 3 and 5", small.requests(), large.requests())
	}
	if got := rg.metric("kvrouter_model_requests_total", map[string]string{"model": "large"}); got != 3 {
		t.Fatalf("requests for large counted %v, want 3", got)
	}
}

func TestUnknownModelIs404ModelNotFoundInTheAPIsOwnShape(t *testing.T) {
	rg, small, large := twoModels(t)
	chat := `{"model":"huge","messages":[{"role":"user","content":"hi"}]}`
	tests := []struct {
		path, body string
		anthropic  bool
	}{
		{"/v1/chat/completions", chat, false},
		{"/v1/completions", `{"model":"huge","prompt":"hi"}`, false},
		{"/v1/responses", `{"model":"huge","input":"hi"}`, false},
		{"/v1/embeddings", `{"model":"huge","input":"hi"}`, false},
		{"/v1/route", chat, false},
		{"/v1/reserve", chat, false},
		{"/v1/messages", `{"model":"huge","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`, true},
	}
	for _, tc := range tests {
		t.Run(tc.path, func(t *testing.T) {
			resp, body := rg.post(tc.path, tc.body, map[string]string{"X-Session-ID": "s1"})
			if resp.StatusCode != http.StatusNotFound {
				t.Fatalf("status %d, want 404: %s", resp.StatusCode, body)
			}
			if tc.anthropic {
				var e struct {
					Type  string `json:"type"`
					Error struct {
						Type, Message string
					} `json:"error"`
				}
				if json.Unmarshal([]byte(body), &e) != nil || e.Type != "error" || e.Error.Type != "not_found_error" || !strings.Contains(e.Error.Message, "huge") {
					t.Fatalf("anthropic shape: %s", body)
				}
				return
			}
			if e := errorOf(t, body); e.Code != "model_not_found" || e.Type != TypeInvalidRequest || e.Param != "model" {
				t.Fatalf("openai shape: %s", body)
			}
		})
	}
	if small.requests()+large.requests() != 0 {
		t.Fatalf("workers saw %d requests for an unknown model", small.requests()+large.requests())
	}
	if _, ok, _ := rg.affinity.Peek(context.Background(), "s1"); ok {
		t.Fatal("an unknown model's request bound its session")
	}
	if got := rg.metric("kvrouter_model_requests_total", map[string]string{"model": routing.OtherModel}); got != float64(len(tests)) {
		t.Fatalf("unknown models counted %v under %q, want %d", got, routing.OtherModel, len(tests))
	}
	if got := rg.metric("kvrouter_errors_total", map[string]string{"cause": "model_not_found"}); got != float64(len(tests)) {
		t.Fatalf("model_not_found counted %v, want %d", got, len(tests))
	}
}

func TestModelsListIsTheUnionAndRetrieveAnswersOne(t *testing.T) {
	rg, _, _ := twoModels(t)
	ids := func() []string {
		resp, body := rg.do(context.Background(), http.MethodGet, "/v1/models", "", nil)
		var list modelList
		if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &list) != nil || list.Object != "list" {
			t.Fatalf("models %d %s", resp.StatusCode, body)
		}
		var out []string
		for _, m := range list.Data {
			if m.Object != "model" || m.OwnedBy == "" {
				t.Fatalf("entry %+v", m)
			}
			out = append(out, m.ID)
		}
		return out
	}
	if got := strings.Join(ids(), ","); got != "large,org/large-instruct,small" {
		t.Fatalf("models = %s", got)
	}
	rg.workers.SetHealthy("w-large", false, "test")
	if got := strings.Join(ids(), ","); got != "small" {
		t.Fatalf("models with w-large down = %s, want small", got)
	}
	rg.workers.SetHealthy("w-large", true, "")
	tests := []struct {
		path string
		want int
		id   string
	}{
		{"/v1/models/small", http.StatusOK, "small"},
		{"/v1/models/org/large-instruct", http.StatusOK, "org/large-instruct"},
		{"/v1/models/org%2Flarge-instruct", http.StatusOK, "org/large-instruct"},
		{"/v1/models/huge", http.StatusNotFound, ""},
	}
	for _, tc := range tests {
		t.Run(tc.path, func(t *testing.T) {
			resp, body := rg.do(context.Background(), http.MethodGet, tc.path, "", nil)
			if resp.StatusCode != tc.want {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.want, body)
			}
			if tc.want == http.StatusNotFound {
				if e := errorOf(t, body); e.Code != "model_not_found" {
					t.Fatalf("404 body %s", body)
				}
				return
			}
			var m modelEntry
			if json.Unmarshal([]byte(body), &m) != nil || m.ID != tc.id || m.Object != "model" {
				t.Fatalf("entry %s", body)
			}
		})
	}
}

func TestLearnedModelsRouteAndGarbageKeepsThem(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		var answer atomic.Value
		answer.Store(`{"object":"list","data":[{"id":"base","parent":null},{"id":"sql","parent":"base"}]}`)
		w := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/models" {
				_, _ = io.WriteString(w, answer.Load().(string))
				return
			}
			okJSON(w, r)
		})
		other := newFakeWorker(t, okJSON)
		o := spec("declared", other.URL)
		o.Models = []string{"else"}
		rg := newRig(t, []routing.WorkerSpec{spec("learner", w.URL), o}, rigOptions{server: server, router: roundRobin})
		ctx := context.Background()
		// Before anything is learned the worker takes any model.
		if resp, _ := rg.post("/v1/completions", `{"model":"whatever","prompt":"hi"}`, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("unknown models: %d, want 200 from the worker of unknown models", resp.StatusCode)
		}
		next := map[string]time.Time{}
		rg.srv.learnDue(ctx, next, time.Now())
		for _, model := range []string{"base", "sql"} {
			resp, body := rg.post("/v1/completions", `{"model":"`+model+`","prompt":"hi"}`, nil)
			if resp.StatusCode != http.StatusOK || resp.Header.Get(HeaderWorker) != "learner" {
				t.Fatalf("%s: %d on %q: %s", model, resp.StatusCode, resp.Header.Get(HeaderWorker), body)
			}
		}
		resp, body := rg.do(ctx, http.MethodGet, "/v1/models/sql", "", nil)
		if resp.StatusCode != http.StatusOK || !strings.Contains(body, `"parent":"base"`) {
			t.Fatalf("learned adapter: %d %s", resp.StatusCode, body)
		}
		if resp, _ := rg.post("/v1/completions", `{"model":"whatever","prompt":"hi"}`, nil); resp.StatusCode != http.StatusNotFound {
			t.Fatalf("once learned, an unknown model: %d, want 404", resp.StatusCode)
		}
		answer.Store(`{"data":[{"id":"a b"}]}`)
		rg.srv.learnDue(ctx, next, time.Now().Add(2*modelsTTL))
		if !rg.workers.Catalog().Known("sql") {
			t.Fatal("a garbage answer dropped what was learned")
		}
	})
}

func TestModelListDecoderRefusesBadLists(t *testing.T) {
	for _, body := range []string{``, `[]`, `{"data":{}}`, `{"data":[{"id":""}]}`, `{"data":[{"id":"x","parent":"a\nb"}]}`,
		`{"data":[` + strings.Repeat(`{"id":"m"},`, routing.MaxModels) + `{"id":"m"}]}`} {
		if _, err := decodeModelList([]byte(body)); err == nil {
			t.Fatalf("decodeModelList(%.60q): no error", body)
		}
	}
}

func FuzzDecodeModelList(f *testing.F) {
	f.Add([]byte(`{"object":"list","data":[{"id":"base","parent":null},{"id":"sql","parent":"base"}]}`))
	f.Add([]byte(`{"data":[{"id":"x","parent":""}]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		list, err := decodeModelList(body)
		if err != nil {
			return
		}
		for _, m := range list {
			if routing.ValidateModelName(m.ID) != nil || (m.Parent != "" && routing.ValidateModelName(m.Parent) != nil) {
				t.Fatalf("accepted a bad name: %+v", m.Model)
			}
		}
		if len(list) > routing.MaxModels {
			t.Fatalf("%d entries accepted", len(list))
		}
	})
}
