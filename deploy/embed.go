package deploy

import _ "embed"

// HAProxyConfig is haproxy.cfg, built into the binary so that the demo finds it from any
// working directory (its addresses come from KVR_LISTEN and KVR_REPLICA0..2).
//
//go:embed haproxy.cfg
var HAProxyConfig string
