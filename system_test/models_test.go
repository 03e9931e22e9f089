package system_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim"
)

// getJSON GETs url and returns its status and body.
func getJSON(ctx context.Context, url string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, string(b), err
}

// postModel sends one request of api for model through base and returns its status, the
// worker that answered (X-Kvrouter-Worker) and the body.
func postModel(ctx context.Context, base, api, model string, i int) (int, string, string, error) {
	var path, body string
	switch api {
	case "chat":
		path, body = "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"question %d"}],"max_tokens":2}`, model, i)
	case "completions":
		path, body = "/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"prompt %d","max_tokens":2}`, model, i)
	case "responses":
		path, body = "/v1/responses", fmt.Sprintf(`{"model":%q,"input":"input %d","max_output_tokens":2}`, model, i)
	case "messages":
		path, body = "/v1/messages", fmt.Sprintf(`{"model":%q,"max_tokens":2,"messages":[{"role":"user","content":"message %d"}]}`, model, i)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, strings.NewReader(body))
	if err != nil {
		return 0, "", "", err
	}
	req.Header.Set("Content-Type", "application/json")
	if i%2 == 0 {
		req.Header.Set("X-Session-ID", fmt.Sprintf("%s-session-%d", model, i%50))
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, "", "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return resp.StatusCode, resp.Header.Get("X-Kvrouter-Worker"), string(b), err
}

// TestTwoModelsBehindHAProxyNeverReachAnotherModelsWorker runs two models on three simulated
// workers each (one of them also serving a LoRA adapter) behind three replicas and the
// deployment's HAProxy. The replicas learn each worker's models from its own GET /v1/models;
// 2,000 requests of four APIs for both models and the adapter go through HAProxy, and none reaches a worker of the other model (each simulated worker
// counts what it refused as not its model, and every answer names its worker). A model no
// worker serves is 404 model_not_found from the router, in OpenAI's shape and Anthropic's.
func TestTwoModelsBehindHAProxyNeverReachAnotherModelsWorker(t *testing.T) {
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("haproxy is not in PATH: this test runs the real HAProxy (.ci/run installs it; apt-get install haproxy)")
	}
	const small, large, adapter = "org/small-8b", "org/large-70b", "large-sql"
	var cfgs []sim.Config
	for _, m := range []string{small, small, small, large, large, large} {
		cfgs = append(cfgs, sim.Config{Model: m})
	}
	// w3 also serves a LoRA adapter of the large model, learned with its parent.
	cfgs[3].LoRAs = []string{adapter}
	fl := startFleetOf(t, cfgs...)
	serves := map[string][]string{small: {"w0", "w1", "w2"}, large: {"w3", "w4", "w5"}, adapter: {"w3"}}
	models := []string{small, large, small, large, small, adapter}
	c := startCluster(t, 3, fl)
	base := "http://" + startHAProxy(t, bin, c)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()

	// Every replica has learned every worker's model: its list is the two models, and a
	// third is unknown.
	eventually(t, 30*time.Second, func() error {
		for _, r := range c.replicas {
			code, body, err := getJSON(ctx, "http://"+r.Client+"/v1/models")
			var list struct {
				Data []struct{ ID string } `json:"data"`
			}
			if err != nil || code != http.StatusOK || json.Unmarshal([]byte(body), &list) != nil {
				return fmt.Errorf("%s: /v1/models %d %v %s", r.ID, code, err, body)
			}
			var ids []string
			for _, m := range list.Data {
				ids = append(ids, m.ID)
			}
			if strings.Join(ids, ",") != adapter+","+large+","+small {
				return fmt.Errorf("%s lists %v", r.ID, ids)
			}
			if code, body, err := getJSON(ctx, "http://"+r.Client+"/v1/models/unknown-model"); err != nil || code != http.StatusNotFound {
				return fmt.Errorf("%s: unknown model %d %v %s", r.ID, code, err, body)
			}
		}
		return nil
	})
	// HAProxy has replicas in its rotation.
	eventually(t, 30*time.Second, func() error {
		if code, body, err := getJSON(ctx, base+"/v1/models/"+large); err != nil || code != http.StatusOK || !strings.Contains(body, `"id":"`+large+`"`) {
			return fmt.Errorf("GET /v1/models/%s through haproxy: %d %v %s", large, code, err, body)
		}
		return nil
	})

	const total, workers = 2000, 8
	apis := []string{"chat", "completions", "responses", "messages"}
	var (
		mu      sync.Mutex
		wrong   []string
		perPair = map[string]int{}
	)
	jobs := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range jobs {
				model, api := models[i%len(models)], apis[(i/len(models))%len(apis)]
				code, worker, body, err := postModel(ctx, base, api, model, i)
				mu.Lock()
				if err != nil || code != http.StatusOK || !slices.Contains(serves[model], worker) {
					wrong = append(wrong, fmt.Sprintf("%s %s: %d on %q %v %.200s", api, model, code, worker, err, body))
				}
				perPair[model+" on "+worker]++
				mu.Unlock()
			}
		})
	}
	start := time.Now()
	for i := 0; i < total && ctx.Err() == nil; i++ {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	t.Logf("%d requests through haproxy in %s; by model and worker: %v", total, time.Since(start).Round(time.Millisecond), perPair)
	if len(wrong) > 0 {
		t.Fatalf("%d of %d requests failed or reached a worker of another model; first: %v", len(wrong), total, wrong[:min(5, len(wrong))])
	}

	// An unknown model: 404 model_not_found from the router, in each API's shape.
	code, _, body, err := postModel(ctx, base, "chat", "unknown-model", 1)
	var oa struct {
		Error struct{ Type, Param, Code string } `json:"error"`
	}
	if err != nil || code != http.StatusNotFound || json.Unmarshal([]byte(body), &oa) != nil ||
		oa.Error.Code != "model_not_found" || oa.Error.Type != "invalid_request_error" || oa.Error.Param != "model" {
		t.Fatalf("unknown model (OpenAI): %d %v %s", code, err, body)
	}
	code, _, body, err = postModel(ctx, base, "messages", "unknown-model", 1)
	var an struct {
		Type  string                         `json:"type"`
		Error struct{ Type, Message string } `json:"error"`
	}
	if err != nil || code != http.StatusNotFound || json.Unmarshal([]byte(body), &an) != nil ||
		an.Type != "error" || an.Error.Type != "not_found_error" || !strings.Contains(an.Error.Message, "unknown-model") {
		t.Fatalf("unknown model (Anthropic): %d %v %s", code, err, body)
	}
	// The workers' own record: none was asked for a model it does not serve.
	var refused []string
	for i, w := range fl.sims {
		if n := w.Stats().WrongModel; n != 0 {
			refused = append(refused, fmt.Sprintf("%s (%s): %d", fl.ids[i], cfgs[i].Model, n))
		}
	}
	if len(refused) > 0 {
		t.Fatalf("workers refused requests for a model they do not serve: %v", refused)
	}
}
