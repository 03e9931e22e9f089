package jsonerr

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestDescribeNamesTheFieldInJSONTerms: each decode error names the member's path and what
// it must be in JSON's words; no Go type name reaches the message.
func TestDescribeNamesTheFieldInJSONTerms(t *testing.T) {
	type target struct {
		Messages *[]struct {
			Role *string `json:"role"`
		} `json:"messages"`
		Stream *bool             `json:"stream"`
		N      uint32            `json:"n"`
		I      int               `json:"i"`
		F      float64           `json:"f"`
		Meta   map[string]string `json:"meta"`
	}
	for _, tc := range []struct {
		body, field, message string
	}{
		{`{"messages":"hi"}`, "messages", "messages must be an array, not a string"},
		{`{"messages":[{"role":3}]}`, "messages.role", "messages.role must be a string, not a number"},
		{`{"stream":"yes"}`, "stream", "stream must be a boolean, not a string"},
		{`{"n":-1}`, "n", "n must be a non-negative integer in range, not -1"},
		{`{"i":1.5}`, "i", "i must be an integer in range, not 1.5"},
		{`{"f":[]}`, "f", "f must be a number, not an array"},
		{`{"meta":true}`, "meta", "meta must be an object, not a boolean"},
		{`{"n":1` + strings.Repeat("0", 60) + `}`, "n", "n must be a non-negative integer in range, not 1" + strings.Repeat("0", 39) + "..."},
		{`[1]`, "", "request body must be an object, not an array"},
		{`{"a":`, "", "request body is not valid JSON: unexpected end of JSON input"},
		{`{x}`, "", "request body is not valid JSON: invalid character 'x' looking for beginning of object key string"},
	} {
		t.Run(tc.body, func(t *testing.T) {
			var v target
			err := json.Unmarshal([]byte(tc.body), &v)
			if err == nil {
				t.Fatal("decoded without an error")
			}
			field, message := Describe(err)
			if field != tc.field || message != tc.message {
				t.Fatalf("Describe(%v) = %q, %q; want %q, %q", err, field, message, tc.field, tc.message)
			}
		})
	}
}

// TestDescribeWordsADecodersErrors: a json.Decoder's own errors (nothing sent, a body cut
// short, a field DisallowUnknownFields refuses) are worded too.
func TestDescribeWordsADecodersErrors(t *testing.T) {
	type target struct {
		Name string `json:"name"`
	}
	for _, tc := range []struct {
		body, field, message string
	}{
		{``, "", "request body is empty"},
		{`{"name":"a"`, "", "request body is not valid JSON: unexpected end of JSON input"},
		{`{"name":"a","color":"red"}`, "color", `request body has an unknown field "color"`},
		{`{"name":3}`, "name", "name must be a string, not a number"},
	} {
		t.Run(tc.body, func(t *testing.T) {
			dec := json.NewDecoder(strings.NewReader(tc.body))
			dec.DisallowUnknownFields()
			var v target
			err := dec.Decode(&v)
			if err == nil {
				t.Fatal("decoded without an error")
			}
			field, message := Describe(err)
			if field != tc.field || message != tc.message {
				t.Fatalf("Describe(%v) = %q, %q; want %q, %q", err, field, message, tc.field, tc.message)
			}
		})
	}
}
