package workers

import (
	"errors"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// FuzzParseSpecs: any bytes give specs that every registry accepts, or ErrInvalid; never a
// panic.
func FuzzParseSpecs(f *testing.F) {
	f.Add([]byte(`[{"id":"a","url":"http://127.0.0.1:1","dp_size":2,"loras":["x"]}]`))
	f.Add([]byte(`[]`))
	f.Add([]byte(`[{"id":"a","url":"http://x"},{"id":"a","url":"http://y"}]`))
	f.Add([]byte(`[{"id":"a b","url":"http://x"}] 1`))
	f.Fuzz(func(t *testing.T, b []byte) {
		specs, err := ParseSpecs(b)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v is not ErrInvalid", err)
			}
			return
		}
		if _, err := routing.NewRegistry(specs); err != nil {
			t.Fatalf("parsed specs the registry refuses: %v", err)
		}
	})
}
