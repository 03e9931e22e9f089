// Package jsonerr words encoding/json's decode errors for the client that sent the JSON:
// the field and what it must be, in JSON's terms, never a Go type name.
package jsonerr

import (
	"encoding/json"
	"errors"
	"io"
	"reflect"
	"strconv"
	"strings"
)

// maxValueText bounds how much of a number the client sent is quoted back.
const maxValueText = 40

// Describe words err, an error of json.Unmarshal or a json.Decoder (DisallowUnknownFields
// included), for a client. field is
// the offending member's path in the body ("messages", "messages.role"; "" for the body
// itself) and message a sentence naming it: "messages must be an array, not a string",
// "request body is not valid JSON: invalid character 'x' looking for beginning of value".
func Describe(err error) (field, message string) {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		name := te.Field
		if name == "" {
			name = "request body"
		}
		return te.Field, name + " must be " + kind(te.Type) + ", not " + sent(te.Value)
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return "", "request body is not valid JSON: " + se.Error()
	}
	switch {
	case errors.Is(err, io.EOF):
		return "", "request body is empty"
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "", "request body is not valid JSON: unexpected end of JSON input"
	case err != nil:
		// A Decoder with DisallowUnknownFields says `json: unknown field "name"`.
		if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
			if f, uerr := strconv.Unquote(name); uerr == nil {
				return f, "request body has an unknown field " + name
			}
		}
	}
	return "", "request body is not valid JSON"
}

// kind names what JSON a Go type takes, with its article.
func kind(t reflect.Type) string {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil {
		return "a JSON value"
	}
	switch t.Kind() {
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Map, reflect.Struct:
		return "an object"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer in range"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		return "a non-negative integer in range"
	case reflect.Float32, reflect.Float64:
		return "a number"
	}
	return "a different JSON value"
}

// sent names what the client sent, from UnmarshalTypeError's Value ("string", "number 1.5").
func sent(value string) string {
	switch value {
	case "string":
		return "a string"
	case "bool":
		return "a boolean"
	case "array":
		return "an array"
	case "object":
		return "an object"
	case "number":
		return "a number"
	}
	if n, ok := strings.CutPrefix(value, "number "); ok {
		if len(n) > maxValueText {
			n = n[:maxValueText] + "..."
		}
		return n
	}
	return "that value"
}

// ShowsGoTypes reports whether msg carries encoding/json's Go type wording ("into Go struct
// field", "of type []struct {"), which Describe never writes: fuzzers of the decoders that
// use it check their errors with it.
func ShowsGoTypes(msg string) bool {
	return strings.Contains(msg, "Go struct") || strings.Contains(msg, "Go value") || strings.Contains(msg, "struct {")
}
