//go:build kvrouter_pprof

package main

import (
	"log/slog"
	"net/http"
	_ "net/http/pprof" // registers /debug/pprof/ on http.DefaultServeMux
	"os"
	"runtime"
)

// A binary built with -tags kvrouter_pprof (system_test's throughput benchmark builds one to
// profile a real `kvrouter-ha serve`) serves net/http/pprof on $KVROUTER_PPROF_LISTEN when it
// is set. Release builds have none of this: the handlers are on http.DefaultServeMux, which no
// listener of the router serves, and only this file, outside release builds, listens on it.
// It samples contended mutexes (one in 10) and blocking events (one per 10 µs blocked) too,
// for the mutex and block profiles.
func init() {
	addr := os.Getenv("KVROUTER_PPROF_LISTEN")
	if addr == "" {
		return
	}
	runtime.SetMutexProfileFraction(10)
	runtime.SetBlockProfileRate(10_000)
	go func() {
		if err := http.ListenAndServe(addr, nil); err != nil {
			slog.Error("pprof listener", "addr", addr, "error", err)
		}
	}()
}
