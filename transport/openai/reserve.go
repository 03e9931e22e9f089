package openai

import (
	"crypto/rand"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// The decision service's reserving side, for whatever carries the bytes instead of the
// router (a load balancer's script, a gateway): POST /v1/reserve routes a request as the
// proxy would (the session bound, the load counted, the decision recorded in the index and
// gossiped) without dispatching it, and DELETE /v1/reservations/{id} ends it when the
// request is over. A reservation that is not released ends by itself after its TTL. It
// lives on the replica that made it: the release must reach the same replica (the answer
// names it). Its load counts as prefill until its release, since nothing tells the replica
// when the first token came.

// reservation is one reserved decision waiting for its release.
type reservation struct {
	held  *Held
	timer *time.Timer
	// client is the key of the client that made it (limits.go).
	client string
}

// reservations are a front's open reservations by id.
type reservations struct {
	mu   sync.Mutex
	open map[string]*reservation
	// taken counts the open reservations and those being made, so that concurrent calls
	// cannot open more than the bound between its check and their insertion; byClient
	// counts them by client (only clients with some, so it is bounded by taken).
	taken    int
	byClient map[string]int
}

// reserveAnswer is POST /v1/reserve's answer: the routing answer, the reservation's id, and
// how long it lasts unreleased.
type reserveAnswer struct {
	routeAnswer
	// DPSize is the worker's number of data-parallel ranks: the rank goes to it (in
	// X-Data-Parallel-Rank) only when it has more than one.
	DPSize           int     `json:"dp_size"`
	Reservation      string  `json:"reservation"`
	Replica          string  `json:"replica"`
	ExpiresInSeconds float64 `json:"expires_in_s"`
}

// serveReserve routes the request in the body, reserving the decision until its release.
func (s *Server) serveReserve(w *recorder, r *http.Request) {
	body, apiErr := s.readBody(w, r)
	if apiErr != nil || body == nil {
		s.fail(w, r, apiErr)
		return
	}
	// ?path= names the API the body is for (/v1/messages, ...), as a proxied request's own
	// path would; without it the body says (chat or completion).
	path := r.URL.Query().Get("path")
	if _, ok := KindOfPath(path); path != "" && !ok {
		s.fail(w, r, invalid("path", "path "+strconv.Quote(path)+" is not an API the router routes"))
		return
	}
	client := s.clientKey(r.Header, r.RemoteAddr)
	if apiErr := s.takeReservation(client); apiErr != nil {
		s.fail(w, r, apiErr)
		return
	}
	held, apiErr := s.hold(r.Context(), r.Header, body, HoldOptions{Path: path, Peer: r.RemoteAddr})
	if held == nil {
		s.untakeReservation(client)
		s.fail(w, r, apiErr)
		return
	}
	id := rand.Text()
	res := &reservation{held: held, client: client}
	s.res.mu.Lock()
	if s.res.open == nil {
		s.res.open = map[string]*reservation{}
	}
	s.res.open[id] = res
	res.timer = time.AfterFunc(s.cfg.ReservationTTL, func() {
		if s.endReservation(id, 0, false) {
			s.metrics.reservations.WithLabelValues("expired").Inc()
		}
	})
	s.res.mu.Unlock()
	s.metrics.reservations.WithLabelValues("reserved").Inc()
	ans := reserveAnswer{routeAnswer: routeAnswerOf(held.Decision, held.Session, held.Plan, held.Prefill),
		Reservation: id, Replica: s.cfg.ReplicaID, ExpiresInSeconds: s.cfg.ReservationTTL.Seconds()}
	if spec := held.Decision.Target.Spec; spec != nil {
		ans.DPSize = max(spec.DPSize, 1)
	}
	writeJSON(w, http.StatusOK, ans)
}

// serveRelease ends a reservation: ?completed=true (the worker finished the request whole)
// with &output_tokens=N records the prompt and its answer's blocks again, as the proxy does
// at the end of an answer; without it the load is freed and nothing more recorded.
func (s *Server) serveRelease(w *recorder, r *http.Request) {
	q := r.URL.Query()
	completed := q.Get("completed") == "true"
	out := 0
	if v := q.Get("output_tokens"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			s.fail(w, r, &Error{Status: http.StatusBadRequest, Message: "output_tokens must be a non-negative integer",
				Type: TypeInvalidRequest, Param: "output_tokens", Code: "invalid_value"})
			return
		}
		out = n
	}
	if !s.endReservation(r.PathValue("id"), out, completed) {
		s.fail(w, r, &Error{Status: http.StatusNotFound, Message: "no open reservation " + strconv.Quote(r.PathValue("id")) +
			" on this replica (released, expired, or made on another replica)", Type: TypeNotFound, Code: "unknown_reservation"})
		return
	}
	s.metrics.reservations.WithLabelValues("released").Inc()
	w.WriteHeader(http.StatusNoContent)
}

// endReservation ends the open reservation id, reporting whether there was one.
func (s *Server) endReservation(id string, outputTokens int, completed bool) bool {
	s.res.mu.Lock()
	res := s.res.open[id]
	if res == nil {
		s.res.mu.Unlock()
		return false
	}
	delete(s.res.open, id)
	s.res.mu.Unlock()
	s.untakeReservation(res.client)
	res.timer.Stop()
	res.held.End(completed, outputTokens)
	return true
}

// takeReservation counts a reservation being made by client, or answers 429: past the
// open reservations of the replica or of the client, or past the client's rate.
func (s *Server) takeReservation(client string) *Error {
	perClient := s.cfg.ClientLimits.MaxReservations
	s.res.mu.Lock()
	full := s.res.taken >= s.cfg.MaxReservations
	mine := perClient > 0 && s.res.byClient[client] >= perClient
	if !full && !mine {
		s.res.taken++
		if s.res.byClient == nil {
			s.res.byClient = map[string]int{}
		}
		s.res.byClient[client]++
	}
	s.res.mu.Unlock()
	switch {
	case full:
		return &Error{Status: http.StatusTooManyRequests, Message: strconv.Itoa(s.cfg.MaxReservations) + " reservations are open; release some",
			Type: TypeUnavailable, Code: "too_many_reservations", RetryAfter: "1", Cause: "reservations_full"}
	case mine:
		s.metrics.clientLimited.WithLabelValues("open_reservations").Inc()
		return &Error{Status: http.StatusTooManyRequests, Type: TypeRateLimit, Code: "client_reservations_full",
			Message:    "this client has " + strconv.Itoa(perClient) + " reservations open on this replica; release some",
			RetryAfter: "1", Cause: "client_limited"}
	}
	if apiErr := s.admit(client, limitedReservation); apiErr != nil {
		s.untakeReservation(client)
		return apiErr
	}
	return nil
}

// untakeReservation uncounts a reservation of client that ended or was never made.
func (s *Server) untakeReservation(client string) {
	s.res.mu.Lock()
	defer s.res.mu.Unlock()
	s.res.taken--
	if n := s.res.byClient[client] - 1; n > 0 {
		s.res.byClient[client] = n
	} else {
		delete(s.res.byClient, client)
	}
}

// closeReservations ends every open reservation (the front is closing).
func (s *Server) closeReservations() {
	s.res.mu.Lock()
	ids := make([]string, 0, len(s.res.open))
	for id := range s.res.open {
		ids = append(ids, id)
	}
	s.res.mu.Unlock()
	for _, id := range ids {
		s.endReservation(id, 0, false)
	}
}
