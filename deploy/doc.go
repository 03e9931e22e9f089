// Package deploy holds the files that run kvrouter-ha outside the repository: a Dockerfile,
// docker-compose, Kubernetes manifests, systemd units, nginx and HAProxy configurations and a
// Grafana dashboard. It has no code of its own. Its tests hold those files to the binary (flags,
// ports, probes, drain timeouts, metric names, the admin port kept private) and start replicas
// from their command lines, because nothing else would notice one of them drifting.
package deploy
