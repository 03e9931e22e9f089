package version

import (
	"runtime/debug"
	"testing"
)

func TestFromBuild(t *testing.T) {
	cases := []struct {
		name     string
		settings []debug.BuildSetting
		want     string
	}{
		{"no settings", nil, Release},
		{"a revision", []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: "87952b7a1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f"}}, Release + "+87952b7a1c2d"},
		{"a short revision", []debug.BuildSetting{{Key: "vcs.revision", Value: "87952b7"}}, Release},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := fromBuild(tc.settings); got != tc.want {
				t.Fatalf("fromBuild: %q, want %q", got, tc.want)
			}
		})
	}
}
