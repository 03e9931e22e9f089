package proc

import (
	"encoding/json"
	"fmt"
	"os"
)

// WriteFleetFile writes specs (worker specs, or anything that marshals to the --workers-file
// shape) as JSON to path the way a discovery file source wants it: a complete file renamed over
// the old one, so a reader never sees half of it.
func WriteFleetFile(path string, specs any) error {
	b, err := json.Marshal(specs)
	if err != nil {
		return fmt.Errorf("fleet file: %w", err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("fleet file: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("fleet file: %w", err)
	}
	return nil
}
