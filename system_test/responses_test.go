package system_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// turn is what one Responses request got.
type turn struct {
	status          int
	worker, replica string
	id              string // the response's id ("" for an error)
	body            string // an error's body
	input, cached   int    // prompt tokens and those the worker had cached
	stream          bool
}

// respond sends one Responses request to r, continuing previous ("" for none), with no
// session header, streamed or not, and reads the response's id and usage.
func respond(ctx context.Context, r *replica, previous, input string, stream bool) (turn, error) {
	req := map[string]any{"model": sim.DefaultModel, "input": input, "max_output_tokens": 4, "stream": stream}
	if previous != "" {
		req["previous_response_id"] = previous
	}
	raw, _ := json.Marshal(req)
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+r.Client+"/v1/responses", strings.NewReader(string(raw)))
	if err != nil {
		return turn{}, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := httpClient.Do(hreq)
	if err != nil {
		return turn{}, err
	}
	defer resp.Body.Close()
	t := turn{status: resp.StatusCode, worker: resp.Header.Get("X-Kvrouter-Worker"), replica: resp.Header.Get("X-Kvrouter-Replica"),
		stream: stream}
	var obj struct {
		ID    string `json:"id"`
		Usage struct {
			Input   int `json:"input_tokens"`
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"input_tokens_details"`
		} `json:"usage"`
	}
	switch {
	case resp.StatusCode != http.StatusOK:
		b, _ := io.ReadAll(resp.Body)
		t.body = string(b)
		return t, nil
	case stream:
		// The stream's answer is its response.completed event's response.
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok || !strings.Contains(data, `"response.completed"`) {
				continue
			}
			var ev struct {
				Response json.RawMessage `json:"response"`
			}
			if err := json.Unmarshal([]byte(data), &ev); err != nil {
				return t, fmt.Errorf("response.completed: %w", err)
			}
			if err := json.Unmarshal(ev.Response, &obj); err != nil {
				return t, fmt.Errorf("response.completed's response: %w", err)
			}
		}
		if err := sc.Err(); err != nil {
			return t, fmt.Errorf("read stream: %w", err)
		}
	default:
		if err := json.NewDecoder(resp.Body).Decode(&obj); err != nil {
			return t, fmt.Errorf("read answer: %w", err)
		}
	}
	if obj.ID == "" {
		return t, fmt.Errorf("an answer from %s without a response id", t.worker)
	}
	t.id, t.input, t.cached = obj.ID, obj.Usage.Input, obj.Usage.Details.Cached
	return t, nil
}

// TestAResponsesConversationFollowsItsStateThroughAnyReplica: five turns of a Responses
// conversation chained by previous_response_id, with no session header, each through
// another replica of three, streamed and not, in front of four workers that keep their
// answers as vLLM does (any other worker answers 404): every turn lands on the worker that
// stored its predecessor, and a SIGKILL of the leader between turns changes nothing.
func TestAResponsesConversationFollowsItsStateThroughAnyReplica(t *testing.T) {
	fl := startFleet(t, 4)
	// A new leader's election on a loaded machine can take more than the default 3 s bind
	// wait; the binding of the turn after the kill waits for it.
	c := startCluster(t, 3, fl, "--bind-wait", "15s")
	leader := c.leader()
	followers := c.others(leader)
	// Turns 1 and 2 through a follower and the leader; the leader dies; turns 3 to 5 through
	// the two survivors in turn.
	via := []*replica{followers[0], leader, followers[1], followers[0], followers[1]}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	var turns []turn
	prev := ""
	for i, r := range via {
		if i == 2 {
			c.kill(leader)
			t.Logf("killed the leader %s after turn 2", leader.ID)
		}
		input := fmt.Sprintf("turn %d: %s", i+1, strings.Repeat(fmt.Sprintf("more words for turn %d. ", i+1), 8))
		sent := time.Now()
		tr, err := respond(ctx, r, prev, input, i%2 == 1)
		took := time.Since(sent)
		if err != nil {
			t.Fatalf("turn %d via %s: %v", i+1, r.ID, err)
		}
		turns = append(turns, tr)
		if tr.status != http.StatusOK {
			t.Fatalf("turn %d via %s (previous %q): status %d on %s: %s", i+1, r.ID, prev, tr.status, tr.worker, tr.body)
		}
		// The time is a figure for the record (the turn after the kill waits for a new
		// leader to bind its answer), not asserted.
		t.Logf("turn %d via %s on %s (streamed %v) in %v: %s, %d of %d prompt tokens cached", i+1, tr.replica, tr.worker, tr.stream,
			took.Round(time.Millisecond), tr.id, tr.cached, tr.input)
		prev = tr.id
	}
	for i, tr := range turns[1:] {
		if tr.worker != turns[0].worker {
			t.Errorf("turn %d on %s, not on %s, the worker that stored its predecessor", i+2, tr.worker, turns[0].worker)
		}
		if tr.cached == 0 {
			t.Errorf("turn %d found none of its conversation cached on %s", i+2, tr.worker)
		}
		if tr.replica == turns[i].replica {
			t.Errorf("turns %d and %d both through %s: the test means each through another replica", i+1, i+2, tr.replica)
		}
	}
}
