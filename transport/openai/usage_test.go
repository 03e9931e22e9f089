package openai

import (
	"bytes"
	"math/rand/v2"
	"strings"
	"testing"
)

// TestScanUsageIsUsageCountPerKey checks the one-pass scan against usageCount, key by key, on
// answers and stream chunks built from pieces of usages (keys, near misses, values, spacing).
func TestScanUsageIsUsageCountPerKey(t *testing.T) {
	pieces := []string{`"completion_tokens"`, `"output_tokens"`, `"cached_tokens"`, `"cache_read_input_tokens"`,
		`"prompt_tokens"`, `_tokens"`, `"cache`, `"cached`, `completion`, `"x_completion_tokens"`, `: `, `:`, ` : `,
		"\n", `12`, `7`, `1234567890123456`, `,`, `{`, `}`, `"`, `data: `, `"usage":{`, ` `, `:x`}
	rng := rand.New(rand.NewPCG(5, 6))
	for range 50000 {
		var b strings.Builder
		for range rng.IntN(12) {
			b.WriteString(pieces[rng.IntN(len(pieces))])
		}
		checkScanUsage(t, []byte(b.String()))
	}
}

// FuzzScanUsage checks the one-pass scan against usageCount, key by key, on any bytes.
func FuzzScanUsage(f *testing.F) {
	for _, s := range []string{`{"usage":{"completion_tokens": 12,"prompt_tokens_details":{"cached_tokens":7}}}`,
		`data: {"usage":{"output_tokens":3,"cache_read_input_tokens":0}}` + "\n\n", `"cached_tokens"_tokens": 5`, ``} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, chunk []byte) { checkScanUsage(t, chunk) })
}

// usageCount is the reference scanUsage is checked against: the last key: N in b, found by
// bytes.LastIndex, one key at a time.
func usageCount(b []byte, key string) (int, bool) {
	i := bytes.LastIndex(b, []byte(key))
	if i < 0 {
		return 0, false
	}
	return usageValue(b[i+len(key):])
}

// checkScanUsage fails t where scanUsage and usageCount disagree on a key of chunk.
func checkScanUsage(t *testing.T, chunk []byte) {
	t.Helper()
	u := scanUsage(chunk)
	for k, key := range usageKeyNames {
		if n, ok := usageCount(chunk, key); n != u.n[k] || ok != u.ok[k] {
			t.Fatalf("%q: scanUsage says %s is %d, %v; usageCount says %d, %v", chunk, key, u.n[k], u.ok[k], n, ok)
		}
	}
}
