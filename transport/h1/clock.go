package h1

import "time"

// A connection's phase, which its serve goroutine and the server's clock move it through.
// The phase and the time its wait ends (or its watch starts) are one atomic word, so that
// the clock changes a connection only in the phase it read: a move of the serve goroutine
// and the clock's expiry cannot both happen.
const (
	// phaseIdle: waiting for the next request's first byte (serve reads).
	phaseIdle uint64 = iota
	// phaseHead: reading a request's head.
	phaseHead
	// phaseBody: the handler runs and its body is not read to the end (the body's deadline).
	phaseBody
	// phaseHandling: the handler runs, its body read; the clock starts a watch at its time.
	phaseHandling
	// phasePipelined: the handler runs and the next request is already buffered: not watched
	// (net/http's watch stops there too).
	phasePipelined
	// phaseWatched: the handler runs and the watcher reads the connection.
	phaseWatched
	// phaseWatchedIdle: the answer is out; the watcher's read is the wait for the next request.
	phaseWatchedIdle
	// phaseExpired: the clock ended a wait (or Shutdown an idle connection): every read of
	// the connection fails from now on.
	phaseExpired
	// phaseClosed: the connection is ending.
	phaseClosed

	phaseBits = 4
	phaseMask = 1<<phaseBits - 1
)

// state packs a phase and a time in unix milliseconds (0: none).
func state(phase uint64, atMs int64) uint64 { return uint64(atMs)<<phaseBits | phase }

func phaseOf(s uint64) uint64 { return s & phaseMask }

func timeOf(s uint64) int64 { return int64(s >> phaseBits) }

// DefaultTick is Config.Tick's default.
const DefaultTick = 10 * time.Millisecond

// nowMs is the server's clock in unix milliseconds, as its last tick read it: a phase's
// time costs an atomic load, not a clock read, and is late by a tick at most.
func (s *Server) nowMs() int64 { return s.clock.Load() }

// after is the time d from now on the server's clock (0, none, for d == 0), a tick later
// than that: the clock is late by a tick at most, so a wait is never cut short, and ends
// within two ticks after its time.
func (s *Server) after(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return s.nowMs() + (d + s.cfg.Tick).Milliseconds()
}

// phases is a set of phases, for move.
func phases(ps ...uint64) uint64 {
	var set uint64
	for _, p := range ps {
		set |= 1 << p
	}
	return set
}

// move changes c's phase, when it is one of the set from (phases), to to, with to's time
// at; false when it is not, or when the clock (or Shutdown) changed it first, which ends the
// request or the connection.
func (c *conn) move(from, to uint64, at int64) bool {
	old := c.state.Load()
	if from&(1<<phaseOf(old)) == 0 {
		return false
	}
	return c.state.CompareAndSwap(old, state(to, at))
}

// runClock is the server's clock: every tick it reads the time and, for each connection,
// ends a wait past its time (the idle, head and body timeouts: a read under a deadline
// that has passed fails at once) and starts the hang-up watch of a handler that has run
// for a tick. A request answered within a tick, the common case at load, so costs no
// deadline, no timer, no clock read and no second goroutine. It stops while the server has
// no connection, and returns when the server is closed, or shut down with none left.
func (s *Server) runClock() {
	t := time.NewTicker(s.cfg.Tick)
	defer t.Stop()
	for {
		s.mu.Lock()
		now := s.nowMs()
		for c := range s.conns {
			c.tick(now)
		}
		left, shutting := len(s.conns), s.shutting.Load()
		s.mu.Unlock()
		if left == 0 {
			// With no connection the clock stops until the next one (newConn reads the
			// time again) or the end.
			if shutting {
				return
			}
			t.Stop()
			select {
			case <-s.base.Done():
				return
			case <-s.wake:
			}
			t.Reset(s.cfg.Tick)
			continue
		}
		select {
		case <-s.base.Done():
			return
		case now := <-t.C:
			s.setClock(now)
		}
	}
}

// tick is the clock's look at c at now.
func (c *conn) tick(now int64) {
	st := c.state.Load()
	at := timeOf(st)
	if at == 0 || now < at {
		return
	}
	switch phaseOf(st) {
	case phaseIdle, phaseHead, phaseBody, phaseWatchedIdle:
		c.expire(st)
	case phaseHandling:
		if c.state.CompareAndSwap(st, state(phaseWatched, 0)) {
			c.startWatch()
		}
	}
}

// expire ends c's wait if c is still in st: its reads fail from now on.
func (c *conn) expire(st uint64) {
	if c.state.CompareAndSwap(st, state(phaseExpired, 0)) {
		_ = c.rwc.SetReadDeadline(aLongTimeAgo)
	}
}

// expireIdle ends c's wait for a next request (Shutdown's close of an idle connection). A
// failed move is one out of the idle phases: a request came, or the clock expired it.
func (c *conn) expireIdle() {
	if c.move(phases(phaseIdle, phaseWatchedIdle), phaseExpired, 0) {
		_ = c.rwc.SetReadDeadline(aLongTimeAgo)
	}
}
