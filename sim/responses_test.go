package sim

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// TestResponsesStateLivesOnTheWorker: a stored answer continues on the worker that made it
// (its conversation is the follow-up's prefix, so it is cached), and is unknown elsewhere,
// unstored, or never made: 404 in vLLM's words.
func TestResponsesStateLivesOnTheWorker(t *testing.T) {
	_, a := newTestWorker(t, Config{ID: "a"})
	_, b := newTestWorker(t, Config{ID: "b"})
	type answer struct {
		ID    string `json:"id"`
		Store bool   `json:"store"`
		Usage struct {
			Input   int `json:"input_tokens"`
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"input_tokens_details"`
		} `json:"usage"`
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
		} `json:"error"`
	}
	send := func(base string, body map[string]any) (int, answer) {
		t.Helper()
		body["model"] = DefaultModel
		body["max_output_tokens"] = 4
		status, _, raw := post(t, t.Context(), http.DefaultClient, base+"/v1/responses", body)
		if b, ok := body["stream"].(bool); ok && b && status == http.StatusOK {
			// The answer of a stream is its response.completed event's response.
			i := strings.LastIndex(string(raw), "event: response.completed\ndata: ")
			if i < 0 {
				t.Fatalf("stream without response.completed: %s", raw)
			}
			line := string(raw[i+len("event: response.completed\ndata: "):])
			line = line[:strings.IndexByte(line, '\n')]
			var ev struct {
				Response answer `json:"response"`
			}
			if err := json.Unmarshal([]byte(line), &ev); err != nil {
				t.Fatalf("completed event: %v", err)
			}
			return status, ev.Response
		}
		var ans answer
		if err := json.Unmarshal(raw, &ans); err != nil {
			t.Fatalf("answer %s: %v", raw, err)
		}
		return status, ans
	}
	long := strings.Repeat("a long instruction that makes a prefix of many blocks. ", 20)
	status, first := send(a.URL, map[string]any{"input": long})
	if status != http.StatusOK || first.ID == "" || !first.Store {
		t.Fatalf("first turn: %d %+v", status, first)
	}
	for _, stream := range []bool{false, true} {
		status, next := send(a.URL, map[string]any{"input": "and then?", "previous_response_id": first.ID, "stream": stream})
		if status != http.StatusOK {
			t.Fatalf("stream %v: follow-up on its worker: %d %+v", stream, status, next)
		}
		if next.Usage.Input <= first.Usage.Input || next.Usage.Details.Cached < first.Usage.Input/2 {
			t.Errorf("stream %v: follow-up prompt %d tokens, %d cached: the previous turn's %d tokens are not its cached prefix",
				stream, next.Usage.Input, next.Usage.Details.Cached, first.Usage.Input)
		}
	}
	_, unstored := send(a.URL, map[string]any{"input": "forget me", "store": false})
	for _, tc := range []struct {
		name, base, id string
	}{
		{"another worker", b.URL, first.ID},
		{"not stored", a.URL, unstored.ID},
		{"never made", a.URL, "resp-nobody-1"},
	} {
		status, ans := send(tc.base, map[string]any{"input": "more", "previous_response_id": tc.id})
		want := "Response with id '" + tc.id + "' not found."
		if status != http.StatusNotFound || ans.Error.Message != want || ans.Error.Type != "invalid_request_error" {
			t.Errorf("%s: %d %+v, want 404 %q", tc.name, status, ans.Error, want)
		}
	}
}
