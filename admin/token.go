package admin

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// TokenFileName is the file in a replica's data directory that holds the admin token the
// replica made itself (kvrouter-ha ctl --token-file reads it).
const TokenFileName = "admin.token"

// LoadOrCreateToken returns the token in the file at path, making the file first when it
// does not exist: 32 bytes from crypto/rand, base64url, mode 0600, synced. created says
// whether this call made it. An empty file, or one that others may read, is an error: the
// token is never logged, only the path.
func LoadOrCreateToken(path string) (token string, created bool, err error) {
	if token, err := readTokenFile(path); !errors.Is(err, fs.ErrNotExist) {
		return token, false, err
	}
	raw := make([]byte, 32)
	if _, err := rand.Read(raw); err != nil {
		return "", false, fmt.Errorf("admin token: %w", err)
	}
	token = base64.RawURLEncoding.EncodeToString(raw)
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return "", false, fmt.Errorf("admin token: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		// Another process made it meanwhile: its token is the one.
		token, err := readTokenFile(path)
		return token, false, err
	}
	if err != nil {
		return "", false, fmt.Errorf("admin token: %w", err)
	}
	_, err = f.WriteString(token + "\n")
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(path)
		return "", false, fmt.Errorf("admin token file %s: %w", path, err)
	}
	return token, true, nil
}

// readTokenFile reads an existing token file, refusing one that is empty or open to others.
func readTokenFile(path string) (string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	if st.Mode().Perm()&0o077 != 0 {
		return "", fmt.Errorf("admin token file %s has mode %v: others may read it; chmod 600 it", path, st.Mode().Perm())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("admin token file: %w", err)
	}
	token := strings.TrimSpace(string(b))
	if token == "" {
		return "", fmt.Errorf("admin token file %s is empty: write a token into it, or delete it and a new one is made", path)
	}
	return token, nil
}
