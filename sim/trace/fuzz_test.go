package trace_test

import (
	"bytes"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
)

// FuzzRead checks that no input panics the decoder and that whatever it
// accepts keeps the invariants the replay relies on.
func FuzzRead(f *testing.F) {
	seeds := []string{
		`{"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78]}`,
		"{\"timestamp\": 1.5, \"input_length\": 512, \"output_length\": 0, \"hash_ids\": [7]}\n\n{\"timestamp\": 2, \"input_length\": 1, \"output_length\": 3, \"hash_ids\": [7]}\n",
		`{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [7]}`,
		`{"timestamp": 0, "input_length": 2000001, "output_length": 1, "hash_ids": []}`,
		`{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 1e308, "input_length": 1, "output_length": 1, "hash_ids": [1]}`,
		`{"hash_ids": null}`,
		`[]`,
		"\x00\xff{",
	}
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		reqs, err := trace.Read(bytes.NewReader(data))
		if err != nil {
			if reqs != nil {
				t.Fatalf("requests returned with error %v", err)
			}
			return
		}
		for i, r := range reqs {
			if r.Index != i {
				t.Fatalf("request %d has Index %d", i, r.Index)
			}
			if r.InputLength < 1 || r.InputLength > trace.MaxInputLength || r.OutputLength < 0 ||
				r.Timestamp < 0 || r.Timestamp > trace.MaxTimestamp {
				t.Fatalf("accepted out-of-range request %+v", r)
			}
			if len(r.HashIDs) != trace.BlockCount(r.InputLength) {
				t.Fatalf("accepted %d ids for %d tokens", len(r.HashIDs), r.InputLength)
			}
			if got := len(trace.Tokens(r, 0, nil)); got != r.InputLength {
				t.Fatalf("Tokens gave %d, want %d", got, r.InputLength)
			}
		}
		trace.AssignSessions(reqs)
		trace.Ceiling(reqs)
	})
}
