package replica

import (
	"github.com/kvrouter-ha/kvrouter-ha/fsm"
)

// bindingChanged tells the front of the bindings that end or are replaced, so that it
// counts the live sessions it made for each client (--client-max-sessions). It runs inside
// the FSM's Apply and does not block.
func (r *Replica) bindingChanged(c fsm.Change) {
	front := r.front.Load()
	if front == nil {
		return
	}
	switch {
	case c.Kind == fsm.Unbound:
		front.BindingEnded(c.Binding.Session, c.Binding.Revision, 0)
	case c.Kind == fsm.Bound && c.Reason == fsm.Replaced:
		front.BindingEnded(c.Binding.Session, c.Previous.Revision, c.Binding.Revision)
	case c.Kind == fsm.Reset:
		front.BindingsReset()
	}
}
