package gossip

import (
	"context"
	"fmt"
	"net"
	"strconv"

	"github.com/hashicorp/memberlist"
)

// Handle registers fn for messages of kind (broadcasts, sends and push/pull state alike);
// a later call replaces it. fn runs on memberlist's receive path: it must return quickly.
// from is the sending replica, already checked to be an alive member; payload is fn's own.
// A broadcast may arrive more than once (it is retransmitted to random members), or not at
// all: fn must be idempotent and treat what it gets as a hint.
func (g *Gossip) Handle(kind Kind, fn func(from string, payload []byte)) {
	g.hmu.Lock()
	defer g.hmu.Unlock()
	g.handlers[kind] = fn
}

// ShareState registers fn to supply this replica's state of kind for memberlist's periodic
// full exchange with a random member (push/pull over TCP, and on join). The other side
// receives it through its Handle(kind) function. It is the anti-entropy that repairs lost
// broadcasts; keep it small (all kinds together at most MaxReliablePayload).
func (g *Gossip) ShareState(kind Kind, fn func() []byte) {
	g.hmu.Lock()
	defer g.hmu.Unlock()
	g.states[kind] = fn
}

// MaxBroadcastPayload is the largest payload Broadcast and SendBestEffort accept: what fits
// in one UDP packet with memberlist's and this package's headers.
func (g *Gossip) MaxBroadcastPayload() int {
	return maxPacketFrame - frameHeaderLen(len(g.cfg.Name))
}

// Broadcast queues payload for every member: memberlist piggybacks it on its gossip
// packets, a few times each (Timings.RetransmitMult), so it reaches every member of a
// small cluster within a gossip round or two, with no guarantee. A payload over
// MaxBroadcastPayload is refused (ErrTooLarge); when the queue already holds a second's
// worth of the budget the message is dropped (ErrOverBudget, counted). Never blocks.
func (g *Gossip) Broadcast(kind Kind, payload []byte) error {
	return g.broadcast(kind, "", payload)
}

// BroadcastKeyed is Broadcast for state that supersedes itself (a load report, a health
// change): a queued broadcast with the same kind and key is replaced, not sent as well.
func (g *Gossip) BroadcastKeyed(kind Kind, key string, payload []byte) error {
	return g.broadcast(kind, key, payload)
}

func (g *Gossip) broadcast(kind Kind, key string, payload []byte) error {
	if g.closed.Load() {
		return ErrClosed
	}
	if kind == 0 {
		return fmt.Errorf("gossip: kind 0 is invalid")
	}
	if len(payload) > g.MaxBroadcastPayload() {
		return fmt.Errorf("%w: %d bytes, a broadcast carries at most %d (use SendReliable)", ErrTooLarge, len(payload), g.MaxBroadcastPayload())
	}
	msg := appendFrame(make([]byte, 0, frameHeaderLen(len(g.cfg.Name))+len(payload)), kind, g.cfg.Name, payload)
	if key != "" {
		key = fmt.Sprintf("%d/%s", kind, key)
	}
	if !g.queue.push(key, msg, g.cfg.MaxBytesPerSecond) {
		g.stats.drop(DropBudget)
		return ErrOverBudget
	}
	return nil
}

