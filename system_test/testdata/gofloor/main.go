// Command gofloor is the throughput benchmark's floor for Go: the least a Go proxy can do on
// the path, to tell what Go itself costs from what the router's own work costs. One goroutine
// per client connection reads a request, sends it whole to the next backend (round-robin)
// over that connection's own keep-alive connection to it, reads the answer whole and writes
// it back: blocking reads and writes on the runtime's poller, no HTTP library, no goroutine
// hand-offs, no timeouts, no hang-up watch, no headers added.
//
// It frames messages by Content-Length only (the benchmark's requests and its backends'
// static answers have one): it is a measuring stick, not a proxy to use.
//
//	gofloor -listen 127.0.0.1:8080 -backend 127.0.0.1:9001 -backend 127.0.0.1:9002
package main

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
)

type backends []string

func (b *backends) String() string { return fmt.Sprint(*b) }

func (b *backends) Set(v string) error {
	*b = append(*b, strings.TrimPrefix(v, "http://"))
	return nil
}

func main() {
	listen := flag.String("listen", "127.0.0.1:8080", "listen address")
	var to backends
	flag.Var(&to, "backend", "backend host:port (repeatable)")
	flag.Parse()
	if len(to) == 0 {
		fmt.Fprintln(os.Stderr, "gofloor: at least one -backend")
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	var next atomic.Uint64
	for {
		c, err := ln.Accept()
		if err != nil {
			log.Fatal(err)
		}
		go serve(c, to, &next)
	}
}

// serve relays one client connection's requests until either side closes or misbehaves.
func serve(c net.Conn, to backends, next *atomic.Uint64) {
	defer c.Close()
	br := bufio.NewReader(c)
	ups := make([]*upstream, len(to))
	defer func() {
		for _, u := range ups {
			if u != nil {
				u.c.Close()
			}
		}
	}()
	var req, resp bytes.Buffer
	for {
		target, err := readMessage(br, &req)
		if err != nil {
			return
		}
		if target == "/readyz" {
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n"); err != nil {
				return
			}
			continue
		}
		i := int(next.Add(1) % uint64(len(to)))
		if ups[i] == nil {
			uc, err := net.Dial("tcp", to[i])
			if err != nil {
				return
			}
			ups[i] = &upstream{c: uc, br: bufio.NewReader(uc)}
		}
		u := ups[i]
		if _, err := u.c.Write(req.Bytes()); err != nil {
			return
		}
		if _, err := readMessage(u.br, &resp); err != nil {
			return
		}
		if _, err := c.Write(resp.Bytes()); err != nil {
			return
		}
	}
}

// upstream is a client connection's own connection to one backend.
type upstream struct {
	c  net.Conn
	br *bufio.Reader
}

// readMessage reads one HTTP/1.1 message (head, and the body its Content-Length gives) into
// buf and returns the request target (a status line's second word for an answer).
func readMessage(br *bufio.Reader, buf *bytes.Buffer) (string, error) {
	buf.Reset()
	target, length := "", 0
	for first := true; ; first = false {
		line, err := br.ReadSlice('\n')
		if err != nil {
			return "", err
		}
		buf.Write(line)
		if first {
			if f := strings.Fields(string(line)); len(f) > 1 {
				target = f[1]
			}
			continue
		}
		if len(bytes.TrimRight(line, "\r\n")) == 0 {
			break
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if ok && strings.EqualFold(string(name), "Content-Length") {
			if length, err = strconv.Atoi(string(bytes.TrimSpace(value))); err != nil || length < 0 {
				return "", errors.New("bad Content-Length")
			}
		}
	}
	if _, err := io.CopyN(buf, br, int64(length)); err != nil {
		return "", err
	}
	return target, nil
}
