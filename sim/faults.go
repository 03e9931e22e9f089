package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
)

// Faults are the failures a worker injects; they can change while it runs.
type Faults struct {
	// ErrorRate is the share of requests answered 500.
	ErrorRate float64
	// StallRate is the share of requests that hang before their first byte. A draw below
	// ErrorRate is an error, so the stall share is at most 1 - ErrorRate.
	StallRate float64
	// Stall is how long a stall lasts (wall clock); 0 lasts until the client leaves.
	Stall time.Duration
	// Refuse closes every new connection and every request at once, so clients see
	// connection errors. While it is on, POST /sim/faults cannot be reached either: turn it
	// off with SetFaults, or bound it with RefuseFor.
	Refuse bool
	// RefuseFor, when positive, ends Refuse by itself after this long (wall clock).
	RefuseFor time.Duration
}

// Validate reports the fields of f that are out of range.
func (f Faults) Validate() error {
	var errs []error
	for _, r := range []struct {
		name string
		v    float64
	}{{"error rate", f.ErrorRate}, {"stall rate", f.StallRate}} {
		if math.IsNaN(r.v) || r.v < 0 || r.v > 1 {
			errs = append(errs, fmt.Errorf("%s %v: must be in [0, 1]", r.name, r.v))
		}
	}
	if f.Stall < 0 {
		errs = append(errs, fmt.Errorf("stall %v: must not be negative", f.Stall))
	}
	if f.RefuseFor < 0 {
		errs = append(errs, fmt.Errorf("refuse for %v: must not be negative", f.RefuseFor))
	}
	return errors.Join(errs...)
}

// faultsWire is the JSON of /sim/faults: durations as Go duration strings, and absent
// fields left as they are on update.
type faultsWire struct {
	ErrorRate *float64 `json:"error_rate,omitempty"`
	StallRate *float64 `json:"stall_rate,omitempty"`
	Stall     *string  `json:"stall,omitempty"`
	Refuse    *bool    `json:"refuse,omitempty"`
	RefuseFor *string  `json:"refuse_for,omitempty"`
}

func (f Faults) wire() faultsWire {
	stall, refuseFor := f.Stall.String(), f.RefuseFor.String()
	return faultsWire{
		ErrorRate: &f.ErrorRate, StallRate: &f.StallRate, Stall: &stall,
		Refuse: &f.Refuse, RefuseFor: &refuseFor,
	}
}

// applyFaultsJSON returns cur updated by the fields present in body.
func applyFaultsJSON(cur Faults, body []byte) (Faults, error) {
	var w faultsWire
	if err := json.Unmarshal(body, &w); err != nil {
		_, msg := jsonerr.Describe(err)
		return cur, errors.New("faults: " + msg)
	}
	if w.ErrorRate != nil {
		cur.ErrorRate = *w.ErrorRate
	}
	if w.StallRate != nil {
		cur.StallRate = *w.StallRate
	}
	if w.Refuse != nil {
		cur.Refuse = *w.Refuse
	}
	for _, d := range []struct {
		src *string
		dst *time.Duration
	}{{w.Stall, &cur.Stall}, {w.RefuseFor, &cur.RefuseFor}} {
		if d.src == nil {
			continue
		}
		v, err := time.ParseDuration(*d.src)
		if err != nil {
			return cur, fmt.Errorf("faults: %w", err)
		}
		*d.dst = v
	}
	if err := cur.Validate(); err != nil {
		return cur, fmt.Errorf("faults: %w", err)
	}
	return cur, nil
}

// faultKind is the outcome of one request's fault draw.
type faultKind uint8

const (
	faultNone faultKind = iota
	faultError
	faultStall
)

// refusingListener closes connections as soon as they are accepted while refusing says so.
type refusingListener struct {
	net.Listener
	refusing func() bool
}

// Accept returns the next connection the worker is willing to serve.
func (l refusingListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if !l.refusing() {
			return c, nil
		}
		abortConn(c)
	}
}

// abortConn closes c with a reset rather than a clean FIN, as a dead process would look.
func abortConn(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}
