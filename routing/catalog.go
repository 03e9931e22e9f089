package routing

import (
	"fmt"
	"slices"
	"sort"
)

// MaxModels bounds the models one worker declares or is learned to serve.
const MaxModels = 256

// maxModelName bounds a model's name, in bytes.
const maxModelName = 256

// OtherModel is the metrics label of every model the fleet does not serve, which keeps the
// label's values bounded by what the workers serve.
const OtherModel = "other"

// ValidateModelName checks a model or adapter name: 1 to 256 bytes of printable ASCII
// without spaces.
func ValidateModelName(name string) error {
	if name == "" {
		return fmt.Errorf("model name is empty")
	}
	if len(name) > maxModelName {
		return fmt.Errorf("model name %.20q...: longer than %d bytes", name, maxModelName)
	}
	for _, c := range []byte(name) {
		if c <= 0x20 || c >= 0x7f {
			return fmt.Errorf("model name %q: only printable ASCII without spaces", name)
		}
	}
	return nil
}

// servingOf is what worker st serves as routing reads it; nil when nothing is known.
func servingOf(st *WorkerStatus) *Serving {
	if len(st.Spec.Models) == 0 && len(st.Learned) == 0 {
		return nil
	}
	s := &Serving{LoRAs: st.Spec.LoRAs}
	for _, m := range st.Spec.Models {
		s.Models = appendNew(s.Models, m)
	}
	for _, m := range st.Learned {
		if m.Parent != "" && m.Parent != m.ID {
			s.LoRAs = appendNew(slices.Clip(s.LoRAs), m.ID)
			continue
		}
		s.Models = appendNew(s.Models, m.ID)
	}
	if s.Models == nil {
		// Only adapters learned: the base model's name is not known, so any is taken.
		return &Serving{LoRAs: s.LoRAs}
	}
	return s
}

func appendNew(list []string, name string) []string {
	if slices.Contains(list, name) {
		return list
	}
	return append(list, name)
}

// CatalogModel is one model (or LoRA adapter) of the fleet.
type CatalogModel struct {
	ID string
	// Parent is an adapter's base model ("" for a base model, or an adapter whose base is
	// not known); Adapter marks adapters.
	Parent  string
	Adapter bool
	// Workers counts the configured workers that serve it, Routable those healthy and
	// undrained.
	Workers, Routable int
}

// Catalog is the fleet's models at one moment: the union of what every configured worker
// serves, declared or learned. It is immutable once built.
type Catalog struct {
	models map[string]*CatalogModel
	// open: some configured worker's models are not known, so it may serve any model.
	open bool
}

func newCatalog(all []WorkerStatus) *Catalog {
	c := &Catalog{models: make(map[string]*CatalogModel)}
	for i := range all {
		st := &all[i]
		routable := st.Healthy && !st.Drained
		serves := servingOf(st)
		if serves == nil || serves.Models == nil {
			c.open = true
		}
		base := ""
		if serves != nil && len(serves.Models) > 0 {
			base = serves.Models[0]
		}
		parents := make(map[string]string, len(st.Learned))
		for _, m := range st.Learned {
			if m.Parent != m.ID {
				parents[m.ID] = m.Parent
			}
		}
		add := func(id string, adapter bool) {
			m := c.models[id]
			if m == nil {
				m = &CatalogModel{ID: id, Adapter: adapter}
				if adapter {
					m.Parent = base
					if p, ok := parents[id]; ok {
						m.Parent = p
					}
				}
				c.models[id] = m
			}
			m.Workers++
			if routable {
				m.Routable++
			}
		}
		if serves == nil {
			for _, l := range st.Spec.LoRAs {
				if l != "*" {
					add(l, true)
				}
			}
			continue
		}
		for _, id := range serves.Models {
			add(id, false)
		}
		for _, l := range serves.LoRAs {
			if l != "*" {
				add(l, true)
			}
		}
	}
	return c
}

// Open reports whether some configured worker's models are not known (declared nor
// learned): such a worker takes any model, so no model is refused as unknown.
func (c *Catalog) Open() bool { return c == nil || c.open }

// Known reports whether the fleet may serve model: some configured worker serves it, or
// some worker's models are not known.
func (c *Catalog) Known(model string) bool {
	if c.Open() {
		return true
	}
	_, ok := c.models[model]
	return ok
}

// Adapter reports whether model is a LoRA adapter some configured worker serves.
func (c *Catalog) Adapter(model string) bool {
	if c == nil {
		return false
	}
	m, ok := c.models[model]
	return ok && m.Adapter
}

// Lookup returns one model of the fleet.
func (c *Catalog) Lookup(id string) (CatalogModel, bool) {
	if c == nil {
		return CatalogModel{}, false
	}
	m, ok := c.models[id]
	if !ok {
		return CatalogModel{}, false
	}
	return *m, true
}

// Models returns the fleet's models sorted by id.
func (c *Catalog) Models() []CatalogModel {
	if c == nil {
		return nil
	}
	out := make([]CatalogModel, 0, len(c.models))
	for _, m := range c.models {
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Label is model's metrics label: the model itself when the fleet serves it, OtherModel
// otherwise, so that a client cannot grow the label's values.
func (c *Catalog) Label(model string) string {
	if c == nil {
		return OtherModel
	}
	if _, ok := c.models[model]; ok {
		return model
	}
	return OtherModel
}
