package discovery

import (
	"sync"
	"time"
)

// SourceStatus is how one source's looks went on the replica that runs the duty (the leader).
type SourceStatus struct {
	// Source is the source's name (its flag value).
	Source string
	// LastGood is when its last good look was (zero: none in this term).
	LastGood time.Time
	// FailingSince is when its looks started to fail (zero: the last look was good, or
	// there was none yet).
	FailingSince time.Time
	// Failures is how many looks in a row failed.
	Failures int
	// LastError is the last failed look's error ("" while the looks are good).
	LastError string
	// SuspectDrains is how many drains the suspect rule holds now.
	SuspectDrains int
}

// Duty is the discovery leader duty Start registered; Status tells how its sources are doing.
// A nil Duty is no discovery at all.
type Duty struct {
	names []string

	mu      sync.Mutex
	running bool
	status  map[string]SourceStatus
}

func newDuty(sources []Source) *Duty {
	d := &Duty{status: map[string]SourceStatus{}}
	for _, s := range sources {
		d.names = append(d.names, s.Name())
	}
	return d
}

// Sources names the configured sources, in the order they were given.
func (d *Duty) Sources() []string {
	if d == nil {
		return nil
	}
	return append([]string(nil), d.names...)
}

// Status reports whether the duty runs on this replica now (it leads) and, if it does, each
// source's status in the order the sources were given. A replica that does not lead has no
// status to give: the leader's looks are the ones that count.
func (d *Duty) Status() (running bool, sources []SourceStatus) {
	if d == nil {
		return false, nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.running {
		return false, nil
	}
	for _, n := range d.names {
		st := d.status[n]
		st.Source = n
		sources = append(sources, st)
	}
	return true, sources
}

// begin starts a term: what an earlier term saw is forgotten, as the term's own state is.
func (d *Duty) begin() {
	if d == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.running = true
	d.status = map[string]SourceStatus{}
}

// end ends a term.
func (d *Duty) end() {
	if d == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.running = false
}

// update changes source's status under the lock.
func (d *Duty) update(source string, fn func(*SourceStatus)) {
	if d == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	st := d.status[source]
	fn(&st)
	d.status[source] = st
}

// looked records a look at source at now: good when err is nil.
func (d *Duty) looked(source string, now time.Time, err error) {
	d.update(source, func(st *SourceStatus) {
		if err == nil {
			st.LastGood, st.FailingSince, st.Failures, st.LastError = now, time.Time{}, 0, ""
			return
		}
		if st.Failures == 0 {
			st.FailingSince = now
		}
		st.Failures++
		st.LastError = err.Error()
	})
}

// held records how many drains the suspect rule holds for source.
func (d *Duty) held(source string, n int) {
	d.update(source, func(st *SourceStatus) { st.SuspectDrains = n })
}
