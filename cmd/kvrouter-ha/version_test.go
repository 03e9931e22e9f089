package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"strings"
	"testing"

	"github.com/kvrouter-ha/kvrouter-ha/internal/version"
)

func TestVersionIsPrintedAndAnUnknownSubcommandFails(t *testing.T) {
	cases := []struct {
		args    []string
		wantOut string // in stdout
		wantErr string // "" for success; "help" for flag.ErrHelp (exit 0 with the help)
	}{
		{args: []string{"--version"}, wantOut: "kvrouter-ha " + version.String()},
		{args: []string{"version"}, wantOut: "kvrouter-ha " + version.String()},
		{args: []string{"version", "extra"}, wantErr: "no arguments"},
		{args: []string{"serv"}, wantErr: `unknown subcommand "serv": want one of serve, sim-worker`},
		{args: []string{"bogus", "--listen", "127.0.0.1:0"}, wantErr: `unknown subcommand "bogus"`},
		{args: nil, wantErr: "help"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, errOut bytes.Buffer
			err := run(context.Background(), tc.args, &out, &errOut)
			switch {
			case tc.wantErr == "help":
				if !errors.Is(err, flag.ErrHelp) {
					t.Fatalf("kvrouter-ha %v: %v, want the help", tc.args, err)
				}
			case tc.wantErr != "":
				if err == nil || errors.Is(err, flag.ErrHelp) || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("kvrouter-ha %v: %v, want an error with %q (main exits 1 on it)", tc.args, err, tc.wantErr)
				}
			case err != nil:
				t.Fatalf("kvrouter-ha %v: %v\n%s", tc.args, err, errOut.String())
			case !strings.HasPrefix(out.String(), tc.wantOut):
				t.Fatalf("kvrouter-ha %v printed %q, want it to start with %q", tc.args, out.String(), tc.wantOut)
			}
		})
	}
}
