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
	return routingAlias(al), true
}

// List implements openai.Aliases.
func (a aliases) List() []routing.Alias {
	all := a.f.Aliases()
	out := make([]routing.Alias, len(all))
	for i, al := range all {
		out[i] = routingAlias(al)
	}
	return out
}

func routingAlias(al fsm.Alias) routing.Alias {
	out := routing.Alias{Name: al.Name, Targets: make([]routing.AliasTarget, len(al.Targets))}
	for i, t := range al.Targets {
		out.Targets[i] = routing.AliasTarget{Model: t.Model, Weight: t.Weight}
	}
	return out
}
