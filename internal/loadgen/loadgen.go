// Package loadgen is the throughput benchmarks' load generator: raw keep-alive HTTP/1.1
// connections that write a fixed request and read each answer whole, allocating nothing, so
// that the generator costs as little of a shared machine's CPU as it can.
package loadgen

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Prompt is the text prompt of Request's completions: a short question, as a chat user asks.
const Prompt = "You are a helpful assistant. Answer the question briefly and politely, in one sentence: " +
	"what is the capital of France, and why is it known as the city of light?"

// Request is the raw request the generator sends for model: a short non-streaming completion
// with a text prompt, or, with stream, a streamed chat completion of the same prompt.
func Request(model string, stream bool) []byte {
	path := "/v1/completions"
	body := `{"model":"` + model + `","max_tokens":16,"prompt":"` + Prompt + `"}`
	if stream {
		path = "/v1/chat/completions"
		body = `{"model":"` + model + `","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"` + Prompt + `"}]}`
	}
	return fmt.Appendf(nil, "POST %s HTTP/1.1\r\nHost: kvrouter-load\r\nUser-Agent: kvrouter-load/1\r\nAccept: */*\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
}

// Conn is one keep-alive connection of the generator. It is not safe for concurrent use.
type Conn struct {
	c  net.Conn
	br *bufio.Reader
}

// Dial opens a connection to addr.
func Dial(addr string) (*Conn, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	return &Conn{c: c, br: bufio.NewReaderSize(c, 16<<10)}, nil
}

// Close closes the connection.
func (lc *Conn) Close() error { return lc.c.Close() }

var (
	hdrContentLength    = []byte("content-length:")
	hdrTransferEncoding = []byte("transfer-encoding:")
	hdrConnection       = []byte("connection:")
)

// Do writes req and reads its answer whole (Content-Length or chunked, no trailers). An
// answer other than 200, one without a length, or one that closes the connection is an error.
func (lc *Conn) Do(req []byte) error {
	if _, err := lc.c.Write(req); err != nil {
		return err
	}
	line, err := lc.br.ReadSlice('\n')
	if err != nil {
		return fmt.Errorf("status line: %w", err)
	}
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.1 ")) {
		return fmt.Errorf("status line %q", line)
	}
	if !bytes.Equal(line[9:12], []byte("200")) {
		return fmt.Errorf("answer %q", bytes.TrimSpace(line))
	}
	length, chunked, closing := -1, false, false
	for {
		line, err = lc.br.ReadSlice('\n')
		if err != nil {
			return fmt.Errorf("header: %w", err)
		}
		if len(line) <= 2 {
			break
		}
		switch {
		case hasPrefixFold(line, hdrContentLength):
			n, err := strconv.Atoi(string(bytes.TrimSpace(line[len(hdrContentLength):])))
			if err != nil || n < 0 {
				return fmt.Errorf("content-length %q", line)
			}
			length = n
		case hasPrefixFold(line, hdrTransferEncoding):
			chunked = bytes.Contains(bytes.ToLower(line), []byte("chunked"))
		case hasPrefixFold(line, hdrConnection):
			closing = bytes.Contains(bytes.ToLower(line), []byte("close"))
		}
	}
	switch {
	case chunked:
		// Each pass reads one chunk; the last is empty.
		for {
			line, err = lc.br.ReadSlice('\n')
			if err != nil {
				return fmt.Errorf("chunk size: %w", err)
			}
			size, err := strconv.ParseUint(string(bytes.TrimSpace(line)), 16, 32)
			if err != nil {
				return fmt.Errorf("chunk size %q", line)
			}
			if size == 0 {
				if _, err := lc.br.ReadSlice('\n'); err != nil {
					return fmt.Errorf("last chunk: %w", err)
				}
				break
			}
			if _, err := lc.br.Discard(int(size) + 2); err != nil {
				return fmt.Errorf("chunk: %w", err)
			}
		}
	case length >= 0:
		if _, err := lc.br.Discard(length); err != nil {
			return fmt.Errorf("body: %w", err)
		}
	default:
		return errors.New("an answer without a length")
	}
	if closing {
		return errors.New("the server closed the connection")
	}
	return nil
}

func hasPrefixFold(s, prefix []byte) bool {
	return len(s) >= len(prefix) && bytes.EqualFold(s[:len(prefix)], prefix)
}

// Drive sends req over conns keep-alive connections to addr until total answers are in, each
// connection sending its next request when its answer is in; it returns the first error.
func Drive(addr string, req []byte, conns int, total int64) error {
	var left atomic.Int64
	left.Store(total)
	errs := make(chan error, conns)
	var wg sync.WaitGroup
	for range conns {
		wg.Go(func() {
			lc, err := Dial(addr)
			if err != nil {
				errs <- err
				return
			}
			defer lc.Close()
			for left.Add(-1) >= 0 {
				if err := lc.Do(req); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// ProcessCPU is the CPU time (user and system, every thread) this process has used.
func ProcessCPU() (time.Duration, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, err
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), nil
}
