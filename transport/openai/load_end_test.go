package openai

import (
	"bufio"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// TestAStreamEndsItsLoadBeforeTheClientReadsItsEnd: by the time a client has read a
// stream's [DONE], the request counts no more on its worker, even while the worker's
// connection is still open past the end: a next turn sent at once must find the worker free.
// (A whole answer's load ends before its body is written too, as the proxy calls Complete
// first; there the proxy's Finish right after the write usually wins the race with the
// client's read, so no test of it could fail reliably without that order.)
func TestAStreamEndsItsLoadBeforeTheClientReadsItsEnd(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		hold := make(chan struct{})
		w0 := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
			rc := http.NewResponseController(w)
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n")
			_ = rc.Flush()
			_, _ = io.WriteString(w, "data: [DONE]\n\n")
			_ = rc.Flush()
			select { // the connection stays open past the end
			case <-hold:
			case <-r.Context().Done():
			}
		})
		t.Cleanup(func() { close(hold) })
		rg := newRig(t, []routing.WorkerSpec{spec("w0", w0.URL)}, rigOptions{server: server})
		req, _ := http.NewRequest(http.MethodPost, rg.front.URL+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
		resp, err := rg.front.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() && sc.Text() != "data: [DONE]" {
		}
		if sc.Err() != nil {
			t.Fatal(sc.Err())
		}
		if !rg.idle() {
			t.Fatalf("the client has read the end and the worker still counts: %+v", rg.tracker.Snapshot())
		}
	})
}
