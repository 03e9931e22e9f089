// Package version is the one place the software's version comes from: a replica reports
// it in its status (peer port, admin API) and in its gossip metadata, and the CLI prints it
// (kvrouter-ha --version, kvrouter-ha version).
package version

import "runtime/debug"

// Release is the version of this source tree.
const Release = "0.5.0"

// stamp is the version a release build sets with
// -ldflags "-X github.com/kvrouter-ha/kvrouter-ha/internal/version.stamp=v1.2.3" (make build
// stamps `git describe`). The linker writes it; nothing in the program assigns it.
var stamp string

// String is the stamped version when the build set one; else Release, with the VCS
// revision the build recorded when there is one (go build stamps it unless -buildvcs=false).
func String() string {
	if stamp != "" {
		return stamp
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return Release
	}
	return fromBuild(bi.Settings)
}

// fromBuild is Release with the 12-digit VCS revision in settings, when they have one.
func fromBuild(settings []debug.BuildSetting) string {
	for _, s := range settings {
		if s.Key == "vcs.revision" && len(s.Value) >= 12 {
			return Release + "+" + s.Value[:12]
		}
	}
	return Release
}
