// Package version is the one place the software's version comes from: a replica reports
// it in its status (peer port, admin API) and in its gossip metadata, and the CLI prints it.
package version

import "runtime/debug"

// Release is the version of this source tree.
const Release = "0.5.0"

// String is Release, with the VCS revision the build recorded when there is one
// (go build stamps it unless -buildvcs=false).
func String() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return Release
	}
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" && len(s.Value) >= 12 {
			return Release + "+" + s.Value[:12]
		}
	}
	return Release
}
