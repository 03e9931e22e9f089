package gossip

import (
	"sync"
	"time"
)

// bucket is a token bucket of bytes: rate per second, holding at most one second's worth.
// It never blocks: a caller that cannot pay is told so and drops its message.
type bucket struct {
	mu     sync.Mutex
	rate   float64
	burst  float64
	tokens float64
	last   time.Time
	now    func() time.Time
}

func newBucket(perSecond int, now func() time.Time) *bucket {
	r := float64(perSecond)
	return &bucket{rate: r, burst: r, tokens: r, last: now(), now: now}
}

func (b *bucket) refillLocked() {
	t := b.now()
	if d := t.Sub(b.last); d > 0 {
		b.tokens = min(b.burst, b.tokens+d.Seconds()*b.rate)
	}
	b.last = t
}

// take pays n bytes if the bucket holds them.
func (b *bucket) take(n int) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refillLocked()
	if float64(n) > b.tokens {
		return false
	}
	b.tokens -= float64(n)
	return true
}

// available is how many bytes could be paid now.
func (b *bucket) available() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refillLocked()
	return int(b.tokens)
}

// pay takes n bytes that were already sent within an available() allowance.
func (b *bucket) pay(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tokens = max(0, b.tokens-float64(n))
}
