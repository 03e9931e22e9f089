package h1

import "net/http"

// maxSpareFields bounds the map a connection keeps for its next request: a map that held
// more fields (a client that sent hundreds) is left to the collector rather than kept, and
// cleared, for the connection's life.
const maxSpareFields = 32

// spareHeader is a header map a connection lends to one request at a time, cleared between
// two: a request's header and its answer's each cost a map and its groups otherwise.
//
// It is safe because a request's maps are used only while its handler runs and its answer
// is finished: a handler may not use its ResponseWriter, nor keep its *http.Request's
// Header, after ServeHTTP returned (net/http's contract), and no handler this server serves
// does (transport/openai's handlers, behind replica's closeWhileDraining: they read the
// header's values, never keep the map, and start no goroutine that outlives the request;
// the request context's AfterFunc functions close a worker's connection only).
// TestHeaderMapsDoNotCarryIntoTheNextRequest fails if a field carries over.
type spareHeader struct {
	m http.Header
}

// take returns the spare map, empty, or a new one sized for n fields when there is none;
// the map is the caller's until it gives it back.
func (s *spareHeader) take(n int) http.Header {
	m := s.m
	s.m = nil
	if m == nil {
		m = make(http.Header, n)
	}
	return m
}

// give keeps m, cleared, for the next take, unless it grew past maxSpareFields; nil does
// nothing. m must no longer be used by anyone else.
func (s *spareHeader) give(m http.Header) {
	if m == nil || len(m) > maxSpareFields {
		return
	}
	clear(m)
	s.m = m
}
