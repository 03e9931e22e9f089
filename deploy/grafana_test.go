package deploy_test

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
)

func TestGrafanaDashboardIsWellFormed(t *testing.T) {
	var dash struct {
		UID        string `json:"uid"`
		Templating struct {
			List []struct{ Name, Type string } `json:"list"`
		} `json:"templating"`
		Panels []struct {
			ID         int    `json:"id"`
			Type       string `json:"type"`
			Title      string `json:"title"`
			Datasource struct {
				UID string `json:"uid"`
			} `json:"datasource"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal([]byte(readFile(t, "grafana/kvrouter-ha.json")), &dash); err != nil {
		t.Fatalf("grafana/kvrouter-ha.json: %v", err)
	}
	hasDS := false
	for _, v := range dash.Templating.List {
		hasDS = hasDS || (v.Name == "datasource" && v.Type == "datasource")
	}
	if dash.UID == "" || !hasDS {
		t.Error("dashboard: want a uid and a datasource variable (imports work on any Prometheus)")
	}
	ids := map[int]bool{}
	queries := 0
	for _, p := range dash.Panels {
		if ids[p.ID] {
			t.Errorf("panel %q: id %d used twice", p.Title, p.ID)
		}
		ids[p.ID] = true
		if p.Type == "row" || p.Type == "text" {
			continue
		}
		if p.Datasource.UID != "${datasource}" || len(p.Targets) == 0 {
			t.Errorf("panel %q: want targets on the ${datasource} variable", p.Title)
		}
		for _, q := range p.Targets {
			if strings.Count(q.Expr, "(") != strings.Count(q.Expr, ")") || !strings.Contains(q.Expr, "kvrouter_") {
				t.Errorf("panel %q: expr %q", p.Title, q.Expr)
			}
			queries++
		}
	}
	if queries < 20 {
		t.Errorf("only %d queries in the dashboard", queries)
	}
}

// dashboardMetrics are the kvrouter_ names every query of the dashboard uses.
func dashboardMetrics(t *testing.T) map[string]bool {
	t.Helper()
	var doc any
	if err := json.Unmarshal([]byte(readFile(t, "grafana/kvrouter-ha.json")), &doc); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	ident := regexp.MustCompile(`kvrouter_[a-zA-Z0-9_:]+`)
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for _, x := range v {
				walk(x)
			}
		case []any:
			for _, x := range v {
				walk(x)
			}
		case string:
			for _, n := range ident.FindAllString(v, -1) {
				names[n] = true
			}
		}
	}
	walk(doc)
	return names
}
