package cluster

import (
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
)

// TestFailedExpireProposalNeverShortensATimer: a failed Expire proposal re-arms its timer a
// second later, unless a touch moved the deadline later meanwhile, and never touches the
// timer a later term armed for the same binding (before, either came due within a second:
// a session idle for a second after a quick change of leader expired).
func TestFailedExpireProposalNeverShortensATimer(t *testing.T) {
	const ttl = 10 * time.Minute
	b := fsm.Binding{Session: "s", Worker: "w1", Revision: 7}
	cases := []struct {
		name string
		// meanwhile runs between the proposal (the timer fired at now) and its failure.
		meanwhile func(l *leader, now time.Time)
		want      func(now time.Time) time.Time // the deadline after the failure
	}{
		{
			name:      "nothing moved the timer: proposed again a second later",
			meanwhile: func(*leader, time.Time) {},
			want:      func(now time.Time) time.Time { return now.Add(time.Second) },
		},
		{
			name: "a touch moved the deadline later",
			meanwhile: func(l *leader, now time.Time) {
				l.mu.Lock()
				defer l.mu.Unlock()
				l.timers[b.Session].deadline = now.Add(ttl)
			},
			want: func(now time.Time) time.Time { return now.Add(ttl) },
		},
		{
			name: "the term ended and a later one armed the binding's timer",
			meanwhile: func(l *leader, now time.Time) {
				l.revoke()
				l.mu.Lock()
				defer l.mu.Unlock()
				l.active = true
				l.armLocked(b, now.Add(ttl))
			},
			want: func(now time.Time) time.Time { return now.Add(ttl) },
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			l := newLeader(&Node{cfg: Config{SessionTTL: ttl}})
			now := time.Now()
			l.mu.Lock()
			l.active = true
			l.armLocked(b, now.Add(-time.Millisecond))
			l.mu.Unlock()
			due, _ := l.dueAt(now)
			if len(due) != 1 {
				t.Fatalf("%d timers due, want 1", len(due))
			}
			tc.meanwhile(l, now)
			l.expireFailed(due[0].t, due[0].e, now)
			l.mu.Lock()
			defer l.mu.Unlock()
			got := l.timers[b.Session]
			if got == nil {
				t.Fatal("the timer is gone")
			}
			if want := tc.want(now); !got.deadline.Equal(want) {
				t.Fatalf("deadline %s after now, want %s", got.deadline.Sub(now), want.Sub(now))
			}
			if got.proposing {
				t.Fatal("the timer is still marked proposing: it would never be proposed again")
			}
		})
	}
}
