package openai

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// reserve asks the rig's front for a reservation and decodes the answer.
func (r *rig) reserve(body string, hdr map[string]string) (*http.Response, reserveAnswer) {
	r.t.Helper()
	resp, b := r.post("/v1/reserve", body, hdr)
	var ans reserveAnswer
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal([]byte(b), &ans); err != nil {
			r.t.Fatalf("reserve answer %s: %v", b, err)
		}
	}
	return resp, ans
}

// TestReservationHoldsTheDecisionUntilItsRelease: a reservation names a worker and counts
// its load there without dispatching anything; its release frees the load and, for a
// completed request, records it again; a second release, or one of an unknown id, is 404.
func TestReservationHoldsTheDecisionUntilItsRelease(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0, w1 := newFakeWorker(t, okJSON), newFakeWorker(t, okJSON)
		rg := newRig(t, specsOf(w0, w1), rigOptions{server: server})
		resp, ans := rg.reserve(completionBody, nil)
		if resp.StatusCode != http.StatusOK || ans.Reservation == "" || (ans.Worker != "w0" && ans.Worker != "w1") || ans.Replica != "replica-1" {
			t.Fatalf("reserve: %d %+v", resp.StatusCode, ans)
		}
		if rg.idle() {
			t.Fatal("a reservation counts no load")
		}
		if w0.requests()+w1.requests() != 0 {
			t.Fatal("a reservation dispatched the request")
		}
		if got := rg.metric("kvrouter_reservations_total", map[string]string{"event": "reserved"}); got != 1 {
			t.Fatalf("reserved count %v", got)
		}
		resp, body := rg.do(t.Context(), http.MethodDelete, "/v1/reservations/"+ans.Reservation+"?completed=true&output_tokens=40", "", nil)
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("release: %d %s", resp.StatusCode, body)
		}
		if !rg.idle() {
			t.Fatalf("load left after the release: %v", rg.tracker.Snapshot())
		}
		resp, body = rg.do(t.Context(), http.MethodDelete, "/v1/reservations/"+ans.Reservation, "", nil)
		if resp.StatusCode != http.StatusNotFound || errorOf(t, body).Code != "unknown_reservation" {
			t.Fatalf("second release: %d %s", resp.StatusCode, body)
		}
		resp, body = rg.do(t.Context(), http.MethodDelete, "/v1/reservations/x?output_tokens=-1", "", nil)
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("bad output_tokens: %d %s", resp.StatusCode, body)
		}
	})
}

// TestReservationBindsItsSession: a session's reservations name one worker, as its
// proxied requests would.
func TestReservationBindsItsSession(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		rg := newRig(t, specsOf(newFakeWorker(t, okJSON), newFakeWorker(t, okJSON), newFakeWorker(t, okJSON)), rigOptions{server: server})
		hdr := map[string]string{"X-Session-ID": "lua-1"}
		_, first := rg.reserve(completionBody, hdr)
		if first.BindingRevision == 0 {
			t.Fatalf("first reservation did not bind: %+v", first)
		}
		for i := range 5 {
			resp, ans := rg.reserve(fmt.Sprintf(`{"model":"m","prompt":"turn %d"}`, i), hdr)
			if resp.StatusCode != http.StatusOK || ans.Worker != first.Worker || !ans.Bound {
				t.Fatalf("turn %d: %d %+v, want bound to %s", i, resp.StatusCode, ans, first.Worker)
			}
		}
	})
}

// TestUnreleasedReservationExpires: a reservation nobody releases frees its load after its
// TTL.
func TestUnreleasedReservationExpires(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		rg := newRig(t, specsOf(newFakeWorker(t, okJSON)), rigOptions{server: server, front: func(c *Config) { c.ReservationTTL = 50 * time.Millisecond }})
		if resp, _ := rg.reserve(completionBody, nil); resp.StatusCode != http.StatusOK {
			t.Fatalf("reserve: %d", resp.StatusCode)
		}
		poll.Until(t, 10*time.Second, func() error {
			if !rg.idle() {
				return fmt.Errorf("load left: %v", rg.tracker.Snapshot())
			}
			return nil
		})
		if got := rg.metric("kvrouter_reservations_total", map[string]string{"event": "expired"}); got != 1 {
			t.Fatalf("expired count %v", got)
		}
	})
}

// TestReservationsAreBounded: past MaxReservations open ones, a reservation is refused with
// 429 and changes nothing.
func TestReservationsAreBounded(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		rg := newRig(t, specsOf(newFakeWorker(t, okJSON)), rigOptions{server: server, front: func(c *Config) { c.MaxReservations = 2 }})
		for range 2 {
			if resp, _ := rg.reserve(completionBody, nil); resp.StatusCode != http.StatusOK {
				t.Fatalf("reserve: %d", resp.StatusCode)
			}
		}
		before := rg.tracker.Snapshot()
		resp, body := rg.post("/v1/reserve", completionBody, nil)
		if resp.StatusCode != http.StatusTooManyRequests || errorOf(t, body).Code != "too_many_reservations" {
			t.Fatalf("third reservation: %d %s", resp.StatusCode, body)
		}
		if after := rg.tracker.Snapshot(); fmt.Sprint(after) != fmt.Sprint(before) {
			t.Fatalf("a refused reservation changed the load: %v -> %v", before, after)
		}
	})
}

// specsOf names fake workers w0, w1, ... in order.
func specsOf(ws ...*fakeWorker) []routing.WorkerSpec {
	out := make([]routing.WorkerSpec, len(ws))
	for i, w := range ws {
		out[i] = spec(fmt.Sprintf("w%d", i), w.URL)
	}
	return out
}

// TestReservationTakesTheAPIPath: ?path= names the API a body is for, so that a balancer can
// reserve Messages, Responses and Embeddings requests too; a path the router does not route is
// 400 and holds nothing. The answer says the worker's data-parallel size.
func TestReservationTakesTheAPIPath(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		w0 := newFakeWorker(t, okJSON)
		rg := newRig(t, specsOf(w0), rigOptions{server: server})
		messages := `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`
		resp, b := rg.post("/v1/reserve?path=/v1/messages", messages, nil)
		var ans reserveAnswer
		if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(b), &ans) != nil || ans.Worker != "w0" || ans.DPSize != 1 {
			t.Fatalf("reserve a Messages body: %d %s", resp.StatusCode, b)
		}
		// Without the path, the same body is read as a chat request, which it is not.
		if resp, b := rg.post("/v1/reserve", `{"model":"m","input":"hi"}`, nil); resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("a Responses body without its path: %d %s", resp.StatusCode, b)
		}
		if resp, b := rg.post("/v1/reserve?path=/v1/nope", messages, nil); resp.StatusCode != http.StatusBadRequest || errorOf(t, b).Param != "path" {
			t.Fatalf("unknown path: %d %s", resp.StatusCode, b)
		}
		if resp, b := rg.do(t.Context(), http.MethodDelete, "/v1/reservations/"+ans.Reservation, "", nil); resp.StatusCode != http.StatusNoContent {
			t.Fatalf("release: %d %s", resp.StatusCode, b)
		}
		if !rg.idle() {
			t.Fatalf("load left: %v", rg.tracker.Snapshot())
		}
	})
}
