package peer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"
)

// LeaderFunc reports the current leader's peer address as this replica's Raft view knows
// it; ok is false while no leader is known.
type LeaderFunc func() (addr string, ok bool)

// Defaults of ForwarderOptions.
const (
	DefaultMaxHops    = 3
	DefaultMinBackoff = 10 * time.Millisecond
	DefaultMaxBackoff = 250 * time.Millisecond
	DefaultWait       = 10 * time.Second
)

// ForwarderOptions tune a Forwarder; zero fields take the defaults above.
type ForwarderOptions struct {
	// MaxHops bounds the redirects followed in a row before backing off and asking the
	// LeaderFunc again (two replicas with stale views can point at each other).
	MaxHops int
	// MinBackoff and MaxBackoff bound the jittered exponential wait between rounds while
	// no leader is known or the leader is unreachable.
	MinBackoff, MaxBackoff time.Duration
	// Wait bounds a call whose context has no deadline.
	Wait time.Duration
	// Logger receives redirects and retries at debug level; nil discards them.
	Logger *slog.Logger
}

// Forwarder sends leader-only calls to the current leader from any replica: it asks a
// LeaderFunc for the leader's peer address, follows *NotLeaderError redirects (bounded
// hops), and retries with backoff while no leader is known or the leader is Unavailable,
// until the context ends. Other errors (ErrInvalid, Internal) return at once.
//
// Retrying an Apply whose first attempt may have been applied is safe for the affinity
// commands, because none of them can take effect twice: Bind with expect_revision 0 binds
// only an absent session and answers with the existing binding otherwise; a Bind with
// expect_revision R is a compare-and-set that the first application already moved past
// R (the new revision is its own log index), so a replay fails the comparison and
// answers with the current binding; Invalidate and Expire are guarded by a revision the
// same way; InvalidateWorker and the registry commands set state and are idempotent.
// Every command answers with the resulting binding, so the caller of a replayed command
// learns the one binding that exists. See DESIGN.md.
type Forwarder struct {
	pool     *Pool
	leader   LeaderFunc
	maxHops  int
	min, max time.Duration
	wait     time.Duration
	log      *slog.Logger
}

// NewForwarder returns a forwarder that reaches replicas through pool.
func NewForwarder(pool *Pool, leader LeaderFunc, opts ForwarderOptions) *Forwarder {
	f := &Forwarder{pool: pool, leader: leader, maxHops: opts.MaxHops, min: opts.MinBackoff, max: opts.MaxBackoff, wait: opts.Wait, log: opts.Logger}
	if f.maxHops <= 0 {
		f.maxHops = DefaultMaxHops
	}
	if f.min <= 0 {
		f.min = DefaultMinBackoff
	}
	if f.max < f.min {
		f.max = max(DefaultMaxBackoff, f.min)
	}
	if f.wait <= 0 {
		f.wait = DefaultWait
	}
	if f.log == nil {
		f.log = slog.New(slog.DiscardHandler)
	}
	return f
}

// Forward applies one encoded command on the leader and returns its encoded result and
// log index.
func (f *Forwarder) Forward(ctx context.Context, command []byte) (result []byte, index uint64, err error) {
	err = f.do(ctx, "", func(ctx context.Context, c *Client) error {
		var cerr error
		result, index, cerr = c.Apply(ctx, command)
		return cerr
	})
	return result, index, err
}

// ReadIndex returns the leader's confirmed commit index.
func (f *Forwarder) ReadIndex(ctx context.Context) (index uint64, err error) {
	err = f.do(ctx, "", func(ctx context.Context, c *Client) error {
		var cerr error
		index, cerr = c.ReadIndex(ctx)
		return cerr
	})
	return index, err
}

// Touch delivers touches to the leader.
func (f *Forwarder) Touch(ctx context.Context, touches []Touch) error {
	return f.do(ctx, "", func(ctx context.Context, c *Client) error { return c.Touch(ctx, touches) })
}

// Leave asks the leader to remove replica id.
func (f *Forwarder) Leave(ctx context.Context, id string) error {
	return f.do(ctx, "", func(ctx context.Context, c *Client) error { return c.Leave(ctx, id) })
}

// JoinVia asks the leader to add a replica, starting at seed (any replica's peer
// address) when the LeaderFunc knows no leader, as on a replica not yet in a cluster.
func (f *Forwarder) JoinVia(ctx context.Context, seed string, req JoinRequest) error {
	return f.do(ctx, seed, func(ctx context.Context, c *Client) error { return c.Join(ctx, req) })
}

// errNoLeader is the last error of a round in which no leader address was known.
var errNoLeader = errors.New("no leader known")

// do runs call against the leader until it succeeds, fails for good, or ctx ends.
// fallback is the address tried when the LeaderFunc knows no leader.
func (f *Forwarder) do(ctx context.Context, fallback string, call func(context.Context, *Client) error) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, f.wait)
		defer cancel()
	}
	backoff := f.min
	last := errNoLeader
	for round := 1; ; round++ {
		addr, ok := f.leader()
		if !ok || addr == "" {
			addr = fallback
		}
		if addr != "" {
			next, err := f.hops(ctx, addr, call)
			if next == "" {
				return err
			}
			last = err
			// Remember the last leader named by a redirect: it beats having none when
			// the LeaderFunc still knows no leader on the next round.
			fallback = next
		}
		jitter := time.Duration(rand.Int64N(int64(backoff)/2 + 1))
		f.log.Debug("peer call retrying", "round", round, "wait", backoff/2+jitter, "last", last)
		t := time.NewTimer(backoff/2 + jitter)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("reaching the leader: %w (last error: %v)", ctx.Err(), last)
		case <-t.C:
		}
		backoff = min(2*backoff, f.max)
	}
}

// hops calls addr and follows up to maxHops redirects. It returns next == "" when the
// round settled the call (err is its result), else the address to prefer next round and
// the error that made the round fail.
func (f *Forwarder) hops(ctx context.Context, addr string, call func(context.Context, *Client) error) (next string, err error) {
	for hop := 0; ; hop++ {
		c, gerr := f.pool.Get(addr)
		if gerr != nil {
			return "", gerr
		}
		err = call(ctx, c)
		if err == nil {
			return "", nil
		}
		if cerr := ctx.Err(); cerr != nil {
			return "", fmt.Errorf("reaching the leader: %w (last error: %v)", cerr, err)
		}
		var nl *NotLeaderError
		switch {
		case errors.As(err, &nl):
			if nl.LeaderAddr == "" || nl.LeaderAddr == addr || hop >= f.maxHops {
				return addr, err
			}
			f.log.Debug("peer redirect", "from", addr, "to", nl.LeaderAddr, "leader", nl.LeaderID)
			addr = nl.LeaderAddr
		case errors.Is(err, ErrUnavailable):
			return addr, err
		default:
			return "", err
		}
	}
}
