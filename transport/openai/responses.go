package openai

import (
	"bytes"
	"context"
	"encoding/json"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/indexer"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// State that lives on a worker. A Responses answer the worker stored (store, the API's
// default) is continued by a later request naming it as previous_response_id, and only that
// worker holds it (vLLM keeps it in its process; elsewhere the id is 404). So the router binds
// the answer's id to its worker as a session (routing.ResponseSession: a key no client
// header can name), through Raft with the session TTL, and routes a request naming it as a
// request of that session, without any session header. The id is the worker's, from its
// answer: the response object's id (whole, or in the stream's response.created event, the
// stream's end from its response.completed event), never the client's. The binding is made before the end of the answer goes to the client,
// so a client cannot have a finished answer whose id is not yet bound; a replica that has not
// applied the binding yet confirms its miss with a read-index round (routing Request.Resume).

// maxResponseEvent bounds a streamed line the watch reads. The end event's data repeats the
// whole answer: it is read only from a stream without SSE event lines (the router then knows
// the end from that line alone), and a longer one leaves its answer unbound.
const maxResponseEvent = 1 << 20

// responseSession is the session key of response id, false for an id that cannot be one
// (empty, too long, not printable ASCII without spaces): such an id is not bound, and a
// request naming it is routed as any other.
func responseSession(id string) (string, bool) {
	key := routing.ResponseSession(id)
	if id == "" || len(key) > maxSessionKey || !printable(id) {
		return "", false
	}
	return key, true
}

// resumes is the session of a request that continues a stored response: the key of its
// previous_response_id, else "" (always "" with Config.NoResponsesAffinity).
func (s *Server) resumes(p *Request) string {
	if s.cfg.NoResponsesAffinity || p.Kind != KindResponses || p.PreviousResponseID == "" {
		return ""
	}
	key, _ := responseSession(p.PreviousResponseID)
	return key
}

// bindsResponse reports whether p's answer is bound to its worker: the worker keeps it
// (store), and Config.NoResponsesAffinity is off.
func (s *Server) bindsResponse(p *Request) bool {
	return !s.cfg.NoResponsesAffinity && p.Kind == KindResponses && p.StoreResponse
}

// responseObject is what the router reads of a Responses answer.
type responseObject struct {
	ID     string `json:"id"`
	Object string `json:"object"`
	Status string `json:"status"`
	// Store is the answer's own word on whether it was stored, when it says (vLLM's does
	// not: it drops the request's store silently unless VLLM_ENABLE_RESPONSES_API_STORE).
	Store *bool `json:"store"`
}

// kept reports whether the worker keeps this answer: a response object that did not fail
// (completed, incomplete, or queued and running in the background) and does not say it was
// not stored.
func (o *responseObject) kept() bool {
	if o.Object != "" && o.Object != "response" || o.Store != nil && !*o.Store {
		return false
	}
	switch o.Status {
	case "completed", "incomplete", "queued", "in_progress":
		return true
	}
	return false
}

// scanResponse reads a whole (non-streamed) Responses answer.
func scanResponse(body []byte) (responseObject, bool) {
	var o responseObject
	if json.Unmarshal(body, &o) != nil || !o.kept() {
		return responseObject{}, false
	}
	return o, true
}

// responseWatch reads a Responses stream as it passes for the event that ends it well
// (response.completed or response.incomplete) and the response id. The id and what the
// answer says of its storing come from the stream's first event (response.created, small);
// the end from the SSE event line that names it, so that the end event's data, which
// repeats the whole answer, need not be read. A stream without event lines has its end
// event's data read instead, up to maxResponseEvent.
type responseWatch struct {
	line    []byte // the current line, while it is of bounded length
	skip    bool   // the current line is dropped (too long)
	done    bool   // the end was found
	created responseObject
}

// Event types the watch reads.
const (
	eventCreated    = "response.created"
	eventCompleted  = "response.completed"
	eventIncomplete = "response.incomplete"
)

// feed reads the next bytes of the stream and returns the response once the event that ends
// it has arrived in them (at most once).
func (w *responseWatch) feed(b []byte) (responseObject, bool) {
	for len(b) > 0 && !w.done {
		i := bytes.IndexByte(b, '\n')
		part := b
		if i >= 0 {
			part = b[:i]
		}
		if !w.skip {
			if len(w.line)+len(part) > maxResponseEvent {
				w.skip, w.line = true, w.line[:0]
			} else {
				w.line = append(w.line, part...)
			}
		}
		if i < 0 {
			break
		}
		if !w.skip {
			if o, ok := w.readLine(bytes.TrimSuffix(w.line, []byte{'\r'})); ok {
				w.done = true
				return o, true
			}
		}
		w.line, w.skip = w.line[:0], false
		b = b[i+1:]
	}
	return responseObject{}, false
}

// readLine reads one whole stream line, and returns the response when it ends the stream well.
func (w *responseWatch) readLine(line []byte) (responseObject, bool) {
	if name, ok := bytes.CutPrefix(line, []byte("event:")); ok {
		switch string(bytes.TrimSpace(name)) {
		case eventCompleted, eventIncomplete:
			if o := w.created; o.ID != "" && (o.Store == nil || *o.Store) {
				o.Status = string(bytes.TrimPrefix(bytes.TrimSpace(name), []byte("response.")))
				return o, true
			}
		}
		return responseObject{}, false
	}
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok || !bytes.Contains(data, []byte(`"response.`)) {
		return responseObject{}, false
	}
	var ev struct {
		Type     string         `json:"type"`
		Response responseObject `json:"response"`
	}
	if json.Unmarshal(data, &ev) != nil {
		return responseObject{}, false
	}
	switch ev.Type {
	case eventCreated:
		if w.created.ID == "" {
			w.created = ev.Response
		}
	case eventCompleted, eventIncomplete:
		if ev.Response.kept() {
			return ev.Response, true
		}
	}
	return responseObject{}, false
}

// keepResponse binds the answer o, which worker w made for call c, to w. The binding is a new
// session of the client's, admitted as one (its rate, its live sessions): past them the
// answer is served unbound, since most clients send store true only because it is the
// API's default and never continue an answer. A binding that cannot be made (no quorum
// within the bind wait, the cap on bindings, an id bound elsewhere) is counted and logged
// (at most every respWarnEvery); the answer still goes to the client, and a request
// continuing it is routed as any other.
func (s *Server) keepResponse(ctx context.Context, c *call, w indexer.Worker, o responseObject) {
	key, ok := responseSession(o.ID)
	if !ok {
		s.metrics.errors.WithLabelValues("response_unbound").Inc()
		s.log.Debug("a response id that cannot be a session key is not bound", "worker", w.String(), "id_bytes", len(o.ID))
		return
	}
	if admit := s.admitNew(c.client); admit != nil {
		if err := admit(); err != nil {
			// Counted in kvrouter_client_limited_total.
			s.log.Debug("a stored response is not bound: its client is past its new-session limits", "worker", w.String(), "error", err)
			return
		}
	}
	b, err := s.router.Pin(ctx, key, w)
	if err != nil {
		s.metrics.errors.WithLabelValues("response_unbound").Inc()
		if ok, left := s.respWarn.Allow("bind", time.Now()); ok && ctx.Err() == nil {
			s.log.Warn("could not bind a stored response to its worker; a request continuing it is routed as any other",
				"worker", w.String(), "response", o.ID, "error", err, "suppressed", left)
		}
		return
	}
	s.madeSession(c.client, false, b)
}

// respWarnEvery spaces the warnings of responses that could not be bound.
const respWarnEvery = 10 * time.Second
