package replica

import (
	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// aliases serves the front the replicated model aliases, read lock-free from the FSM.
type aliases struct{ f *fsm.FSM }

// Alias implements openai.Aliases.
func (a aliases) Alias(name string) (routing.Alias, bool) {
	al, ok := a.f.Alias(name)
	if !ok {
		return routing.Alias{}, false
	}
	out := routing.Alias{Name: al.Name, Targets: make([]routing.AliasTarget, len(al.Targets))}
	for i, t := range al.Targets {
		out.Targets[i] = routing.AliasTarget{Model: t.Model, Weight: t.Weight}
	}
	return out, true
}
