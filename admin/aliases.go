package admin

import (
	"encoding/json"
	"io"
	"net/http"

	"github.com/kvrouter-ha/kvrouter-ha/fsm"
	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
)

// Aliases reads the replicated model aliases (*fsm.FSM is one).
type Aliases interface {
	Aliases() []fsm.Alias
	Alias(name string) (fsm.Alias, bool)
}

// AliasView is a model alias as the API shows it and takes it (PUT's body needs only
// targets; the name is the path's).
type AliasView struct {
	Name    string            `json:"name"`
	Targets []AliasTargetView `json:"targets"`
}

// AliasTargetView is one weighted target of an alias.
type AliasTargetView struct {
	Model  string `json:"model"`
	Weight uint32 `json:"weight"`
}

func aliasView(a fsm.Alias) AliasView {
	v := AliasView{Name: a.Name, Targets: make([]AliasTargetView, len(a.Targets))}
	for i, t := range a.Targets {
		v.Targets[i] = AliasTargetView{Model: t.Model, Weight: t.Weight}
	}
	return v
}

func (a *api) listAliases(w http.ResponseWriter, _ *http.Request) {
	out := []AliasView{}
	for _, al := range a.cfg.Aliases.Aliases() {
		out = append(out, aliasView(al))
	}
	writeJSON(w, http.StatusOK, out)
}

func (a *api) getAlias(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	al, ok := a.cfg.Aliases.Alias(name)
	if !ok {
		fail(w, http.StatusNotFound, "no alias %q", name)
		return
	}
	writeJSON(w, http.StatusOK, aliasView(al))
}

// setAlias adds or replaces an alias. A weight change applies to new sessions only: a
// session keeps the target its binding records.
func (a *api) setAlias(w http.ResponseWriter, r *http.Request) {
	var body struct {
		Name    string            `json:"name"`
		Targets []AliasTargetView `json:"targets"`
	}
	dec := json.NewDecoder(io.LimitReader(r.Body, 64<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&body); err != nil {
		_, msg := jsonerr.Describe(err)
		fail(w, http.StatusBadRequest, "alias: %s", msg)
		return
	}
	name := r.PathValue("name")
	if body.Name != "" && body.Name != name {
		fail(w, http.StatusBadRequest, "alias: body names %q, path %q", body.Name, name)
		return
	}
	if len(body.Targets) > fsm.MaxAliasTargets {
		fail(w, http.StatusBadRequest, "alias %q: %d targets, over %d", name, len(body.Targets), fsm.MaxAliasTargets)
		return
	}
	al := fsm.Alias{Name: name, Targets: make([]fsm.AliasTarget, len(body.Targets))}
	for i, t := range body.Targets {
		al.Targets[i] = fsm.AliasTarget{Model: t.Model, Weight: t.Weight}
	}
	if err := fsm.ValidAlias(al); err != nil {
		fail(w, http.StatusBadRequest, "%v", err)
		return
	}
	res, ok := a.apply(w, r, &fsm.SetAlias{Alias: al})
	if !ok {
		return
	}
	if res.Status == fsm.Invalid {
		fail(w, http.StatusBadRequest, "%v", res.Err)
		return
	}
	writeJSON(w, http.StatusOK, aliasView(al))
}

func (a *api) deleteAlias(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	if err := fsm.ValidModel(name); err != nil {
		fail(w, http.StatusBadRequest, "alias: %v", err)
		return
	}
	res, ok := a.apply(w, r, &fsm.DeleteAlias{Name: name})
	if !ok {
		return
	}
	if res.Status == fsm.NotFound {
		fail(w, http.StatusNotFound, "no alias %q", name)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"alias": name, "deleted": true})
}
