// Command goproxy is the throughput benchmark's Go anchor: net/http/httputil.ReverseProxy doing
// round-robin over the backends, with nothing else, as a Go user would write it (keep-alive
// connections enough for every client connection, no compression). It shows what Go's HTTP
// server and client cost on the same path before any routing work.
//
//	goproxy -listen 127.0.0.1:8080 -backend 127.0.0.1:9001 -backend 127.0.0.1:9002
package main

import (
	"flag"
	"fmt"
	"log"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"time"
)

type backends []*url.URL

func (b *backends) String() string { return fmt.Sprint(*b) }

func (b *backends) Set(v string) error {
	u, err := url.Parse("http://" + strings.TrimPrefix(v, "http://"))
	if err != nil {
		return err
	}
	*b = append(*b, u)
	return nil
}

func main() {
	listen := flag.String("listen", "127.0.0.1:8080", "address to serve on")
	var to backends
	flag.Var(&to, "backend", "a backend host:port (repeat)")
	flag.Parse()
	if len(to) == 0 {
		fmt.Fprintln(os.Stderr, "goproxy: no -backend")
		os.Exit(2)
	}
	var next atomic.Uint64
	rp := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(to[next.Add(1)%uint64(len(to))])
			r.SetXForwarded()
		},
		Transport: &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024, IdleConnTimeout: time.Minute,
			DisableCompression: true},
		ErrorLog: log.New(os.Stderr, "goproxy: ", 0),
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.Handle("/", rp)
	srv := &http.Server{Addr: *listen, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	log.Fatal(srv.ListenAndServe())
}