// target is a node for memberlist to send to: an alive member's name and gossip address as
// this replica recorded them from memberlist's events. It is a copy of its own: the nodes
// Members returns are memberlist's, which it rewrites in place when a member comes back at
// another address, so reading one while a send goroutine runs was a data race.
func (g *Gossip) target(to string) (*memberlist.Node, error) {
	g.mu.Lock()
	m, ok := g.members[to]
	addr := ""
	if ok && (m.State == Alive || m.State == Suspect) {
		addr = m.Addr
	}
	g.mu.Unlock()
	if addr == "" {
		return nil, fmt.Errorf("%w: %q", ErrUnknownMember, to)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("gossip: member %q at %q: %w", to, addr, err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	ip := net.ParseIP(host)
	if err != nil || ip == nil {
		return nil, fmt.Errorf("gossip: member %q at %q: not an IP address and port", to, addr)
	}
	return &memberlist.Node{Name: to, Addr: ip, Port: uint16(p)}, nil
}

// SendReliable sends payload to one member over TCP (up to MaxReliablePayload, and within
// the budget: a message over it is dropped with ErrOverBudget). It waits until the message
// is written or ctx ends (the write itself is bounded by Timings.TCPTimeout).
func (g *Gossip) SendReliable(ctx context.Context, to string, kind Kind, payload []byte) error {
	if g.closed.Load() {
		return ErrClosed
	}
	if kind == 0 {
		return fmt.Errorf("gossip: kind 0 is invalid")
	}
	if len(payload) > MaxReliablePayload {
		return fmt.Errorf("%w: %d bytes, a reliable send carries at most %d", ErrTooLarge, len(payload), MaxReliablePayload)
	}
	msg := appendFrame(nil, kind, g.cfg.Name, payload)
	if len(msg) > g.cfg.MaxBytesPerSecond {
		return fmt.Errorf("%w: %d bytes exceed the whole budget of %d bytes/s", ErrTooLarge, len(msg), g.cfg.MaxBytesPerSecond)
	}
	node, err := g.target(to)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if !g.budget.take(len(msg)) {
		g.stats.drop(DropBudget)
		return ErrOverBudget
	}
	done := make(chan error, 1)
	go func() { done <- g.ml.SendReliable(node, msg) }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("gossip: send to %s: %w", to, err)
		}
		g.stats.payloadOut.Add(uint64(len(msg)))
		g.stats.msgsOut.Add(1)
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// SendBestEffort sends payload to one member in a single UDP packet (at most
// MaxBroadcastPayload), with no retry or acknowledgement. Never blocks.
func (g *Gossip) SendBestEffort(to string, kind Kind, payload []byte) error {
	if g.closed.Load() {
		return ErrClosed
	}
	if kind == 0 {
		return fmt.Errorf("gossip: kind 0 is invalid")
	}
	if len(payload) > g.MaxBroadcastPayload() {
		return fmt.Errorf("%w: %d bytes, a packet carries at most %d (use SendReliable)", ErrTooLarge, len(payload), g.MaxBroadcastPayload())
	}
	node, err := g.target(to)
	if err != nil {
		return err
	}
	msg := appendFrame(nil, kind, g.cfg.Name, payload)
	if !g.budget.take(len(msg)) {
		g.stats.drop(DropBudget)
		return ErrOverBudget
	}
	if err := g.ml.SendBestEffort(node, msg); err != nil {
		return fmt.Errorf("gossip: send to %s: %w", to, err)
	}
	g.stats.payloadOut.Add(uint64(len(msg)))
	g.stats.msgsOut.Add(1)
	return nil
}

// deliver checks one received frame and hands it to its handler.
func (g *Gossip) deliver(f frame) {
	if f.from == g.cfg.Name || !g.IsAlive(f.from) {
		g.stats.drop(DropNonMember)
		return
	}
	g.hmu.RLock()
	fn := g.handlers[f.kind]
	g.hmu.RUnlock()
	if fn == nil {
		g.stats.drop(DropUnknownKind)
		return
	}
	g.stats.msgsIn.Add(1)
	fn(f.from, append([]byte(nil), f.payload...))
}

// delegate is memberlist's hook into the Gossip (same value, memberlist's method names).
type delegate Gossip

// NodeMeta implements memberlist.Delegate.
func (d *delegate) NodeMeta(limit int) []byte {
	d.metaMu.Lock()
	b := d.cfg.Meta.encode()
	d.metaMu.Unlock()
	if len(b) > limit {
		return nil // New checked the size against memberlist's limit
	}
	return b
}

// NotifyMsg implements memberlist.Delegate: one frame per user message.
func (d *delegate) NotifyMsg(b []byte) {
	g := (*Gossip)(d)
	f, rest, err := parseFrame(b, MaxReliablePayload)
	if err == nil && len(rest) > 0 {
		err = frameErr(DropDecode, "%d bytes after the payload", len(rest))
	}
	if err != nil {
		g.stats.drop(dropReason(err))
		return
	}
	g.deliver(f)
}

// GetBroadcasts implements memberlist.Delegate: queued broadcasts, within the budget.
func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte {
	g := (*Gossip)(d)
	if g.queue.len() == 0 {
		return nil
	}
	avail := g.budget.available()
	if avail < overhead+frameHeaderLen(len(g.cfg.Name)) {
		return nil // the queue waits for the budget; Broadcast drops once it is full
	}
	msgs := g.queue.take(overhead, min(limit, avail))
	var n int
	for _, m := range msgs {
		n += len(m)
	}
	g.budget.pay(n)
	g.stats.payloadOut.Add(uint64(n))
	g.stats.msgsOut.Add(uint64(len(msgs)))
	return msgs
}

// LocalState implements memberlist.Delegate: every shared state, one frame per kind.
func (d *delegate) LocalState(bool) []byte {
	g := (*Gossip)(d)
	g.hmu.RLock()
	fns := make(map[Kind]func() []byte, len(g.states))
	for k, fn := range g.states {
		fns[k] = fn
	}
	g.hmu.RUnlock()
	var out []byte
	for k, fn := range fns {
		p := fn()
		if len(p) == 0 {
			continue
		}
		if len(out)+frameHeaderLen(len(g.cfg.Name))+len(p) > maxStateBytes {
			g.stats.drop(DropSize)
			g.log.Warn("gossip: shared state too large, left out of the exchange", "kind", k, "bytes", len(p))
			continue
		}
		out = appendFrame(out, k, g.cfg.Name, p)
	}
	if len(out) == 0 {
		return nil
	}
	if !g.budget.take(len(out)) {
		g.stats.drop(DropBudget)
		return nil
	}
	g.stats.payloadOut.Add(uint64(len(out)))
	return out
}

// MergeRemoteState implements memberlist.Delegate: the other side's LocalState.
func (d *delegate) MergeRemoteState(buf []byte, _ bool) {
	g := (*Gossip)(d)
	for len(buf) > 0 {
		f, rest, err := parseFrame(buf, maxStateBytes)
		if err != nil {
			g.stats.drop(dropReason(err))
			return
		}
		g.deliver(f)
		buf = rest
	}
}

// events is memberlist's event hook into the Gossip.
type events Gossip

// NotifyJoin implements memberlist.EventDelegate.
func (e *events) NotifyJoin(n *memberlist.Node) { (*Gossip)(e).setMember(n, false) }

// NotifyUpdate implements memberlist.EventDelegate.
func (e *events) NotifyUpdate(n *memberlist.Node) { (*Gossip)(e).setMember(n, false) }

// NotifyLeave implements memberlist.EventDelegate: dead, or left on purpose.
func (e *events) NotifyLeave(n *memberlist.Node) { (*Gossip)(e).setMember(n, true) }
