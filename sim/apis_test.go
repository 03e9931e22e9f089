package sim

import (
	"net/http"
	"testing"
)

// FuzzDecodeAPIs: the Responses, Messages and Embeddings decoders take any body without a
// panic, answering a request the engine can run or a 4xx error.
func FuzzDecodeAPIs(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","input":"hi","max_output_tokens":3}`,
		`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"}]}],"stream":true}`,
		`{"model":"m","max_tokens":5,"system":"s","messages":[{"role":"user","content":"q"}]}`,
		`{"model":"m","max_tokens":0,"messages":[]}`,
		`{"model":"m","input":[[1,2],[3]]}`, `null`, `{`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		for _, x := range []api{responsesAPI, messagesAPI} {
			req, aerr := x.decode(body, 4096)
			if aerr != nil {
				if aerr.status < 400 || aerr.status >= 500 || aerr.message == "" {
					t.Fatalf("%s: error %+v", x.name, aerr)
				}
				continue
			}
			if req.maxTokens < 1 || req.maxTokens > maxMaxTokens || len(req.prompt)+req.maxTokens > 4096 {
				t.Fatalf("%s: request %+v out of bounds", x.name, req)
			}
		}
		if _, aerr := embeddingInputs(body); aerr != nil && aerr.status != http.StatusBadRequest {
			t.Fatalf("embeddings: error %+v", aerr)
		}
		_, _, _ = decodeAnthropic(body, false)
	})
}
