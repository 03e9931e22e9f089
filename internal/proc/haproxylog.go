package proc

import (
	"fmt"
	"strconv"
	"strings"
)

// HeaderOpTag is the request header a client of HAProxyConfig's balancer sets to name a
// request in HAProxy's log (the fault harness sets it to a tag of the operation).
const HeaderOpTag = "X-Jepsen-Op"

// haproxyLogPrefix starts every request line HAProxyConfig's balancer logs.
const haproxyLogPrefix = "kvrouter-lb"

// HAProxyRequest is one request as HAProxyConfig's balancer logged it.
type HAProxyRequest struct {
	// Tag is the request's X-Jepsen-Op header ("" when it had none).
	Tag string
	// Server is the replica that served it last ("" when none did: <NOSRV>).
	Server string
	// Retries is how many times HAProxy sent the request again after a failed attempt.
	Retries int
	// Redispatched reports whether a retry went to another server (option redispatch).
	Redispatched bool
	// Status is the status HAProxy sent the client (-1 when it sent none).
	Status int
	// Termination is HAProxy's two-letter termination state ("--" for a normal end; "SD": the
	// server closed mid-response, "CD": the client did, ...).
	Termination string
}

// ParseHAProxyLogLine reads one line of HAProxyConfig's balancer's log. ok is false for a
// line of another kind (HAProxy's own messages); err is set for a request line that does not
// parse.
func ParseHAProxyLogLine(line string) (req HAProxyRequest, ok bool, err error) {
	fields := strings.Fields(line)
	if len(fields) == 0 || fields[0] != haproxyLogPrefix {
		return HAProxyRequest{}, false, nil
	}
	if len(fields) != 6 {
		return HAProxyRequest{}, true, fmt.Errorf("haproxy log: %d fields in %q, want 6", len(fields), line)
	}
	req.Tag, req.Server, req.Termination = fields[1], fields[2], fields[5]
	if req.Tag == "-" {
		req.Tag = ""
	}
	if req.Server == "<NOSRV>" {
		req.Server = ""
	}
	rc := fields[3]
	if after, found := strings.CutPrefix(rc, "+"); found {
		req.Redispatched, rc = true, after
	}
	if req.Retries, err = strconv.Atoi(rc); err != nil || req.Retries < 0 {
		return HAProxyRequest{}, true, fmt.Errorf("haproxy log: retries %q in %q", fields[3], line)
	}
	if req.Status, err = strconv.Atoi(fields[4]); err != nil || req.Status < -1 || req.Status > 999 {
		return HAProxyRequest{}, true, fmt.Errorf("haproxy log: status %q in %q", fields[4], line)
	}
	return req, true, nil
}
