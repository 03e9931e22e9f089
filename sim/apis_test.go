package sim

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"slices"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/internal/jsonerr"
)

// FuzzDecodeAPIs: the Responses, Messages and Embeddings decoders take any body without a
// panic, answering a request the engine can run or a 4xx error.
func FuzzDecodeAPIs(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","input":"hi","max_output_tokens":3}`,
		`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"}]}],"stream":true}`,
		`{"model":"m","max_tokens":5,"system":"s","messages":[{"role":"user","content":"q"}]}`,
		`{"model":"m","max_tokens":0,"messages":[]}`,
		`{"model":"m","input":[[1,2],[3]]}`, `null`, `{`, `{"model":"m","max_tokens":1,"messages":"hi"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		for _, x := range []api{responsesAPI, messagesAPI} {
			req, aerr := x.decode(body, 4096)
			if aerr != nil {
				if aerr.status < 400 || aerr.status >= 500 || aerr.message == "" || jsonerr.ShowsGoTypes(aerr.message) {
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
		if _, aerr := embeddingEncoder(body); aerr != nil && aerr.status != http.StatusBadRequest {
			t.Fatalf("embeddings' encoding_format: error %+v", aerr)
		}
		_, _, _ = decodeAnthropic(body, false)
	})
}

// TestEmbeddingsHonourEncodingFormat: an embedding comes as numbers for "float" (and by
// default), as base64 of little-endian float32s for "base64" (what the official openai
// clients ask for by default, and decode), the same vector either way; any other format is
// a 400 naming encoding_format.
func TestEmbeddingsHonourEncodingFormat(t *testing.T) {
	_, srv := newTestWorker(t, Config{})
	url := srv.URL + "/v1/embeddings"
	want := embedding(Tokenize("same text", true))
	for _, tc := range []struct {
		name, format string // format is the encoding_format's JSON; empty leaves it out
		status       int
	}{
		{"default", "", http.StatusOK},
		{"null", "null", http.StatusOK},
		{"float", `"float"`, http.StatusOK},
		{"base64", `"base64"`, http.StatusOK},
		{"unknown", `"bytes"`, http.StatusBadRequest},
		{"not a string", `3`, http.StatusBadRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := fmt.Sprintf(`{"model":%q,"input":["same text","same text"]`, DefaultModel)
			if tc.format != "" {
				body += `,"encoding_format":` + tc.format
			}
			status, _, resp := post(t, t.Context(), srv.Client(), url, body+"}")
			if status != tc.status {
				t.Fatalf("status %d, want %d: %s", status, tc.status, resp)
			}
			if status != http.StatusOK {
				var e errorBody
				if err := json.Unmarshal(resp, &e); err != nil || e.Error.Type != "invalid_request_error" ||
					e.Error.Param == nil || *e.Error.Param != "encoding_format" {
					t.Fatalf("error %s is not an invalid_request_error naming encoding_format", resp)
				}
				return
			}
			var out struct {
				Data []struct {
					Embedding json.RawMessage `json:"embedding"`
				} `json:"data"`
			}
			if err := json.Unmarshal(resp, &out); err != nil || len(out.Data) != 2 {
				t.Fatalf("answer %s: %v", resp, err)
			}
			for _, d := range out.Data {
				got := decodeEmbedding(t, d.Embedding, tc.format == `"base64"`)
				if !slices.Equal(got, want) {
					t.Fatalf("embedding %v, want %v", got, want)
				}
			}
		})
	}
}

// decodeEmbedding reads an embedding sent as numbers or, when base64, as a base64 string of
// little-endian float32s.
func decodeEmbedding(t *testing.T, raw json.RawMessage, base64Encoded bool) []float32 {
	t.Helper()
	if !base64Encoded {
		var v []float32
		if err := json.Unmarshal(raw, &v); err != nil {
			t.Fatalf("embedding %s is not numbers: %v", raw, err)
		}
		return v
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatalf("embedding %s is not a string: %v", raw, err)
	}
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil || len(b)%4 != 0 {
		t.Fatalf("embedding %q is not base64 of float32s: %v", s, err)
	}
	v := make([]float32, len(b)/4)
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return v
}
