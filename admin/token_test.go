package admin

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadOrCreateToken checks the token file's life: made once (0600, random), read back
// after, and refused when empty or readable by others.
func TestLoadOrCreateToken(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sub", TokenFileName)
	tok, created, err := LoadOrCreateToken(path)
	if err != nil || !created || len(tok) < 32 {
		t.Fatalf("first call: %q, created %v, %v", tok, created, err)
	}
	again, created, err := LoadOrCreateToken(path)
	if err != nil || created || again != tok {
		t.Fatalf("second call: %q (first %q), created %v, %v", again, tok, created, err)
	}
	other, _, err := LoadOrCreateToken(filepath.Join(dir, "other", TokenFileName))
	if err != nil || other == tok {
		t.Fatalf("another directory's token %q equals the first, or %v", other, err)
	}
	for _, tc := range []struct {
		name    string
		content string
		mode    os.FileMode
		want    string
	}{
		{"empty", "\n", 0o600, "empty"},
		{"readable by others", "secret\n", 0o644, "chmod 600"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), TokenFileName)
			if err := os.WriteFile(p, []byte(tc.content), tc.mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, tc.mode); err != nil {
				t.Fatal(err)
			}
			_, _, err := LoadOrCreateToken(p)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error about %q", err, tc.want)
			}
		})
	}
}
