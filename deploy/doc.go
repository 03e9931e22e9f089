// Package deploy holds the files that run kvrouter-ha outside the repository: a Dockerfile,
// docker-compose, Kubernetes manifests, systemd units, nginx and HAProxy configurations and a
// Grafana dashboard. Its only code embeds haproxy.cfg for the demo (HAProxyConfig). Its tests hold those files to the binary (flags,
// ports, probes, drain timeouts, metric names, the admin port kept private) and start replicas
// from their command lines, because nothing else would notice one of them drifting.
package deploy
