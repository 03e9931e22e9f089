package sim

import (
	"net/http"
	"slices"
	"sync"
)

// State that lives on a worker: vLLM keeps a Responses answer in its own process (when its
// store is on), so that a later request naming it as previous_response_id continues the
// conversation there; on any other worker the id is unknown and the request gets 404. The
// simulator does the same, in memory, bounded (vLLM's store is not: it never forgets).

// maxStoredResponses bounds the responses a simulated worker keeps; the oldest goes first.
const maxStoredResponses = 1 << 16

// responseTurn is a Responses request's place in its conversation.
type responseTurn struct {
	// previous is the previous_response_id the request continues ("" for none).
	previous string
	// instructions counts the leading system message the request's instructions make (0 or 1).
	instructions int
	// msgs are the request's messages: its instructions and input, and once resumed the
	// previous response's conversation between them, as vLLM orders them.
	msgs      []ChatMessage
	maxTokens *int64
	stream    *bool
	// store: the answer is kept for a later previous_response_id (the API's default).
	store bool
}

// responseStore is a worker's stored responses: each one's whole conversation, its answer
// last.
type responseStore struct {
	mu    sync.Mutex
	byID  map[string][]ChatMessage
	order []string // ids, oldest first
}

// resume puts the previous response's conversation into req's prompt, or answers 404 for an
// id this worker does not hold, in vLLM's words.
func (s *responseStore) resume(req *genRequest, maxModelLen int) (*genRequest, *apiError) {
	t := req.turn
	if t.previous == "" {
		return req, nil
	}
	s.mu.Lock()
	prev, ok := s.byID[t.previous]
	s.mu.Unlock()
	if !ok {
		return nil, &apiError{status: http.StatusNotFound, typ: "invalid_request_error",
			message: "Response with id '" + t.previous + "' not found."}
	}
	msgs := slices.Concat(t.msgs[:t.instructions], prev, t.msgs[t.instructions:])
	next, aerr := genFrom(req.model, msgs, t.maxTokens, t.stream, "max_output_tokens", maxModelLen)
	if aerr != nil {
		return nil, aerr
	}
	t.msgs = msgs
	next.turn = t
	next.cacheSalt = req.cacheSalt
	return next, nil
}

// keep stores the conversation msgs answered by text as response id.
func (s *responseStore) keep(id string, msgs []ChatMessage, text string) {
	conv := append(slices.Clip(msgs), ChatMessage{Role: "assistant", Content: text})
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.byID == nil {
		s.byID = make(map[string][]ChatMessage)
	}
	if _, ok := s.byID[id]; !ok {
		if len(s.order) >= maxStoredResponses {
			delete(s.byID, s.order[0])
			s.order = s.order[1:]
		}
		s.order = append(s.order, id)
	}
	s.byID[id] = conv
}

// len is how many responses are stored.
func (s *responseStore) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.byID)
}
