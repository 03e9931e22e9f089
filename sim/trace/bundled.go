package trace

import (
	"bytes"
	_ "embed"
)

// bundled is Mooncake's synthetic trace (Apache-2.0, licence in data/), so the demo and the
// replay tool run with no file at hand.
//
//go:embed data/mooncake_synthetic_trace.jsonl
var bundled []byte

// Bundled parses the bundled Mooncake synthetic trace (3,993 requests).
func Bundled() ([]Request, error) { return Read(bytes.NewReader(bundled)) }
