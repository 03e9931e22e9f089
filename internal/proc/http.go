package proc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// pollInterval is how often WaitReady asks again.
const pollInterval = 50 * time.Millisecond

// StatusError is an answer other than 200 OK.
type StatusError struct {
	// Code is the HTTP status code.
	Code int
	// Body is the start of the answer's body, trimmed.
	Body string
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("status %d: %.200s", e.Code, e.Body)
}

// Get fetches url with hc (http.DefaultClient when nil) and decodes a 200 answer's JSON into
// out when out is not nil. Any other status is a *StatusError.
func Get(ctx context.Context, hc *http.Client, url string, out any) error {
	if hc == nil {
		hc = http.DefaultClient
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("get %s: %w", url, err)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err // *url.Error names the URL already
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return fmt.Errorf("read %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return &StatusError{Code: resp.StatusCode, Body: strings.TrimSpace(string(body))}
	}
	if out != nil {
		if err := json.Unmarshal(body, out); err != nil {
			return fmt.Errorf("decode %s: %w", url, err)
		}
	}
	return nil
}

// WaitReady asks url (a replica's /readyz, a worker's /health, a load balancer's /readyz)
// until it answers 200, and gives up once within has passed or ctx has ended, with the last
// answer in the error.
func WaitReady(ctx context.Context, hc *http.Client, url string, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	var last error
	for {
		err := Get(ctx, hc, url, nil)
		if err == nil {
			return nil
		}
		if last == nil || ctx.Err() == nil {
			last = err // not the request the deadline cut short: the answer before it says more
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not ready within %s: %w (last: %w)", url, within, ctx.Err(), last)
		case <-tick.C:
		}
	}
}

// Status is the part of a replica's GET /admin/cluster that the harnesses read.
type Status struct {
	// Self is the replica's own Raft view.
	Self struct {
		ID       string `json:"id"`
		State    string `json:"state"` // Follower, Candidate, Leader, Shutdown
		LeaderID string `json:"leader_id"`
		Term     uint64 `json:"term"`
	} `json:"self"`
	// Bindings is how many session bindings its state machine holds.
	Bindings int `json:"bindings"`
}

// Leads reports whether the replica said it is the Raft leader.
func (s Status) Leads() bool { return s.Self.State == "Leader" }

// GetStatus reads GET /admin/cluster from the admin address admin (host:port).
func GetStatus(ctx context.Context, hc *http.Client, admin string) (Status, error) {
	var st Status
	err := Get(ctx, hc, "http://"+admin+"/admin/cluster", &st)
	return st, err
}

// ErrNoLeader is FindLeader's error when no replica says it leads.
var ErrNoLeader = errors.New("no replica leads")

// FindLeader asks every admin address at once and returns the index of one whose replica
// says it leads, as soon as one does (a paused replica does not hold up the answer). It
// asks once: a caller that waits for an election polls it.
func FindLeader(ctx context.Context, hc *http.Client, admins []string) (int, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type answer struct {
		i   int
		err error
	}
	answers := make(chan answer, len(admins))
	for i, a := range admins {
		go func() {
			st, err := GetStatus(ctx, hc, a)
			if err == nil && !st.Leads() {
				err = fmt.Errorf("%s is %s", a, st.Self.State)
			}
			answers <- answer{i, err}
		}()
	}
	var errs []error
	for range admins {
		a := <-answers
		if a.err == nil {
			return a.i, nil
		}
		errs = append(errs, a.err)
	}
	return -1, fmt.Errorf("%w: %w", ErrNoLeader, errors.Join(errs...))
}

// AwaitLeader asks FindLeader again, each ask bounded by ask, until a replica says it leads,
// ctx ends or within has passed: a starved cluster may be between leaders, or slow to
// answer. Its error says which of the last two ended the wait, with the last answer.
func AwaitLeader(ctx context.Context, hc *http.Client, admins []string, within, ask time.Duration) (int, error) {
	deadline := time.Now().Add(within)
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		actx, cancel := context.WithTimeout(ctx, ask)
		i, err := FindLeader(actx, hc, admins)
		cancel()
		switch {
		case err == nil:
			return i, nil
		case ctx.Err() != nil:
			return -1, fmt.Errorf("gave up waiting for a leader: %w (last answer: %w)", ctx.Err(), err)
		case time.Now().After(deadline):
			return -1, fmt.Errorf("no leader within %s: %w", within, err)
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
}
